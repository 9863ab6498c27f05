"""Errors onnxshrink reports to its users (no traceback; the CLI maps them to exit codes)."""

from __future__ import annotations

from typing import Any


class ShrinkError(Exception):
    """Bad input from the user: the message names the file, node or mask at fault and what to do."""

    exit_code = 2


class ValidationFailed(ShrinkError):
    """The shrunk model does not match the reference within tolerance; nothing was written."""

    exit_code = 1

    def __init__(self, message: str, result: Any = None):
        super().__init__(message)
        self.result = result


class InternalError(RuntimeError):
    """The analysis promised something the rewrite cannot honour: a bug, never a user error."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (for one-paragraph errors), or its type."""
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__

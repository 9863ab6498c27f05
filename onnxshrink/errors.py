"""Errors onnxshrink reports to its users (no traceback; the CLI maps them to exit codes)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
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
        self.report: dict[str, Any] | None = None  # what --report writes, when not result's


class NotShrunk(ShrinkError):
    """A prune whose chosen groups could not be removed: nothing was written (the model with them
    zeroed would have the pruned model's quality at the input's size); or an output larger than
    the input in every form it can be written in (see stages.growth)."""

    exit_code = 1


class InternalError(RuntimeError):
    """The analysis promised something the rewrite cannot honour: a bug, never a user error."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (for one-paragraph errors), or its type."""
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__


# What to do about the OSErrors a user's environment causes (by errno).
_FIXES = {
    errno.ENOSPC: "free some space on that disk or write elsewhere",
    errno.EDQUOT: "free some space (a disk quota is full) or write elsewhere",
    errno.EFBIG: "the file is larger than this system allows (see ulimit -f); write elsewhere",
    errno.EROFS: "that file system is read-only; write elsewhere",
    errno.EACCES: "no permission; write elsewhere or fix the directory's permissions",
    errno.EPERM: "not permitted; write elsewhere or fix the directory's permissions",
}


def os_error_message(exc: OSError, path: object = None, what: str = "write") -> str:
    """An OSError reading or writing a user's file (a full disk, a read-only directory, no
    permission), said as bad input: the file, the reason, what to do."""
    where = path if path is not None else exc.filename
    reason = exc.strerror or str(exc) or type(exc).__name__
    fix = _FIXES.get(exc.errno or 0, "check the path and the disk")
    return f"cannot {what} {where} ({reason}): {fix}. Nothing was written."


@contextmanager
def file_access(path: object, what: str = "write") -> Iterator[None]:
    """Turn an OSError inside the block into a ShrinkError naming `path` (see os_error_message)."""
    try:
        yield
    except OSError as exc:
        raise ShrinkError(os_error_message(exc, path, what)) from exc

"""What libraries say, routed through Python logging (loggers under "onnxshrink.libs"), never
printed on stdout where the report goes.

onnx-graphsurgeon prints its messages with print(), on stdout: dumps of nodes that share a name,
"colored module is not installed", "Could not convert: BFLOAT16". `route_library_logs` sends
them to the logger "onnxshrink.libs.onnx_graphsurgeon" instead. The package attaches no handler
to "onnxshrink.libs", so they are silent unless the application configures logging; the command
line shows them, and Python's warnings, on stderr with -v (`show_library_logs`).

onnxruntime writes its own log to stderr from C++, past Python's logging: a failed run logs its
error there (colored, several lines per failure) before the exception that carries the same
message reaches us. Its sessions are made to log only what is fatal (`onnxruntime_severity`),
errors too with -v.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

LIBS = "onnxshrink.libs"
logging.getLogger(LIBS).addHandler(logging.NullHandler())  # silent unless configured

_routed = False
# onnxruntime's log severity for the sessions onnxshrink makes: 4 fatal only, 3 errors too (-v)
_ort_severity = 4
_ort_default_set: int | None = None


def onnxruntime_severity() -> int:
    """The log severity to give an onnxruntime session; onnxruntime's default logger is set to
    it too (once per process and value), for what it logs outside a session."""
    global _ort_default_set
    if _ort_default_set != _ort_severity:
        import onnxruntime as ort

        ort.set_default_logger_severity(_ort_severity)
        _ort_default_set = _ort_severity
    return _ort_severity


def route_library_logs() -> None:
    """Send onnx-graphsurgeon's log to logging (once per process; idempotent)."""
    global _routed
    if _routed:
        return
    from onnx_graphsurgeon.logger.logger import G_LOGGER, Logger, LogMode

    log = logging.getLogger(f"{LIBS}.onnx_graphsurgeon")
    levels = {
        Logger.ULTRA_VERBOSE: logging.DEBUG,
        Logger.VERBOSE: logging.DEBUG,
        Logger.DEBUG: logging.DEBUG,
        Logger.INFO: logging.INFO,
        Logger.WARNING: logging.WARNING,
        Logger.ERROR: logging.ERROR,
        Logger.CRITICAL: logging.CRITICAL,
    }
    once: set[str] = set()

    def emit(message: Any, severity: int, mode: Any = LogMode.EACH, stack_depth: int = 2) -> None:
        level = levels.get(severity, logging.WARNING)
        if severity < G_LOGGER.severity or not log.isEnabledFor(level):
            return  # a message may be a callable that builds a long dump: not built then
        text = str(message() if callable(message) else message)
        if mode == LogMode.ONCE:
            if text in once:
                return
            once.add(text)
        log.log(level, text)

    G_LOGGER.log = emit  # its print() to stdout, replaced
    G_LOGGER.colors = False  # (and no "colored module is not installed" warning)
    _routed = True


class _Tagged(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        tag = "E" if record.levelno >= logging.ERROR else "W" if record.levelno >= logging.WARNING else "I"
        source = record.name.removeprefix(f"{LIBS}.") if record.name != "py.warnings" else "warning"
        lines = record.getMessage().rstrip().splitlines() or [""]
        return "\n".join([f"[{tag}] ({source}) {lines[0]}", *(f"[{tag}]     {ln}" for ln in lines[1:])])


def show_library_logs(verbose: bool) -> None:
    """For the command line: library messages and Python warnings on stderr with -v, else
    nowhere (the report on stdout stays the tool's own); onnxruntime's errors with -v."""
    global _ort_severity
    _ort_severity = 3 if verbose else 4
    logging.captureWarnings(True)
    handler: logging.Handler = logging.StreamHandler(sys.stderr) if verbose else logging.NullHandler()
    handler.setFormatter(_Tagged())
    for name in (LIBS, "py.warnings"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if verbose else logging.CRITICAL + 1)
        logger.propagate = False
    route_library_logs()

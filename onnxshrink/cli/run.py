"""`main`: a command line run from its arguments to its exit code (0 done, 1 validation
failed, 2 bad input, 3 internal error, 130 interrupted), each failure said in one line."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from onnxshrink import __version__
from onnxshrink.cli.checks import check_command, prune_target, report_path
from onnxshrink.cli.flags import options_from
from onnxshrink.cli.parser import build_parser, order_free
from onnxshrink.cli.pruning import run_prune, say_prune_written, write_groups
from onnxshrink.cli.result import Say, print_result
from onnxshrink.errors import (
    ShrinkError,
    ValidationFailed,
    file_access,
    first_line,
    os_error_message,
)
from onnxshrink.options import ShrinkOptions
from onnxshrink.progress import process_seconds

EXIT_INTERNAL = 3


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: the process's) and return its exit code."""
    # when the run began: the process's start for the command line itself (its start-up is
    # part of what the user waits for), the call for a caller in Python
    entered = time.perf_counter()
    since = process_seconds() if argv is None else None
    began = entered - since if since is not None else entered
    argv = order_free(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_intermixed_args(argv)
    say: Say = (lambda _m: None) if args.quiet else (lambda m: print(m, flush=True))
    try:
        return _run(args, say, began)
    except (Exception, KeyboardInterrupt) as exc:
        return _failed(exc, args)


def _run(args: argparse.Namespace, say: Say, began: float) -> int:
    """Check the command line, then write the groups, prune or shrink as it says."""
    from onnxshrink.logs import show_library_logs

    show_library_logs(args.verbose and not args.quiet)
    from onnxshrink.api import check_options

    report = report_path(args)
    options = options_from(
        args,
        ShrinkOptions,
        log=lambda m: say(f"[I] {m}"),
        progress=not args.quiet,  # shown only when stderr is a terminal
    )
    say(
        f"[I] onnxshrink {__version__} | model {args.model}"
        + (f" | masks {args.masks}" if args.masks else "")
    )
    pruning_to = prune_target(args)
    groups_only = args.groups is not None and pruning_to is None  # validates nothing
    check_options(options.but(validate=False) if groups_only else options, flags=True)
    check_command(args, pruning_to)
    if args.groups is not None:
        write_groups(args, say)
        if pruning_to is None:
            return 0
    pruned, result, failure = _shrink_or_prune(args, options, pruning_to is not None, say)
    if result is not None:
        # a prune's phases, after the start-up (reading the command line, the imports)
        timings = {"start": pruned.started - began, **pruned.timings} if pruned is not None else None
        print_result(result, args, say, timings)
    if pruned is not None:
        say_prune_written(pruned, args, say)
    if report is not None:
        _write_report(report, pruned, result, failure)
    if failure is not None:
        print(f"[E] {failure}", file=sys.stderr)
        return failure.exit_code
    return 0


def _shrink_or_prune(
    args: argparse.Namespace, options: ShrinkOptions, pruning: bool, say: Say
) -> tuple[Any, Any, ValidationFailed | None]:
    """The prune's result (None when the run does not prune or failed its proof), the shrink's
    result, and the proof's failure (None when it passed)."""
    from onnxshrink.api import shrink

    try:
        if pruning:
            pruned = run_prune(args, options, say)
            return pruned, pruned.shrink, None
        return None, shrink(args.model, args.masks, args.output, options=options), None
    except ValidationFailed as exc:
        return None, exc.result, exc


def _write_report(report: Path, pruned: Any, result: Any, failure: ValidationFailed | None) -> None:
    """Write --report: the same keys whether the run passed or not."""
    from onnxshrink.api import ShrinkResult

    if pruned is not None:
        data = pruned.to_dict()
    elif failure is not None and failure.report is not None:
        data = failure.report
    else:
        data = result.to_dict() if result is not None else ShrinkResult.empty_report()
    data["error"] = str(failure) if failure is not None else None
    with file_access(report):
        report.write_text(json.dumps(data, indent=2))


def _failed(exc: BaseException, args: argparse.Namespace) -> int:
    """Say why a run stopped (with the traceback under -v) and return its exit code: the
    user's input, disk and memory are theirs to mend; anything else is a bug of ours."""
    if isinstance(exc, KeyboardInterrupt):
        print("[E] interrupted; nothing was written.", file=sys.stderr)
        return 130
    if isinstance(exc, ShrinkError):
        print(f"[E] {exc}", file=sys.stderr)
        code = exc.exit_code
    elif isinstance(exc, OSError):  # the user's disk or files (full, read-only, no permission)
        print(f"[E] {os_error_message(exc, what='read or write')}", file=sys.stderr)
        code = ShrinkError.exit_code
    elif isinstance(exc, MemoryError):  # the machine's memory, as a full disk is the disk's
        print(
            f"[E] out of memory ({first_line(exc)}): the model, or the validation inputs of "
            f"{' '.join(args.input_shapes) if args.input_shapes else 'its shapes'}, need more than "
            "this machine has; give smaller --input-shapes, or run where there is more memory. "
            "Nothing was written.",
            file=sys.stderr,
        )
        code = ShrinkError.exit_code
    else:  # a bug: say so plainly, keep the traceback for -v
        print(
            f"[E] internal error: {type(exc).__name__}: {exc}. Nothing was written. Please report this "
            "with the model (or run with -v for the traceback).",
            file=sys.stderr,
        )
        code = EXIT_INTERNAL
    if args.verbose:
        traceback.print_exc()
    return code

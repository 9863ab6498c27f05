"""The recover stage: from a failed proof, the removals responsible found and kept back
(proof.recover), and the verdict on what is left: a run with no rewrite, or a recovered model no
smaller than the input, is no outcome worth writing."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import onnx

from onnxshrink.core.reasons import AxisKey
from onnxshrink.errors import ValidationFailed
from onnxshrink.io.model import Scratch
from onnxshrink.options import ShrinkOptions
from onnxshrink.progress import PhaseClock
from onnxshrink.proof.recover import BUDGET, Attempt, Recovery, recover
from onnxshrink.proof.verdict import round_up
from onnxshrink.report import count_params
from onnxshrink.stages import attempt as attempts
from onnxshrink.stages.read import Source


@dataclass
class Run:
    """The outcome of a shrink's attempts (the first, or the recovery's), and the recovery when
    the first proof failed."""

    outcome: Attempt
    recovery: Recovery | None = None


def recovered(
    first: Attempt,
    reference: onnx.ModelProto,
    source: Source,
    opts: ShrinkOptions,
    scratch: Scratch | None,
    clock: PhaseClock,
) -> Run:
    """The run from `first`: recovered when its proof failed (not by rounding) and recovery is
    on. ValidationFailed when it leaves no rewrite, or a recovered model no smaller than the input."""
    run = Run(first)
    rounding = first.report is not None and first.report.rounding()
    if opts.validate and opts.recover and not first.passed and not rounding:
        opts.say(f"the proof failed: {first.failure()}; finding the removals responsible ...")
        run.recovery = _recover(first, reference, source, opts, scratch)
        run.outcome = run.recovery.attempt
        clock.lap("recover")
    first.known = None  # the reference's runs: let go
    if run.outcome.rewritten is None:  # the rewrite failed even keeping every channel
        raise ValidationFailed(f"{run.outcome.failure()}; nothing was written.", None)
    if run.recovery is not None and run.outcome.passed:
        _check_smaller(reference, run.outcome.rewritten.model, run.recovery, first)
    return run


def _recover(
    first: Attempt, reference: onnx.ModelProto, source: Source, opts: ShrinkOptions, scratch: Scratch | None
) -> Recovery:
    """Tries with axes kept whole until one passes (proof.recover), each announced with what it
    keeps and how long the last one took (a try is a whole shrink and proof: minutes on an
    LLM). Only the first failure's report, the best passing try and the current one are held
    (the first's shrunk model is let go): never more than the prune's own models at once. The
    data files of the tries not kept (failed, or replaced by a smaller passing one) are removed
    as they go: 37 tries of a 135 M-parameter LLM filled 22 GB of disk when passing ones stayed."""
    total = len(first.analysis.keep.removed())
    first.rewritten = None  # its report says what failed; its model is not the outcome
    tries, seconds, best = 0, 0.0, None

    def one_try(pins: frozenset[AxisKey]) -> Attempt:
        nonlocal tries, seconds, best
        tries += 1
        last = f"; the last took {seconds:.0f} s" if tries > 1 else ""
        opts.say(f"recovery: try {tries} (at most {BUDGET}), keeping {len(pins)} of {total} tensor axes whole{last} ...")
        t0 = time.perf_counter()
        tried = attempts.attempt(reference, source, opts, pins, scratch, first.known)
        seconds = time.perf_counter() - t0
        data = tried.rewritten.data_file if tried.rewritten else None
        if not tried.passed and tries > 1 and data is not None:
            data.unlink(missing_ok=True)  # a failed try's data (the first try may be the outcome)
        if tried.passed:
            if best is not None:  # a smaller passing set replaces it: its model and data go
                replaced = best.rewritten.data_file if best.rewritten else None
                best.rewritten = None
                if replaced is not None:
                    replaced.unlink(missing_ok=True)
            best = tried
        return tried

    recovery = recover(first, one_try)
    if scratch is not None:  # the data of every other try
        outcome = recovery.attempt
        scratch.drop_except(outcome.rewritten.data_file if outcome.rewritten else None)
    return recovery


def _check_smaller(
    reference: onnx.ModelProto, recovered: onnx.ModelProto, recovery: Recovery, first: Attempt
) -> None:
    """A recovery that keeps back so much that the model is no smaller than the input is no
    outcome worth writing: ValidationFailed, saying what failed and the tolerance that would
    have passed the first proof."""
    before, after = count_params(reference), count_params(recovered)
    if after < before:
        return
    hint = ""
    report = first.report
    if report is not None and report.error is None and not any(o.rounding is False for o in report.outputs):
        needed = report.needed_rtol()  # the error was not judged in float64: rounding, maybe
        if math.isfinite(needed):
            hint = f" If that error is rounding, --rtol {round_up(needed)} would have passed the first proof."
    raise ValidationFailed(
        f"the proof failed ({recovery.first_failure}), and keeping the removals responsible "
        f"leaves a model no smaller than the input ({after} parameters, the input {before}): "
        f"nothing was written.{hint}",
        None,
    )

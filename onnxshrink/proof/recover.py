"""A failed proof is not the end of the run: keep the removals responsible and prove again.

The analysis is meant to be sound on its own; the proof is the net. When the net catches
something (the shrunk model differs from the reference, or onnxruntime cannot load or run it, or
the rewrite itself fails), the tensor axes that lost indices are the suspects. Keeping all of
them whole must give a model that passes (else the failure is not about removals, and the run
fails). Then delta debugging (Zeller's ddmin, on complements) looks for a small set of axes whose
keeping suffices: each try is a full analysis, rewrite and proof with those axes pinned. The
result keeps every other removal, and the report names what was kept back: each is a bug to
report. The same inputs and seed give the same tries in the same order, so the same result.

A failure the proof calls rounding (onnxshrink.proof.judge: the same function in float64) never comes
here: no removal is responsible for rounding. A result no smaller than the input is not written
(stages/recovery.py says so).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onnxshrink.analyze import Analysis
from onnxshrink.core.reasons import AxisKey
from onnxshrink.proof.verdict import ValidationReport
from onnxshrink.rewrite import RewriteResult

if TYPE_CHECKING:
    from onnxshrink.proof.comparison import KnownRuns

# Tries beyond the first failure (each is a whole shrink and proof): enough for ddmin to isolate
# a few culprits among thousands of axes; past it, the smallest passing set found so far is kept.
BUDGET = 48


@dataclass
class Attempt:
    """One analysis, rewrite and proof."""

    analysis: Analysis
    rewritten: RewriteResult | None
    report: ValidationReport | None
    error: str | None = None  # the rewrite failed (an InternalError, a model onnx rejects)
    known: KnownRuns | None = None  # its proof's runs of the reference, for a recovery's tries

    @property
    def passed(self) -> bool:
        return self.rewritten is not None and self.report is not None and self.report.passed

    def failure(self) -> str:
        """What went wrong, in one line."""
        if self.error:
            return f"the rewrite failed ({self.error})"
        if self.report is not None and self.report.error:
            return f"the shrunk model does not run ({self.report.error})"
        outputs = self.report.outputs if self.report else []
        worst = max((o.max_rel_error for o in outputs), default=0.0)
        another = any(o.rounding is False for o in outputs if not o.passed)
        unjudged = [o.judged for o in outputs if not o.passed and o.rounding is None and o.judged]
        return (
            f"the shrunk model differs from the reference (max relative error {worst:.3g}"
            + ("; in float64 too: another function)" if another else "")
            + (f"; not judged in float64: {unjudged[0]})" if unjudged and not another else "")
            + (")" if not another and not unjudged else "")
        )

    def bug(self) -> bool:
        """Is the failure a wrong model for sure: the rewrite failed, the shrunk model does not
        run, or the float64 judge found another function (not a failure float64 could not judge,
        which may be rounding)?"""
        if self.error or (self.report is not None and self.report.error):
            return True
        outputs = self.report.outputs if self.report else []
        return any(o.rounding is False for o in outputs if not o.passed)


@dataclass
class Recovery:
    attempt: Attempt  # the passing one, or the last failure when nothing helped
    kept: dict[AxisKey, int]  # tensor axes kept whole, and how many indices that kept back
    first_failure: str
    tries: int
    bug: bool = True  # the first failure is a wrong model for sure (Attempt.bug)


def recover(
    first: Attempt, attempt: Callable[[frozenset[AxisKey]], Attempt], budget: int = BUDGET
) -> Recovery:
    """From a failed first attempt, the smallest set of pinned axes found that passes."""
    removed = first.analysis.keep.removed()
    units = sorted(removed)
    everything = attempt(frozenset(units))
    if not everything.passed:  # keeping every channel does not help: not about removals
        return Recovery(everything, {}, first.failure(), 1, first.bug())
    keep, best, tries = units, everything, 1
    n = 2
    while len(keep) >= 2 and tries < budget:
        size = math.ceil(len(keep) / n)
        reduced = False
        for start in range(0, len(keep), size):
            candidate = keep[:start] + keep[start + size :]
            result = attempt(frozenset(candidate))
            tries += 1
            if result.passed:
                keep, best, reduced = candidate, result, True
                n = max(n - 1, 2)
                break
            if tries >= budget:
                break
        if not reduced:
            if n >= len(keep):
                break
            n = min(len(keep), 2 * n)
    return Recovery(best, {k: removed[k] for k in keep}, first.failure(), tries, first.bug())

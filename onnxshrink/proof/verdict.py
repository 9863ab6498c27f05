"""The verdict of a proof: per output, its error against its tolerance (`OutputCheck`), the
report (`ValidationReport`), and how tolerances are set: the dtype's floor and the reference's
own noise (`output_tolerance`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper


@dataclass
class OutputCheck:
    name: str
    shape: list[int]
    max_abs_error: float
    max_rel_error: float  # max |shrunk - reference| / max |reference|
    passed: bool
    rtol: float | None = None  # this output's tolerance (None: the report's rtol)
    tolerance: str = ""  # why that tolerance: "given", the dtype's floor, the reference's noise
    noise: float | None = None  # the reference's own noise: its outputs with onnxruntime's
    # optimizations on vs off, relative to max |reference| (None: not measured)
    rounding: bool | None = None  # the float64 judge's verdict on a failure (None: not judged)
    float64: float | None = None  # max |shrunk - reference| in float64, relative (when judged)
    judged: str = ""  # what the float64 judge found, or why it could not judge

    def needed_rtol(self, atol: float) -> float:
        """The smallest rtol this output passes with, at `atol` (inf: none, e.g. shapes differ)."""
        if not math.isfinite(self.max_abs_error):
            return math.inf
        if self.max_abs_error <= atol:
            return 0.0
        if self.max_rel_error == 0 or not math.isfinite(self.max_rel_error):
            return math.inf
        mag = self.max_abs_error / self.max_rel_error
        return (self.max_abs_error - atol) / mag


@dataclass
class ValidationReport:
    passed: bool
    rtol: float  # the tolerance given, or the dtype's floor (each output's own: OutputCheck.rtol)
    atol: float
    draws: int
    provider: str
    input_shapes: dict[str, list[int]]
    outputs: list[OutputCheck] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # the shrunk model did not load or run in onnxruntime
    # What was proven: "full" (the graph outputs), or "first N of M blocks" (their frontier)
    kind: str = "full"
    detail: str = ""  # how: sessions one after the other, segments, the dtype the tolerance follows
    # The least precise float type the model computes in, and its machine epsilon
    dtype: str = "float32"
    eps: float = 2.0**-23
    # onnxruntime's graph optimization level the models were compared at (its default, as users
    # run them; ORT_DISABLE_ALL when the reference itself does not load at the default)
    level: str = ""
    rtol_given: bool = False  # the tolerance was given (--rtol): it wins over the derived one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rounding(self) -> bool:
        """Did it fail by rounding only: every output that failed computes the reference's
        function (the float64 judge says so; where it could not judge, the error is within a
        few machine epsilons of the dtype), above a tolerance that was given?"""
        failed = [o for o in self.outputs if not o.passed]
        return (
            not self.passed
            and self.error is None
            and bool(failed)
            and all(
                o.rounding if o.rounding is not None else o.max_rel_error <= ROUNDING_STEPS * self.eps
                for o in failed
            )
        )

    def needed_rtol(self) -> float:
        """The smallest rtol every output passes with (at this atol); inf when none does."""
        return max((o.needed_rtol(self.atol) for o in self.outputs), default=0.0)

    def tolerance_hint(self) -> str:
        """What a failure by rounding means, and the smallest tolerance that would have passed."""
        failed = [o for o in self.outputs if not o.passed]
        worst = max(failed, key=lambda o: o.max_rel_error)
        judged = (
            f"in float64 the two compute the same function ({worst.judged})"
            if worst.rounding
            else f"it is within a few machine epsilons of {self.dtype} ({self.eps:.3g})"
        )
        needed = self.needed_rtol()
        passing = (
            f" The smallest tolerance that would have passed: --rtol {round_up(needed)}"
            + (f" (with --atol {self.atol:g})" if self.atol else "")
            + ("; without --rtol the tolerance follows the reference's own noise." if self.rtol_given else ".")
            if math.isfinite(needed)
            else ""
        )
        return (
            f"The error (relative {worst.max_rel_error:.3g} on '{worst.name}') is rounding, not a "
            f"wrong model: {judged}; {self.dtype} arithmetic rounds differently when zero terms "
            f"are removed and constants folded.{passing}"
        )

    def lines(self) -> list[str]:
        """Polygraphy-style accuracy block."""
        shapes = " ".join(f"{n}:{','.join(map(str, d)) or '[]'}" for n, d in self.input_shapes.items())
        out = [
            f"[I] Accuracy Comparison | reference (masked input) vs shrunk | {self.draws} draw(s) on "
            f"{self.provider}" + (f" | random inputs {shapes}" if shapes else "")
        ]
        if self.kind != "full" or self.detail:
            tag = "[I]" if self.kind == "full" else "[W]"  # a partial proof says so
            out.append(f"{tag}     Proof: {self.kind}" + (f" ({self.detail})" if self.detail else ""))
        for o in self.outputs:
            rtol = self.rtol if o.rtol is None else o.rtol
            out.append(f"[I]     Comparing Output: '{o.name}' (shape={tuple(o.shape)})")
            why = f" ({o.tolerance})" if o.tolerance else ""
            out.append(
                f"[I]         Tolerance: [abs={self.atol:.5g}, rel={rtol:.5g}]{why} | Checking max error relative to the output's magnitude"
            )
            out.append(
                f"[I]         Minimum Required Tolerance: [abs={o.max_abs_error:.5g}] OR [rel={o.max_rel_error:.5g}]"
            )
            if o.judged:
                verdict = "rounding" if o.rounding else "not rounding" if o.rounding is False else "not judged"
                out.append(f"[I]         Float64 judge: {verdict} ({o.judged})")
            tag = "[I]         PASSED" if o.passed else "[E]         FAILED"
            bound = f"(rel={rtol:.5g}, abs={self.atol:.5g})"
            difference = (
                f"rounding, the same function in float64 (above the tolerance {bound})"
                if o.passed and o.rounding
                else f"{'within' if o.passed else 'NOT within'} tolerance {bound}"
            )
            out.append(f"{tag} | Output: '{o.name}' | Difference is {difference}")
        if self.error:
            out.append(f"[E]     FAILED | the shrunk model does not run: {self.error}")
            return out
        names = [o.name for o in self.outputs]
        if self.passed:
            out.append(f"[I]     PASSED | All outputs matched | Outputs: {names}")
        else:
            bad = [o.name for o in self.outputs if not o.passed]
            out.append(f"[E]     FAILED | Mismatched outputs: {bad}")
        return out


def round_up(x: float) -> str:
    """`x` with two significant digits, rounded up (a tolerance that passes)."""
    if x <= 0:
        return "0"
    exp = math.floor(math.log10(x)) - 1
    up = math.ceil(x / 10.0**exp - 1e-9) * 10.0**exp
    return f"{up:.2g}"


def float_error(reference: np.ndarray, candidate: np.ndarray) -> float:
    """max |candidate - reference| over the elements, in float64: 0 where both are NaN or both
    the same infinity, inf where one is not finite and the other differs (a NaN in one only)."""
    r, s = reference.astype(np.float64), candidate.astype(np.float64)
    same = (r == s) | (np.isnan(r) & np.isnan(s))
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
        diff = np.where(same, 0.0, np.abs(r - s))
    return float(np.nan_to_num(diff, nan=np.inf, posinf=np.inf).max(initial=0.0))


class ErrorTally:
    """The worst error of each output over several runs: reference vs candidate. A non-float
    output matches where it equals the reference, or `alternative` (the reference run another,
    equally valid way: an ArgMax of a near tie may differ between the two as well)."""

    def __init__(self, names: list[str]):
        self.names = names
        self.err = dict.fromkeys(names, 0.0)  # max |candidate - reference|
        self.mag = dict.fromkeys(names, 0.0)  # max |reference|
        self.exact = dict.fromkeys(names, True)  # shapes, dtypes and non-float values agree
        self.shape: dict[str, list[int]] = {n: [] for n in names}
        self.worst = dict.fromkeys(names, 0)  # the run with the largest error
        self.values_differ: set[str] = set()  # non-float outputs of one shape and dtype, other values
        self.runs = 0

    def add(
        self,
        reference: list[np.ndarray],
        candidate: list[np.ndarray],
        alternative: list[np.ndarray] | None = None,
    ) -> None:
        others: list[np.ndarray | None] = list(alternative) if alternative is not None else [None] * len(self.names)
        for n, r, s, a in zip(self.names, reference, candidate, others, strict=True):
            r, s = np.asarray(r), np.asarray(s)
            self.shape[n] = list(r.shape)
            if r.shape != s.shape or r.dtype != s.dtype:
                self.exact[n], self.err[n] = False, float("inf")
                self.values_differ.discard(n)
            elif np.issubdtype(r.dtype, np.floating):
                err = float_error(r, s)
                if err > self.err[n]:
                    self.err[n], self.worst[n] = err, self.runs
                finite = np.abs(r[np.isfinite(r)])  # the magnitude of the values it compares
                self.mag[n] = max(self.mag[n], float(finite.max(initial=0.0)))
            elif not np.array_equal(r, s) and (
                a is None or a.shape != s.shape or not bool(np.all((r == s) | (a == s)))
            ):
                if self.exact[n]:  # the first run it differs on: judged in float64 (an ArgMax
                    self.values_differ.add(n)  # of a near tie that float32 rounding moved)
                    self.worst[n] = self.runs
                self.exact[n], self.err[n] = False, float("inf")
        self.runs += 1

    def relative(self, name: str) -> float:
        err, mag = self.err[name], self.mag[name]
        return err / mag if mag > 0 else (0.0 if err == 0 else float("inf"))

    def checks(self, rtol: float | Mapping[str, float], atol: float) -> list[OutputCheck]:
        out = []
        for n in self.names:
            tol = rtol[n] if isinstance(rtol, Mapping) else rtol
            err, mag = self.err[n], self.mag[n]
            passed = self.exact[n] and err <= atol + tol * mag
            out.append(OutputCheck(n, self.shape[n], err, self.relative(n), passed, tol))
        return out


# Machine epsilon of each float type a model may compute in; the default tolerance is ten of
# them for the least precise type the model computes in, and never below 1e-5.
EPS = {
    onnx.TensorProto.DOUBLE: 2.0**-52,
    onnx.TensorProto.FLOAT: 2.0**-23,
    onnx.TensorProto.FLOAT16: 2.0**-10,
    onnx.TensorProto.BFLOAT16: 2.0**-7,
}


# Where the float64 judge cannot decide, a failure by at most this many machine epsilons of the
# model's dtype is rounding (see ValidationReport.rounding).
ROUNDING_STEPS = 16


# The derived tolerance of an output: this many times the reference's own noise (its outputs
# with onnxruntime's graph optimizations on vs off: two equally valid float orders), at least
# default_tolerance, at most NOISE_CAP (past it the runtime, not rounding, is at odds with
# itself, and the float64 judge decides).
NOISE_FACTOR = 2.0


def default_tolerance(eps: float) -> float:
    """Ten machine epsilons of the dtype, and never below 1e-5: the floor of every tolerance."""
    return max(1e-5, 10 * eps)


def noise_cap(eps: float) -> float:
    """The largest tolerance the reference's noise may set: 8192 machine epsilons (1e-3 for
    float32), at most 0.1, never below the floor."""
    return max(default_tolerance(eps), min(0.1, 8192 * eps))


def output_tolerance(
    given: float | None, eps: float, dtype: str, noise: float | None
) -> tuple[float, str]:
    """One output's rtol, and why: given (--rtol), else NOISE_FACTOR x the reference's own
    relative noise, between the dtype's floor and noise_cap."""
    if given is not None:
        return given, "given"
    floor, derived = default_tolerance(eps), NOISE_FACTOR * (noise or 0.0)
    if derived <= floor:
        shown = f"; reference noise {noise:.2g}" if noise else ""
        return floor, f"the floor for {dtype}{shown}"
    cap = noise_cap(eps)
    if derived > cap:
        return cap, f"reference noise {noise:.2g} at {dtype}, capped at {cap:.2g}"
    return derived, f"reference noise {noise:.2g} at {dtype}: {NOISE_FACTOR:g} x noise"


def arithmetic(model: onnx.ModelProto) -> tuple[str, float]:
    """The least precise float type the model computes in (its nodes' outputs), and its machine
    epsilon."""
    from onnxshrink.prepare import inferred_shapes

    produced = {o for n in model.graph.node for o in n.output}
    types = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in [*inferred_shapes(model), *model.graph.output]
        if vi.type.HasField("tensor_type")
    }
    computed = {types[n] for n in produced if types.get(n) in EPS}
    worst = max(computed, key=lambda t: EPS[t], default=onnx.TensorProto.FLOAT)
    name = helper.tensor_dtype_to_np_dtype(worst).name if worst != onnx.TensorProto.BFLOAT16 else "bfloat16"
    return name, EPS[worst]

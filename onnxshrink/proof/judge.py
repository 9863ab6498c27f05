"""The proof's second judge: both models computed in float64, where float32 cannot decide.

Removing zero terms and folding constants changes the order of float32 sums, so a correct shrunk
model differs from the reference by rounding, amplified by whatever the model amplifies (a
sigmoid of very negative logits, a LayerNorm over near-constant features, a long recurrence);
float32 cannot tell that from a wrong model of the same size. Computed in float64 (every float
tensor, weight, Cast and constant widened: the exact function of the same weights) on the input
where the float32 difference was worst, they can be told apart:

- The twin: the same shrink of the reference widened to float64 (its folds exact). Where it has
  the shrunk model's graph, it must agree with the widened reference to float64's own rounding
  (the same function), and the shrunk model's constants must be its constants rounded to the
  dtype. A wrong removal or fold makes the twin wrong too; a wrong constant in the shrunk model
  alone is not the twin's rounded.
- Where the twin's graph differs (the analysis of a float64 model can find less: onnxruntime has
  no float64 kernel for some ops it evaluates constants with), the shrunk model itself in
  float64 must be as close to the reference as moving its new constants (the values the
  reference does not hold: folded biases, border corrections) by PERTURB_STEPS epsilons of their
  dtype moves it: what storing them rounded can do, measured, not guessed.

And the float32 difference must be of the size float32 gives that output: at most SIZE_FACTOR x
the reference's own float32 error against float64 (a prune's shorter sums and products round
differently, as the reference's own arithmetic does; a runtime computing one model otherwise is
no rounding). That bound, not the spread between onnxruntime's optimization levels, is the
float32 tolerance of an output the judge decides.

The judge never declines a model for its size: each model is computed in float64 in pieces
(onnxshrink.proof.widen), and the twin of a reference of at most TWIN_BYTES of weights is made
in memory; past it, streamed (a `Twin` with its weights on disk): the reference widened into a
float64 data file tensor by tensor, shrunk as a large model is (its weights mapped, the shrunk
ones written to a file), compared with the shrunk model a tensor at a time and computed a piece
at a time, so that its memory is the shrink's, not the model's. Without a twin (it could not be
made: no room on disk for it, a shrink of it that fails), the shrunk model is judged with its
new constants moved. Contrib ops with no float64 kernel cannot be judged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.errors import first_line
from onnxshrink.io.weights import WeightStore, tensor_values, trim
from onnxshrink.ops import is_constant_node
from onnxshrink.proof.verdict import EPS, ROUNDING_STEPS, ErrorTally, OutputCheck
from onnxshrink.proof.widen import (
    DOUBLE,
    NARROW,
    NotJudged,
    declared,
    float64_outputs,
    stored,
    widened,
)

# The twin must agree with the widened reference to float64's rounding (FLOOR_STEPS and
# AMPLIFIED_STEPS below); the shrunk model's constants must be the twin's rounded to the dtype:
# within this many of its epsilons of each tensor's largest value (a fold summed in the dtype
# rounds a few times).
STORED_STEPS = 16
# Without a twin: the shrunk model's new constants, each moved by this many epsilons of its
# dtype: more than a fold computed in float32 arithmetic rounds, far less than a wrong value.
PERTURB_STEPS = 64
# A float64 difference this many float64 epsilons of the output, plus this many times the
# reference's float32 error scaled down to float64's epsilon (the model amplifies both alike), is
# float64's own rounding.
FLOOR_STEPS = 64
AMPLIFIED_STEPS = 16
EPS64 = float(np.finfo(np.float64).eps)
# And the float32 difference must be of the size float32 arithmetic gives that output: at most
# this many times the reference's own float32 error (its distance from float64) or ROUNDING_STEPS
# epsilons. Larger is no rounding (a runtime computing one model otherwise, a wrong model).
SIZE_FACTOR = 10.0
# Weights of a reference whose shrink the judge repeats in float64 in memory (the twin: the
# float64 copy and its analysis held at once); a larger one's twin is streamed through files
# (`Twin`), which costs less than it holds: SmolLM2-135M (541 MB) pruned 0.2 in memory with its
# proof peaked at 6.92 GiB with its twin in memory, 5.55 GiB streamed (2026-11-29). Without a
# twin the judge is loose: on SmolLM2-135M and random tokens, moving its rescaled norm gains by
# 64 epsilons moves the logits by 7%, where its twin decides to 1e-12.
TWIN_BYTES = 256 * 2**20
_EPS: dict[int, float] = {int(k): v for k, v in EPS.items()}  # by the element type number


@dataclass
class Case:
    """What the proof ran: both models, the inputs, their float32 outputs (per input, per output)."""

    reference: onnx.ModelProto
    shrunk: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    ref_out: list[list[np.ndarray]]
    new_out: list[list[np.ndarray]]
    eps: float
    dtype: str
    shapes: dict[str, list[int]]
    reference_dir: str | Path | None = None
    shrunk_dir: str | Path | None = None


@dataclass
class Twin:
    """The shrink of the reference widened to float64. A streamed one keeps its weights in
    external data under `base_dir` (a scratch directory of its own), deleted by `close()`."""

    model: onnx.ModelProto
    base_dir: Path | None = None
    close: Callable[[], None] = lambda: None
    # the reference widened, its weights under `base_dir` too (a streamed twin's; else None: the
    # reference is widened a piece at a time as it runs)
    reference: onnx.ModelProto | None = None


@dataclass
class Verdict:
    """The float64 judgement of one output on one input."""

    rounding: bool
    float64: float  # max |shrunk - reference| in float64, relative to max |reference|
    own: float  # the reference's own float32 error (its distance from float64), relative
    text: str



def _constants(model: onnx.ModelProto, types: Sequence[int]) -> dict[str, onnx.TensorProto]:
    """The model's constants of `types`, by name: initializers, and Constant values (by output)."""
    from onnxshrink.prepare import default_opset

    opset = default_opset(model)
    out = {t.name: t for t in model.graph.initializer if t.data_type in types}
    for n in model.graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in types and is_constant_node(n, opset):
                out[n.output[0]] = a.t
    return out


def new_constants(
    shrunk: onnx.ModelProto,
    reference: onnx.ModelProto,
    shrunk_dir: str | Path | None = None,
    reference_dir: str | Path | None = None,
) -> dict[str, tuple[np.ndarray, float]]:
    """The elements of the shrunk model's float constants the reference does not hold (a
    constant of a name the reference has: its values not among that constant's; any other: all
    of it), by name: (mask, the dtype's epsilon)."""
    mine, theirs = _constants(shrunk, NARROW), _constants(reference, NARROW)
    out = {}
    for name, t in mine.items():
        values = tensor_values(t, shrunk_dir)
        if name in theirs:
            known = tensor_values(theirs[name], reference_dir)
            mask = ~np.isin(values, known)
        else:
            mask = np.ones(values.shape, bool)
        if mask.any():
            out[name] = (mask, _EPS[t.data_type])
    return out


def perturbed(wide: onnx.ModelProto, new: dict[str, tuple[np.ndarray, float]], seed: int = 0) -> onnx.ModelProto:
    """`wide` (a widened model) with each new constant moved by PERTURB_STEPS epsilons of its
    dtype, random signs."""
    rng = np.random.default_rng(seed)
    out = onnx.ModelProto()
    out.CopyFrom(wide)
    tensors = _constants(out, (*NARROW, DOUBLE))
    for name, (mask, eps) in new.items():
        t = tensors.get(name)
        if t is None:
            continue
        values = numpy_helper.to_array(t).astype(np.float64)
        signs = rng.choice([-1.0, 1.0], size=values.shape)
        values = np.where(mask, values * (1 + signs * PERTURB_STEPS * eps), values)
        t.CopyFrom(numpy_helper.from_array(values.astype(numpy_helper.to_array(t).dtype), t.name))
    return out


def verdict(
    r32: np.ndarray,
    s32: np.ndarray,
    r64: np.ndarray,
    x64: np.ndarray,
    eps: float,
    dtype: str = "float32",
    moved: np.ndarray | None = None,
    noise: float | None = None,
) -> Verdict | None:
    """Rounding or not, for one output on one input: the reference and the shrunk model in
    float32, the reference in float64, and in float64 either the twin (`moved` None) or the
    shrunk model itself, with `moved` its outputs once its new constants are moved (None: not
    comparable, e.g. not finite). `noise`: the reference's spread between onnxruntime's
    optimization levels (relative, as the proof measured it), float32 rounding of the same
    function too: the size the shrunk model's float32 difference may have is at least that."""
    if not np.issubdtype(np.asarray(r32).dtype, np.floating):  # an ArgMax, a comparison
        # Where the shrunk model's values differ, either float64 gives the reference's values
        # (the same function), or the reference's own float32 and float64 values differ there, or
        # moving the stored constants changes them: near ties, which rounding decides.
        r32a, s32a, r64a, x64a = (np.asarray(a) for a in (r32, s32, r64, x64))
        if len({a.shape for a in (r32a, s32a, r64a, x64a)}) > 1:
            return None
        tie = (x64a == r64a) | (r64a != r32a)
        if moved is not None:
            tie |= np.asarray(moved) != x64a
        same = bool(np.all(tie[s32a != r32a]))
        text = (
            "float64: the same values but at near ties, which rounding decides"
            if same
            else "float64: other values where the reference's are not near a tie: another function"
        )
        return Verdict(same, 0.0 if same else math.inf, 0.0, text)
    arrays = [np.asarray(a, np.float64) for a in (r32, s32, r64, x64, x64 if moved is None else moved)]
    if any(a.shape != arrays[0].shape or not np.isfinite(a).all() for a in arrays):
        return None
    r32d, s32d, r64d, x64d, m64d = arrays
    mag = float(np.abs(r32d).max(initial=0.0)) or 1.0
    d32 = float(np.abs(s32d - r32d).max(initial=0.0))
    d64 = float(np.abs(x64d - r64d).max(initial=0.0))
    own = float(np.abs(r32d - r64d).max(initial=0.0))
    reach = FLOOR_STEPS * EPS64 * float(np.abs(r64d).max(initial=0.0)) + AMPLIFIED_STEPS * (EPS64 / eps) * own
    if moved is not None:  # what storing its new constants rounded can move it by
        reach += float(np.abs(m64d - x64d).max(initial=0.0))
    same = d64 <= reach
    # one output's own float32 error on one input is one draw of its rounding (a single
    # probability can land near its float64 value by chance): its spread between levels too
    spread = (noise or 0.0) * mag
    sized = d32 <= SIZE_FACTOR * max(own, spread, ROUNDING_STEPS * eps * mag)
    what = "its float64 twin" if moved is None else "it"
    text = (
        f"float64: {d64 / mag:.2g} between the reference and {what}"
        + ("" if moved is None else f", its stored constants' rounding reaching {reach / mag:.2g}")
        + ("" if same else ": another function")
        + f"; the reference's own {dtype} error {own / mag:.2g}"
        + (f" (its spread between optimization levels {spread / mag:.2g})" if spread > own else "")
        + f", the shrunk model's {d32 / mag:.2g} {'within' if sized else 'past'} {SIZE_FACTOR:g} x it"
    )
    return Verdict(same and sized, d64 / mag, own / mag, text)


def _too_costly(case: Case, macs_limit: float | None) -> str | None:
    """Why the models are not judged in float64 here (None: they are): only a limit given (a
    recovery's try) keeps a model from it; the judge computes any other in pieces."""
    from onnxshrink.report import count_macs

    if macs_limit is None:
        return None
    macs = count_macs(case.reference, case.shapes)
    if macs > macs_limit:
        return f"{macs / 1e9:.2g} G multiply-adds: a recovery's try is judged in float64 below {macs_limit / 1e9:.2g} G"
    return None


def judge(
    case: Case,
    twin: Callable[[bool], Twin] | None,
    tally: ErrorTally,
    outputs: list[OutputCheck],
    macs_limit: float | None = None,
) -> None:
    """Judge each of `outputs` (off by more than the float32 floor) in float64: sets its
    rounding, float64 and judged (see the module doc). `twin(streamed)`: the shrink of the
    reference widened to float64, streamed for a reference past TWIN_BYTES of weights (without
    one, the shrunk model is judged with its new constants moved)."""
    from onnxshrink.io.weights import release_all
    from onnxshrink.proof.segment import weight_bytes

    release_all()  # the weights' pages the shrink and its proof read: back to the page cache

    def none(why: str) -> None:
        for c in outputs:
            c.judged = why

    why = _too_costly(case, macs_limit)
    if why:
        return none(why)
    exact, missing = None, ""
    try:
        exact = twin(weight_bytes(case.reference) > TWIN_BYTES) if twin is not None else None
    except Exception as exc:  # the float64 shrink failed (or has no room): judged without it
        missing = f"no float64 twin ({first_line(exc)})"
    try:
        _judged(case, exact, tally, outputs)
    except NotJudged as exc:
        none(str(exc))
    except Exception as exc:  # its constants cannot be read, ...
        none(f"it cannot be computed in float64 here ({first_line(exc)})")
    finally:
        if exact is not None:
            exact.close()
    if missing:
        for c in outputs:
            c.judged = f"{c.judged}; {missing}" if c.judged else missing


def _judged(case: Case, exact: Twin | None, tally: ErrorTally, outputs: list[OutputCheck]) -> None:
    """`judge` with its twin made (or None)."""
    names = [c.name for c in outputs]
    draws = sorted({tally.worst[n] for n in names})
    feeds = [case.feeds[k] for k in draws]
    differs = (
        same_form(case.shrunk, exact.model, case.eps, case.shrunk_dir, exact.base_dir)
        if exact is not None
        else "no twin"
    )
    if differs is not None and "rounded" in differs:  # the same graph, other constants
        for c in outputs:
            c.rounding, c.judged = False, f"{differs}: another model"
        return
    if exact is not None and exact.reference is not None:
        r64 = float64_outputs(exact.reference, feeds, names, exact.base_dir, wide=True)
    else:
        r64 = float64_outputs(case.reference, feeds, names, case.reference_dir)
    x64, moved = _shrunk_float64(case, None if differs else exact, feeds, names)
    _verdicts(case, tally, outputs, draws, r64, x64, moved)


def _shrunk_float64(
    case: Case, exact: Twin | None, feeds: list[dict[str, np.ndarray]], names: list[str]
) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]] | None]:
    """The shrunk model's side in float64: the twin's outputs (`exact`), or the shrunk model's
    and its outputs with its new constants moved (each widened piece by piece)."""
    if exact is not None:
        return float64_outputs(exact.model, feeds, names, exact.base_dir, wide=True), None
    new = new_constants(case.shrunk, case.reference, case.shrunk_dir, case.reference_dir)
    x64 = float64_outputs(case.shrunk, feeds, names, case.shrunk_dir)
    if not new:
        return x64, x64
    moved = float64_outputs(case.shrunk, feeds, names, case.shrunk_dir, change=lambda m: perturbed(m, new))
    return x64, moved


def _verdicts(
    case: Case,
    tally: ErrorTally,
    outputs: list[OutputCheck],
    draws: list[int],
    r64: list[list[np.ndarray]],
    x64: list[list[np.ndarray]],
    moved: list[list[np.ndarray]] | None,
) -> None:
    """Each output's verdict on the draw it was worst on (see verdict)."""
    for j, c in enumerate(outputs):
        k = tally.worst[c.name]
        row, i = draws.index(k), tally.names.index(c.name)
        v = verdict(
            case.ref_out[k][i], case.new_out[k][i], r64[row][j], x64[row][j], case.eps, case.dtype,
            None if moved is None else moved[row][j], c.noise,
        )  # fmt: skip
        if v is None:
            c.judged = "its values are not finite in float64 or float32"
            continue
        c.rounding, c.float64, c.judged = v.rounding, v.float64, v.text


# A node's form (op, domain, inputs, outputs, attributes: a tensor's or graph's by name and
# type, any other by name and value), and a graph's initializers' (names and shapes)
_NodeForm = tuple[str, str, tuple[str, ...], tuple[str, ...], tuple[tuple[str, int | bytes], ...]]
_InitializersForm = tuple[tuple[str, tuple[int, ...]], ...]


def _form(model: onnx.ModelProto) -> list[_NodeForm | _InitializersForm]:
    """Every graph's nodes and initializers, by what they are: op, tensors read and written,
    non-tensor attributes; initializer names and shapes (not values, not dtypes)."""
    from onnxshrink.ir import all_graphs

    out: list[_NodeForm | _InitializersForm] = []
    for g in all_graphs(model.graph):
        for n in g.node:
            attrs = tuple(
                (a.name, a.type) if a.type in (onnx.AttributeProto.TENSOR, onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                else (a.name, a.SerializeToString())
                for a in n.attribute
            )
            out.append((n.op_type, n.domain, tuple(n.input), tuple(n.output), attrs))
        out.append(tuple(sorted((t.name, tuple(t.dims)) for t in g.initializer)))
    return out


def _tensors(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Every float initializer and Constant value of the model (all graphs), by graph and name
    (their values are read one at a time: see `same_form`)."""
    from onnxshrink.ir import all_graphs

    out = {}
    for k, g in enumerate(all_graphs(model.graph)):
        for t in g.initializer:
            if t.data_type in (*NARROW, DOUBLE):
                out[f"{k}:{t.name}"] = t
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in (*NARROW, DOUBLE):
                    out[f"{k}:{n.output[0] if n.output else n.name}:{a.name}"] = a.t
    return out


def same_form(
    shrunk: onnx.ModelProto,
    twin: onnx.ModelProto,
    eps: float,
    shrunk_dir: str | Path | None = None,
    twin_dir: str | Path | None = None,
) -> str | None:
    """Why `shrunk` is not `twin` (its float64 shrink) with every constant rounded to the model's
    dtype; None when it is. `*_dir`: where each keeps its external data; their weights are read
    mapped, a tensor and a block of rows at a time."""
    if _form(widened(shrunk, shrunk_dir, declared)) != _form(twin):
        return "the float64 shrink has another graph (other nodes or weight shapes)"
    mine, exact = _tensors(shrunk), _tensors(twin)
    store = WeightStore()
    try:
        for name, t in mine.items():
            w = exact.get(name)
            if w is None or tuple(w.dims) != tuple(t.dims):
                return f"constant {name.split(':', 1)[1]} is not in its float64 shrink"
            if not _rounded(stored(t, shrunk_dir, store), stored(w, twin_dir, store), eps):
                return f"constant {name.split(':', 1)[1]} is not its float64 value rounded"
    finally:
        store.close()
    return None


def _rounded(value: np.ndarray, want: np.ndarray, eps: float) -> bool:
    """Is `value` (a constant of the shrunk model) `want` (its twin's) rounded: each element
    within STORED_STEPS epsilons of the largest finite value of `want`, or equal to it (a NaN
    or infinite value, a fill or a mask, is itself in both)? Read a block of rows at a time."""
    value, want = np.asarray(value), np.asarray(want)
    if value.ndim == 0:
        value, want = value.reshape(1), want.reshape(1)
    rows = max(1, _BLOCK // max(1, want[:1].nbytes))
    scale = largest = 0.0  # the largest finite |want|, the largest difference where they differ
    for s in range(0, len(want), rows):  # one pass: an element off is off whatever the scale
        trim()  # (the pages read: back to the page cache)
        v, w = np.asarray(value[s : s + rows], np.float64), np.asarray(want[s : s + rows], np.float64)
        differ = ~((v == w) | (np.isnan(v) & np.isnan(w)))
        if differ.any():
            with np.errstate(invalid="ignore"):
                off = np.abs(v[differ] - w[differ])
            if not np.isfinite(w[differ]).all() or np.isnan(off).any():
                return False
            largest = max(largest, float(off.max()))
        scale = max(scale, float(np.abs(w[np.isfinite(w)]).max(initial=0.0)))
    return largest <= STORED_STEPS * eps * scale


_BLOCK = 32 * 2**20  # bytes of a twin's constant compared at once

"""The proof's second judge: both models computed in float64, where float32 cannot decide.

Removing zero terms and folding constants changes the order of float32 sums, so a correct shrunk
model differs from the reference by rounding, amplified by whatever the model amplifies (a
sigmoid of very negative logits, a LayerNorm over near-constant features, a long recurrence).
When that difference exceeds the float32 tolerance, the same two graphs are computed in float64
(every float tensor, weight, Cast and constant widened: the exact function of the same weights)
on the input where the difference was worst. A correct model agrees with the reference there to
within the float32 rounding of the constants it stores (folded biases, at most the rounding each
model does on its own); a wrong one (a changed weight, a wrong axis, a dropped channel) differs
in float64 as much as in float32.

onnxruntime runs the widened graph when it has a double kernel for every op (LSTM, Gemm, MatMul,
elementwise ops); otherwise onnx's reference evaluator does (Conv, Resize, ...; about 0.1 G
multiply-adds a second). Contrib ops have no float64 form here: such a model cannot be judged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxshrink.errors import first_line
from onnxshrink.validate import ROUNDING_STEPS, ErrorTally, OutputCheck

NARROW = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
DOUBLE = TensorProto.DOUBLE
DOUBLE_TYPE = "tensor(double)"

# The float64 twin (the shrink of the reference widened to float64, its constants exact) must
# agree with the widened reference to float64's own rounding: this many times the reference's
# float32 error scaled down to float64's epsilon (the model amplifies both alike), plus this many
# float64 epsilons of the output.
TWIN_STEPS = 16
FLOOR_STEPS = 64
# The shrunk model's constants must be the twin's rounded to the model's dtype: within this many
# of its epsilons of each tensor's largest value (a fold summed in the dtype rounds a few times).
STORED_STEPS = 16
# And the float32 difference must be of the size float32 arithmetic gives that output: at most
# this many times the reference's own float32 error (its distance from float64) or ROUNDING_STEPS
# epsilons. Larger is no rounding (a runtime computing one model otherwise, a wrong model).
SIZE_FACTOR = 10.0
# Multiply-adds of the model above which it is not judged (onnx's reference evaluator computes
# about 0.1 G a second: both models on one input)
MACS = 2e9
EPS64 = float(np.finfo(np.float64).eps)


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
class Verdict:
    """The float64 judgement of one output on one input."""

    rounding: bool
    float64: float  # max |twin - reference| in float64, relative to max |reference|
    own: float  # the reference's own float32 error (its distance from float64), relative
    text: str


class NotJudged(Exception):
    """The models cannot be computed in float64 here (the reason is the message)."""


def _widen_tensor(t: onnx.TensorProto, base_dir: str | Path | None) -> onnx.TensorProto:
    values = numpy_helper.to_array(t, base_dir=str(base_dir) if base_dir is not None else "")
    return numpy_helper.from_array(np.asarray(values, dtype=np.float64), t.name)


def _widen_node(n: onnx.NodeProto, base_dir: str | Path | None) -> None:
    """Widen the attributes of `n` (and its subgraphs): tensors, Cast's `to`, ops' `dtype`."""
    for a in n.attribute:
        if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in NARROW:
            a.t.CopyFrom(_widen_tensor(a.t, base_dir))
        elif a.type == onnx.AttributeProto.GRAPH:
            _widen_graph(a.g, base_dir)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for sub in a.graphs:
                _widen_graph(sub, base_dir)
        elif a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i in NARROW:
            a.i = DOUBLE
    if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
        for a in list(n.attribute):
            if a.name in ("value_float", "value_floats"):
                value = a.f if a.name == "value_float" else list(a.floats)
                n.attribute.remove(a)
                n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.array(value, np.float64))))


def _widen_graph(g: onnx.GraphProto, base_dir: str | Path | None) -> None:
    """Widen `g` in place: its inputs, outputs, weights and nodes (value_info is dropped)."""
    for vi in [*g.input, *g.output]:
        if vi.type.tensor_type.elem_type in NARROW:
            vi.type.tensor_type.elem_type = DOUBLE
    del g.value_info[:]
    for t in g.initializer:
        if t.data_type in NARROW:
            t.CopyFrom(_widen_tensor(t, base_dir))
    for n in g.node:
        _widen_node(n, base_dir)


def widened(model: onnx.ModelProto, base_dir: str | Path | None = None) -> onnx.ModelProto:
    """`model` computing in float64: the exact function of its weights (see the module doc).
    Inputs a schema allows no float64 for (Resize's scales) are widened too: onnxruntime then
    refuses the model, and the reference evaluator, which is not strict about types, runs it."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _widen_graph(out.graph, base_dir)
    for f in out.functions:
        for n in f.node:
            _widen_node(n, base_dir)
    return out


def _wide_feed(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v for k, v in feed.items()}


def float64_outputs(
    model: onnx.ModelProto,
    feeds: Sequence[dict[str, np.ndarray]],
    outputs: list[str],
    base_dir: str | Path | None = None,
) -> list[list[np.ndarray]]:
    """`outputs` of `model` computed in float64 on each feed; NotJudged when neither onnxruntime
    nor onnx's reference evaluator can."""
    try:
        wide = widened(model, base_dir)
    except Exception as exc:
        raise NotJudged(f"its weights cannot be widened ({first_line(exc)})") from exc
    data = wide.SerializeToString()
    try:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        return [sess.run(outputs, {k: v for k, v in _wide_feed(f).items() if k in names}) for f in feeds]
    except Exception:
        pass  # no double kernel for some op: the reference evaluator has them all
    try:
        from onnx.reference import ReferenceEvaluator

        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            evaluator = ReferenceEvaluator(wide)
            return [list(evaluator.run(outputs, _wide_feed(f))) for f in feeds]  # type: ignore[arg-type]
    except Exception as exc:
        raise NotJudged(f"onnx's reference evaluator cannot run it ({first_line(exc)})") from exc


def verdict(
    r32: np.ndarray, s32: np.ndarray, r64: np.ndarray, t64: np.ndarray, eps: float, dtype: str = "float32"
) -> Verdict | None:
    """Rounding or not, for one output on one input: the reference and the shrunk model in
    float32, the reference and the twin in float64 (None: not comparable, e.g. not finite)."""
    arrays = [np.asarray(a, np.float64) for a in (r32, s32, r64, t64)]
    if any(a.shape != arrays[0].shape or not np.isfinite(a).all() for a in arrays):
        return None
    r32d, s32d, r64d, t64d = arrays
    mag = float(np.abs(r32d).max(initial=0.0)) or 1.0
    d32 = float(np.abs(s32d - r32d).max(initial=0.0))
    d64 = float(np.abs(t64d - r64d).max(initial=0.0))
    own = float(np.abs(r32d - r64d).max(initial=0.0))
    same = d64 <= TWIN_STEPS * (EPS64 / eps) * own + FLOOR_STEPS * EPS64 * float(np.abs(r64d).max(initial=0.0))
    sized = d32 <= SIZE_FACTOR * max(own, ROUNDING_STEPS * eps * mag)
    text = (
        f"float64: {d64 / mag:.2g} between them"
        + ("" if same else ", more than float64 rounds: another function")
        + f"; the reference's own {dtype} error {own / mag:.2g}"
        + ("" if sized else f", the shrunk model's {d32 / mag:.2g} is past {SIZE_FACTOR:g} x it")
    )
    return Verdict(same and sized, d64 / mag, own / mag, text)


def _judgeable(case: Case, macs_limit: float) -> str | None:
    """Why the models are not judged in float64 here (None: they are)."""
    from onnxshrink.report import count_macs
    from onnxshrink.segment import weight_bytes

    if weight_bytes(case.reference) > 256 * 2**20:
        return "the model is too large to compute in float64 here"
    macs = count_macs(case.reference, case.shapes)
    if macs > macs_limit:
        return f"{macs / 1e9:.2g} G multiply-adds would take too long in float64 here"
    return None


def judge(
    case: Case,
    twin: Callable[[], onnx.ModelProto] | None,
    tally: ErrorTally,
    failed: list[OutputCheck],
    macs_limit: float = MACS,
) -> None:
    """Judge each output of `failed` (above the float32 floor) in float64 (sets its rounding, float64 and judged): on the
    input where its float32 error was largest, the reference and the twin (`twin()`: the shrink
    of the reference widened to float64) must compute the same function, the shrunk model's
    constants must be the twin's rounded, and the float32 difference of the size float32 gives."""

    def none(why: str) -> None:
        for c in failed:
            c.judged = why

    why = _judgeable(case, macs_limit) if twin is not None else "no float64 shrink to compare with"
    if why:
        return none(why)
    assert twin is not None
    try:
        exact = twin()
    except Exception as exc:
        return none(f"the shrink of the reference in float64 failed ({first_line(exc)})")
    try:
        differs = same_form(case.shrunk, exact, case.eps, case.shrunk_dir)
    except Exception as exc:
        return none(f"its constants cannot be read in float64 ({first_line(exc)})")
    if differs:
        if "rounded" in differs:  # the same graph with other constants: not rounding
            for c in failed:
                c.rounding, c.judged = False, differs
            return None
        return none(differs)
    names = [c.name for c in failed]
    index = {n: tally.names.index(n) for n in names}
    draws = sorted({tally.worst[n] for n in names})
    try:
        r64 = float64_outputs(case.reference, [case.feeds[k] for k in draws], names, case.reference_dir)
        t64 = float64_outputs(exact, [case.feeds[k] for k in draws], names)
    except NotJudged as exc:
        return none(str(exc))
    for j, c in enumerate(failed):
        k = tally.worst[c.name]
        row = draws.index(k)
        v = verdict(case.ref_out[k][index[c.name]], case.new_out[k][index[c.name]], r64[row][j], t64[row][j], case.eps, case.dtype)
        if v is None:
            c.judged = "its values are not finite in float64 or float32"
            continue
        c.rounding, c.float64, c.judged = v.rounding, v.float64, v.text
    return None


def _form(model: onnx.ModelProto) -> list[tuple]:
    """Every graph's nodes and initializers, by what they are: op, tensors read and written,
    non-tensor attributes; initializer names and shapes (not values, not dtypes)."""
    from onnxshrink.ir import all_graphs

    out: list[tuple] = []
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


def _tensors(model: onnx.ModelProto, base_dir: str | Path | None) -> dict[str, np.ndarray]:
    """Every float initializer and Constant value of the model (all graphs), as float64."""
    from onnxshrink.ir import all_graphs

    out = {}
    for k, g in enumerate(all_graphs(model.graph)):
        for t in g.initializer:
            if t.data_type in (*NARROW, DOUBLE):
                out[f"{k}:{t.name}"] = np.asarray(numpy_helper.to_array(t, base_dir=str(base_dir or "")), np.float64)
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in (*NARROW, DOUBLE):
                    out[f"{k}:{n.output[0] if n.output else n.name}:{a.name}"] = np.asarray(numpy_helper.to_array(a.t), np.float64)
    return out


def same_form(
    shrunk: onnx.ModelProto, twin: onnx.ModelProto, eps: float, shrunk_dir: str | Path | None = None
) -> str | None:
    """Why `shrunk` is not `twin` (its float64 shrink) with every constant rounded to the model's
    dtype; None when it is."""
    if _form(widened(shrunk, shrunk_dir)) != _form(twin):
        return "the float64 shrink has another graph (other nodes or weight shapes)"
    mine, exact = _tensors(shrunk, shrunk_dir), _tensors(twin, None)
    for name, value in mine.items():
        want = exact.get(name)
        if want is None or want.shape != value.shape:
            return f"constant {name.split(':', 1)[1]} is not in its float64 shrink"
        scale = float(np.abs(want).max(initial=0.0))
        if not np.all(np.abs(value - want) <= STORED_STEPS * eps * scale):
            return f"constant {name.split(':', 1)[1]} is not its float64 value rounded"
    return None

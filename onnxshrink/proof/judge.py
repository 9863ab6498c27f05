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

And the float32 difference must be of the size float32 gives that output (a runtime computing
one model otherwise is no rounding). onnxruntime runs the widened graph when it has a double
kernel for every op (LSTM, Gemm, MatMul, elementwise ops); otherwise onnx's reference evaluator
does (Conv, Resize, ...; about 0.1 G multiply-adds a second, BatchNormalization by the inference
formula). Contrib ops have no float64 form here: such a model cannot be judged.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxshrink.errors import first_line
from onnxshrink.ops import is_constant_node
from onnxshrink.proof.verdict import EPS, ROUNDING_STEPS, ErrorTally, OutputCheck

NARROW = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
DOUBLE = TensorProto.DOUBLE
DOUBLE_TYPE = "tensor(double)"

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
# Multiply-adds of the model above which it is not judged (onnx's reference evaluator computes
# about 0.1 G a second: three runs on one input)
MACS = 2e9
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
class Verdict:
    """The float64 judgement of one output on one input."""

    rounding: bool
    float64: float  # max |shrunk - reference| in float64, relative to max |reference|
    own: float  # the reference's own float32 error (its distance from float64), relative
    text: str


class NotJudged(Exception):
    """The models cannot be computed in float64 here (the reason is the message)."""


def _widen_tensor(t: onnx.TensorProto, base_dir: str | Path | None) -> onnx.TensorProto:
    values = numpy_helper.to_array(t, base_dir=str(base_dir) if base_dir is not None else "")
    return numpy_helper.from_array(np.asarray(values, dtype=np.float64), t.name)


def _widen_node(n: onnx.NodeProto, base_dir: str | Path | None, keep: set[str], opset: int) -> None:
    """Widen the attributes of `n` (and its subgraphs): tensors, Cast's `to`, ops' `dtype`
    (a Constant whose value is in `keep` stays as it is)."""
    if is_constant_node(n, opset):
        if set(n.output) & keep:
            return
        for a in list(n.attribute):
            if a.name in ("value_float", "value_floats"):
                value = a.f if a.name == "value_float" else list(a.floats)
                n.attribute.remove(a)
                n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.array(value, np.float64))))
    for a in n.attribute:
        if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in NARROW:
            a.t.CopyFrom(_widen_tensor(a.t, base_dir))
        elif a.type == onnx.AttributeProto.GRAPH:
            _widen_graph(a.g, base_dir, {}, opset)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for sub in a.graphs:
                _widen_graph(sub, base_dir, {}, opset)
        elif a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i in NARROW:
            a.i = DOUBLE


def _narrow_only(n: onnx.NodeProto, index: int, dtype: int, opset: int) -> bool:
    """Does input `index` of `n` take `dtype` (a narrow float) but no float64, by its schema
    (Resize's scales, ...)? Unknown ops (contrib) are taken to take float64."""
    if n.domain not in ("", "ai.onnx"):
        return False
    try:
        schema = onnx.defs.get_schema(n.op_type, opset, "")
    except Exception:
        return False
    params = list(schema.inputs)
    if not params:
        return False
    p = params[min(index, len(params) - 1)]
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}.get(p.type_str, {p.type_str})
    name = helper.tensor_dtype_to_string(dtype).removeprefix("TensorProto.").lower()
    wanted = {"float": "tensor(float)", "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)"}[name]
    return DOUBLE_TYPE not in allowed and wanted in allowed


def _widen_graph(g: onnx.GraphProto, base_dir: str | Path | None, types: dict[str, int], opset: int) -> None:
    """Widen `g` in place: its inputs, outputs, weights and nodes (value_info is dropped). A
    tensor of a narrow float (`types`: the original model's) that an input reads which admits
    no float64 stays narrow: a constant is kept as it is (a Cast widens it for any reader that
    takes float64), a computed tensor is cast back for that reader."""
    constants = {t.name for t in g.initializer} | {
        o for n in g.node if is_constant_node(n, opset) for o in n.output
    }
    narrow = {
        (k, i)
        for k, n in enumerate(g.node)
        for i, name in enumerate(n.input)
        if name and types.get(name) in NARROW and _narrow_only(n, i, types[name], opset)
    }
    keep = {g.node[k].input[i] for k, i in narrow} & constants
    for vi in [*g.input, *g.output]:
        if vi.type.tensor_type.elem_type in NARROW:
            vi.type.tensor_type.elem_type = DOUBLE
    del g.value_info[:]
    for t in g.initializer:
        if t.data_type in NARROW and t.name not in keep:
            t.CopyFrom(_widen_tensor(t, base_dir))
    nodes: list[onnx.NodeProto] = []
    casts: dict[tuple[str, int], str] = {}
    for k, n in enumerate(g.node):
        _widen_node(n, base_dir, keep, opset)
        for i, name in enumerate(n.input):
            cast = (
                types[name] if (k, i) in narrow and name not in keep
                else DOUBLE if name in keep and (k, i) not in narrow
                else None
            )
            if cast is None:
                continue
            if (name, cast) not in casts:
                casts[(name, cast)] = f"{name}__as_{cast}"
                nodes.append(helper.make_node("Cast", [name], [casts[(name, cast)]], to=cast))
            n.input[i] = casts[(name, cast)]
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)


def widened(model: onnx.ModelProto, base_dir: str | Path | None = None) -> onnx.ModelProto:
    """`model` computing in float64: the exact function of its weights (see the module doc).
    Inputs a schema admits no float64 for (Resize's scales) stay in their type, so that shape
    inference, onnxruntime and the analysis read the widened model as they read the model."""
    from onnxshrink.prepare import default_opset
    from onnxshrink.proof.emulate import tensor_types

    types = tensor_types(model)
    opset = default_opset(model)
    for n in model.graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and is_constant_node(n, opset):
                types[n.output[0]] = a.t.data_type
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _widen_graph(out.graph, base_dir, types, opset)
    for f in out.functions:
        for n in f.node:
            _widen_node(n, base_dir, set(), opset)
    return out


def _wide_feed(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v for k, v in feed.items()}


def float64_outputs(
    model: onnx.ModelProto,
    feeds: Sequence[dict[str, np.ndarray]],
    outputs: list[str],
    base_dir: str | Path | None = None,
    wide: bool = False,
) -> list[list[np.ndarray]]:
    """`outputs` of `model` computed in float64 on each feed (`wide`: the model is widened
    already); NotJudged when neither onnxruntime nor onnx's reference evaluator can."""
    if not wide:
        try:
            model = widened(model, base_dir)
        except Exception as exc:
            raise NotJudged(f"its weights cannot be widened ({first_line(exc)})") from exc
    data = model.SerializeToString()
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
            evaluator = ReferenceEvaluator(model, new_ops=[_batch_norm()])
            return [list(evaluator.run(outputs, _wide_feed(f))) for f in feeds]  # type: ignore[arg-type]
    except Exception as exc:
        raise NotJudged(f"onnx's reference evaluator cannot run it ({first_line(exc)})") from exc


def _batch_norm() -> type:
    """BatchNormalization for onnx's reference evaluator, by the inference formula (its opset-9
    kernel takes a momentum attribute for training mode: batch statistics)."""
    from onnx.reference.op_run import OpRun

    class BatchNormalization(OpRun):
        op_domain = ""

        def _run(self, x, scale, bias, mean, var, epsilon=1e-5, momentum=None, training_mode=0, spatial=1):
            if training_mode:
                raise NotImplementedError("BatchNormalization in training mode")
            shape = (1, *scale.shape) if not spatial else (1, -1) + (1,) * (x.ndim - 2)
            scale, bias, mean, var = (np.reshape(v, shape) for v in (scale, bias, mean, var))
            return (((x - mean) / np.sqrt(var + epsilon) * scale + bias).astype(x.dtype),)

    return BatchNormalization


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
        values = numpy_helper.to_array(t, base_dir=str(shrunk_dir or ""))
        if name in theirs:
            known = numpy_helper.to_array(theirs[name], base_dir=str(reference_dir or ""))
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
) -> Verdict | None:
    """Rounding or not, for one output on one input: the reference and the shrunk model in
    float32, the reference in float64, and in float64 either the twin (`moved` None) or the
    shrunk model itself, with `moved` its outputs once its new constants are moved (None: not
    comparable, e.g. not finite)."""
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
    sized = d32 <= SIZE_FACTOR * max(own, ROUNDING_STEPS * eps * mag)
    what = "its float64 twin" if moved is None else "it"
    text = (
        f"float64: {d64 / mag:.2g} between the reference and {what}"
        + ("" if moved is None else f", its stored constants' rounding reaching {reach / mag:.2g}")
        + ("" if same else ": another function")
        + f"; the reference's own {dtype} error {own / mag:.2g}"
        + ("" if sized else f", the shrunk model's {d32 / mag:.2g} is past {SIZE_FACTOR:g} x it")
    )
    return Verdict(same and sized, d64 / mag, own / mag, text)


def _judgeable(case: Case, macs_limit: float) -> str | None:
    """Why the models are not judged in float64 here (None: they are)."""
    from onnxshrink.proof.segment import weight_bytes
    from onnxshrink.report import count_macs

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
    outputs: list[OutputCheck],
    macs_limit: float = MACS,
) -> None:
    """Judge each of `outputs` (off by more than the float32 floor) in float64: sets its
    rounding, float64 and judged (see the module doc). `twin()`: the shrink of the reference
    widened to float64."""

    def none(why: str) -> None:
        for c in outputs:
            c.judged = why

    why = _judgeable(case, macs_limit)
    if why:
        return none(why)
    names = [c.name for c in outputs]
    index = {n: tally.names.index(n) for n in names}
    draws = sorted({tally.worst[n] for n in names})
    feeds = [case.feeds[k] for k in draws]
    exact, moved = None, None
    try:
        exact = twin() if twin is not None else None
    except Exception:
        exact = None  # the float64 shrink failed: judged without it
    try:
        differs = same_form(case.shrunk, exact, case.eps, case.shrunk_dir) if exact is not None else "no twin"
        if differs is not None and "rounded" in differs:  # the same graph, other constants
            for c in outputs:
                c.rounding, c.judged = False, f"{differs}: another model"
            return None
        r64 = float64_outputs(case.reference, feeds, names, case.reference_dir)
        if differs is None and exact is not None:
            x64 = float64_outputs(exact, feeds, names, wide=True)
        else:
            new = new_constants(case.shrunk, case.reference, case.shrunk_dir, case.reference_dir)
            wide = widened(case.shrunk, case.shrunk_dir)
            x64 = float64_outputs(wide, feeds, names, wide=True)
            moved = float64_outputs(perturbed(wide, new), feeds, names, wide=True) if new else x64
    except NotJudged as exc:
        return none(str(exc))
    except Exception as exc:  # its constants cannot be read, ...
        return none(f"it cannot be computed in float64 here ({first_line(exc)})")
    for j, c in enumerate(outputs):
        k = tally.worst[c.name]
        row, i = draws.index(k), index[c.name]
        v = verdict(
            case.ref_out[k][i], case.new_out[k][i], r64[row][j], x64[row][j], case.eps, case.dtype,
            None if moved is None else moved[row][j],
        )  # fmt: skip
        if v is None:
            c.judged = "its values are not finite in float64 or float32"
            continue
        c.rounding, c.float64, c.judged = v.rounding, v.float64, v.text
    return None


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

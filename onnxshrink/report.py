"""What a shrink did, as data and as text: model statistics, kept-channel explanations, sparsity."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper

from onnxshrink import ir
from onnxshrink.core.handler import OpNode
from onnxshrink.core.nonzero import pattern
from onnxshrink.core.registry import Lookup
from onnxshrink.ir import is_float
from onnxshrink.prepare import FLOAT_TYPES, default_opset, skeleton
from onnxshrink.prepare.shapes import contrib_shapes, inferred_static

if TYPE_CHECKING:  # the analysis imports every op; explain_kept only reads one it is given
    from onnxshrink.analyze import Analysis


@dataclass
class ModelStats:
    ops: dict[str, int]
    nodes: int
    params: int
    macs: int
    file_bytes: int | None = None
    # the input shapes MACs were counted at (a before/after pair: the same ones, the proof's)
    input_shapes: dict[str, list[int]] | None = None


# Parameters: float weights, and the integer ones of quantized models (8-, 4- and 16-bit weights,
# int32 biases); int64 constants are shape arithmetic.
PARAM_TYPES = FLOAT_TYPES | {
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.INT4,
    onnx.TensorProto.UINT4,
    onnx.TensorProto.INT16,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.INT32,
}


def model_stats(
    model: onnx.ModelProto,
    input_shapes: dict[str, list[int]] | None = None,
    file_bytes: int | None = None,
    macs: int | None = None,
) -> ModelStats:
    """`macs`: count_macs(model, input_shapes), when counted already (macs_of)."""
    # Nodes of every graph the file holds (an If-wrapped model is all branches)
    ops = Counter(n.op_type for g in ir.all_graphs(model.graph) for n in g.node)
    return ModelStats(
        dict(sorted(ops.items())),
        sum(ops.values()),
        count_params(model),
        count_macs(model, input_shapes or {}) if macs is None else macs,
        file_bytes,
        dict(input_shapes) if input_shapes is not None else None,
    )


def count_params(model: onnx.ModelProto) -> int:
    """Float constants, whether stored as initializers or Constant nodes (onnxshrink turns the
    latter into the former, which must not change the count), in subgraphs too (a weight only
    a Loop body reads may be stored there); integer weights of quantized models (PARAM_TYPES)."""
    from onnxshrink.ops import facts

    opset = default_opset(model)
    params = 0
    for g in ir.all_graphs(model.graph):
        params += sum(
            int(np.prod(t.dims, dtype=np.int64)) for t in g.initializer if t.data_type in PARAM_TYPES
        )
        for n in g.node:
            handler, op = facts(n, opset) if not n.input else (None, None)
            value = handler.constant_value(op) if handler is not None and op is not None else None
            if value is not None and is_float(value.dtype):
                params += int(value.size)
    return params


def count_macs(model: onnx.ModelProto, input_shapes: dict[str, list[int]]) -> int:
    """Multiply-accumulates of one run, of the ops whose handlers count them (Conv,
    ConvTranspose, Gemm, MatMul, ...); dynamic dims count as 1. Bodies count as they run: an If
    as its costlier branch, a Loop or Scan body once per iteration (a trip count the graph does
    not fix counts 1)."""
    return macs_of(model, input_shapes)[0]


def node_macs(model: onnx.ModelProto, input_shapes: dict[str, list[int]]) -> dict[str, int]:
    """count_macs of each node (in every graph, times the iterations of the bodies around it), by
    its first output."""
    return macs_of(model, input_shapes)[1]


def macs_of(model: onnx.ModelProto, input_shapes: dict[str, list[int]]) -> tuple[int, dict[str, int]]:
    """(count_macs, node_macs) from one shape inference."""
    try:
        inferred = inferred_static(skeleton(model, input_shapes))
    except Exception:
        return 0, {}
    inferred = contrib_shapes(inferred)
    from onnxshrink.ops import facts

    opset = default_opset(model)
    per_node: dict[str, int] = {}

    def constant(n: onnx.NodeProto) -> np.ndarray | None:
        handler, op = facts(n, opset) if not n.input else (None, None)
        return handler.constant_value(op) if handler is not None and op is not None else None

    def graph_macs(graph: onnx.GraphProto, outer: _Scope, times: int) -> tuple[int, _Scope]:
        """The MACs of one run of `graph` (per_node: times the runs of the bodies around it),
        and its scope."""
        scope = outer.inner(graph, constant)
        total = 0
        for n in graph.node:
            handler, op = facts(n, opset)
            out = scope.shapes.get(n.output[0]) if n.output else None
            if out is not None and handler is not None:
                own = handler.macs(op, [scope.shapes.get(i) for i in n.input], out)
                if own:
                    per_node[n.output[0]] = max(per_node.get(n.output[0], 0), own * times)
                    total += own
            bodies = ir.subgraphs_of(n)
            if bodies:
                k = handler.body_runs(op, scope.shapes, scope.scalars) if handler is not None else 1
                runs = [graph_macs(g, scope, times * k) for g in bodies]
                macs = [m for m, _ in runs]
                total += max(macs) if handler is not None and handler.runs_one_body else k * sum(macs)
                if handler is not None:
                    scope.carry(n, handler.carried(op), bodies[0], runs[0][1])
        return total, scope

    return graph_macs(inferred.graph, _Scope({}, {}), 1)[0], per_node


@dataclass
class _Scope:
    """What the names visible in a graph tell the MAC count: static shapes (dynamic dims as 1)
    and the values of integer scalars (a Loop's trip count)."""

    shapes: dict[str, list[int]]
    scalars: dict[str, int]

    def inner(self, graph: onnx.GraphProto, constant: Callable[[onnx.NodeProto], np.ndarray | None]) -> _Scope:
        """This scope with `graph`'s own names added (a body sees its enclosing graphs');
        `constant`: the value a node without inputs gives (a Constant in any of its forms)."""
        shapes, scalars = dict(self.shapes), dict(self.scalars)
        for vi in [*graph.input, *graph.value_info, *graph.output]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                dims = vi.type.tensor_type.shape.dim
                shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else 1 for d in dims]
        constants = [
            (t.name, numpy_helper.to_array(t))
            for t in graph.initializer
            if t.data_type == onnx.TensorProto.INT64 and int(np.prod(t.dims)) == 1
        ]
        constants += [(n.output[0], v) for n in graph.node if n.output and (v := constant(n)) is not None]
        for name, v in constants:
            shapes[name] = list(v.shape)
            if v.dtype == np.int64 and v.size == 1:
                scalars[name] = int(v.reshape(-1)[0])
        for t in graph.initializer:
            shapes[t.name] = list(t.dims)
        return _Scope(shapes, scalars)

    def carry(
        self, loop: onnx.NodeProto, carried: list[tuple[int, int, int]], body: onnx.GraphProto, inner: _Scope
    ) -> None:
        """A Loop's final carried values (`carried`: its handler's), whose shapes onnx's inference
        leaves unknown: the shape the value keeps in every iteration (its initial, body input
        and body output shapes all equal); `inner`: the body's scope."""
        for out, (i, body_in, body_out) in zip(loop.output, carried, strict=False):
            first = self.shapes.get(loop.input[i])
            same = inner.shapes.get(body.input[body_in].name) == first == inner.shapes.get(body.output[body_out].name)
            if out not in self.shapes and first is not None and same:
                self.shapes[out] = first


# ------------------------------------------------------------------ interface
@dataclass
class InterfaceChange:
    """A graph input or output whose declared shape changed (a KV cache whose heads went): what
    the runtime that feeds the model must know."""

    name: str
    kind: str  # "input" | "output"
    before: list[int | str]
    after: list[int | str]

    def text(self) -> str:
        def dims(d: list[int | str]) -> str:
            return "[" + ",".join(str(x) for x in d) + "]"

        return f"{self.kind} {self.name} {dims(self.before)} -> {dims(self.after)}"


def declared_dims(vi: onnx.ValueInfoProto) -> list[int | str] | None:
    """A graph input's or output's dims as declared: a size, a symbol, or "?" (none given)."""
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return None
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
        for d in vi.type.tensor_type.shape.dim
    ]


def interface_changes(before: onnx.ModelProto, after: onnx.ModelProto) -> list[InterfaceChange]:
    """Every graph input and output of `after` whose declared shape differs from `before`'s."""
    out = []
    for kind, old, new in (
        ("input", before.graph.input, after.graph.input),
        ("output", before.graph.output, after.graph.output),
    ):
        was = {vi.name: declared_dims(vi) for vi in old}
        for vi in new:
            b, a = was.get(vi.name), declared_dims(vi)
            if b is not None and a is not None and a != b:
                out.append(InterfaceChange(vi.name, kind, b, a))
    return out


# ------------------------------------------------------------------ explanations
@dataclass
class KeptGroup:
    """Zeroed slices of one weight axis that had to stay, and why."""

    tensor: str
    axis: int
    count: int
    reason: str
    kind: str
    module: str = ""  # the module reading it, when the exporter named the weight apart


def _is_weight(t: gs.Constant, handler_for: Lookup) -> bool:
    """Read as a layer's weight (a Conv, Gemm or MatMul weight, an embedding table), not a
    rotary table or a mask."""
    for n in t.outputs:
        handler = handler_for(n)
        if handler is None:
            continue
        op = OpNode.of(n)
        for i, x in enumerate(n.inputs):
            axes = handler.weight_axes(op, i, t.values.ndim) if x is t else None
            if axes is not None and axes.family != "vector":
                return True
    return False


def explain_kept(analysis: Analysis) -> list[KeptGroup]:
    """For every all-zero slice of a weight (rank >= 2) the shrunk model still holds, the root
    reason it was kept. Run on the rewritten graph (its values are the shrunk weights), before
    initializer names are merged back: a slice is zero when all its kept entries are."""
    ks = analysis.keep
    untied = analysis.untied
    groups: dict[tuple[str, int, str, str], int] = defaultdict(int)
    seen = set()
    for t in ks.tensors.values():
        if not isinstance(t, gs.Constant) or t.name not in ks.demanded:
            continue
        if not _is_weight(t, analysis.handler_for):
            continue
        values = np.asarray(t.values)
        base = untied.get(t.name, t.name)
        if values.ndim < 2 or not is_float(values.dtype):
            continue
        p = pattern(values) if values.ndim == 2 else None
        for axis in range(min(values.ndim, 2)):  # output and input channels
            kept = ks.kept(t, axis)
            if kept is None or int(kept.sum()) != values.shape[axis]:
                continue  # sliced by its handler (a grouped conv's inputs), not by the axis
            if p is not None:
                zero = np.logical_not(p.rows if axis == 0 else p.cols)
            else:
                zero = ~np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1).any(axis=1)
            if not zero.any():
                continue
            why = ks.why(t, axis)
            for i in np.flatnonzero(kept)[zero]:
                if (base, axis, int(i)) in seen:
                    continue
                seen.add((base, axis, int(i)))
                r = why[i]
                groups[(base, axis, str(r) if r else "kept", r.kind if r else "")] += 1
    return [KeptGroup(n, a, c, reason, kind) for (n, a, reason, kind), c in sorted(groups.items())]


@dataclass
class Sparsity:
    tensor: str
    zeros: float  # fraction of the shrunk weight's elements that are zeros inside non-zero slices
    elements: int
    # zeros in whole zero slices (filters, input channels) that had to be kept: structured, not
    # unstructured sparsity (`kept_zeroed` says why each was kept)
    in_zero_slices: int = 0


def sparsity_left(
    model: onnx.ModelProto,
    minimum: float = 0.0,
    arrays: Mapping[str, np.ndarray] | None = None,
    skip: Collection[str] = (),
) -> list[Sparsity]:
    """Zeros that remain in kept weights (rank >= 2): inside non-zero slices (unstructured
    sparsity), and in whole zero slices along the first two axes (kept for a reason). `arrays`:
    the values of initializers stored as external data, by name; `skip`: tensors onnxshrink
    added (folds, border corrections), which are not the model's weights."""
    out = []
    for t in model.graph.initializer:
        if t.data_type not in FLOAT_TYPES or len(t.dims) < 2 or t.name in skip:
            continue
        v = arrays[t.name] if arrays and t.name in arrays else numpy_helper.to_array(t)
        if v.size == 0:
            continue
        if v.ndim == 2:
            p = pattern(v)
            nonzeros, rows, cols = p.count, p.rows, p.cols
        else:
            nonzeros = int(np.count_nonzero(v))
            blocks = (v != 0).reshape(v.shape[0], v.shape[1], -1).any(axis=2)
            rows, cols = blocks.any(axis=1), blocks.any(axis=0)
        # elements in a zero row or a zero column (filters / input channels), each counted once
        per_block = v.size // (len(rows) * len(cols))
        zr, zc = int((~rows).sum()), int((~cols).sum())
        in_slices = (zr * len(cols) + zc * len(rows) - zr * zc) * per_block
        z = float(v.size - nonzeros - in_slices) / v.size
        if z > minimum or in_slices:
            out.append(Sparsity(t.name, z, int(v.size), in_slices))
    return out


# ------------------------------------------------------------------ text
def human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n} B"


def _change(before: float | None, after: float | None) -> str:
    if not before or after is None or before == after:
        return ""
    return f"{(after - before) / before * 100:+.1f}%"


def stats_table(before: ModelStats, after: ModelStats, timings: dict[str, float]) -> list[str]:
    rows: list[tuple[str, str, str, str]] = []
    for op in sorted(set(before.ops) | set(after.ops)):
        b, a = before.ops.get(op, 0), after.ops.get(op, 0)
        rows.append((op, str(b), str(a), _change(b, a)))
    rows.append(("", "", "", ""))
    rows.append(("Nodes", str(before.nodes), str(after.nodes), _change(before.nodes, after.nodes)))
    rows.append(
        (
            "Parameters",
            human(before.params),
            human(after.params),
            _change(before.params, after.params),
        )
    )
    rows.append(("MACs", human(before.macs), human(after.macs), _change(before.macs, after.macs)))
    if before.file_bytes is not None or after.file_bytes is not None:
        rows.append(
            (
                "File size",
                human_bytes(before.file_bytes),
                human_bytes(after.file_bytes),
                _change(before.file_bytes, after.file_bytes),
            )
        )
    w0 = max(len(r[0]) for r in rows + [("Model",)])
    w = [max(12, *(len(r[k]) for r in rows)) for k in (1, 2, 3)]
    sep = "+" + "-" * (w0 + 2) + "+" + "+".join("-" * (x + 2) for x in w) + "+"
    lines = [
        sep,
        f"| {'Model':<{w0}} | {'before':>{w[0]}} | {'after':>{w[1]}} | {'change':>{w[2]}} |",
        sep,
    ]
    for r in rows:
        if r == ("", "", "", ""):
            lines.append(sep)
            continue
        lines.append(f"| {r[0]:<{w0}} | {r[1]:>{w[0]}} | {r[2]:>{w[1]}} | {r[3]:>{w[2]}} |")
    lines.append(sep)
    if timings:
        lines.append(time_line(timings))
    return lines


def time_line(timings: dict[str, float]) -> str:
    """Each phase's seconds, in order; a prune's phases with its shrink's inside `shrink` (the
    keys `shrink.NAME`), and their total, which is the run's wall time less its start-up."""
    top = {k: v for k, v in timings.items() if not k.startswith("shrink.")}
    inner = {k.split(".", 1)[1]: v for k, v in timings.items() if k.startswith("shrink.") and k != "shrink.save"}
    parts = []
    for k, v in top.items():
        parts.append(f"{k} {v:.2f} s" + (f" ({', '.join(f'{n} {s:.2f}' for n, s in inner.items())})" if k == "shrink" and inner else ""))
    if inner:
        parts.append(f"total {sum(top.values()):.2f} s")
    return "Time: " + " | ".join(parts)


# How a normalization (or a mean) whose zero channels left keeps the statistics of its original
# width: the `into` of its Fold records (rewrite.Fold), which are not constants folded.
STATISTICS = (
    "normalization with epsilon and scale rescaled",
    "normalization over a zero-padded input",
    "mean with its original divisor",
    "variance with its original divisor",
)


def summary(before: ModelStats, after: ModelStats, fold_kinds: Mapping[str, int]) -> str:
    """One line: what shrank and what grew (ops the rewrite added, and why: `fold_kinds` counts
    the folds by how they were made, e.g. {"border correction": 12})."""
    shrank: list[str] = []
    grew: list[str] = []
    for label, b, a in (
        ("parameters", before.params, after.params),
        ("MACs", before.macs, after.macs),
        ("nodes", before.nodes, after.nodes),
        ("file size", before.file_bytes, after.file_bytes),
    ):
        if b and a is not None and a != b:
            (shrank if a < b else grew).append(f"{label} {_change(b, a)}")
    text = ("smaller: " + ", ".join(shrank)) if shrank else "nothing smaller"
    added = [f"{op} {before.ops.get(op, 0)} -> {n}" for op, n in after.ops.items() if n > before.ops.get(op, 0)]
    if grew or added:
        text += "; larger: " + (", ".join(grew) if grew else "some ops")
        if added:
            text += f" ({', '.join(added)})"
        made = {kind: n for kind, n in fold_kinds.items() if kind != "bias" and kind not in STATISTICS}
        kept = sum(n for kind, n in fold_kinds.items() if kind in STATISTICS)
        why = []
        if made:
            why.append(
                ", ".join(f"{n} {kind}(s)" for kind, n in sorted(made.items()))
                + " folding constant channels through zero padding"
            )
        if kept:
            why.append(f"{kept} normalization(s) or mean(s) keeping the statistics of their width")
        if added and why:
            text += ": added by " + "; ".join(why)
    return text


def to_jsonable(obj):
    if hasattr(obj, "__dataclass_fields__"):
        return {k: to_jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    return obj

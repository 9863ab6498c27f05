"""Replay one node in onnxruntime to read off what its outputs depend on.

A handler's rules say, for an op they know, which input indices a kept output needs. The replay
finds the same thing for any op onnxruntime can run, by experiment: the node runs on random
values for its live inputs (constant inputs hold their values), then again with one slice of one
input (index j along axis a) drawn anew; the output elements that change depend on that slice.
Their projections on each output axis give, per (input, axis), a relation: slice j can change
output index k along axis b.

A false "does not depend" would remove a channel that is needed, so the draws are chosen to
cross the kinks of piecewise ops (ReLU's 0, Clip's bounds, Shrink's lambda): several draws,
with base values and new values at different scales and of both signs, and the relation is the
union over draws. The replay only ever adds to what is kept. Runs are in float64 where the
runtime has the kernel (a change is then never lost to rounding), else in the model's type.

(The design named a torch autograd replay. onnx2torch, the converter it would need, depends on
torchvision, which cannot be installed beside the torch this project pins; onnxruntime runs the
very kernels the proof uses, every standard and contrib op, and a finite redraw also crosses
the flat regions where a gradient is zero.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from onnxshrink.analyze.evaluate import _attrs
from onnxshrink.errors import first_line

# Per draw: (scale, sign) of the base values and of the redrawn slice; sign 0 draws both signs,
# +1 only positive values, -1 only negative ones. Scales over four orders of magnitude leave the
# flat region of a clip, a shrink or a saturation in some draw; two draws move every redrawn
# value across zero (ReLU's kink), both ways.
DRAWS = (
    ((1.0, 0), (3.0, 0)),
    ((0.1, 0), (1.0, 0)),
    ((10.0, 0), (0.1, 0)),
    ((1.0, 1), (1.0, -1)),
    ((1.0, -1), (1.0, 1)),
    ((0.3, 0), (30.0, 0)),
)
_IR_VERSION = 8


class ReplayError(RuntimeError):
    """The node cannot be replayed (an op or a type onnxruntime does not run, unknown shapes)."""


@dataclass
class Replayed:
    """What one replay found.

    `relation[(i, a)][o][b]`: bool [size of input i's axis a, size of output o's axis b]: slice j
    of input i along axis a changes index k of output o along axis b (in some draw).
    `depends[o]`: bool, output o's shape: the element changes with some live input slice."""

    relation: dict[tuple[int, int], list[list[np.ndarray]]]
    depends: list[np.ndarray]
    outputs: list[np.ndarray]  # output values of the first draw's base run

    def __post_init__(self) -> None:
        # A boolean or integer output (a comparison, IsInf, a rounding) may change only on the
        # rare values random draws never hit (equality, infinities): what it depends on is not
        # read off the draws (`judged` is False). It is taken to depend on every input element,
        # and is never constant.
        self.judged = [bool(np.issubdtype(out.dtype, np.floating)) for out in self.outputs]
        for o, judged in enumerate(self.judged):
            if not judged:
                self.depends[o][...] = True
                for axes in self.relation.values():
                    for r in axes[o]:
                        r[...] = True

    def needed(self, i: int, a: int, kept: Sequence[Sequence[np.ndarray | None] | None]) -> np.ndarray:
        """Slices of input i along axis a that a kept output element may depend on. `kept[o]`:
        per axis of output o, its kept indices (None: all); None when output o is unused. A
        slice is needed when, for some used output, its changes reach a kept index on every
        axis (a sound over-approximation of reaching a kept element)."""
        rel = self.relation[(i, a)]
        need = np.zeros(rel[0][0].shape[0] if rel and rel[0] else 0, dtype=bool)
        for o, axes in enumerate(rel):
            used = kept[o]
            if used is None:
                continue
            reach = np.ones_like(need)
            for b, r in enumerate(axes):
                k = used[b] if len(used) == len(axes) else None
                reach &= r.any(axis=1) if k is None else (r & k[None, :]).any(axis=1)
            need |= reach
        return need


    def witness(
        self, i: int, a: int, j: int, kept: Sequence[Sequence[np.ndarray | None] | None]
    ) -> tuple[int, int, int] | None:
        """For a needed slice: (output, axis, index) of a kept output index it reaches, on the
        axis (of more than one index) where it reaches the fewest: the one that explains it."""
        best: tuple[tuple[bool, int], int, int, int] | None = None
        for o, axes in enumerate(self.relation[(i, a)]):
            used = kept[o]
            if used is None:
                continue
            for b, r in enumerate(axes):
                k = used[b] if len(used) == len(axes) else None
                hits = np.flatnonzero(r[j] if k is None else r[j] & k)
                rank = (r.shape[1] == 1, len(hits))  # a size-1 axis explains nothing
                if len(hits) and (best is None or rank < best[0]):
                    best = (rank, o, b, int(hits[0]))
        return None if best is None else best[1:]


def _model(node: gs.Node, inputs: Sequence[np.ndarray | None], opset: int) -> onnx.ModelProto:
    names = [f"i{k}" if a is not None else "" for k, a in enumerate(inputs)]
    outs = [f"o{k}" for k in range(len(node.outputs))]
    domain = node.domain or ""
    onode = helper.make_node(node.op, names, outs, domain=domain, **_attrs(node))
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in zip(names, inputs, strict=True)
        if a is not None
    ]
    graph = helper.make_graph(
        [onode], "replay", graph_inputs, [onnx.ValueInfoProto(name=n) for n in outs]
    )
    imports = [helper.make_opsetid("", opset)]
    if domain not in ("", "ai.onnx"):
        imports.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=imports, ir_version=_IR_VERSION)


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


class NodeRunner:
    """The node in a session of its own: in float64 when onnxruntime runs it so, else as given."""

    def __init__(self, node: gs.Node, inputs: Sequence[np.ndarray | None], opset: int):
        failure: Exception | None = None
        for arrays in ([_widen(a) for a in inputs], list(inputs)):
            try:
                self.session = _session(_model(node, arrays, opset))
                self.templates = arrays
                self.run(arrays)
                return
            except Exception as exc:  # no kernel for these types: try the next
                failure = exc
        raise ReplayError(f"onnxruntime cannot run it ({first_line(failure or Exception())})")

    def run(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        feeds = {f"i{k}": np.asarray(a, order="C") for k, a in enumerate(inputs) if a is not None}
        return [np.asarray(o) for o in self.session.run(None, feeds)]


def _widen(a: np.ndarray | None) -> np.ndarray | None:
    if a is None or not np.issubdtype(a.dtype, np.floating):
        return a
    return a.astype(np.float64)


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elements that differ by more than rounding. (A kernel may round an element differently
    when another element of the tensor changes: onnxruntime's vectorized float64 Cos does, by
    an ulp. A change that small is no dependence the proof could see.)"""
    if a.shape != b.shape:
        raise ReplayError(f"its output shape changed with its input values ({a.shape} vs {b.shape})")
    if not np.issubdtype(a.dtype, np.floating):
        return a != b
    rel = 1e-9 if a.dtype == np.float64 else 1e-5
    with np.errstate(all="ignore"):
        big = np.abs(a - b) > rel * np.maximum(np.abs(a), np.abs(b))
    nan = np.isnan(a) != np.isnan(b)
    return (big & ~(np.isnan(a) | np.isnan(b))) | nan | ((a != b) & np.isinf(a) & np.isinf(b))


def replay(
    node: gs.Node,
    inputs: Sequence[np.ndarray | None],
    live: Sequence[bool],
    axes: Mapping[int, Sequence[int]],
    opset: int,
    seed: int = 0,
    fixed: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None,
) -> Replayed:
    """Replay `node`. `inputs`: an array per input (its value for constant inputs, any array of
    the right shape and type for live ones; None for absent ones); `live`: which inputs are live
    (drawn at random); `axes`: per live input, the axes whose slices are probed; `fixed`: per
    live input, (mask, value) of its constant elements, which keep their values (a slice of
    constants only is not redrawn: nothing depends on it changing)."""
    fixed = fixed or {}
    for i, given in enumerate(inputs):
        if live[i] and (given is None or not np.issubdtype(given.dtype, np.floating)):
            raise ReplayError(f"input {i} is live and not floating point: its values cannot be drawn")
    runner = NodeRunner(node, inputs, opset)
    rng = np.random.default_rng(seed)
    relation: dict[tuple[int, int], list[list[np.ndarray]]] = {}
    depends: list[np.ndarray] = []
    first: list[np.ndarray] = []
    for (base_scale, base_sign), (new_scale, new_sign) in DRAWS:
        base = [
            _fix(_draw(rng, a, base_scale, base_sign), fixed.get(i)) if live[i] and a is not None else a
            for i, a in enumerate(runner.templates)
        ]
        out = runner.run(base)
        if not first:
            first = out
            depends = [np.zeros(o.shape, dtype=bool) for o in out]
        for i in (k for k, is_live in enumerate(live) if is_live):
            # The whole input redrawn: every element it reaches (a scalar input too).
            whole = list(base)
            whole[i] = _fix(_draw(rng, base[i], new_scale, new_sign), fixed.get(i))  # type: ignore[arg-type]
            for o, after in enumerate(runner.run(whole)):
                depends[o] |= _changed(out[o], after)
            x = base[i]
            assert x is not None
            for axis in axes.get(i, ()):
                rel = relation.setdefault(
                    (i, axis), [[np.zeros((x.shape[axis], n), bool) for n in o.shape] for o in out]
                )
                settled = _settled(fixed.get(i), x.shape, axis)
                for j in range(x.shape[axis]):
                    if settled[j]:
                        continue  # a slice of constants: never redrawn
                    redrawn = list(base)
                    part = x.copy()
                    index = (slice(None),) * axis + (j,)
                    part[index] = _draw(rng, part[index], new_scale, new_sign)
                    redrawn[i] = _fix(part, fixed.get(i))
                    for o, after in enumerate(runner.run(redrawn)):
                        changed = _changed(out[o], after)
                        depends[o] |= changed
                        for b in range(changed.ndim):
                            other = tuple(k for k in range(changed.ndim) if k != b)
                            rel[o][b][j] |= changed.any(axis=other) if other else changed
    return Replayed(relation, depends, first)


def commutes(
    node: gs.Node,
    inputs: Sequence[np.ndarray | None],
    live: Sequence[bool],
    sliced: Sequence[int],
    axis: int,
    opset: int,
    seed: int = 1,
) -> bool:
    """Does removing indices along `axis` of inputs `sliced` remove the same indices of every
    output, and change nothing else? The op then treats those indices as channels on their own
    (as an activation does); one that splits the axis into groups or heads does not. Checked
    for a few subsets (the first index, a random half), on random values for the live inputs."""
    rng = np.random.default_rng(seed)
    n = inputs[sliced[0]].shape[axis]  # type: ignore[union-attr]
    subsets = [np.arange(1, n), np.sort(rng.choice(n, size=max(1, n // 2), replace=False))]
    try:
        full = NodeRunner(node, inputs, opset)
        values = [
            _draw(rng, a, 1.0, 0) if live[i] and a is not None else a
            for i, a in enumerate(full.templates)
        ]
        whole = full.run(values)
        for keep in subsets:
            part = [
                np.take(v, keep, axis=axis) if i in sliced and v is not None else v
                for i, v in enumerate(values)
            ]
            got = NodeRunner(node, part, opset).run(part)
            for w, g in zip(whole, got, strict=True):
                want = np.take(w, keep, axis=axis)
                if want.shape != g.shape or not np.allclose(g, want, rtol=1e-9 if g.dtype == np.float64 else 1e-5, atol=0, equal_nan=True):
                    return False
    except (ReplayError, IndexError, ValueError):
        return False
    return True


def _fix(values: np.ndarray, fixed: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """`values` with the constant elements set to their values."""
    if fixed is None:
        return values
    mask, value = fixed
    return np.where(np.broadcast_to(mask, values.shape), np.broadcast_to(value, values.shape), values).astype(values.dtype)


def _settled(
    fixed: tuple[np.ndarray, np.ndarray] | None, shape: tuple[int, ...], axis: int
) -> np.ndarray:
    """Per index along `axis`: is its whole slice constant?"""
    if fixed is None:
        return np.zeros(shape[axis], dtype=bool)
    mask = np.broadcast_to(fixed[0], shape)
    other = tuple(k for k in range(len(shape)) if k != axis)
    return np.asarray(mask.all(axis=other)) if other else mask


def _draw(rng: np.random.Generator, like: np.ndarray, scale: float, sign: int) -> np.ndarray:
    values = rng.standard_normal(like.shape)
    if sign:
        values = sign * np.abs(values)
    return (values * scale).astype(like.dtype)

"""A test bench for op handlers: tiny models in ONNX text, one node's analysis in isolation.

    from onnxshrink.testing import analyze_node

    bench = analyze_node(
        "g (float[1, 3, 2, 2] x, float[8, 3, 1, 1] W) => (float[1, 2, 4, 4] y) {"
        "  c = Conv (x, W)"
        "  y = DepthToSpace <blocksize = 2> (c)"
        "}",
        needs={"y": {1: [1]}},  # what the graph after the node reads of y: channel 1 only
    )
    bench.kept("c", 1)  # -> [1, 3, 5, 7]: the input channels output channel 1 is built from

Graph inputs and outputs keep every index (they are the interface): put a node with weights in
front to see what the node under test demands, and say with `needs` what a downstream consumer
would read of an output (those indices are gathered after it). Graph inputs named
with a capital letter (W, B, Scale, ...) are initializers: random values, or `values`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxshrink.analyze import Analysis, analyze, lookup
from onnxshrink.core.values import ConstInfo
from onnxshrink.prepare import FLOAT_TYPES, default_opset, prepare

HEADER = '<ir_version: 8, opset_import: ["" : {opset}]>\n'


def model_from_text(
    text: str,
    *,
    opset: int = 17,
    values: Mapping[str, Any] | None = None,
    zero: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> onnx.ModelProto:
    """A model from ONNX text (onnx.parser's syntax; the header is added when missing). Graph
    inputs named with a capital letter become initializers: `values[name]`, else random
    (normal for floats, 1..3 for integers); `zero` maps some of them to an index expression
    (e.g. numpy.s_[[1, 4]]) set to zero: the masks."""
    if not text.lstrip().startswith("<"):
        text = HEADER.format(opset=opset) + text
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(seed)
    keep = []
    for inp in model.graph.input:
        if not inp.name[:1].isupper():
            keep.append(inp)
            continue
        dims = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)
        if values and inp.name in values:
            arr = np.asarray(values[inp.name], dtype=dtype).reshape(dims)
        elif inp.type.tensor_type.elem_type in FLOAT_TYPES:  # bfloat16 is not np.floating
            arr = rng.standard_normal(dims).astype(dtype)
        else:
            arr = rng.integers(1, 4, size=dims).astype(dtype)
        if zero and inp.name in zero:
            arr[zero[inp.name]] = 0
        model.graph.initializer.append(numpy_helper.from_array(arr, inp.name))
    del model.graph.input[:]
    model.graph.input.extend(keep)
    onnx.checker.check_model(model)
    return model


@dataclass
class NodeBench:
    """The analysis of a small graph, read by tensor name."""

    analysis: Analysis

    def _tensor(self, name: str) -> Any:
        t = self.analysis.keep.tensors.get(name)
        if t is None:
            raise KeyError(f"no tensor {name!r} in the graph")
        return t

    def kept(self, tensor: str, axis: int) -> list[int] | None:
        """The indices of `axis` that stay (None: the axis is not prunable, all stay)."""
        k = self.analysis.keep.kept(self._tensor(tensor), axis)
        return None if k is None else np.flatnonzero(k).tolist()

    def why(self, tensor: str, axis: int) -> list[str | None]:
        """Per index of `axis`: why it stays (None: it goes)."""
        reasons = self.analysis.keep.why(self._tensor(tensor), axis)
        return [str(r) if r is not None else None for r in reasons]

    def constant(self, tensor: str) -> ConstInfo | None:
        """Its input-independent elements and their values (None: none)."""
        return self.analysis.consts.const(self._tensor(tensor))

    def constant_indices(self, tensor: str, axis: int) -> list[int]:
        """The indices of `axis` whose whole slice is constant."""
        c = self.constant(tensor)
        size = self._tensor(tensor).shape[axis]
        return [] if c is None else np.flatnonzero(c.slice_constant(axis, size)).tolist()

    @property
    def barriers(self) -> list[str]:
        """The ops that kept everything (no handler, or a form their handler refuses)."""
        return [r.op for r in self.analysis.keep.barriers.values()]


def analyze_node(
    model: str | onnx.ModelProto,
    *,
    needs: Mapping[str, Mapping[int, Sequence[int]]] | None = None,
    opset: int = 17,
    values: Mapping[str, Any] | None = None,
    zero: Mapping[str, Any] | None = None,
    analysis: str = "rules",
    free_inputs: bool = False,
) -> NodeBench:
    """Run the analysis (constants, shape values, keep closure) on a small graph. `needs` maps a
    graph output to, per axis, the indices downstream reads: only those are demanded of it.
    `analysis="replay"`: handlers' needs found by replaying their nodes. `free_inputs`: graph
    inputs are not the interface (not pinned): their kept sets are what the node demands."""
    if isinstance(model, str):
        model = model_from_text(model, opset=opset, values=values, zero=zero)
    if needs:
        model = _gather_outputs(model, needs)
    graph, untied = prepare(model)
    op_set = default_opset(model)
    return NodeBench(
        analyze(graph, op_set, lookup(op_set), untied, mode=analysis, free_inputs=free_inputs)
    )


def _gather_outputs(
    model: onnx.ModelProto, needs: Mapping[str, Mapping[int, Sequence[int]]]
) -> onnx.ModelProto:
    """The model with Gathers after some outputs: what a consumer reading only those indices does."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for o in g.output:
        if o.name not in needs:
            continue
        name = o.name
        for axis, indices in needs[o.name].items():
            idx = f"{name}__needs_{axis}"
            g.initializer.append(numpy_helper.from_array(np.asarray(indices, np.int64), idx))
            g.node.append(helper.make_node("Gather", [name, idx], [f"{idx}_out"], axis=axis))
            name = f"{idx}_out"
            dim = o.type.tensor_type.shape.dim[axis]
            dim.Clear()
            dim.dim_value = len(indices)
        o.name = name  # the declared shape, with the gathered axes' new sizes
    return out


# ------------------------------------------------------------------ wrong models, for the proof
# A rewrite's result edited after the fact (tests/test_proof.py, tools/judge_edges.py): a wrong
# model the proof must catch. An edit changes initializers given by name.
Edit = Callable[[dict[str, onnx.TensorProto]], None]


def set_values(t: onnx.TensorProto, values: np.ndarray) -> None:
    """`t` holds `values` now, in its own dtype (float64 in the float64 twin)."""
    t.CopyFrom(numpy_helper.from_array(np.asarray(values, numpy_helper.to_array(t).dtype), t.name))


def scaled(name: str, relative: float) -> Edit:
    """Weight `name` times (1 + relative)."""
    return lambda inits: set_values(inits[name], numpy_helper.to_array(inits[name]).astype(np.float64) * (1 + relative))


def element_moved(name: str, delta: float) -> Edit:
    """One element of weight `name` (a third of the way in) moved by `delta`."""

    def change(inits: dict[str, onnx.TensorProto]) -> None:
        w = numpy_helper.to_array(inits[name]).astype(np.float64)
        w.flat[w.size // 3] += delta
        set_values(inits[name], w)

    return change


def row_removed(name: str, row: int) -> Edit:
    """Row `row` of weight `name` zeroed: a live channel removed."""

    def change(inits: dict[str, onnx.TensorProto]) -> None:
        w = numpy_helper.to_array(inits[name]).copy()
        w[row] = 0
        set_values(inits[name], w)

    return change


def wrong_axis(name: str, axis: int) -> Edit:
    """The weight read along the other axis (its indices reversed along `axis`)."""
    return lambda inits: set_values(inits[name], np.flip(numpy_helper.to_array(inits[name]), axis))


def edited(apply: Callable[..., Any], change: Edit) -> Callable[..., Any]:
    """`apply` (the rewrite, stages.attempt.apply) with its result changed by `change`, in every
    try that writes what it edits (recovery's tries and the float64 shrink alike)."""

    def wrong(analysis: Any, reference: Any, *streaming: Any) -> Any:
        result = apply(analysis, reference, *streaming)
        with contextlib.suppress(KeyError):  # kept whole, what it edits is not there
            change({t.name: t for t in result.model.graph.initializer})
        return result

    return wrong

"""The graph the analysis works on: the reference model as onnx-graphsurgeon tensors, with inferred
shapes, Constant nodes as initializers, and shared initializers untied (see `tie`). Subgraphs
(If branches, Loop and Scan bodies) are prepared alike; their tensors have names no other scope
uses (`ir.unique_scope_names`): the analysis reads every scope's tensors by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from onnxshrink import ir
from onnxshrink.io.weights import WeightStore
from onnxshrink.logs import route_library_logs
from onnxshrink.prepare.shapes import default_opset, inferred_shapes
from onnxshrink.prepare.tie import untie


def prepare(
    model: onnx.ModelProto, base_dir: str | Path | None = None, store: WeightStore | None = None
) -> tuple[gs.Graph, dict[str, str]]:
    """The gs graph to analyze, and {untied copy name: original initializer name}. Weights the
    model keeps in external data files (in `base_dir`) become read-only arrays mapped by
    `store`: read only where a handler reads them."""
    route_library_logs()  # onnx-graphsurgeon's warnings: to logging, not stdout
    if ir.unique_scope_names(model.graph, apply=False):  # read_model names them apart already
        named = onnx.ModelProto()
        named.CopyFrom(model)
        ir.unique_scope_names(named.graph)
        model = named
    graph = gs.import_onnx(model)
    tensors = ir.all_tensors(graph)
    store = store or WeightStore()
    for t in tensors.values():
        lazy: Any = getattr(t, "_values", None)
        if (
            isinstance(t, gs.Constant)
            and hasattr(lazy, "tensor")
            and lazy.tensor.data_location == onnx.TensorProto.EXTERNAL
        ):
            pending = store.pending(lazy.tensor, base_dir or ".")
            if pending is not None:  # written and mapped when its whole values are read
                t.values = _Mapped(lazy.tensor, store, str(base_dir or "."), pending.source)
            else:
                t.values = store.array(lazy.tensor, base_dir or ".")
            t.data_location = None
        elif isinstance(t, gs.Variable) and isinstance(t.dtype, int):
            # onnx-graphsurgeon keeps the ONNX type of what numpy lacks (bfloat16): ml_dtypes has it
            t.dtype = onnx.helper.tensor_dtype_to_np_dtype(t.dtype)
    # The graph's inputs and outputs as the model declares them: onnx-graphsurgeon lets a
    # value_info entry of the same name override them, and onnxruntime.quantization writes
    # entries with no shape (an output without one fails onnx's checker at the export).
    bounds = {t.name for g in list(ir.scopes(graph))[1:] for t in [*g.inputs, *g.outputs]}
    for vi in [*inferred_shapes(model, subgraphs=True), *model.graph.input, *model.graph.output]:
        t = tensors.get(vi.name)
        if isinstance(t, gs.Variable) and vi.type.HasField("tensor_type"):
            tt = vi.type.tensor_type
            if tt.elem_type:
                t.dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            if tt.HasField("shape"):
                dims = [
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in tt.shape.dim
                ]
                if vi.name in bounds and t.shape is not None:  # a body's declared shape, with
                    dims = _known(list(t.shape), dims)  # the sizes inference adds to it
                t.shape = dims
    opset = default_opset(model)
    _constants_to_initializers(graph, opset)
    untied = untie(graph, opset)
    graph.toposort()
    return graph, untied


def _constants_to_initializers(graph: gs.Graph, opset: int) -> None:
    """Nodes that produce a value without inputs (Constant) become initializers, in every scope
    (a Constant node in a body is a weight of that body)."""
    from onnxshrink.core.handler import OpNode
    from onnxshrink.ops import handler_for

    for scope in ir.scopes(graph):
        outputs = {t.name for t in scope.outputs}
        for node in scope.nodes:
            if node.inputs or len(node.outputs) != 1 or node.outputs[0].name in outputs:
                continue
            handler = handler_for(node, opset)
            value = handler.constant_value(OpNode.of(node)) if handler is not None else None
            if value is None:
                continue
            out = node.outputs[0]
            const = gs.Constant(out.name, values=value)
            for consumer in list(out.outputs):
                for i, t in enumerate(consumer.inputs):
                    if t is out:
                        consumer.inputs[i] = const
            node.outputs.clear()
    graph.cleanup(remove_unused_graph_inputs=False)


def _known(declared: list[ir.Dim], inferred: list[ir.Dim]) -> list[ir.Dim]:
    """The declared dims of a body's input or output, each unknown one inferred when it is."""
    if len(declared) != len(inferred):
        return declared
    return [d if isinstance(d, int) or not isinstance(i, int) else i for d, i in zip(declared, inferred, strict=True)]


class _Mapped(LazyValues):
    """A weight in a range its store reserved and has not written yet (a prune's reference's
    zeroed weight, `deferred`: what makes it, and answers what the analysis and the rewrite ask
    without the whole values): written and mapped only when they are read (`load`)."""

    def __init__(self, tensor: onnx.TensorProto, store: WeightStore, base_dir: str, deferred: Any):
        super().__init__(tensor)
        self.store, self.base_dir, self.deferred = store, base_dir, deferred

    def load(self) -> Any:
        return self.store.array(self.tensor, self.base_dir)

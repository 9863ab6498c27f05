"""Turn the reference model into the graph the analysis works on.

Shapes are inferred, Constant nodes become initializers, and initializers read by several
nodes are untied (one tensor per use, sharing the array) so that each use can be sliced on its
own; `retie` merges the uses that end up identical again.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper

TWO_GB = 2**31


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return 1


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    if model.ByteSize() >= TWO_GB:
        return model  # shape inference needs the protobuf in memory under 2 GB
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # a model onnx cannot infer: work with the shapes it carries
        return model


def prepare(model: onnx.ModelProto) -> tuple[gs.Graph, dict[str, str]]:
    """The gs graph to analyze, and {untied copy name: original initializer name}."""
    graph = gs.import_onnx(infer_shapes(model))
    _constants_to_initializers(graph)
    untied = _untie(graph)
    graph.toposort()
    return graph, untied


def _constant_value(node: gs.Node) -> np.ndarray | None:
    a = node.attrs
    if "value" in a:
        v = a["value"]
        return np.asarray(v.values) if isinstance(v, gs.Constant) else np.asarray(v)
    for key, dtype in (("value_float", np.float32), ("value_int", np.int64)):
        if key in a:
            return np.asarray(a[key], dtype=dtype)
    for key, dtype in (("value_floats", np.float32), ("value_ints", np.int64)):
        if key in a:
            return np.asarray(list(a[key]), dtype=dtype)
    return None


def _constants_to_initializers(graph: gs.Graph) -> None:
    outputs = {t.name for t in graph.outputs}
    for node in graph.nodes:
        if node.op != "Constant" or len(node.outputs) != 1 or node.outputs[0].name in outputs:
            continue
        value = _constant_value(node)
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


def _untie(graph: gs.Graph) -> dict[str, str]:
    uses: dict[str, list[tuple[gs.Node, int]]] = defaultdict(list)
    for node in graph.nodes:
        for i, t in enumerate(node.inputs):
            if isinstance(t, gs.Constant):
                uses[t.name].append((node, i))
    taken = set(graph.tensors())
    untied: dict[str, str] = {}
    for name, sites in uses.items():
        if len(sites) < 2:
            continue
        original = sites[0][0].inputs[sites[0][1]]
        for k, (node, i) in enumerate(sites[1:], start=1):
            new = f"{name}__use{k}"
            while new in taken:
                new += "_"
            taken.add(new)
            node.inputs[i] = gs.Constant(new, values=original.values)
            untied[new] = name
    return untied


def retie(graph: gs.Graph, untied: dict[str, str]) -> None:
    """Merge untied uses whose sliced values are identical; name the rest apart."""
    originals = set(untied.values())
    groups: dict[str, list[tuple[gs.Node, int]]] = defaultdict(list)
    for node in graph.nodes:
        for i, t in enumerate(node.inputs):
            if isinstance(t, gs.Constant):
                base = untied.get(t.name, t.name if t.name in originals else None)
                if base is not None:
                    groups[base].append((node, i))
    taken = {n for n in graph.tensors() if n not in untied and n not in originals}
    for base, sites in groups.items():
        distinct: list[gs.Constant] = []
        for node, i in sites:
            t = node.inputs[i]
            for d in distinct:
                if d is t or (
                    d.values.shape == t.values.shape
                    and d.values.dtype == t.values.dtype
                    and np.array_equal(d.values, t.values)
                ):
                    node.inputs[i] = d
                    break
            else:
                distinct.append(t)
        for k, d in enumerate(distinct):
            name = base if k == 0 else f"{base}__{k}"
            while name in taken:
                name += "_"
            d.name = name
            taken.add(name)


def to_initializer_proto(name: str, values: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values), name=name)

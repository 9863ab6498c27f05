"""A model's skeleton: its graph without the large weights' data (what shape inference and
onnx's checker need: the weights' dims, not their values), and what onnxruntime defines that
onnx does not. Below the pipeline: reading a model checks it on its skeleton."""

from __future__ import annotations

import functools

import numpy as np
import onnx

from onnxshrink.ir import all_graphs

FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BFLOAT16,
}


def skeleton(
    model: onnx.ModelProto, input_shapes: dict[str, list[int]] | None = None
) -> onnx.ModelProto:
    """The model without its large float weights' data (shape inference needs only their dims;
    small float constants such as Resize scales stay), its graph inputs optionally fixed to
    concrete shapes."""
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g = light.graph
    g.name = model.graph.name or "graph"
    g.node.extend(model.graph.node)
    g.output.extend(model.graph.output)
    listed = model.ir_version < 4  # IR 3: every initializer is also a graph input
    for t in model.graph.initializer:
        if heavy(t):
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            g.initializer.append(t)
            if listed:
                g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    inits = {t.name for t in model.graph.initializer}
    for i in model.graph.input:
        if i.name in inits:
            continue
        vi = g.input.add()
        vi.CopyFrom(i)
        if input_shapes and i.name in input_shapes:
            for d, v in zip(vi.type.tensor_type.shape.dim, input_shapes[i.name], strict=False):
                d.Clear()
                d.dim_value = int(v)
    for body in list(all_graphs(g))[1:]:  # a body's weights: outer inputs of the skeleton
        weights = [t for t in body.initializer if heavy(t)]
        if weights:
            light_ones = [t for t in body.initializer if not heavy(t)]
            g.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in weights)
            del body.initializer[:]
            body.initializer.extend(light_ones)
    return light


# A float constant of at most this many elements is kept in the skeleton (an epsilon, a Resize
# scale); a larger one is a weight, whose dims are all shape inference needs.
SMALL_FLOATS = 64


def heavy(t: onnx.TensorProto) -> bool:
    """A weight whose data shape inference does not need: stored externally, or a float tensor
    of more than SMALL_FLOATS elements."""
    external = t.data_location == onnx.TensorProto.EXTERNAL
    return external or (t.data_type in FLOAT_TYPES and int(np.prod(t.dims, dtype=np.int64)) > SMALL_FLOATS)


def onnx_knows(node: onnx.NodeProto) -> bool:
    """An op of the ONNX domain that onnx has a schema for."""
    return node.domain in ("", "ai.onnx") and onnx.defs.has(node.op_type)


@functools.cache
def runtime_schemas() -> frozenset[tuple[str, str]]:
    """(domain, op) of every op onnxruntime has a schema for ("" for the ONNX domain)."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as rt

        schemas = rt.get_all_operator_schema()
    except Exception:
        return frozenset()
    return frozenset(("" if s.domain == "ai.onnx" else s.domain, s.name) for s in schemas)


@functools.cache
def _runtime_onnx_ops() -> frozenset[str]:
    """Ops onnxruntime defines in the ONNX domain that onnx does not (its contrib
    SimplifiedLayerNormalization, which its transformer optimizer writes)."""
    return frozenset(op for domain, op in runtime_schemas() if domain == "" and not onnx.defs.has(op))


RUNTIME_DOMAIN = "onnxshrink.onnxruntime_onnx_domain"


def checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """A skeleton onnx's checker can check: ops onnxruntime defines in the ONNX domain and onnx
    does not are moved to a domain of their own, which the checker leaves alone (everything
    else is checked as usual)."""
    light = skeleton(model)
    moved = False
    for n in light.graph.node:
        if not onnx_knows(n) and n.op_type in _runtime_onnx_ops():
            n.domain = RUNTIME_DOMAIN
            moved = True
    if moved:
        light.opset_import.append(onnx.helper.make_opsetid(RUNTIME_DOMAIN, 1))
    return light

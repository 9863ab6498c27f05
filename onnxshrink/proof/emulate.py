"""bfloat16 arithmetic for the proof, emulated: onnxruntime has few bfloat16 kernels (on the CPU
none for Add, MatMul, Conv, Relu, ...) and its Python API takes and returns no bfloat16 arrays.

The emulated model computes in float32 and rounds every tensor the model holds in bfloat16 to
bfloat16 where it is made (Cast to bfloat16 and back), which is what bfloat16 kernels do (they
accumulate in float32 and round their outputs): its weights are exact (bfloat16 widens to float32
exactly), its inputs and outputs float32 holding bfloat16 values. The reference and the shrunk
model are emulated alike. Nothing here knows an op: only the dtypes of tensors, as onnx's shape
inference gives them; every op of the model still computes what it computes.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from onnxshrink import ir
from onnxshrink.prepare.shapes import inferred_shapes

BF16, F32 = TensorProto.BFLOAT16, TensorProto.FLOAT


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every typed tensor of the main graph (inferred where not declared)."""
    types = {t.name: t.data_type for t in model.graph.initializer}
    for vi in [*model.graph.input, *inferred_shapes(model), *model.graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types.setdefault(vi.name, vi.type.tensor_type.elem_type)
    return types


def needs_emulation(model: onnx.ModelProto, types: dict[str, int] | None = None) -> bool:
    """Does the model compute in bfloat16, or take or give bfloat16 tensors? (Weights stored in
    bfloat16 and cast to float32 where read run as they are.)"""
    types = tensor_types(model) if types is None else types
    produced = {o for n in model.graph.node for o in n.output}
    interface = [*model.graph.input, *model.graph.output]
    return any(types.get(n) == BF16 for n in produced) or any(
        vi.type.tensor_type.elem_type == BF16 for vi in interface
    )


def _float32_interface(g: onnx.GraphProto, inits: set[str]) -> None:
    """The graph's bfloat16 inputs and outputs declared float32 (an input holds bfloat16 values
    already: the proof's feeds are made so)."""
    for vi in g.input:
        if vi.name not in inits and vi.type.tensor_type.elem_type == BF16:
            vi.type.tensor_type.elem_type = F32
    for vi in g.output:
        if vi.type.tensor_type.elem_type == BF16:
            vi.type.tensor_type.elem_type = F32


def emulated(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` computing in float32 with every bfloat16 tensor rounded to bfloat16 (see
    the module docstring). The model's own tensor names are kept (they name float32 tensors
    now); the Casts added are named after them."""
    types = tensor_types(model)
    inits = {t.name for t in model.graph.initializer}
    taken = set(types) | {o for n in model.graph.node for o in n.output} | {i for n in model.graph.node for i in n.input}

    def fresh(hint: str) -> str:
        return ir.fresh_name(taken, hint)

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    del g.node[:]
    del g.value_info[:]  # bfloat16 tensors are float32 now; onnxruntime infers the rest
    nodes: list[onnx.NodeProto] = []
    widened: dict[str, str] = {}  # bfloat16 weight -> its float32 copy (made once)

    def wide(name: str) -> str:
        if name in inits and types.get(name) == BF16:
            if name not in widened:
                widened[name] = fresh(f"{name}__float")
                nodes.append(helper.make_node("Cast", [name], [widened[name]], to=F32, name=fresh(f"{name}__widen")))
            return widened[name]
        return name

    def rounded(name: str) -> str:
        """A new name for tensor `name`'s unrounded value; `name` becomes the rounded one."""
        raw, bf16 = fresh(f"{name}__unrounded"), fresh(f"{name}__bf16")
        nodes.append(helper.make_node("Cast", [raw], [bf16], to=BF16, name=fresh(f"{name}__round")))
        nodes.append(helper.make_node("Cast", [bf16], [name], to=F32, name=fresh(f"{name}__widen")))
        return raw

    _float32_interface(g, inits)
    for node in model.graph.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        for i, name in enumerate(n.input):
            if name:
                n.input[i] = wide(name)
        tail: list[onnx.NodeProto] = []
        for i, name in enumerate(n.output):
            if name and types.get(name) == BF16:
                before = len(nodes)
                n.output[i] = rounded(name)
                tail += nodes[before:]
                del nodes[before:]
        nodes.append(n)
        nodes += tail
    g.node.extend(nodes)
    return out

"""QDQ models proven as integer kernels compute them.

In a QDQ model (`DequantizeLinear -> Conv/MatMul/Gemm -> QuantizeLinear`), the product of two
dequantized operands is a sum of integer products times one scale. Evaluated in float32, as ONNX
writes it, the sum is rounded term by term, in an order the kernel chooses by the number of
terms: removing channels whose terms are exactly 0 changes that order, the sum moves by an ulp,
and a QuantizeLinear after it rounds a near-tie to the next integer, a step that grows through
the layers after it. Integer kernels (onnxruntime's QDQ fusion, TensorRT, the QOperator form)
accumulate in int32, where removing zero terms changes nothing.

The proof therefore runs both models with each such product computed in integers: `ConvInteger`
or `MatMulInteger` on the quantized operands and their zero points, exact, then cast to float and
multiplied by the operands' scales (the bias added after). A Conv whose every partial sum is an
integer below 2**24 whatever its input (bounded by its weights and its input type) runs as a
float Conv of the integers (x - zero point) and (w - zero point): exact too, and faster than
onnxruntime's ConvInteger. In exact arithmetic this is the
product itself; the reference and the shrunk model are rewritten alike, so a shrink that removed
only terms that are 0 gives equal results. Products whose operands are not both dequantized
8-bit integers (per tensor, the weight's scale per output channel too), or that would need
onnxruntime's ConvInteger with a weight zero point per channel (it takes one), stay in float.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxshrink.prepare.shapes import inferred_shapes

EIGHT_BIT = (TensorProto.INT8, TensorProto.UINT8)


class _Graph:
    """Names, producers, initializer values and element types of the main graph."""

    def __init__(self, model: onnx.ModelProto, base_dir: str | Path | None):
        g = model.graph
        self.model = model
        self.base_dir = str(base_dir) if base_dir is not None else ""
        self.inits = {t.name: t for t in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output}
        self.types = {t.name: t.data_type for t in g.initializer}
        for vi in [*g.input, *g.value_info, *g.output]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                self.types.setdefault(vi.name, vi.type.tensor_type.elem_type)
        self.inferred = False
        self.taken = set(self.types) | {x for n in g.node for x in [*n.input, *n.output]}
        self.added: list[onnx.TensorProto] = []

    def type_of(self, name: str) -> int | None:
        """The element type of a tensor: declared, a QuantizeLinear's (its zero point's, or its
        output_dtype), else inferred (once, for the whole graph)."""
        if name in self.types:
            return self.types[name]
        q = self.producer.get(name)
        if q is not None and q.op_type == "QuantizeLinear" and q.domain in ("", "ai.onnx"):
            attrs = {a.name: helper.get_attribute_value(a) for a in q.attribute}
            if len(q.input) > 2 and q.input[2] in self.inits:
                return self.types[q.input[2]]
            if len(q.input) < 3 or not q.input[2]:
                return int(attrs.get("output_dtype", 0)) or TensorProto.UINT8
        if not self.inferred:
            self.inferred = True
            for vi in inferred_shapes(self.model):
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                    self.types.setdefault(vi.name, vi.type.tensor_type.elem_type)
        return self.types.get(name)

    def value(self, name: str) -> np.ndarray | None:
        """An initializer's values (read from its external data file when it has one)."""
        t = self.inits.get(name)
        return numpy_helper.to_array(t, self.base_dir) if t is not None else None

    def fresh(self, hint: str) -> str:
        name, k = hint, 0
        while name in self.taken:
            k += 1
            name = f"{hint}_{k}"
        self.taken.add(name)
        return name

    def constant(self, values: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.added.append(numpy_helper.from_array(np.asarray(values), name))
        return name


class _Operand:
    """A DequantizeLinear's output: (q - zero) * scale, q 8-bit, scale float32 constant."""

    def __init__(self, q: str, scale: np.ndarray, zero: np.ndarray, axis: int):
        self.q, self.scale, self.zero, self.axis = q, scale, zero, axis


def _dequantized(g: _Graph, name: str) -> _Operand | None:
    dq = g.producer.get(name)
    if (
        dq is None
        or dq.op_type != "DequantizeLinear"
        or dq.domain not in ("", "ai.onnx")
        or len(dq.input) < 2
    ):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
    if int(attrs.get("block_size", 0)) != 0 or g.type_of(dq.input[0]) not in EIGHT_BIT:
        return None
    scale = g.value(dq.input[1])
    if scale is None or scale.dtype != np.float32:
        return None
    zero = g.value(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else np.zeros((), np.int32)
    if zero is None:
        return None
    return _Operand(dq.input[0], scale, zero, int(attrs.get("axis", 1)))


def _per_tensor(p: np.ndarray) -> bool:
    return p.size == 1


def _along(op: _Operand, axis: int, rank: int, n: int | None) -> bool:
    """Are op's scale and zero point per tensor, or vectors along `axis` of a rank-`rank` tensor?"""
    if _per_tensor(op.scale) and _per_tensor(op.zero):
        return True
    a = op.axis + rank if op.axis < 0 else op.axis
    return a == axis and all(
        p.ndim == 1 and (n is None or p.shape[0] == n) for p in (op.scale, op.zero) if p.size > 1
    )


def _exact_in_float32(centered: np.ndarray, x_dtype: np.dtype, x_zero: np.ndarray) -> bool:
    """Is every partial sum of a product with weights `centered` (w - zero point, output channels
    first) an integer float32 holds exactly, whatever the input? Its magnitude is at most the sum
    of |w - zero point| times the largest |x - x_zero| the input's type allows."""
    info = np.iinfo(x_dtype)
    z = int(np.asarray(x_zero).reshape(-1)[0])
    x_max = max(z - int(info.min), int(info.max) - z)
    per_output = np.abs(centered).reshape(centered.shape[0], -1).sum(axis=1)
    return bool(per_output.max(initial=0) * x_max < 2**24)


def _scalar(g: _Graph, values: np.ndarray, dtype: np.dtype, hint: str) -> str:
    return g.constant(np.asarray(values).reshape(()).astype(dtype), hint)


def _integer_product(g: _Graph, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """The nodes computing `node` (Conv, MatMul or Gemm of two dequantized operands) in integers,
    or None when it does not qualify."""
    if node.domain not in ("", "ai.onnx") or len(node.input) < 2 or len(node.output) != 1:
        return None
    a, b = _dequantized(g, node.input[0]), _dequantized(g, node.input[1])
    if a is None or b is None or not (_per_tensor(a.scale) and _per_tensor(a.zero)):
        return None
    attrs = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    w = g.inits.get(b.q)
    rank_b = len(w.dims) if w is not None else None
    y = node.output[0]
    out: list[onnx.NodeProto] = []

    def make(op: str, inputs: list[str], hint: str, **kw) -> str:
        name = g.fresh(f"{y}__int_{hint}")
        out.append(helper.make_node(op, inputs, [name], name=name, **kw))
        return name

    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    a_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(g.type_of(a.q) or 0))
    b_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(g.type_of(b.q) or 0))

    def az() -> str:
        return _scalar(g, a.zero, a_dtype, f"{y}__int_a_zero")

    if node.op_type == "Conv":
        if w is None or rank_b is None or not _along(b, 0, rank_b, w.dims[0]):
            return None
        conv_attrs = {
            k: v
            for k, v in attrs.items()
            if k in ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
        }
        per_channel = [1, -1] + [1] * (rank_b - 2)
        zero = b.zero.astype(np.int64).reshape([-1] + [1] * (rank_b - 1) if b.zero.size > 1 else ())
        centered = np.asarray(g.value(b.q), dtype=np.int64) - zero
        if _exact_in_float32(centered, a_dtype, a.zero):
            # float32 holds every partial sum exactly: the float kernel computes the integer sum
            x = make(
                "Sub",
                [
                    make("Cast", [a.q], "x", to=TensorProto.FLOAT),
                    g.constant(a.zero.astype(np.float32).reshape(()), f"{y}__int_x_zero"),
                ],
                "x_centered",
            )
            w_zero = g.constant(zero.astype(np.float32), f"{y}__int_w_zero")
            w_centered = make(
                "Sub", [make("Cast", [b.q], "w", to=TensorProto.FLOAT), w_zero], "w_centered"
            )
            acc = make("Conv", [x, w_centered], "acc", **conv_attrs)
        elif np.unique(b.zero).size == 1:
            bz = _scalar(g, b.zero.reshape(-1)[:1], b_dtype, f"{y}__int_w_zero")
            acc = make(
                "Cast",
                [make("ConvInteger", [a.q, b.q, az(), bz], "acc32", **conv_attrs)],
                "acc",
                to=TensorProto.FLOAT,
            )
        else:
            return None  # onnxruntime's ConvInteger takes one weight zero point
        scale = g.constant(
            (a.scale.reshape(()) * b.scale.reshape(-1)).reshape(
                per_channel if b.scale.size > 1 else ()
            ),
            f"{y}__int_scale",
        )
        y0 = make("Mul", [acc, scale], "scaled")
        if bias is not None:
            shape = g.constant(np.array(per_channel, np.int64), f"{y}__int_bias_shape")
            y0 = make("Add", [y0, make("Reshape", [bias, shape], "bias")], "biased")
    elif node.op_type == "MatMul":
        per_column = w is not None and rank_b == 2 and _along(b, 1, 2, w.dims[1])
        if not (per_column or (_per_tensor(b.scale) and _per_tensor(b.zero))):
            return None
        bz = g.constant(b.zero.astype(b_dtype), f"{y}__int_b_zero")
        acc = make("MatMulInteger", [a.q, b.q, az(), bz], "acc")
        scale = g.constant((a.scale.reshape(()) * b.scale).astype(np.float32), f"{y}__int_scale")
        y0 = make("Mul", [make("Cast", [acc], "float", to=TensorProto.FLOAT), scale], "scaled")
    elif node.op_type == "Gemm":
        trans_a, trans_b = int(attrs.get("transA", 0)), int(attrs.get("transB", 0))
        n_axis = 0 if trans_b else 1
        per_column = w is not None and rank_b == 2 and _along(b, n_axis, 2, w.dims[n_axis])
        if not (per_column or (_per_tensor(b.scale) and _per_tensor(b.zero))):
            return None
        aq = make("Transpose", [a.q], "a_t", perm=[1, 0]) if trans_a else a.q
        bq = make("Transpose", [b.q], "b_t", perm=[1, 0]) if trans_b else b.q
        bz = g.constant(b.zero.astype(b_dtype), f"{y}__int_b_zero")
        acc = make("MatMulInteger", [aq, bq, az(), bz], "acc")
        alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
        scale = g.constant(
            (a.scale.reshape(()) * b.scale * np.float32(alpha)).astype(np.float32),
            f"{y}__int_scale",
        )
        y0 = make("Mul", [make("Cast", [acc], "float", to=TensorProto.FLOAT), scale], "scaled")
        if bias is not None and beta != 0.0:
            c = (
                bias
                if beta == 1.0
                else make("Mul", [bias, g.constant(np.float32(beta), f"{y}__int_beta")], "beta")
            )
            y0 = make("Add", [y0, c], "biased")
    else:
        return None
    out[-1].output[0] = y  # the last node writes the product's own output
    return out


def integer_products(
    model: onnx.ModelProto, base_dir: str | Path | None = None
) -> onnx.ModelProto | None:
    """A copy of `model` with each product of two dequantized operands computed in integers (see
    the module docstring), or None when it has none. `base_dir`: where its external data are."""
    g = _Graph(model, base_dir)
    nodes: list[onnx.NodeProto] = []
    changed = False
    for node in model.graph.node:
        if node.op_type in ("Conv", "MatMul", "Gemm"):
            replaced = _integer_product(g, node)
            if replaced is not None:
                nodes += replaced
                changed = True
                continue
        nodes.append(node)
    if not changed:
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(g.added)
    return out


def float_activations(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of `model` whose MatMulNBits nodes multiply in float32 (`accuracy_level` 0), or None
    when none asks for another arithmetic. At accuracy_level 4 onnxruntime quantizes A to int8 per
    block at run time: a value that float rounding moves by an ulp (a normalization's statistics
    kept over fewer channels) can round to the next integer, and the step grows through the layers
    after it, as a QuantizeLinear's does (see the module docstring). Both models are run alike.
    (onnxruntime's own fusion of a block-wise int4 DequantizeLinear into a MatMul is told the same
    by the proof's sessions: `validate.session`.)"""
    def levels(graph: onnx.GraphProto) -> list[onnx.AttributeProto]:
        return [
            a
            for n in graph.node
            if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"
            for a in n.attribute
            if a.name == "accuracy_level" and a.i != 0
        ]

    if not levels(model.graph):  # (no copy of a model that has nothing to change)
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for a in levels(out.graph):
        a.i = 0
    return out

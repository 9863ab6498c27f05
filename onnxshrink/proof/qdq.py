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

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxshrink import ir
from onnxshrink.core import Dequantizes, IntegerProduct, QdqForm, Quantizes, RuntimeQuantized
from onnxshrink.io.weights import tensor_values
from onnxshrink.ops import facts
from onnxshrink.prepare import default_opset
from onnxshrink.prepare.shapes import inferred_shapes

EIGHT_BIT = (TensorProto.INT8, TensorProto.UINT8)


def _qdq_form(node: onnx.NodeProto, opset: int) -> QdqForm | None:
    """What `node` is in the quantized arithmetic, as its handler declares it (Handler.qdq_form)."""
    handler, op = facts(node, opset)
    return handler.qdq_form(op) if handler is not None else None


class _Graph:
    """Names, producers, initializer values and element types of the main graph."""

    def __init__(self, model: onnx.ModelProto, base_dir: str | Path | None):
        g = model.graph
        self.model = model
        self.opset = default_opset(model)
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

    def made_by(self, name: str) -> tuple[onnx.NodeProto | None, QdqForm | None]:
        """The node making tensor `name` (None: a graph input or initializer) and its QDQ form."""
        node = self.producer.get(name)
        return node, _qdq_form(node, self.opset) if node is not None else None

    def type_of(self, name: str) -> int | None:
        """The element type of a tensor: declared, a QuantizeLinear's (its zero point's, or its
        output_dtype), else inferred (once, for the whole graph)."""
        if name in self.types:
            return self.types[name]
        q, form = self.made_by(name)
        if q is not None and isinstance(form, Quantizes):
            if len(q.input) > 2 and q.input[2] in self.inits:
                return self.types[q.input[2]]
            if len(q.input) < 3 or not q.input[2]:
                return form.dtype
        if not self.inferred:
            self.inferred = True
            for vi in inferred_shapes(self.model):
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                    self.types.setdefault(vi.name, vi.type.tensor_type.elem_type)
        return self.types.get(name)

    def value(self, name: str) -> np.ndarray | None:
        """An initializer's values (read from its external data file when it has one)."""
        t = self.inits.get(name)
        return tensor_values(t, self.base_dir) if t is not None else None

    def fresh(self, hint: str) -> str:
        return ir.fresh_name(self.taken, hint)

    def constant(self, values: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.added.append(numpy_helper.from_array(np.asarray(values), name))
        return name


class _Operand:
    """A DequantizeLinear's output: (q - zero) * scale, q 8-bit, scale float32 constant."""

    def __init__(self, q: str, scale: np.ndarray, zero: np.ndarray, axis: int):
        self.q, self.scale, self.zero, self.axis = q, scale, zero, axis


def _dequantized(g: _Graph, name: str) -> _Operand | None:
    dq, form = g.made_by(name)
    if dq is None or not isinstance(form, Dequantizes) or len(dq.input) < 2:
        return None
    if form.block != 0 or g.type_of(dq.input[0]) not in EIGHT_BIT:
        return None
    scale = g.value(dq.input[1])
    if scale is None or scale.dtype != np.float32:
        return None
    zero = g.value(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else np.zeros((), np.int32)
    if zero is None:
        return None
    return _Operand(dq.input[0], scale, zero, form.axis)


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


@dataclass
class _Product:
    """One product being rewritten in integers: its operands, the weight (b's initializer, when
    it is one), and the nodes made so far, each named after the product's output `y`."""

    g: _Graph
    y: str
    a: _Operand
    b: _Operand
    form: IntegerProduct
    bias: str | None
    nodes: list[onnx.NodeProto] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.w = self.g.inits.get(self.b.q)
        self.rank_b = len(self.w.dims) if self.w is not None else None
        self.a_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(self.g.type_of(self.a.q) or 0))
        self.b_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(self.g.type_of(self.b.q) or 0))

    def make(self, op: str, inputs: list[str], hint: str, **kw) -> str:
        name = self.g.fresh(f"{self.y}__int_{hint}")
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **kw))
        return name

    def constant(self, values: np.ndarray, hint: str) -> str:
        return self.g.constant(values, f"{self.y}__int_{hint}")

    def a_zero(self) -> str:
        return _scalar(self.g, self.a.zero, self.a_dtype, f"{self.y}__int_a_zero")

    def per_column(self) -> bool:
        """Is b's scale per tensor, or per column of a 2-D weight (along its output axis)?"""
        axis = self.form.out_axis
        column = self.w is not None and self.rank_b == 2 and _along(self.b, axis, 2, self.w.dims[axis])
        return column or (_per_tensor(self.b.scale) and _per_tensor(self.b.zero))


def _integer_product(g: _Graph, node: onnx.NodeProto, form: IntegerProduct) -> list[onnx.NodeProto] | None:
    """The nodes computing `node` (a product of two dequantized operands, `form` its handler's
    declaration) in integers, or None when it does not qualify."""
    if len(node.input) < 2 or len(node.output) != 1:
        return None
    a, b = _dequantized(g, node.input[0]), _dequantized(g, node.input[1])
    if a is None or b is None or not (_per_tensor(a.scale) and _per_tensor(a.zero)):
        return None
    bias = node.input[form.bias] if form.bias is not None and len(node.input) > form.bias else ""
    p = _Product(g, node.output[0], a, b, form, bias or None)
    made = _convolution(p) if form.window is not None else _matrix_product(p)
    if not made:
        return None
    p.nodes[-1].output[0] = p.y  # the last node writes the product's own output
    return p.nodes


def _convolution(p: _Product) -> bool:
    """A Conv in integers (False: it does not qualify): exact in float32 when every partial sum
    is, else as ConvInteger (one weight zero point); scaled per output channel, the bias added."""
    w, rank_b, b = p.w, p.rank_b, p.b
    assert p.form.window is not None
    if w is None or rank_b is None or not _along(b, p.form.out_axis, rank_b, w.dims[p.form.out_axis]):
        return False
    per_channel = [1, -1] + [1] * (rank_b - 2)
    zero = b.zero.astype(np.int64).reshape([-1] + [1] * (rank_b - 1) if b.zero.size > 1 else ())
    centered = np.asarray(p.g.value(b.q), dtype=np.int64) - zero
    if _exact_in_float32(centered, p.a_dtype, p.a.zero):
        acc = _float_conv_of_integers(p, zero)
    elif np.unique(b.zero).size == 1:
        bz = _scalar(p.g, b.zero.reshape(-1)[:1], p.b_dtype, f"{p.y}__int_w_zero")
        acc32 = p.make("ConvInteger", [p.a.q, b.q, p.a_zero(), bz], "acc32", **p.form.window)
        acc = p.make("Cast", [acc32], "acc", to=TensorProto.FLOAT)
    else:
        return False  # onnxruntime's ConvInteger takes one weight zero point
    scale = p.constant(
        (p.a.scale.reshape(()) * b.scale.reshape(-1)).reshape(per_channel if b.scale.size > 1 else ()),
        "scale",
    )
    y0 = p.make("Mul", [acc, scale], "scaled")
    if p.bias is not None:
        shape = p.constant(np.array(per_channel, np.int64), "bias_shape")
        p.make("Add", [y0, p.make("Reshape", [p.bias, shape], "bias")], "biased")
    return True


def _float_conv_of_integers(p: _Product, zero: np.ndarray) -> str:
    """float32 holds every partial sum exactly: the float kernel computes the integer sum of
    (x - zero point) and (w - zero point)."""
    assert p.form.window is not None
    x = p.make("Cast", [p.a.q], "x", to=TensorProto.FLOAT)
    x_zero = p.constant(p.a.zero.astype(np.float32).reshape(()), "x_zero")
    x_centered = p.make("Sub", [x, x_zero], "x_centered")
    w_zero = p.constant(zero.astype(np.float32), "w_zero")
    w = p.make("Cast", [p.b.q], "w", to=TensorProto.FLOAT)
    w_centered = p.make("Sub", [w, w_zero], "w_centered")
    return p.make("Conv", [x_centered, w_centered], "acc", **p.form.window)


def _matrix_product(p: _Product) -> bool:
    """A MatMul or Gemm in integers (False: it does not qualify): MatMulInteger of the operands
    (transposed first as the op says), scaled (times alpha), the bias added (times beta)."""
    form = p.form
    if not p.per_column():
        return False
    aq = p.make("Transpose", [p.a.q], "a_t", perm=[1, 0]) if form.trans_a else p.a.q
    bq = p.make("Transpose", [p.b.q], "b_t", perm=[1, 0]) if form.trans_b else p.b.q
    bz = p.constant(p.b.zero.astype(p.b_dtype), "b_zero")
    acc = p.make("MatMulInteger", [aq, bq, p.a_zero(), bz], "acc")
    scale = p.constant(
        (p.a.scale.reshape(()) * p.b.scale * np.float32(form.alpha)).astype(np.float32), "scale"
    )
    y0 = p.make("Mul", [p.make("Cast", [acc], "float", to=TensorProto.FLOAT), scale], "scaled")
    if p.bias is not None and form.beta != 0.0:
        c = p.bias
        if form.beta != 1.0:
            c = p.make("Mul", [p.bias, p.constant(np.float32(form.beta), "beta")], "beta")
        p.make("Add", [y0, c], "biased")
    return True


def integer_products(
    model: onnx.ModelProto, base_dir: str | Path | None = None
) -> onnx.ModelProto | None:
    """A copy of `model` with each product of two dequantized operands computed in integers (see
    the module docstring), or None when it has none. `base_dir`: where its external data are."""
    g = _Graph(model, base_dir)
    nodes: list[onnx.NodeProto] = []
    changed = False
    for node in model.graph.node:
        form = _qdq_form(node, g.opset)
        if isinstance(form, IntegerProduct):
            replaced = _integer_product(g, node, form)
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
    by the proof's sessions: `sessions.session`.)"""
    opset = default_opset(model)

    def levels(graph: onnx.GraphProto) -> list[onnx.AttributeProto]:
        """The attributes asking for run-time quantization (nonzero) in `graph`'s nodes."""
        out = []
        for n in graph.node:
            form = _qdq_form(n, opset)
            if isinstance(form, RuntimeQuantized):
                out += [a for a in n.attribute if a.name == form.attribute and a.i != 0]
        return out

    if not levels(model.graph):  # (no copy of a model that has nothing to change)
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for a in levels(out.graph):
        a.i = 0
    return out

"""Random single-node graphs of every op onnxshrink has a handler for, for the replay oracle.

`case(op, seed)` writes one graph in ONNX text: the op's data inputs are graph inputs (live,
lower-case names), its weights and parameters initializers (capitalized: random, some slices
zeroed, as masks leave them), with random shapes, attributes and opset; plus what a consumer
reads of each output (random subsets of indices). tests/test_replay_oracle.py and
tools/oracle.py run the handler's rule on it and compare with the replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

UNARY = (
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Celu", "Cos", "Cosh",
    "Elu", "Erf", "Exp", "Floor", "HardSigmoid", "HardSwish", "IsInf", "IsNaN", "LeakyRelu",
    "Log", "Mish", "Neg", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin",
    "Sinh", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu", "Identity",
)  # fmt: skip
BINARY = (
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Greater", "Less",
    "GreaterOrEqual", "LessOrEqual",
)  # fmt: skip
POOLS = ("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
REDUCES = (
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
)  # fmt: skip
# Registered ops with no case, and why: nothing in them to draw at random and compare.
EXCLUDED = {
    "And": "boolean data only", "Or": "boolean data only", "Xor": "boolean data only",
    "Not": "boolean data only", "BitShift": "integer data only",
    "Constant": "no input", "ConstantOfShape": "reads a shape, not data",
    "Range": "reads scalars, not data", "Shape": "reads sizes only", "Size": "reads sizes only",
    "RandomNormal": "not a function of its inputs", "RandomUniform": "not a function of its inputs",
    "RandomNormalLike": "not a function of its inputs",
    "RandomUniformLike": "not a function of its inputs",
    "Multinomial": "not a function of its inputs", "Bernoulli": "not a function of its inputs",
    "RMSNormalization": "onnxruntime here has no kernel for it (opset 23)",
    "Swish": "onnxruntime here has no kernel for it (opset 24)",
    "BiasAdd": "onnxruntime has a CUDA kernel only (tests/ops/test_fused.py checks its rule)",
    "SimplifiedLayerNormalization": "onnx's checker refuses it in the ONNX domain, where "
    "onnxruntime defines it (tests/ops/test_fused.py runs it)",
    "EmbedLayerNormalization": "its data inputs are token ids (integers)",
    "DequantizeLinear": "integer data (the replay draws floats); tests/ops/test_quantize.py",
    "QuantizeLinear": "integer outputs, which the replay does not judge; tests/ops/test_quantize.py",
    "DynamicQuantizeLinear": "integer outputs, which the replay does not judge; "
    "tests/ops/test_quantize.py",
    "GroupQueryAttention": "empty optional inputs (past key/value) before the ones it needs, "
    "which the replay cannot feed; tests/ops/test_fused.py",
    "MatMulInteger": "integer data only; tests/ops/test_quantize.py",
    "ConvInteger": "integer data only; tests/ops/test_quantize.py",
    "QLinearMatMul": "integer data only; tests/ops/test_quantize.py",
    "QLinearConv": "integer data only; tests/ops/test_quantize.py",
    "QGemm": "integer data only; tests/test_prune_quantized.py",
    "MatMulNBits": "its weight is packed int4 codes with per-block scales, which random "
    "initializers do not make; tests/ops/test_matmul_nbits.py checks it in onnxruntime",
    "QLinearAdd": "integer data only; tests/test_prune_quantized.py",
    "QLinearMul": "integer data only; tests/test_prune_quantized.py (the QOperator BERT)",
    "QLinearSoftmax": "integer data only; tests/test_prune_quantized.py (the QOperator BERT)",
    "QLinearGlobalAveragePool": "integer data only; tests/test_prune_quantized.py",
    "QLinearAveragePool": "integer data only; tests/ops/test_quantize.py",
    "QLinearConcat": "integer data only; tests/ops/test_quantize.py",
    "QLinearSigmoid": "integer data only; tests/ops/test_quantize.py",
    "QLinearLeakyRelu": "integer data only; tests/ops/test_quantize.py",
    "DynamicQuantizeLSTM": "integer weights only; tests/ops/test_recurrent.py",
    "If": "its bodies' nodes are analyzed (and replayed) each on its own; tests/ops/test_control.py",
    "Loop": "its body's nodes are analyzed (and replayed) each on its own; tests/ops/test_control.py",
    "Scan": "its body's nodes are analyzed (and replayed) each on its own; tests/ops/test_control.py",
}  # fmt: skip
MS_HEADER = '<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>\n'
OPSET23 = '<ir_version: 10, opset_import: ["" : 23]>\n'


@dataclass
class Case:
    op: str
    text: str  # the graph in ONNX text (onnxshrink.testing.model_from_text)
    opset: int
    zero: dict = field(default_factory=dict)  # initializer -> index expression set to 0
    values: dict = field(default_factory=dict)  # initializers given exactly
    needs: dict = field(default_factory=dict)  # output -> {axis: indices a consumer reads}
    node_op: str = ""  # the node under test (when the graph has helpers)


def _dims(shape: list[int]) -> str:
    return ", ".join(str(d) for d in shape)


def _sig(
    inputs: list[tuple[str, str, list[int]]], outputs: list[tuple[str, list[int]]], out_type: str = "float"
) -> str:
    ins = ", ".join(f"{t}[{_dims(s)}] {n}" for n, t, s in inputs)
    outs = ", ".join(f"{out_type}[{_dims(s)}] {n}" for n, s in outputs)
    return f"g ({ins}) => ({outs})"


def _needs(rng: np.random.Generator, name: str, shape: list[int]) -> dict:
    """A random non-empty subset of each axis of more than one index."""
    out = {}
    for a, n in enumerate(shape):
        if n > 1 and rng.random() < 0.7:
            out[a] = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
    return {name: out} if out else {}


def _zero_rows(rng: np.random.Generator, n: int) -> list[int]:
    return sorted(rng.choice(n, size=int(rng.integers(0, max(1, n // 2) + 1)), replace=False).tolist())


# ------------------------------------------------------------------ families
def _unary(op: str, rng: np.random.Generator) -> Case:
    c, h, w = int(rng.integers(2, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    x = [1, c, h, w]
    out_t = "bool" if op in ("IsInf", "IsNaN") else "float"
    attrs = {"Celu": " <alpha = 1.5>", "ThresholdedRelu": " <alpha = 0.7>"}.get(op, "")
    text = _sig([("x", "float", x)], [("y", x)], out_t)
    opset = 18 if op == "Mish" else 17
    return Case(op, text + f" {{ y = {op}{attrs} (x) }}", opset, needs=_needs(rng, "y", x))


def _binary(op: str, rng: np.random.Generator) -> Case:
    c, h, w = int(rng.integers(2, 5)), int(rng.integers(1, 4)), int(rng.integers(2, 4))
    x = [1, c, h, w]
    other = [[1, c, h, w], [1, c, 1, 1], [c, 1, 1], [1, 1, h, w], [w]][int(rng.integers(0, 5))]
    weight = rng.random() < 0.4  # the second operand a constant (a bias, a scale)
    b = "B" if weight else "b"
    ins = [("x", "float", x)] + ([] if weight else [("b", "float", other)])
    if weight:
        ins.append(("B", "float", other))
    out_t = "bool" if op in ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual") else "float"
    text = _sig(ins, [("y", x)], out_t)
    zero = {"B": np.s_[..., 0]} if weight and rng.random() < 0.5 else {}
    return Case(op, text + f" {{ y = {op} (x, {b}) }}", 17, zero=zero, needs=_needs(rng, "y", x))


def _prelu(rng: np.random.Generator) -> Case:
    c = int(rng.integers(2, 6))
    x = [1, c, 2, 3]
    text = _sig([("x", "float", x), ("S", "float", [c, 1, 1])], [("y", x)])
    return Case("PRelu", text + " { y = PRelu (x, S) }", 17, zero={"S": np.s_[_zero_rows(rng, c)]},
                needs=_needs(rng, "y", x))


def _mod(rng: np.random.Generator) -> Case:
    x = [1, int(rng.integers(2, 5)), 3]
    text = _sig([("x", "float", x), ("b", "float", x)], [("y", x)])
    return Case("Mod", text + " { y = Mod <fmod = 1> (x, b) }", 17, needs=_needs(rng, "y", x))


def _where(rng: np.random.Generator) -> Case:
    x = [1, int(rng.integers(2, 5)), 3]
    text = _sig([("c", "bool", x), ("a", "float", x), ("b", "float", [x[1], 1])], [("y", x)])
    return Case("Where", text + " { y = Where (c, a, b) }", 17, needs=_needs(rng, "y", x))


def _clip(rng: np.random.Generator) -> Case:
    x = [1, int(rng.integers(2, 5)), 3]
    text = _sig([("x", "float", x), ("Lo", "float", []), ("Hi", "float", [])], [("y", x)])
    return Case("Clip", text + " { y = Clip (x, Lo, Hi) }", 17, values={"Lo": -0.5, "Hi": 0.7},
                needs=_needs(rng, "y", x))


def _conv(op: str, rng: np.random.Generator) -> Case:
    cin = int(rng.choice([2, 4, 6]))
    group = int(rng.choice([g for g in (1, 2, cin) if cin % g == 0]))
    cout = group * int(rng.integers(1, 3))
    k = int(rng.choice([1, 3]))
    pad = k // 2 if rng.random() < 0.5 else 0
    h = w = 4
    if op == "Conv":
        wshape = [cout, cin // group, k, k]
        oh = h + 2 * pad - k + 1
        y = [1, cout, oh, oh]
    else:
        wshape = [cin, cout // group, k, k]
        oh = h - 2 * pad + k - 1
        y = [1, cout, oh, oh]
    attrs = f"<group = {group}, pads = [{pad}, {pad}, {pad}, {pad}]>"
    text = _sig([("x", "float", [1, cin, h, w]), ("W", "float", wshape), ("B", "float", [cout])], [("y", y)])
    zero = {"W": np.s_[_zero_rows(rng, wshape[0])]}
    if rng.random() < 0.5:
        zero = {"W": np.s_[:, _zero_rows(rng, wshape[1])]}
    return Case(op, text + f" {{ y = {op} {attrs} (x, W, B) }}", 17, zero=zero, needs=_needs(rng, "y", y))


def _gemm(rng: np.random.Generator) -> Case:
    m, k, n = int(rng.integers(1, 4)), int(rng.integers(2, 6)), int(rng.integers(2, 6))
    ta, tb = int(rng.integers(0, 2)), int(rng.integers(0, 2))
    a = [k, m] if ta else [m, k]
    b = [n, k] if tb else [k, n]
    text = _sig([("a", "float", a), ("B", "float", b), ("C", "float", [n])], [("y", [m, n])])
    zero = {"B": np.s_[_zero_rows(rng, b[0])]}
    return Case("Gemm", text + f" {{ y = Gemm <transA = {ta}, transB = {tb}> (a, B, C) }}", 17,
                zero=zero, needs=_needs(rng, "y", [m, n]))


def _matmul(rng: np.random.Generator) -> Case:
    s, k, n = int(rng.integers(1, 4)), int(rng.integers(2, 6)), int(rng.integers(2, 5))
    lead = [1, 2] if rng.random() < 0.5 else [1]
    a = [*lead, s, k]
    if rng.random() < 0.6:
        text = _sig([("a", "float", a), ("B", "float", [k, n])], [("y", [*lead, s, n])])
        return Case("MatMul", text + " { y = MatMul (a, B) }", 17, zero={"B": np.s_[_zero_rows(rng, k)]},
                    needs=_needs(rng, "y", [*lead, s, n]))
    text = _sig([("a", "float", a), ("b", "float", [*lead, k, n])], [("y", [*lead, s, n])])
    return Case("MatMul", text + " { y = MatMul (a, b) }", 17, needs=_needs(rng, "y", [*lead, s, n]))


def _pool(op: str, rng: np.random.Generator) -> Case:
    c = int(rng.integers(2, 5))
    x = [1, c, 4, 4]
    if op.startswith("Global"):
        return Case(op, _sig([("x", "float", x)], [("y", [1, c, 1, 1])]) + f" {{ y = {op} (x) }}", 17,
                    needs=_needs(rng, "y", [1, c, 1, 1]))
    pad = int(rng.integers(0, 2))
    y = [1, c, 4 + 2 * pad - 1, 4 + 2 * pad - 1]
    attrs = f"kernel_shape = [2, 2], pads = [{pad}, {pad}, {pad}, {pad}]"
    if op == "AveragePool":
        attrs += f", count_include_pad = {int(rng.integers(0, 2))}"
    return Case(op, _sig([("x", "float", x)], [("y", y)]) + f" {{ y = {op} <{attrs}> (x) }}", 17,
                needs=_needs(rng, "y", y))


def _reduce(op: str, rng: np.random.Generator) -> Case:
    x = [1, int(rng.integers(2, 5)), 3, 2]
    axes = sorted(rng.choice(4, size=int(rng.integers(1, 3)), replace=False).tolist())
    keep = int(rng.integers(0, 2))
    y = [1 if a in axes else d for a, d in enumerate(x)] if keep else [d for a, d in enumerate(x) if a not in axes]
    opset = 18 if rng.random() < 0.5 else 11
    if opset >= 18 or op == "ReduceSum" and opset >= 13:
        text = _sig([("x", "float", x), ("A", "int64", [len(axes)])], [("y", y)])
        return Case(op, text + f" {{ y = {op} <keepdims = {keep}> (x, A) }}", opset, values={"A": axes},
                    needs=_needs(rng, "y", y))
    text = _sig([("x", "float", x)], [("y", y)])
    return Case(op, text + f" {{ y = {op} <axes = [{', '.join(map(str, axes))}], keepdims = {keep}> (x) }}",
                opset, needs=_needs(rng, "y", y))


def _norm(op: str, rng: np.random.Generator) -> Case:
    c = int(rng.choice([2, 4, 6]))
    x = [1, c, 3, 2]
    vec = [("S", "float", [c]), ("B", "float", [c])]
    if op == "BatchNormalization":
        ins = [("x", "float", x), *vec, ("M", "float", [c]), ("V", "float", [c])]
        body, values = "y = BatchNormalization (x, S, B, M, V)", {"V": np.abs(np.linspace(0.5, 2, c))}
        return Case(op, _sig(ins, [("y", x)]) + f" {{ {body} }}", 15, values=values,
                    zero={"S": np.s_[_zero_rows(rng, c)]}, needs=_needs(rng, "y", x))
    if op == "InstanceNormalization":
        return Case(op, _sig([("x", "float", x), *vec], [("y", x)]) + " { y = InstanceNormalization (x, S, B) }",
                    17, needs=_needs(rng, "y", x))
    if op == "GroupNormalization":
        g = int(rng.choice([1, 2]))
        return Case(op, _sig([("x", "float", x), *vec], [("y", x)]) + f" {{ y = GroupNormalization <num_groups = {g}> (x, S, B) }}",
                    21, needs=_needs(rng, "y", x))
    if op == "LayerNormalization":
        axis = int(rng.choice([-1, -2]))
        shape = x[axis:]
        ins = [("x", "float", x), ("S", "float", shape), ("B", "float", shape)]
        return Case(op, _sig(ins, [("y", x)]) + f" {{ y = LayerNormalization <axis = {axis}> (x, S, B) }}", 17,
                    needs=_needs(rng, "y", x))
    if op == "LRN":
        return Case(op, _sig([("x", "float", x)], [("y", x)]) + " { y = LRN <size = 3> (x) }", 17, needs=_needs(rng, "y", x))
    if op == "MeanVarianceNormalization":
        return Case(op, _sig([("x", "float", x)], [("y", x)]) + f" {{ y = {op} (x) }}", 17, needs=_needs(rng, "y", x))
    axis = int(rng.integers(1, 4))
    attr = " <p = 2, axis = 1>" if op == "LpNormalization" else f" <axis = {axis}>"
    return Case(op, _sig([("x", "float", x)], [("y", x)]) + f" {{ y = {op}{attr} (x) }}", 17, needs=_needs(rng, "y", x))


def _layout(op: str, rng: np.random.Generator) -> Case:
    c, h, w = int(rng.choice([2, 4, 6])), 2, 3
    x = [1, c, h, w]
    ins = [("x", "float", x)]
    if op == "Reshape":
        y = [1, c, h * w] if rng.random() < 0.5 else [1, 2, c // 2, h, w]
        ins.append(("S", "int64", [len(y)]))
        return Case(op, _sig(ins, [("y", y)]) + " { y = Reshape (x, S) }", 17, values={"S": y}, needs=_needs(rng, "y", y))
    if op == "Flatten":
        return Case(op, _sig(ins, [("y", [1, c * h * w])]) + " { y = Flatten (x) }", 17, needs=_needs(rng, "y", [1, c * h * w]))
    if op == "Transpose":
        perm = [0, *(1 + rng.permutation(3)).tolist()]
        y = [x[p] for p in perm]
        return Case(op, _sig(ins, [("y", y)]) + f" {{ y = Transpose <perm = [{', '.join(map(str, perm))}]> (x) }}", 17,
                    needs=_needs(rng, "y", y))
    if op == "Squeeze":
        ins.append(("A", "int64", [1]))
        return Case(op, _sig(ins, [("y", [c, h, w])]) + " { y = Squeeze (x, A) }", 17, values={"A": [0]}, needs=_needs(rng, "y", [c, h, w]))
    if op == "Unsqueeze":
        ins.append(("A", "int64", [1]))
        y = [1, c, 1, h, w]
        return Case(op, _sig(ins, [("y", y)]) + " { y = Unsqueeze (x, A) }", 17, values={"A": [2]}, needs=_needs(rng, "y", y))
    if op == "Expand":
        ins = [("x", "float", [1, c, 1, w]), ("S", "int64", [4])]
        y = [2, c, h, w]
        return Case(op, _sig(ins, [("y", y)]) + " { y = Expand (x, S) }", 17, values={"S": y}, needs=_needs(rng, "y", y))
    if op == "Concat":
        ins = [("x", "float", x), ("z", "float", [1, c + 1, h, w])]
        y = [1, 2 * c + 1, h, w]
        return Case(op, _sig(ins, [("y", y)]) + " { y = Concat <axis = 1> (x, z) }", 17, needs=_needs(rng, "y", y))
    if op == "Split":
        ins.append(("P", "int64", [2]))
        outs = [("y", [1, 1, h, w]), ("z", [1, c - 1, h, w])]
        return Case(op, _sig(ins, outs) + " { y, z = Split <axis = 1> (x, P) }", 17, values={"P": [1, c - 1]},
                    needs={**_needs(rng, "y", outs[0][1]), **_needs(rng, "z", outs[1][1])})
    if op == "Slice":
        ins += [("St", "int64", [1]), ("En", "int64", [1]), ("Ax", "int64", [1])]
        y = [1, c - 1, h, w]
        return Case(op, _sig(ins, [("y", y)]) + " { y = Slice (x, St, En, Ax) }", 17,
                    values={"St": [1], "En": [c], "Ax": [1]}, needs=_needs(rng, "y", y))
    if op == "Gather":
        idx = sorted(rng.choice(c, size=int(rng.integers(1, c + 1)), replace=False).tolist())
        ins.append(("I", "int64", [len(idx)]))
        y = [1, len(idx), h, w]
        return Case(op, _sig(ins, [("y", y)]) + " { y = Gather <axis = 1> (x, I) }", 17, values={"I": idx},
                    needs=_needs(rng, "y", y))
    if op == "Pad":
        ins.append(("P", "int64", [8]))
        y = [1, c, h + 2, w + 1]
        return Case(op, _sig(ins, [("y", y)]) + " { y = Pad (x, P) }", 17, values={"P": [0, 0, 1, 0, 0, 0, 1, 1]},
                    needs=_needs(rng, "y", y))
    if op in ("Resize", "Upsample"):
        y = [1, c, 2 * h, 2 * w]
        if op == "Upsample":
            ins.append(("S", "float", [4]))
            return Case(op, _sig(ins, [("y", y)]) + " { y = Upsample (x, S) }", 9, values={"S": [1, 1, 2, 2]},
                        needs=_needs(rng, "y", y))
        ins += [("R", "float", [0]), ("S", "float", [4])]
        return Case(op, _sig(ins, [("y", y)]) + " { y = Resize (x, R, S) }", 17, values={"R": [], "S": [1, 1, 2, 2]},
                    needs=_needs(rng, "y", y))
    if op == "Tile":
        ins.append(("R", "int64", [4]))
        y = [1, c, 2 * h, w]
        return Case(op, _sig(ins, [("y", y)]) + " { y = Tile (x, R) }", 17, values={"R": [1, 1, 2, 1]}, needs=_needs(rng, "y", y))
    if op == "DepthToSpace":
        x = [1, 4 * c, 2, 2]
        y = [1, c, 4, 4]
        mode = rng.choice(["DCR", "CRD"])
        return Case(op, _sig([("x", "float", x)], [("y", y)]) + f' {{ y = DepthToSpace <blocksize = 2, mode = "{mode}"> (x) }}',
                    17, needs=_needs(rng, "y", y))
    if op == "Cast":
        return Case(op, _sig(ins, [("y", x)]) + " { y = Cast <to = 1> (x) }", 17, needs=_needs(rng, "y", x))
    if op == "CastLike":
        ins.append(("L", "float", [1]))
        return Case(op, _sig(ins, [("y", x)]) + " { y = CastLike (x, L) }", 17, needs=_needs(rng, "y", x))
    if op == "Dropout":
        return Case(op, _sig(ins, [("y", x)]) + " { y = Dropout (x) }", 17, needs=_needs(rng, "y", x))
    if op == "Gelu":
        return Case(op, _sig(ins, [("y", x)]) + " { y = Gelu (x) }", 20, needs=_needs(rng, "y", x))
    raise KeyError(op)


def _fused(op: str, rng: np.random.Generator) -> Case:
    """onnxruntime's fused activations and normalizations (com.microsoft)."""
    s, c = int(rng.integers(1, 4)), int(rng.choice([4, 6, 8]))
    x = [1, s, c]
    vec = {"BiasGelu": "B", "FastGelu": "B"}.get(op)
    if op in ("BiasGelu", "FastGelu", "QuickGelu"):
        ins = [("x", "float", x)] + ([("B", "float", [c])] if vec else [])
        args = "x, B" if vec else "x"
        text = _sig(ins, [("y", x)]) + f" {{ y = com.microsoft.{op} ({args}) }}"
        return Case(op, MS_HEADER + text, 17, zero={"B": np.s_[_zero_rows(rng, c)]} if vec else {},
                    needs=_needs(rng, "y", x))
    ins = [("x", "float", x), ("skip", "float", x), ("G", "float", [c])]
    if op == "SkipLayerNormalization":
        ins += [("Be", "float", [c]), ("Bi", "float", [c])]
    args = ", ".join(n for n, _, _ in ins)
    text = _sig(ins, [("y", x)]) + f" {{ y = com.microsoft.{op} <epsilon = 1e-5> ({args}) }}"
    return Case(op, MS_HEADER + text, 17, needs=_needs(rng, "y", x))


def _attention(op: str, rng: np.random.Generator) -> Case:
    """Fused attention, one of its forms at random; heads of 2 dims."""
    s, heads = int(rng.integers(2, 5)), int(rng.choice([2, 4]))
    d = 2
    h = heads * d
    if op == "MultiHeadAttention":
        ins = [("q", "float", [1, s, h]), ("k", "float", [1, s, h]), ("v", "float", [1, s, h]), ("B", "float", [3 * h])]
        body = f"y = com.microsoft.MultiHeadAttention <num_heads = {heads}> (q, k, v, B)"
        return Case(op, MS_HEADER + _sig(ins, [("y", [1, s, h])]) + f" {{ {body} }}", 17,
                    needs=_needs(rng, "y", [1, s, h]))
    form = rng.choice(["contrib", "3d", "4d"])
    if form == "contrib":
        ins = [("x", "float", [1, s, 8]), ("W", "float", [8, 3 * h]), ("B", "float", [3 * h])]
        body = f"y = com.microsoft.Attention <num_heads = {heads}> (x, W, B)"
        return Case(op, MS_HEADER + _sig(ins, [("y", [1, s, h])]) + f" {{ {body} }}", 17,
                    zero={"W": np.s_[:, _zero_rows(rng, 3 * h)]}, needs=_needs(rng, "y", [1, s, h]))
    if form == "3d":
        ins = [("q", "float", [1, s, h]), ("k", "float", [1, s, h]), ("v", "float", [1, s, h])]
        body = f"y = Attention <q_num_heads = {heads}, kv_num_heads = {heads}> (q, k, v)"
        return Case(op, OPSET23 + _sig(ins, [("y", [1, s, h])]) + f" {{ {body} }}", 23,
                    needs=_needs(rng, "y", [1, s, h]))
    kv = int(rng.choice([1, heads]))
    q, k = [1, heads, s, d], [1, kv, s, d]
    ins = [("q", "float", q), ("k", "float", k), ("v", "float", k)]
    body = f"y = Attention <is_causal = {int(rng.integers(0, 2))}> (q, k, v)"
    return Case(op, OPSET23 + _sig(ins, [("y", q)]) + f" {{ {body} }}", 23, needs=_needs(rng, "y", q))


def _rotary(rng: np.random.Generator) -> Case:
    s, heads, d = int(rng.integers(2, 5)), int(rng.choice([1, 2])), 4
    angles = np.arange(s)[:, None] * (1.0 / 10000 ** (np.arange(d // 2) / (d // 2)))[None, :]
    values = {"C": np.cos(angles), "S": np.sin(angles), "P": np.arange(s).reshape(1, s)}
    x = [1, s, heads * d]
    caches = [("C", "float", [s, d // 2]), ("S", "float", [s, d // 2]), ("P", "int64", [1, s])]
    if rng.random() < 0.5:
        body = f"y = com.microsoft.RotaryEmbedding <num_heads = {heads}> (x, P, C, S)"
        return Case("RotaryEmbedding", MS_HEADER + _sig([("x", "float", x), *caches], [("y", x)]) + f" {{ {body} }}",
                    17, values=values, needs=_needs(rng, "y", x))
    body = f"y = RotaryEmbedding <num_heads = {heads}> (x, C, S, P)"
    return Case("RotaryEmbedding", OPSET23 + _sig([("x", "float", x), *caches], [("y", x)]) + f" {{ {body} }}",
                23, values=values, needs=_needs(rng, "y", x))


def _recurrent(op: str, rng: np.random.Generator) -> Case:
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    seq, batch, feat, h = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(2, 5)), int(rng.integers(2, 5))
    dirs = int(rng.integers(1, 3))
    ins = [("x", "float", [seq, batch, feat]), ("W", "float", [dirs, gates * h, feat]),
           ("R", "float", [dirs, gates * h, h]), ("B", "float", [dirs, 2 * gates * h])]  # fmt: skip
    y = [seq, dirs, batch, h]
    direction = "bidirectional" if dirs == 2 else "forward"
    body = f'y, yh = {op} <hidden_size = {h}, direction = "{direction}"> (x, W, R, B)'
    units = _zero_rows(rng, h)
    rows = [g * h + u for g in range(gates) for u in units]
    zero = {"R": np.s_[:, :, units]} if rng.random() < 0.5 else {"W": np.s_[:, rows], "R": np.s_[:, rows]}
    return Case(op, _sig(ins, [("y", y), ("yh", [dirs, batch, h])]) + f" {{ {body} }}", 17, zero=zero,
                needs={**_needs(rng, "y", y), **_needs(rng, "yh", [dirs, batch, h])})


def _einsum(rng: np.random.Generator) -> Case:
    b, i, j, k = (int(v) for v in rng.integers(1, 4, size=4))
    eq = str(rng.choice(["bij,bjk->bik", "bij,jk->bik", "bij,bkj->bik", "bij,bik->bjk"]))
    a_term, b_term, out = eq.replace("->", ",").split(",")
    size = {"b": b, "i": i, "j": j + 1, "k": k + 1}
    shape = {t: [size[ch] for ch in t] for t in (a_term, b_term, out)}
    weight = len(b_term) == 2 or rng.random() < 0.5
    name = "W" if weight else "w"
    ins = [("x", "float", shape[a_term]), (name, "float", shape[b_term])]
    zero = {"W": np.s_[_zero_rows(rng, shape[b_term][0])]} if weight else {}
    text = _sig(ins, [("y", shape[out])]) + f' {{ y = Einsum <equation = "{eq}"> (x, {name}) }}'
    return Case("Einsum", text, 17, zero=zero, needs=_needs(rng, "y", shape[out]))


FAMILIES: dict[str, Callable[[np.random.Generator], Case]] = {}
for _op in UNARY:
    FAMILIES[_op] = lambda rng, op=_op: _unary(op, rng)
for _op in BINARY:
    FAMILIES[_op] = lambda rng, op=_op: _binary(op, rng)
for _op in POOLS:
    FAMILIES[_op] = lambda rng, op=_op: _pool(op, rng)
for _op in REDUCES:
    FAMILIES[_op] = lambda rng, op=_op: _reduce(op, rng)
for _op in ("BatchNormalization", "InstanceNormalization", "GroupNormalization", "LayerNormalization",
            "LRN", "MeanVarianceNormalization", "Softmax", "LogSoftmax", "Hardmax", "LpNormalization"):  # fmt: skip
    FAMILIES[_op] = lambda rng, op=_op: _norm(op, rng)
for _op in ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Concat", "Split",
            "Slice", "Gather", "Pad", "Resize", "Upsample", "Tile", "DepthToSpace", "Cast",
            "CastLike", "Dropout", "Gelu"):  # fmt: skip
    FAMILIES[_op] = lambda rng, op=_op: _layout(op, rng)
for _op in ("Conv", "ConvTranspose"):
    FAMILIES[_op] = lambda rng, op=_op: _conv(op, rng)
FAMILIES.update(Gemm=_gemm, MatMul=_matmul, PRelu=_prelu, Mod=_mod, Where=_where, Clip=_clip)
for _op in ("BiasGelu", "FastGelu", "QuickGelu", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"):
    FAMILIES[_op] = lambda rng, op=_op: _fused(op, rng)
for _op in ("Attention", "MultiHeadAttention"):
    FAMILIES[_op] = lambda rng, op=_op: _attention(op, rng)
for _op in ("LSTM", "GRU", "RNN"):
    FAMILIES[_op] = lambda rng, op=_op: _recurrent(op, rng)
FAMILIES.update(RotaryEmbedding=_rotary, Einsum=_einsum)


def case(op: str, seed: int) -> Case:
    """A random single-node graph of `op` (KeyError for an op without a case)."""
    c = FAMILIES[op](np.random.default_rng(seed))
    c.node_op = op
    return c


# ------------------------------------------------------------------ the oracle
@dataclass
class Comparison:
    """The rule's kept indices against the replay's needed ones, per live input axis."""

    case: Case
    rule: dict[tuple[str, int], list[int]]  # (input, axis) -> kept by the rule
    replay: dict[tuple[str, int], list[int]]  # (input, axis) -> needed by the replay
    judged: bool = True  # False: an output the draws cannot judge (boolean): nothing compared

    @property
    def missing(self) -> dict[tuple[str, int], list[int]]:
        """Needed indices the rule does not keep: a bug in the rule."""
        out = {}
        for key, need in self.replay.items():
            lost = sorted(set(need) - set(self.rule[key]))
            if lost:
                out[key] = lost
        return out

    @property
    def extra(self) -> int:
        """Indices the rule keeps beyond what the replay finds needed (imprecision, not a bug)."""
        return sum(len(set(self.rule[k]) - set(v)) for k, v in self.replay.items())


def compare(c: Case) -> Comparison:
    """Run the handler's rule on the case (its data inputs free: what the node demands shows in
    their kept sets) and replay the node with the kept sets of its outputs."""
    from onnxshrink.analyze.replay import replay
    from onnxshrink.testing import analyze_node, model_from_text

    model = model_from_text(c.text, opset=c.opset, values=c.values, zero=c.zero)
    bench = analyze_node(model, needs=c.needs, free_inputs=True)
    ks = bench.analysis.keep
    # the node under test (not the Gathers `needs` adds after it)
    [node] = [
        n for n in bench.analysis.graph.nodes
        if n.op == c.node_op and not any("__needs_" in t.name for t in n.inputs if t is not None)
    ]  # fmt: skip
    inputs, live, axes, fixed = [], [], {}, {}
    for i, t in enumerate(node.inputs):
        value = ks.value(t) if t is not None and t.name else None
        floating = t is not None and t.dtype is not None and np.issubdtype(np.dtype(t.dtype), np.floating)
        if value is not None or not floating:
            shape = [d if isinstance(d, int) else 1 for d in (t.shape or [])] if t is not None else []
            inputs.append(np.asarray(value) if value is not None else np.zeros(shape, np.dtype(t.dtype)) > 0)
            live.append(False)
        else:
            inputs.append(np.zeros(t.shape, np.dtype(t.dtype)))
            live.append(True)
            axes[i] = list(range(len(t.shape)))
            if ks.const(t) is not None:
                fixed[i] = (ks.const(t).mask, ks.const(t).value)
    found = replay(node, inputs, live, axes, bench.analysis.opset, fixed=fixed)
    kept = [
        [ks.kept(y, b) for b in range(len(y.shape or []))] if ks.exists(y) else None
        for y in node.outputs
    ]
    rule, need = {}, {}
    if not all(found.judged[o] for o, k in enumerate(kept) if k is not None):
        return Comparison(c, rule, need, judged=False)
    for i, probed in axes.items():
        name = node.inputs[i].name
        for a in probed:
            k = ks.kept(node.inputs[i], a)
            rule[(name, a)] = np.flatnonzero(k).tolist() if k is not None else list(range(node.inputs[i].shape[a]))
            need[(name, a)] = np.flatnonzero(found.needed(i, a, kept)).tolist()
    return Comparison(c, rule, need)

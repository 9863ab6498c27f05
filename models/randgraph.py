"""Random small ONNX graphs in the forms real exporters write, to hunt for wrong results.

`build(seed) -> (model, info)`: an fp32 model with one input `input` [N or 1, C, H, W] (N a
symbol "N" for half the seeds), a conv stem, 1-5 random stages and a head, opset 13, 17, 18 or
20. Every initializer is random (no two equal); the masks are zeros written into the weights
while the graph is built (whole filter rows with their bias, filter rows alone so that the
channel is the non-zero constant of its bias, input columns, BatchNorm scales with or without
their shift), so the model itself is the reference `shrink(model)` must reproduce.

Stages: conv (+BN +activation), grouped / depthwise conv, pooling, residual Add, Concat of
branches, Split / Slice parts, and the forms that matter beside them:
- shape values used as numbers: `x / Cast(Gather(Shape(x), 1))`, a channel mean written by
  hand, `Size -> Cast -> Div`, C*H*W from `Shape` (Gather products, `Shape(start=1)` or a Slice
  of it into ReduceProd) used as a scale;
- reshape targets computed from `Shape -> Gather/Slice -> Concat` (or literal with 0 / -1) to
  [N, C, HW] and back, and to attention heads [N, heads, d, HW];
- a non-zero constant channel through a MatMul of two activations (Gram matrix `c @ c^T`,
  `softmax(c) @ c^T`, channel attention `softmax(c c^T) @ c`);
- MatMul of a rank-4 map with a constant weight, on W or (transposed) on the channel axis;
- constants through Gather (index lists and scalar indices), Tile, Concat and Expand with the
  batch taken from `Shape` (dynamic); BatchNorm with zero scales followed by Gather and
  InstanceNormalization;
- Softmax / LayerNormalization / hand-written LayerNorm / reductions over the channel axis;
- squeeze-excitation (GAP -> Gemm -> Relu -> Gemm -> gate -> Mul);
- heads: GAP / Flatten / Reduce into Gemm or MatMul + Add, with value_info from shape
  inference (as the dynamo exporter writes it) where some dims, Gemm's last one among them,
  are renamed to symbols; extra outputs (the map with symbolic dims, an ArgMax).

Forms added for issue 19 (drawn from a second random stream, so that a seed that gets none of
them is the graph it always was; `build(seed, extended=False)` leaves them all out):
- EXTRA stages after a stage, each giving back a map of the shape it was given: learned scalars
  (0-d initializers: Mul, Add, Div, a PRelu slope; sometimes masked to 0); Einsum with a masked
  weight on C, H or W -> Slice with negative starts (out of range, reversed, INT64_MAX ends, on
  one or two axes) -> a reduction over some axes, as a gate or concatenated; a constant weight
  multiplying from the left (`MatMul(W, x)` over the channels of [N, C, HW] or over H, W with
  a batch axis, Gemm with the weight as A);
- H and W symbolic as well as N (dynamic sizes on the axes the masks and slices act on);
- the masks given apart, as a pruner's file holds them ({initializer: 0/1 mask}, a Conv's
  whole-filter masks sometimes as one flag per output channel, all-ones masks on others,
  scalars among them), for the model as masked or, half the time, as exported before masking
  (its masked entries hold other values): `check` applies them itself for the reference.

Conditioning: outputs are compared within 1e-5 of their max magnitude, so the float32 reference
must not be rounding noise. InstanceNorm of a constant channel is rounding amplified by
1/sqrt(epsilon) in onnxruntime itself: its epsilon is 1e-2 and the BatchNorm shifts it sees as
constants are short binary fractions; LayerNorms over the channels (few of them) use epsilon 1e-3
over 3 or more; head outputs get biases of size 1 (no final Relu), so that they are not small
remainders of cancellation. Where an output still is one (zeroed biases, constants folded), an
error within 10x the two models' own float32 rounding of it, with the two in float64 as close,
is rounding, not a wrong model (`rounding_only`); tools/sweep.py counts those apart.

`info` holds the opset, the input's declared shape (and what its symbols H and W are), the
stage names, the output names and, when given apart, the masks and `input_masked`.
`python -m models.randgraph SEED` prints a graph in ONNX text form.

`check(seed)` runs one seed the way tests/test_random_graphs.py and tools/sweep.py do: build,
`shrink(model[, masks], validate=False)`, then an independent comparison in onnxruntime.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSETS = (13, 17, 18, 20)
RTOL = 1e-5
BATCHES = (2, 3)  # the value of every dynamic dim in the two draws


@dataclass
class X:
    """A rank-4 activation [N, c, h, w]."""

    name: str
    c: int
    h: int
    w: int

    def to(self, name: str, c: int | None = None, h: int | None = None, w: int | None = None) -> X:
        return X(name, self.c if c is None else c, h or self.h, w or self.w)


class G:
    """The graph under construction, and the random choices of one seed."""

    def __init__(self, seed: int, extended: bool = True):
        self.rng = np.random.default_rng(seed)
        r = self.rng
        self.opset = int(r.choice(OPSETS))
        self.dynamic = r.random() < 0.5
        self.p = float(r.choice([0.15, 0.3, 0.5]))  # how much is masked
        self.const_nodes = r.random() < 0.3  # int constants as Constant nodes (legacy exporter)
        # The forms added later (EXTRA stages, dynamic H/W, masks given apart) draw from a second
        # stream, so that a seed that gets none of them is the graph it always was.
        self.xrng = np.random.default_rng((seed, 19))
        self.extended = extended  # False: none of them (the graphs of the seeds pinned before)
        self.dynamic_hw = self.dynamic and self.xrng.random() < 0.3 and extended  # H, W symbolic
        self.in_extra = False
        self.extra_tensors: set[str] = set()  # made by EXTRA stages (their value_info: xrng)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}
        self.shared: dict[tuple, str] = {}
        self.outputs: list[tuple[str, int, list]] = []  # (name, elem type, declared dims)
        self.symbolic: set[str] = set()  # tensors whose value_info gets a symbolic last dim
        self.stages: list[str] = []
        self.count = 0

    # ------------------------------------------------------------------ basics
    @contextmanager
    def extra(self):
        """Draw from the second stream (see __init__) while building an EXTRA stage."""
        saved, self.rng, self.in_extra = self.rng, self.xrng, True
        try:
            yield
        finally:
            self.rng, self.in_extra = saved, False

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs):
        n = self.name(op_type.lower())
        outs = [f"{n}_o{k}" for k in range(n_out)] if n_out > 1 else [n]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=n, **attrs))
        if self.in_extra:
            self.extra_tensors.update(outs)
        return outs if n_out > 1 else outs[0]

    def weight(self, arr: np.ndarray, prefix: str) -> str:
        n = self.name(prefix)
        self.inits[n] = np.asarray(arr, np.float32)
        return n

    def randn(self, *shape, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def const(self, values, dtype=np.int64, scalar: bool = False) -> str:
        """A non-weight constant (shape targets, axes, indices, eps): shared by value among
        initializers, as the exporters merge them, or one Constant node per use."""
        arr = np.asarray(values, dtype=dtype)
        if not scalar:
            arr = arr.reshape(-1) if arr.ndim == 0 else arr
        if self.const_nodes:
            return self.op("Constant", [], value=numpy_helper.from_array(arr))
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self.shared:
            self.shared[key] = self.name("const")
            self.inits[self.shared[key]] = arr
        return self.shared[key]

    def fconst(self, v: float) -> str:
        return self.const(np.float32(v), np.float32, scalar=True)

    # ------------------------------------------------------------------ masks
    def mask_out(self, w: np.ndarray, axis: int, bias: np.ndarray | None, force_const=False):
        """Zero whole output channels: the rows and their bias (a zero channel), or the rows
        alone (the channel is the constant of its bias). One channel at least stays whole."""
        n = w.shape[axis]
        modes = ["keep"] * n
        for k in range(n):
            u = self.rng.random()
            if u < self.p / 2:
                modes[k] = "zero"
            elif u < self.p:
                modes[k] = "const"
        if force_const and bias is not None and n > 1:
            modes[int(self.rng.integers(n))] = "const"
        if all(m != "keep" for m in modes):
            modes[int(self.rng.integers(n))] = "keep"
        for k, m in enumerate(modes):
            if m != "keep":
                w[(slice(None),) * axis + (k,)] = 0
                if m == "zero" and bias is not None:
                    bias[k] = 0
        return modes

    def mask_in(self, w: np.ndarray, axis: int) -> None:
        n = w.shape[axis]
        drop = [k for k in range(n) if self.rng.random() < self.p / 3]
        for k in drop[: n - 1]:
            w[(slice(None),) * axis + (k,)] = 0

    # ------------------------------------------------------------------ layers
    def conv(self, x: X, cout: int, k: int = 3, group: int = 1, bias: bool = True, stride=1,
             force_const: bool = False, same: bool = True) -> X:
        pad = k // 2 if same or self.chance(0.7) else 0
        if (min(x.h, x.w) + 2 * pad - k) // stride + 1 < 2:
            pad, stride = k // 2, 1
        fan = x.c // group * k * k
        w = self.randn(cout, x.c // group, k, k, scale=fan**-0.5)
        b = self.randn(cout, scale=0.5) if bias else None
        self.mask_out(w, 0, b, force_const)
        if group == 1:
            self.mask_in(w, 1)
        ins = [x.name, self.weight(w, "conv_w")] + ([self.weight(b, "conv_b")] if bias else [])
        attrs = {"kernel_shape": [k, k], "pads": [pad] * 4}
        if stride > 1:
            attrs["strides"] = [stride, stride]
        if group > 1:
            attrs["group"] = group
        y = self.op("Conv", ins, **attrs)
        h = (x.h + 2 * pad - k) // stride + 1
        return X(y, cout, h, (x.w + 2 * pad - k) // stride + 1)

    def bn(self, x: X, zero_scale: float | None = None, short_shift: bool = False) -> X:
        c = x.c
        s = self.randn(c, scale=0.5) + np.float32(1.0)
        b = self.randn(c, scale=0.5)
        zs = self.p if zero_scale is None else zero_scale
        zeroed = [k for k in range(c) if self.rng.random() < zs][: c - 1]
        for k in zeroed:
            s[k] = 0
            if self.chance(0.4):
                b[k] = 0
            elif short_shift:  # the channel is its shift: a short binary fraction, so that
                # statistics over it (InstanceNorm) are exact in float32, not rounding noise
                b[k] = np.round(b[k] * 16) / 16 or np.float32(0.0625)
        mean = self.randn(c, scale=0.5)
        var = self.rng.uniform(0.5, 2.0, c).astype(np.float32)
        ins = [x.name] + [self.weight(a, f"bn_{t}") for a, t in ((s, "s"), (b, "b"), (mean, "m"), (var, "v"))]
        return x.to(self.op("BatchNormalization", ins, epsilon=1e-5))

    def act(self, x: X, op: str | None = "random") -> X:
        if op == "random":
            op = self.pick([None, "Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "Elu",
                            "Softplus", "Clip", "HardSwish", "Gelu"])
        if op is None:
            return x
        if (op == "HardSwish" and self.opset < 14) or (op == "Gelu" and self.opset < 20):
            op = "Relu"
        ins, attrs = [x.name], {}
        if op == "LeakyRelu":
            attrs["alpha"] = 0.1
        elif op == "Elu":
            attrs["alpha"] = 0.7
        elif op == "HardSigmoid":
            attrs.update(alpha=0.25, beta=0.4)
        elif op == "Clip":
            ins += [self.fconst(-0.8), self.fconst(1.3)]
        return x.to(self.op(op, ins, **attrs))

    def conv_block(self, x: X, cout: int, force_const: bool = False, same: bool = True) -> X:
        use_bn = self.chance(0.5)
        y = self.conv(x, cout, self.pick([1, 3]), bias=not use_bn or self.chance(0.3),
                      force_const=force_const, same=same)
        if use_bn:
            y = self.bn(y)
        return self.act(y)

    def gemm(self, x: str, n_in: int, k: int, bias_scale: float = 0.5) -> str:
        """Gemm (transB either way) or MatMul + Add: [N, n_in] -> [N, k], masked both ways."""
        w = self.randn(k, n_in, scale=n_in**-0.5)
        b = self.randn(k, scale=bias_scale)
        self.mask_out(w, 0, b, force_const=self.chance(0.3))
        self.mask_in(w, 1)
        if self.chance(0.7):
            trans = self.chance(0.5)
            ins = [x, self.weight(w if trans else w.T.copy(), "fc_w"), self.weight(b, "fc_b")]
            y = self.op("Gemm", ins, transB=int(trans))
            self.symbolic.add(y)  # its value_info, if any, gets a symbolic last dim
            return y
        return self.op("Add", [self.op("MatMul", [x, self.weight(w.T.copy(), "fc_w")]), self.weight(b, "fc_b")])

    def reduce(self, op: str, x: str, axes: list[int], keepdims: int = 1) -> str:
        if (op == "ReduceSum" and self.opset >= 13) or self.opset >= 18:
            return self.op(op, [x, self.const(axes)], keepdims=keepdims)
        return self.op(op, [x], axes=axes, keepdims=keepdims)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        return self.op("Unsqueeze", [x, self.const(axes)])

    def shape_of(self, x: str, start: int = 0, end: int | None = None) -> str:
        """Dims [start:end] of x as an int64 vector, written as the exporters do."""
        if start == 0 and end is None:
            return self.op("Shape", [x])
        style = self.pick(["attr", "slice", "gather"]) if self.opset >= 15 else self.pick(["slice", "gather"])
        if style == "gather" and end is None:
            style = "slice"
        if style == "attr":
            attrs = {"start": start} if start else {}
            if end is not None:
                attrs["end"] = end
            return self.op("Shape", [x], **attrs)
        s = self.op("Shape", [x])
        if style == "slice":
            return self.op("Slice", [s, self.const([start]), self.const([end if end is not None else 2**62])])
        parts = [self.op("Gather", [s, self.const([k])], axis=0) for k in range(start, end)]
        return parts[0] if len(parts) == 1 else self.op("Concat", parts, axis=0)

    def dim(self, x: str, k: int, scalar: bool = False) -> str:
        """Dim k of x: Gather(Shape(x), k) with a scalar or a [1] index."""
        return self.op("Gather", [self.op("Shape", [x]), self.const(k, scalar=scalar) if scalar else self.const([k])], axis=0)

    def target(self, src: str, parts: list, reshape: bool = True) -> str:
        """A Reshape (or, `reshape` False, Expand / Tile) target: ints, "N" (the batch of src)
        or ("dim", tensor, k). Literal (a Reshape's batch as 0, a static one as its value) or
        computed from Shape and Concat."""
        literal = all(isinstance(p, int) or p == "N" for p in parts)
        if literal and (reshape or not self.dynamic) and self.chance(0.4):
            n = 0 if reshape and (self.dynamic or self.chance(0.5)) else 1
            return self.const([n if p == "N" else p for p in parts])
        pieces, lit = [], []
        for p in parts:
            if isinstance(p, int):
                lit.append(p)
                continue
            if lit:
                pieces.append(self.const(lit))
                lit = []
            if p == "N":
                pieces.append(self.shape_of(src, 0, 1))
            else:
                pieces.append(self.dim(p[1], p[2]))
        if lit:
            pieces.append(self.const(lit))
        return pieces[0] if len(pieces) == 1 else self.op("Concat", pieces, axis=0)

    def to3d(self, x: X) -> str:
        """[N, C, H, W] -> [N, C, HW]."""
        parts = self.pick([["N", x.c, -1], ["N", ("dim", x.name, 1), -1], ["N", -1, x.h * x.w],
                           ["N", x.c, x.h * x.w]])
        if self.chance(0.25) and self.opset >= 15:  # Shape(x, 0, 2) ++ [-1]
            t = self.op("Concat", [self.op("Shape", [x.name], end=2), self.const([-1])], axis=0)
            return self.op("Reshape", [x.name, t])
        if self.chance(0.2):
            return self.op("Reshape", [x.name, self.const([0, 0, -1])])
        return self.op("Reshape", [x.name, self.target(x.name, parts)])

    def to4d(self, y: str, like: X, c: int | None = None, shape_of_like: bool = True) -> X:
        """[N, C, HW] -> [N, C, H, W] (C = c or like's), the target possibly Shape(like)."""
        c = like.c if c is None else c
        if c == like.c and shape_of_like and self.chance(0.3):
            t = self.op("Shape", [like.name])  # the shape of the map it came from
        else:
            t = self.target(y, self.pick([["N", c, like.h, like.w], ["N", -1, like.h, like.w]]))
        return X(self.op("Reshape", [y, t]), c, like.h, like.w)

    # ------------------------------------------------------------------ model
    def input_shape(self, c0: int, h0: int, w0: int) -> list:
        batch = "N" if self.dynamic else 1
        return [batch, c0, "H", "W"] if self.dynamic_hw else [batch, c0, h0, w0]

    def model(self, c0: int, h0: int, w0: int) -> onnx.ModelProto:
        batch = "N" if self.dynamic else 1
        graph = helper.make_graph(
            self.nodes,
            "randgraph",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, self.input_shape(c0, h0, w0))],
            [helper.make_tensor_value_info(n, t, [batch if d == "N" else d for d in dims])
             for n, t, dims in self.outputs],
            [numpy_helper.from_array(v, k) for k, v in self.inits.items()],
        )
        opsets = [helper.make_opsetid("", self.opset)]
        m = helper.make_model(graph, opset_imports=opsets, producer_name="randgraph")
        m.ir_version = helper.find_min_ir_version_for(opsets)
        if self.chance(0.5):  # value_info as the dynamo exporter writes it, some dims symbolic
            inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
            outs = {o.name for o in m.graph.output}
            for vi in inferred.graph.value_info:
                if vi.name in outs:
                    continue
                dims = vi.type.tensor_type.shape.dim
                last = vi.name in self.symbolic
                r = self.xrng if vi.name in self.extra_tensors else self.rng
                if dims and (last or r.random() < 0.15):
                    k = len(dims) - 1 if last else int(r.integers(len(dims)))
                    dims[k].Clear()
                    dims[k].dim_param = f"s{self.count}_{k}"
                    self.count += 1
                m.graph.value_info.append(vi)
        onnx.checker.check_model(m, full_check=True)
        return m


# ====================================================================== stages
def st_conv(g: G, x: X) -> X:
    return g.conv_block(x, int(g.rng.integers(2, 9)), same=min(x.h, x.w) < 5)


def st_strided(g: G, x: X) -> X:
    if min(x.h, x.w) < 5:
        return g.conv_block(x, int(g.rng.integers(2, 7)))
    y = g.conv(x, int(g.rng.integers(2, 9)), 3, stride=2, bias=g.chance(0.5))
    return g.act(g.bn(y) if g.chance(0.5) else y)


def st_gconv(g: G, x: X) -> X:
    divs = [d for d in range(2, x.c + 1) if x.c % d == 0]
    if not divs:
        return st_conv(g, x)
    grp = g.pick(divs)  # x.c: depthwise
    m = int(g.rng.integers(1, 3))
    y = g.conv(x, grp * m, g.pick([1, 3]), group=grp, bias=g.chance(0.6))
    if g.chance(0.5):
        y = g.bn(y)
    return g.act(y)


def st_pool(g: G, x: X) -> X:
    op = g.pick(["MaxPool", "AveragePool"])
    k = g.pick([2, 3])
    s = 2 if min(x.h, x.w) >= 6 and g.chance(0.5) else 1
    pad = 1 if g.chance(0.5) or (min(x.h, x.w) - k) // s + 1 < 2 else 0
    attrs = {"kernel_shape": [k, k], "strides": [s, s], "pads": [pad] * 4}
    if op == "AveragePool" and pad:
        attrs["count_include_pad"] = int(g.chance(0.5))
    h, w = (x.h + 2 * pad - k) // s + 1, (x.w + 2 * pad - k) // s + 1
    return X(g.op(op, [x.name], **attrs), x.c, h, w)


def st_residual(g: G, x: X) -> X:
    h = g.conv_block(x, int(g.rng.integers(1, 7)))
    h = g.conv(h, x.c, g.pick([1, 3]), bias=g.chance(0.5))
    if g.chance(0.5):
        h = g.bn(h)
    ins = [x.name, h.name] if g.chance(0.5) else [h.name, x.name]
    return g.act(x.to(g.op("Add", ins)), g.pick([None, "Relu"]))


def st_concat(g: G, x: X) -> X:
    outs = [g.conv_block(x, int(g.rng.integers(1, 5)))]
    for _ in range(int(g.rng.integers(1, 3))):
        kind = g.pick(["id", "pool", "conv"])
        if kind == "id":
            outs.append(x)
        elif kind == "pool":
            outs.append(x.to(g.op("MaxPool", [x.name], kernel_shape=[3, 3], pads=[1] * 4)))
        else:
            outs.append(g.conv_block(x, int(g.rng.integers(1, 4))))
    g.rng.shuffle(outs)
    y = g.op("Concat", [o.name for o in outs], axis=g.pick([1, -3]))
    return x.to(y, sum(o.c for o in outs))


def st_split(g: G, x: X) -> X:
    if x.c < 2:
        return x
    n = min(int(g.rng.integers(2, 4)), x.c)
    cuts = sorted(g.rng.choice(np.arange(1, x.c), n - 1, replace=False).tolist())
    sizes = np.diff([0, *cuts, x.c]).tolist()
    how = g.pick(["split", "slice", "num_outputs"])
    if how == "num_outputs" and g.opset >= 18 and x.c % n == 0:
        sizes = [x.c // n] * n
        parts = g.op("Split", [x.name], n_out=n, axis=1, num_outputs=n)
    elif how == "slice":
        bounds = np.cumsum([0, *sizes]).tolist()
        parts = [g.op("Slice", [x.name, g.const([a]), g.const([b if k < n - 1 else 2**62]), g.const([1])])
                 for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
    else:
        parts = g.op("Split", [x.name, g.const(sizes)], n_out=n, axis=1)
    outs = [x.to(p, sz) for p, sz in zip(parts, sizes, strict=True)]
    outs = [o if g.chance(0.4) else g.conv_block(o, int(g.rng.integers(1, 4))) for o in outs]
    return x.to(g.op("Concat", [o.name for o in outs], axis=1), sum(o.c for o in outs))


def st_shape_div(g: G, x: X) -> X:
    """Shape values used as numbers: x / C, the channel mean by hand, Size -> Cast -> Div,
    and C*H*W from Shape as a scale."""
    x = g.conv_block(x, int(g.rng.integers(2, 7)), force_const=True)
    kind = g.pick(["div_c", "mean_c", "size", "size_per_sample", "chw"])
    g.stages[-1] += f":{kind}"
    if kind in ("div_c", "mean_c"):
        c = g.op("Cast", [g.dim(x.name, 1, scalar=g.chance(0.6))], to=TensorProto.FLOAT)
        if kind == "div_c":
            return x.to(g.op("Div", [x.name, c]))
        m = g.op("Div", [g.reduce("ReduceSum", x.name, [1]), c])
        return x.to(g.op(g.pick(["Sub", "Mul"]), [x.name, m]))
    if kind == "size":
        s = g.op("Cast", [g.op("Size", [x.name])], to=TensorProto.FLOAT)
        return x.to(g.op("Div", [x.name, g.op("Sqrt", [s])]))
    if kind == "size_per_sample":
        per = g.op("Div", [g.op("Size", [x.name]), g.dim(x.name, 0, scalar=True)])
        m = g.op("Div", [g.reduce("ReduceSum", x.name, [1, 2, 3]), g.op("Cast", [per], to=TensorProto.FLOAT)])
        return x.to(g.op("Sub", [x.name, m]))
    style = g.pick(["gathers", "prod"])
    if style == "gathers":
        d = [g.dim(x.name, k, scalar=g.chance(0.5)) for k in (1, 2, 3)]
        p = g.op("Mul", [g.op("Mul", [d[0], d[1]]), d[2]])
    else:
        s = g.shape_of(x.name, 1, g.pick([None, 4]))
        p = g.reduce("ReduceProd", s, [0], keepdims=0)
    f = g.op("Cast", [p], to=TensorProto.FLOAT)
    return x.to(g.op("Mul", [x.name, g.op("Reciprocal", [g.op("Sqrt", [f])])]))


def st_reshape(g: G, x: X) -> X:
    """[N, C, H, W] -> [N, C, HW] (a computed or literal target), an op there, and back."""
    y = g.to3d(x)
    kind = g.pick(["softmax_hw", "act", "ln_hw"])
    if kind == "softmax_hw":
        y = g.op("Softmax", [y], axis=-1)
    elif kind == "ln_hw" and g.opset >= 17:
        hw = x.h * x.w
        y = g.op("LayerNormalization", [y, g.weight(g.randn(hw) + 1, "ln_s"), g.weight(g.randn(hw), "ln_b")], axis=-1)
    else:
        y = g.op("Tanh", [y])
    return g.to4d(y, x)


def st_gram(g: G, x: X) -> X:
    """A constant channel (zeroed filter, non-zero bias) through a MatMul of two activations."""
    y = g.conv(x, int(g.rng.integers(2, 7)), g.pick([1, 3]), bias=True, force_const=True)
    if g.chance(0.3):
        y = g.bn(y)
    c = g.to3d(y)
    ct = g.op("Transpose", [c], perm=[0, 2, 1])
    kind = g.pick(["gram_attn", "softmax_gram", "gram_out", "gram_reduce"])
    g.stages[-1] += f":{kind}"
    left = g.op("Softmax", [c], axis=-1) if kind == "softmax_gram" else c
    gram = g.op("MatMul", [left, ct])  # [N, C, C]
    gram = g.op("Mul", [gram, g.fconst(1.0 / (y.h * y.w))])
    if kind == "gram_out":
        g.outputs.append((gram, TensorProto.FLOAT, g.pick([["N", y.c, y.c], ["N", "gram_c", "gram_c"], ["gram_n", "gram_r", "gram_k"]])))
        return y
    if kind == "gram_reduce":
        r = g.reduce(g.pick(["ReduceSum", "ReduceMean", "ReduceMax"]), gram, [2])  # [N, C, 1]
        return g.to4d(g.op("Mul", [c, g.op("Sigmoid", [r])]), y)
    attn = g.op("Softmax", [gram], axis=-1)
    out = g.to4d(g.op("MatMul", [attn, c]), y)
    return y.to(g.op("Add", [y.name, out.name]))


def st_matmul4d(g: G, x: X) -> X:
    """MatMul of a rank-4 map with a constant weight: on W, or on the channel axis."""
    x = g.conv_block(x, int(g.rng.integers(2, 7)), force_const=True)
    if g.chance(0.5):
        k = int(g.rng.integers(2, 6))
        w = g.randn(x.w, k, scale=x.w**-0.5)
        g.mask_in(w, 0)
        g.mask_out(w, 1, None)
        y = g.op("MatMul", [x.name, g.weight(w, "mm_w")])
        if g.chance(0.5):
            y = g.op("Add", [y, g.weight(g.randn(k, scale=0.5), "mm_b")])
        g.stages[-1] += ":on_w"
        return x.to(y, w=k)
    k = int(g.rng.integers(2, 7))
    w = g.randn(x.c, k, scale=x.c**-0.5)
    b = g.randn(k, scale=0.5)
    g.mask_out(w, 1, b)
    g.mask_in(w, 0)
    t = g.op("Transpose", [x.name], perm=[0, 2, 3, 1])  # [N, H, W, C]: C is contracted
    y = g.op("MatMul", [t, g.weight(w, "mm_w")])
    if g.chance(0.6):
        y = g.op("Add", [y, g.weight(b, "mm_b")])
    g.stages[-1] += ":on_c"
    return x.to(g.op("Transpose", [y], perm=[0, 3, 1, 2]), c=k)


def st_gather(g: G, x: X) -> X:
    x = g.conv_block(x, int(g.rng.integers(2, 7)), force_const=True)
    kind = g.pick(["list", "scalar_gate", "concat"])
    g.stages[-1] += f":{kind}"
    if kind == "scalar_gate":  # x * sigmoid(x[:, k]) : a scalar index drops the axis
        s = g.op("Gather", [x.name, g.const(int(g.rng.integers(x.c)), scalar=True)], axis=1)
        return x.to(g.op("Mul", [x.name, g.op("Sigmoid", [g.unsqueeze(s, [1])])]))
    idx = g.rng.integers(0, x.c, size=int(g.rng.integers(1, x.c + 2))).tolist()
    y = g.op("Gather", [x.name, g.const(idx)], axis=g.pick([1, -3]))
    if kind == "list":
        return x.to(y, len(idx))
    return x.to(g.op("Concat", [x.name, y], axis=1), x.c + len(idx))


def st_bn_gather_in(g: G, x: X) -> X:
    """BatchNorm with zero scales (those channels are its shift), Gather, InstanceNorm."""
    x = g.bn(x, zero_scale=0.5, short_shift=True)
    idx = g.rng.integers(0, x.c, size=int(g.rng.integers(1, x.c + 2))).tolist()
    scalar = g.chance(0.3)
    if scalar:
        y = g.unsqueeze(g.op("Gather", [x.name, g.const(idx[0], scalar=True)], axis=1), [1])
        idx = idx[:1]
    else:
        y = g.op("Gather", [x.name, g.const(idx)], axis=1)
    k = len(idx)
    s, b = g.randn(k, scale=0.5) + 1, g.randn(k, scale=0.5)
    # epsilon 1e-2: InstanceNorm of a constant channel that is not a short binary fraction is
    # rounding noise amplified by 1/sqrt(epsilon) in onnxruntime itself
    y = g.op("InstanceNormalization", [y, g.weight(s, "in_s"), g.weight(b, "in_b")], epsilon=1e-2)
    return x.to(y, k)


def st_tile_concat(g: G, x: X) -> X:
    """Constant channels through Tile / Expand / Concat, the batch from Shape."""
    x = g.conv_block(x, int(g.rng.integers(2, 6)), force_const=True)
    kind = g.pick(["tile_c", "token_tile", "token_expand", "expand_add", "gap_expand"])
    g.stages[-1] += f":{kind}"
    if kind == "tile_c":
        return x.to(g.op("Tile", [x.name, g.const([1, 2, 1, 1])]), 2 * x.c)
    if kind == "expand_add":  # a per-channel parameter expanded to x's shape
        v = g.weight(g.randn(1, x.c, 1, 1), "chan")
        return x.to(g.op("Add", [x.name, g.op("Expand", [v, g.op("Shape", [x.name])])]))
    if kind == "gap_expand":
        v = g.op("GlobalAveragePool", [x.name])
        e = g.op("Expand", [v, g.op("Shape", [x.name])])
        return x.to(g.op("Concat", [x.name, e], axis=1), 2 * x.c)
    k = int(g.rng.integers(1, 3))
    tok = g.weight(g.randn(1, k, x.h, x.w), "token")
    if kind == "token_tile":
        t = g.op("Tile", [tok, g.target(x.name, ["N", 1, 1, 1], reshape=False)])
    else:
        t = g.op("Expand", [tok, g.target(x.name, ["N", k, x.h, x.w], reshape=False)])
    ins = [t, x.name] if g.chance(0.5) else [x.name, t]
    return x.to(g.op("Concat", ins, axis=1), x.c + k)


def st_chan_norm(g: G, x: X) -> X:
    """Softmax, LayerNorm (op or by hand, epsilon 1e-3: over few channels, 1e-5 makes the
    reference rounding noise) or a reduction over the channel axis."""
    x = g.conv_block(x, int(g.rng.integers(3, 7)), force_const=True)
    kind = g.pick(["softmax", "layernorm", "ln_hand", "reduce"])
    g.stages[-1] += f":{kind}"
    if kind == "softmax":
        return x.to(g.op("Softmax", [x.name], axis=1))
    if kind == "layernorm" and g.opset >= 17:
        t = g.op("Transpose", [x.name], perm=[0, 2, 3, 1])
        s, b = g.weight(g.randn(x.c, scale=0.5) + 1, "ln_s"), g.weight(g.randn(x.c, scale=0.5), "ln_b")
        y = g.op("LayerNormalization", [t, s, b], axis=-1, epsilon=1e-3)
        return x.to(g.op("Transpose", [y], perm=[0, 3, 1, 2]))
    if kind in ("layernorm", "ln_hand"):
        m = g.reduce("ReduceMean", x.name, [1])
        d = g.op("Sub", [x.name, m])
        v = g.reduce("ReduceMean", g.op("Pow", [d, g.fconst(2.0)]), [1])
        y = g.op("Div", [d, g.op("Sqrt", [g.op("Add", [v, g.fconst(1e-3)])])])
        s = g.weight(g.randn(1, x.c, 1, 1, scale=0.5) + 1, "ln_s")
        return x.to(g.op("Add", [g.op("Mul", [y, s]), g.weight(g.randn(1, x.c, 1, 1, scale=0.5), "ln_b")]))
    op = g.pick(["ReduceMean", "ReduceMax", "ReduceSum", "ReduceL2", "ReduceLogSumExp", "ReduceMin"])
    r = g.reduce(op, x.name, [1])
    if g.chance(0.5):
        return x.to(g.op("Mul", [x.name, g.op("Sigmoid", [r])]))
    return x.to(g.op("Concat", [x.name, r], axis=1), x.c + 1)


def st_heads(g: G, x: X) -> X:
    """Attention over HW with heads: [N, C, HW] -> [N, heads, d, HW], scores, softmax."""
    heads, d = g.pick([1, 2, 3]), g.pick([2, 3])
    c = heads * d
    if x.h * x.w > 25:
        x = st_pool(g, x) if min(x.h, x.w) >= 6 else x
    hw = x.h * x.w

    def proj(force):
        y = g.conv(x, c, 1, bias=True, force_const=force)
        t = g.target(y.name, g.pick([["N", heads, d, -1], ["N", heads, d, hw], ["N", heads, -1, hw]]))
        return g.op("Reshape", [y.name, t])

    q, k, v = proj(True), proj(g.chance(0.5)), proj(g.chance(0.5))
    qt = g.op("Transpose", [q], perm=[0, 1, 3, 2])  # [N, h, HW, d]
    s = g.op("Mul", [g.op("MatMul", [qt, k]), g.fconst(d**-0.5)])  # [N, h, HW, HW]
    a = g.op("Softmax", [s], axis=-1)
    o = g.op("MatMul", [v, g.op("Transpose", [a], perm=[0, 1, 3, 2])])  # [N, h, d, HW]
    o = g.to4d(g.op("Reshape", [o, g.const([0, c, -1])]) if g.chance(0.5) else o, x.to(x.name, c), shape_of_like=False)
    o = g.conv(o, x.c, 1, bias=g.chance(0.5))
    return x.to(g.op("Add", [x.name, o.name]))


def st_se(g: G, x: X) -> X:
    """Squeeze-excitation: GAP -> Gemm -> Relu -> Gemm -> gate, back to 4-D, Mul."""
    x = g.conv_block(x, int(g.rng.integers(2, 7)), force_const=True)
    f = g.op("Flatten", [g.op("GlobalAveragePool", [x.name])])
    r = int(g.rng.integers(1, 5))
    h = g.op("Relu", [g.gemm(f, x.c, r)])
    s = g.op(g.pick(["Sigmoid", "HardSigmoid"]), [g.gemm(h, r, x.c)])
    if g.chance(0.5):
        s = g.unsqueeze(s, [2, 3])
    else:
        s = g.op("Reshape", [s, g.target(s, g.pick([["N", x.c, 1, 1], ["N", -1, 1, 1]]))])
    ins = [x.name, s] if g.chance(0.5) else [s, x.name]
    return x.to(g.op("Mul", ins))


STAGES = {
    "conv": (st_conv, 3),
    "strided": (st_strided, 1),
    "gconv": (st_gconv, 2),
    "pool": (st_pool, 1),
    "residual": (st_residual, 2),
    "concat": (st_concat, 2),
    "split": (st_split, 2),
    "shape_div": (st_shape_div, 3),
    "reshape": (st_reshape, 2),
    "gram": (st_gram, 3),
    "matmul4d": (st_matmul4d, 3),
    "gather": (st_gather, 2),
    "bn_gather_in": (st_bn_gather_in, 2),
    "tile_concat": (st_tile_concat, 3),
    "chan_norm": (st_chan_norm, 3),
    "heads": (st_heads, 2),
    "se": (st_se, 2),
}


# ====================================================================== extra stages
# Forms found with random graphs after the first sweeps (issue 19). Each draws from the second
# stream (G.extra) and returns a map of the shape it was given, so that the stages after it
# draw what they always did.
def xs_scalar(g: G, x: X) -> X:
    """A learned scalar (a 0-d initializer: a layer scale, a shift, a PRelu slope), sometimes
    masked to 0, after a map with constant channels."""
    x = g.conv_block(x, x.c, force_const=True)
    kind = g.pick(["mul", "add", "prelu", "div"])
    g.stages[-1] += f":{kind}"
    v = np.float32(g.rng.uniform(0.5, 1.5) * g.pick([-1, 1]))
    if kind in ("add", "prelu") and g.chance(0.4) or kind == "mul" and g.chance(0.1):
        v = np.float32(0.0)  # masked
    s = g.weight(np.array(v, np.float32), "scalar")
    if kind == "prelu":
        return x.to(g.op("PRelu", [x.name, s]))
    op = {"mul": "Mul", "add": "Add", "div": "Div"}[kind]
    return x.to(g.op(op, [x.name, s] if g.chance(0.7) or kind == "div" else [s, x.name]))


def _slice_bound(g: G, n: int) -> tuple[int, int, int, int]:
    """(start, end, step, size) of a random Slice of an axis of n, with a negative start: the
    bounds as exporters write them (from the end, INT64_MAX, out of range, reversed)."""
    step = g.pick([1, 1, 1, -1])
    start = -int(g.rng.integers(1, n + 1)) if g.chance(0.85) else -int(g.rng.integers(n + 1, n + 4))
    if step > 0:
        end = g.pick([2**62, n, -int(g.rng.integers(0, n)) or 2**62, n + 3])
    else:
        end = g.pick([-(2**62), -n - 1, -n - 5, -int(g.rng.integers(n, n + 2))])
    # the size as ONNX defines it: negative bounds counted from the end, then clamped to [0, n]
    # (step > 0), the start to [0, n - 1] and the end to [-1, n - 1] (step < 0; not numpy's)
    s0, e0 = start + n if start < 0 else start, end + n if end < 0 else end
    if step > 0:
        s0, e0 = min(max(s0, 0), n), min(max(e0, 0), n)
    else:
        s0, e0 = min(max(s0, 0), n - 1), min(max(e0, -1), n - 1)
    return start, end, step, len(range(s0, e0, step))


def xs_einsum_slice(g: G, x: X) -> X:
    """Einsum with a masked weight (zero channels, or zero rows along H or W) -> Slice with
    negative starts (negative steps too) -> a reduction over some axes, its constant channels
    among what it reduces, mixed back into the map (a gate, or concatenated)."""
    x = g.conv_block(x, x.c, force_const=True)
    on = g.pick(["c", "c", "h", "w"])
    n_in = {"c": x.c, "h": x.h, "w": x.w}[on]
    d = int(g.rng.integers(2, 7)) if on == "c" else n_in
    w = g.randn(d, n_in, scale=n_in**-0.5)
    g.mask_out(w, 0, None)
    g.mask_in(w, 1)
    eq, left = {
        "c": g.pick([("bchw,dc->bdhw", False), ("bchw,cd->bdhw", False), ("dc,bchw->bdhw", True)]),
        "h": g.pick([("bchw,gh->bcgw", False), ("gh,bchw->bcgw", True)]),
        "w": g.pick([("bchw,vw->bchv", False), ("bchw,wv->bchv", False)]),
    }[on]
    wn = g.weight(w.T.copy() if eq in ("bchw,cd->bdhw", "bchw,wv->bchv") else w, "ein_w")
    e = g.op("Einsum", [wn, x.name] if left else [x.name, wn], equation=eq)
    g.stages[-1] += f":{on}"
    sizes = {1: d if on == "c" else x.c, 2: x.h, 3: x.w}
    axes, starts, ends, steps = [], [], [], []
    for a in sorted(g.rng.choice([1, 2, 3], size=int(g.rng.integers(1, 3)), replace=False).tolist()):
        if a != 1 and g.chance(0.5):
            continue
        st, en, sp, size = _slice_bound(g, sizes[a])
        if size == 0:
            continue
        axes.append(a - 4 if g.chance(0.3) else a)
        starts.append(st)
        ends.append(en)
        steps.append(sp)
        sizes[a] = size
    if not axes:
        axes, starts, ends, steps = [1], [-1], [2**62], [1]
        sizes[1] = 1
    ins = [e, g.const(starts), g.const(ends), g.const(axes)]
    sl = g.op("Slice", ins + ([g.const(steps)] if any(v != 1 for v in steps) or g.chance(0.3) else []))
    red = sorted(g.rng.choice([1, 2, 3], size=int(g.rng.integers(1, 4)), replace=False).tolist())
    red = sorted(set(red) | {a for a in (2, 3) if sizes[a] != (x.h, x.w)[a - 2]})
    op = g.pick(["ReduceMean", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"])
    r = g.reduce(op, sl, [a - 4 if g.chance(0.3) else a for a in red])  # keepdims
    gate = g.op("Sigmoid", [r])
    if 1 in red or sizes[1] == x.c:
        return x.to(g.op("Mul", [x.name, gate]))
    # [N, k, 1 or H, 1 or W]: expanded and concatenated with x, then a conv back to x's width
    one_channel = g.op("Slice", [x.name, g.const([0]), g.const([1]), g.const([1])])
    ones = g.op("Expand", [g.fconst(1.0), g.op("Shape", [one_channel])])  # [N, 1, H, W]
    y = g.op("Concat", [x.name, g.op("Mul", [gate, ones])], axis=1)
    return g.conv_block(X(y, x.c + sizes[1], x.h, x.w), x.c)


def xs_matmul_left(g: G, x: X) -> X:
    """A constant weight multiplying from the left, `MatMul(W, x)`: over the channels of
    [N, C, HW] (a 1x1 conv written as a product), over H of the map, with a batch axis in W;
    or Gemm with the weight as A on the transposed features (a gate)."""
    x = g.conv_block(x, x.c, force_const=True)
    kind = g.pick(["c", "c_batch", "h", "gemm"])
    g.stages[-1] += f":{kind}"
    if kind == "h":  # [H, H] @ [N, C, H, W]: mixes rows, each channel stays one channel
        w = g.randn(x.h, x.h, scale=x.h**-0.5)
        g.mask_in(w, 1)
        return x.to(g.op("MatMul", [g.weight(w, "mml_w"), x.name]))
    if kind == "gemm":  # gate = sigmoid(W @ f^T + b)^T, f = GAP(x) [N, C]
        f = g.op("Flatten", [g.op("GlobalAveragePool", [x.name])])
        w = g.randn(x.c, x.c, scale=x.c**-0.5)
        b = g.randn(x.c, 1, scale=0.5)
        g.mask_out(w, 0, b[:, 0])
        g.mask_in(w, 1)
        trans = g.chance(0.5)
        a = g.weight(w.T.copy() if trans else w, "gemml_w")
        y = g.op("Gemm", [a, g.op("Transpose", [f], perm=[1, 0]), g.weight(b, "gemml_b")], transA=int(trans))
        s = g.op("Sigmoid", [g.op("Transpose", [y], perm=[1, 0])])
        return x.to(g.op("Mul", [x.name, g.unsqueeze(s, [2, 3])]))
    k = int(g.rng.integers(2, 7))
    w = g.randn(k, x.c, scale=x.c**-0.5)
    b = g.randn(k, 1, scale=0.5)
    g.mask_out(w, 0, b[:, 0])
    g.mask_in(w, 1)
    t = g.to3d(x)  # [N, C, HW]
    wn = g.weight(w[None] if kind == "c_batch" else w, "mml_w")
    y = g.op("MatMul", [wn, t])  # [N, k, HW]
    if g.chance(0.6):
        y = g.op("Add", [y, g.weight(b, "mml_b")])
    y = g.to4d(y, x, c=k)
    return g.conv_block(g.act(y), x.c)


EXTRA = {
    "scalar": (xs_scalar, 2),
    "einsum_slice": (xs_einsum_slice, 2),
    "matmul_left": (xs_matmul_left, 2),
}
EXTRA_P = 0.25  # chance of an extra stage after each stage


# ====================================================================== head
def head(g: G, x: X) -> None:
    k = int(g.rng.integers(3, 7))
    kind = g.pick(["gap", "flatten", "reduce", "reshape"])
    if kind in ("flatten", "reshape") and x.c * x.h * x.w > 300:
        kind = "gap"
    n_in = x.c
    if kind == "gap":
        f = g.op(g.pick(["GlobalAveragePool", "GlobalMaxPool"]), [x.name])
        f = g.op("Flatten", [f]) if g.chance(0.5) else g.op("Squeeze", [f, g.const([2, 3])])
    elif kind == "reduce":
        f = g.reduce(g.pick(["ReduceMean", "ReduceMax", "ReduceSum"]), x.name, [2, 3], keepdims=0)
    elif kind == "flatten":
        f, n_in = g.op("Flatten", [x.name]), x.c * x.h * x.w
    else:
        f, n_in = g.op("Reshape", [x.name, g.target(x.name, ["N", -1])]), x.c * x.h * x.w
    # biases of size 1: outputs of magnitude 1, not small ones left by cancellation, whose
    # float32 rounding would be large relative to them
    y = g.gemm(f, n_in, k, bias_scale=1.0)
    if g.chance(0.3):  # the Gemm's output is then an intermediate (with value_info)
        y = g.op(g.pick(["Softmax", "Identity"]), [y])  # not Relu: outputs all near 0
    decl = g.pick([["N", k], ["N", f"k{g.count}"], ["batch", "classes"]])
    g.outputs.insert(0, (y, TensorProto.FLOAT, decl))
    if g.chance(0.15):  # the map itself, with symbolic dims
        g.outputs.append((x.name, TensorProto.FLOAT, ["N", "C", "H", "W"] if g.chance(0.5) else ["N", x.c, x.h, x.w]))
    if g.chance(0.1):
        g.outputs.append((g.op("ArgMax", [x.name], axis=1, keepdims=0), TensorProto.INT64, ["N", x.h, x.w]))


def build(seed: int, extended: bool = True) -> tuple[onnx.ModelProto, dict]:
    """The seed's model and its `info`; `extended` False: without the forms added for issue 19
    (EXTRA stages, dynamic H/W, masks given apart), the graph the seed gave before them."""
    g = G(seed, extended)
    c0, h0, w0 = (int(v) for v in (g.rng.integers(2, 6), g.rng.integers(3, 7), g.rng.integers(3, 7)))
    x = g.conv_block(X("input", c0, h0, w0), int(g.rng.integers(2, 8)))
    names, weights = list(STAGES), np.array([w for _, w in STAGES.values()], float)
    extras, xweights = list(EXTRA), np.array([w for _, w in EXTRA.values()], float)
    for _ in range(int(g.rng.integers(1, 6))):
        kind = names[g.rng.choice(len(names), p=weights / weights.sum())]
        g.stages.append(kind)
        x = STAGES[kind][0](g, x)
        if x.c > 12 or x.c * x.h * x.w > 400:
            x = g.conv_block(x, int(g.rng.integers(2, 7)))
        if g.xrng.random() < EXTRA_P and extended:
            with g.extra():
                kind = extras[g.rng.choice(len(extras), p=xweights / xweights.sum())]
                g.stages.append("x:" + kind)
                y = EXTRA[kind][0](g, x)
            assert (y.c, y.h, y.w) == (x.c, x.h, x.w), f"extra stage {kind} changed the map's shape"
            x = y
    head(g, x)
    model = g.model(c0, h0, w0)
    floats = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims)]
    seen = {(a.shape, a.tobytes()) for a in floats}
    assert len(seen) == len(floats), f"seed {seed}: two equal initializers"
    info = {
        "seed": seed,
        "opset": g.opset,
        "dynamic": g.dynamic,
        "mask_p": g.p,
        "constant_nodes": g.const_nodes,
        "input_shape": g.input_shape(c0, h0, w0),
        "sizes": {"H": h0, "W": w0},  # what the symbolic H and W are in the draws
        "stages": g.stages,
        "outputs": [o[0] for o in g.outputs],
    }
    if g.xrng.random() < MASKS_P and extended:
        masks_apart(g, model, info)
    return model, info


MASKS_P = 0.3  # chance that the masks are given apart (a dict, as a masks file holds them)


def masks_apart(g: G, model: onnx.ModelProto, info: dict) -> None:
    """Give the masks as a pruner's file would: {initializer: 0/1 mask} for every float
    initializer holding zeros (the whole-filter zeros of a Conv weight sometimes as one flag per
    output channel) and some others all ones, scalars among them. Half the time the model is
    the one exported before masking: its masked entries are given other values (the masks
    must be applied: `input_masked` False, or None for the tool to find out)."""
    r = g.xrng
    masks: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if t.data_type != TensorProto.FLOAT:
            continue
        arr = numpy_helper.to_array(t)
        zero = arr == 0
        if not zero.any() and r.random() >= 0.2:
            continue
        mask = (~zero).astype(np.float32)  # of a scalar: a numpy scalar
        if arr.ndim == 0 and r.random() < 0.5:
            mask = np.asarray(mask)  # a 0-d array, as torch's .numpy() gives
        rows = mask.reshape(len(mask), -1) if arr.ndim == 4 else None
        if rows is not None and (rows.min(axis=1) == rows.max(axis=1)).all() and r.random() < 0.5:
            mask = rows[:, 0].copy()  # one flag per output channel
        masks[t.name] = mask
    if not masks:  # nothing to give (no zeros, no all-ones drawn): the model holds its masks
        return
    info["masks"] = masks
    info["input_masked"] = None
    if r.random() < 0.5:
        info["input_masked"] = False if r.random() < 0.5 else None
        for t in model.graph.initializer:
            if t.name in masks:
                arr = numpy_helper.to_array(t).copy()
                hidden = arr == 0
                arr[hidden] = r.standard_normal(int(hidden.sum())).astype(np.float32)
                t.CopyFrom(numpy_helper.from_array(arr, t.name))
        info["unmasked"] = True


def apply_masks(model: onnx.ModelProto, masks: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The model with each mask multiplied into its initializer (a mask of one flag per output
    channel along axis 0): the reference, computed here and not by onnxshrink."""
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    for t in ref.graph.initializer:
        if t.name in masks:
            arr = numpy_helper.to_array(t)
            m = masks[t.name]
            m = m if m.shape == arr.shape else m.reshape((-1,) + (1,) * (arr.ndim - 1))
            t.CopyFrom(numpy_helper.from_array(np.where(m != 0, arr, np.zeros((), arr.dtype)), t.name))
    return ref


# ====================================================================== the independent check
def ort_session(model: onnx.ModelProto):
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # failures are reported by the caller, not logged
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 4
    # ONNX semantics, not the runtime's graph rewrites (one fuses a zero Pad into a MaxPool).
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def feeds(info: dict, seed: int) -> list[dict[str, np.ndarray]]:
    """Two draws; a dynamic dim is 2 in the first and 3 in the second."""
    rng = np.random.default_rng(seed + 1_000_003)
    out = []
    sizes = info.get("sizes", {})
    for n in BATCHES:
        shape = [sizes.get(d, n) if isinstance(d, str) else d for d in info["input_shape"]]
        out.append({"input": rng.standard_normal(shape).astype(np.float32)})
    return out


def float_params(model: onnx.ModelProto) -> int:
    """Float parameters: initializers and Constant node values (counted here, not by onnxshrink)."""
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
    ts = [*model.graph.initializer,
          *(a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value")]
    return sum(int(np.prod(t.dims, dtype=np.int64)) for t in ts if t.data_type in floats)


@dataclass
class OutputDiff:
    name: str
    ref_shape: tuple
    got_shape: tuple
    exact: bool  # an integer / bool output: must be equal
    max_abs_err: float  # max |got - ref| (inf on a shape or dtype mismatch)
    max_ref: float  # max |ref|
    rel_err: float  # max_abs_err / max_ref

    @property
    def ok(self) -> bool:
        if self.ref_shape != self.got_shape:
            return False
        return self.max_abs_err == 0 if self.exact else self.max_abs_err <= RTOL * self.max_ref


def compare_outputs(names, ref: list[np.ndarray], got: list[np.ndarray]) -> list[OutputDiff]:
    diffs = []
    for name, a, b in zip(names, ref, got, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        exact = not np.issubdtype(a.dtype, np.floating)
        if a.shape != b.shape or a.dtype != b.dtype:
            diffs.append(OutputDiff(name, a.shape, b.shape, exact, math.inf, math.nan, math.inf))
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        err = float(np.max(np.abs(a64 - b64), initial=0.0))
        if np.isnan(b64).any() and not np.isnan(a64).any():
            err = math.inf
        scale = float(np.max(np.abs(a64), initial=0.0))
        rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        diffs.append(OutputDiff(name, a.shape, b.shape, exact, err, scale, rel))
    return diffs


@dataclass
class Outcome:
    """One seed. `failure`: None, "wrong outputs", "does not load/run in onnxruntime",
    "exception in shrink", "parameters grew", "input model modified" or "generator"."""

    seed: int
    failure: str | None = None
    detail: str = ""
    info: dict = field(default_factory=dict)
    diffs: list[list[OutputDiff]] = field(default_factory=list, repr=False)  # per draw
    params_before: int = 0
    params_after: int = 0
    shrink_seconds: float = 0.0
    seconds: float = 0.0
    model: onnx.ModelProto | None = field(default=None, repr=False)  # as given to shrink
    reference: onnx.ModelProto | None = field(default=None, repr=False)  # with the masks applied
    shrunk: onnx.ModelProto | None = field(default=None, repr=False)
    rounding: list[tuple[int, str]] = field(default_factory=list)  # (draw, output) off by rounding only

    @property
    def max_rel_err(self) -> float:
        return max((d.rel_err for draw in self.diffs for d in draw), default=0.0)

    def summary(self) -> str:
        return f"seed {self.seed} ({self.failure}): {self.detail} [stages {self.info.get('stages')}, opset {self.info.get('opset')}, dynamic {self.info.get('dynamic')}]"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def _where(exc: BaseException) -> str:
    """The innermost onnxshrink frame of a traceback: file:line in function."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/onnxshrink/" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename.split('/onnxshrink/')[-1]}:{f.lineno} in {f.name}"


def check(seed: int, extended: bool = True) -> Outcome:
    """Build (see `build`), shrink (no validation), then compare in onnxruntime, independently
    of onnxshrink."""
    from onnxshrink import shrink

    t0 = time.perf_counter()
    out = Outcome(seed)
    try:
        model, info = build(seed, extended)
        out.model, out.info = model, info
        masks = info.get("masks")
        reference = apply_masks(model, masks) if masks is not None else model
        out.reference = reference
        draws = feeds(info, seed)
        ref_sess = ort_session(reference)
        names = [o.name for o in ref_sess.get_outputs()]
        ref = [ref_sess.run(None, f) for f in draws]
    except Exception as exc:  # the generator's own fault
        out.failure, out.detail = "generator", _first_line(exc) + "\n" + traceback.format_exc(limit=-3)
        out.seconds = time.perf_counter() - t0
        return out
    before = model.SerializeToString()
    shapes = {"input": list(draws[0]["input"].shape)}
    t1 = time.perf_counter()
    try:
        if masks is None:
            result = shrink(model, validate=False, input_shapes=shapes)
        else:
            result = shrink(model, masks, validate=False, input_shapes=shapes, input_masked=info["input_masked"])
    except Exception as exc:
        out.shrink_seconds = time.perf_counter() - t1
        out.failure, out.detail = "exception in shrink", f"{_first_line(exc)} [at onnxshrink/{_where(exc)}]"
        out.seconds = time.perf_counter() - t0
        return out
    out.shrink_seconds = time.perf_counter() - t1
    out.shrunk = result.model
    out.params_before, out.params_after = float_params(model), float_params(result.model)
    try:
        sess = ort_session(result.model)
        got_names = [o.name for o in sess.get_outputs()]
        if got_names != names:
            raise RuntimeError(f"outputs {got_names}, expected {names}")
        got = [sess.run(None, f) for f in draws]
    except Exception as exc:
        out.failure, out.detail = "does not load/run in onnxruntime", _first_line(exc)
        out.seconds = time.perf_counter() - t0
        return out
    out.diffs = [compare_outputs(names, r, s) for r, s in zip(ref, got, strict=True)]
    bad = [(k, d) for k, draw in enumerate(out.diffs) for d in draw if not d.ok]
    if bad:  # judged again against the reference's own rounding on the draws that failed
        rounding = {k: rounding_only(reference, result.model, draws[k]) for k in {k for k, _ in bad}}
        out.rounding = [(k, d.name) for k, d in bad if d.name in rounding[k]]
        bad = [(k, d) for k, d in bad if d.name not in rounding[k]]
    if bad:
        k, d = max(bad, key=lambda kd: kd[1].rel_err)
        out.failure = "wrong outputs"
        out.detail = (f"output {d.name} (draw {k}, dynamic dims = {BATCHES[k]}): shape {d.got_shape} vs {d.ref_shape}, "
                      f"max rel err {d.rel_err:.3g} (abs {d.max_abs_err:.3g}, max |ref| {d.max_ref:.3g})")
    elif out.params_after > out.params_before:
        out.failure = "parameters grew"
        out.detail = f"{out.params_before} -> {out.params_after} float parameters"
    elif model.SerializeToString() != before:
        out.failure, out.detail = "input model modified", "shrink changed the ModelProto it was given"
    out.seconds = time.perf_counter() - t0
    return out


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph computing in float64 (initializers, Constant values, Cast targets, types)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    del g.value_info[:]
    for vi in [*g.input, *g.output]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
    return m


# A shrunk output off by at most this many times the two models' own float32 rounding (each
# one's distance from the same graph in float64) is rounding, if in float64 the two agree as
# closely: the same function, its constants folded and summed in another order.
ROUNDING_FACTOR = 10.0


def float64_outputs(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    """`model`'s outputs computed in float64 by onnx's reference evaluator (None: it cannot)."""
    import warnings

    from onnx.reference import ReferenceEvaluator

    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            return ReferenceEvaluator(to_float64(model)).run(
                None, {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feed.items()}
            )
    except Exception:
        return None


def _max_abs(a, b) -> float:
    return float(np.nanmax(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


def rounding_only(
    reference: onnx.ModelProto, shrunk: onnx.ModelProto, feed: dict[str, np.ndarray]
) -> set[str]:
    """The float outputs on which the shrunk model differs from the reference by rounding only:
    |shrunk - ref| in float32, and the same in float64, within ROUNDING_FACTOR x the sum of the
    two models' own float32 rounding on that output. An output that is a small remainder of
    cancellation (|terms| >> |sum|) cannot be judged closer than that; a wrong function differs
    in float64 too. Empty when the reference evaluator cannot run either graph."""
    names = [o.name for o in reference.graph.output]
    r32, s32 = ort_session(reference).run(None, feed), ort_session(shrunk).run(None, feed)
    r64, s64 = float64_outputs(reference, feed), float64_outputs(shrunk, feed)
    if r64 is None or s64 is None:
        return set()
    out = set()
    for name, a32, b32, a64, b64 in zip(names, r32, s32, r64, s64, strict=True):
        if a32.dtype == np.int64 and a32.shape == b32.shape and _ties(reference, shrunk, feed, name):
            out.add(name)
        if not np.issubdtype(a32.dtype, np.floating) or a32.shape != b32.shape or a64.shape != a32.shape:
            continue
        floor = _max_abs(a32, a64) + _max_abs(b32, b64)
        if max(_max_abs(a32, b32), _max_abs(a64, b64)) <= ROUNDING_FACTOR * floor:
            out.add(name)
    return out


def _ties(reference: onnx.ModelProto, shrunk: onnx.ModelProto, feed: dict[str, np.ndarray], name: str) -> bool:
    """Is index output `name`, an ArgMax or ArgMin of both models, off only where the values
    it picks from tie up to rounding? At each index that differs, the reference's values (in
    float64) at the two models' picks are within ROUNDING_FACTOR x the two models' own float32
    rounding of those values (each one's float32 run against the same graph in float64)."""
    picked = []
    for model in (reference, shrunk):
        node = next((n for n in model.graph.node if name in n.output), None)
        if node is None or node.op_type not in ("ArgMax", "ArgMin"):
            return False
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        probe.graph.output.append(helper.make_tensor_value_info(node.input[0], TensorProto.FLOAT, None))
        k = [o.name for o in probe.graph.output].index(name)
        got32, got64 = ort_session(probe).run(None, feed), float64_outputs(probe, feed)
        if got64 is None:
            return False
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        picked.append((got32[k], got32[-1], got64[-1], attrs.get("axis", 0), attrs.get("keepdims", 1)))
    (ri, r32, r64, axis, keep), (si, s32, s64, _, _) = picked
    if r64.shape != s64.shape:
        return False
    floor = _max_abs(r32, r64) + _max_abs(s32, s64)
    ri_, si_ = (ri, si) if keep else (np.expand_dims(ri, axis), np.expand_dims(si, axis))
    at_ref, at_new = np.take_along_axis(r64, ri_, axis), np.take_along_axis(r64, si_, axis)
    return bool(np.all(np.abs(at_ref - at_new) <= ROUNDING_FACTOR * floor))


def reference_noise(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> float:
    """How far the float32 onnxruntime outputs of `model` are from the same graph computed in
    float64, relative to each output's max magnitude (the largest over the outputs): a wrong
    output of the order of this is rounding the reference itself amplifies. Diagnosis only."""
    exact = float64_outputs(model, feed)
    if exact is None:
        return float("nan")
    noise = 0.0
    for a, b in zip(ort_session(model).run(None, feed), exact, strict=True):
        if np.issubdtype(a.dtype, np.floating) and a.size:
            noise = max(noise, _max_abs(a, b) / (float(np.abs(a).max()) or 1.0))
    return noise


def save_failure(out: Outcome, directory: str | None = None) -> str:
    """Save the input model (and the shrunk one, if any) as seed_N.onnx; returns the path."""
    import tempfile

    directory = directory or os.path.join(tempfile.gettempdir(), "onnxshrink_random")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"seed_{out.seed}.onnx")
    if out.model is not None:
        onnx.save(out.model, path)
    if out.info.get("masks") is not None:  # given apart: shrink(model, masks, input_masked=...)
        np.savez(path.replace(".onnx", ".masks.npz"), **out.info["masks"])
    if out.shrunk is not None:
        onnx.save(out.shrunk, path.replace(".onnx", ".shrunk.onnx"))
    return path


if __name__ == "__main__":
    import sys

    m, i = build(int(sys.argv[1]))
    print(i)
    print(onnx.printer.to_text(m.graph))

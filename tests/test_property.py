"""Property-based tests: random small CNNs built with onnx.helper, random masks, shrink.

Graphs: input [N or 1, C, H, W] (C 2-8, H, W 4-10), a conv stem, then 1-4 random stages
(conv +BN +activation, grouped / depthwise conv, pooling, residual block, concat of branches,
split or slices processed and concatenated back, per-channel Mul/Add/Sub/Div/PRelu, SE block,
Resize / Pad / Dropout / Transpose / Squeeze / Reshape / ConvTranspose), then a head (global
pooling, a Flatten of the map or a Reduce*, into Gemm or MatMul + Add); opsets 11, 13, 17, 18,
20 (Split / Squeeze / Unsqueeze / Reduce axes as attributes or inputs). Every parameter is a
random float32 array.

1. Whole-group masks are removed exactly and maximally. While a graph is generated, every
   channel gets an id; ids that must be removed together are unioned (a conv's output channels
   with their BatchNorm, the residual stream with every block that writes into it, a depthwise
   conv with its input, the SE gate with the stream it scales). A random subset of the classes
   is zeroed in every producer (filter rows, biases, BN scale and shift, SE Gemm rows), keeping
   the structural constraints onnxshrink documents (a Split part and every group of a grouped
   conv keep at least one channel, grouped-conv groups stay balanced). The shrunk model must
   match (see below) and every Conv / ConvTranspose / Gemm / MatMul must keep exactly the surviving channels, on its output and on
   its input side, with nothing in `kept_zeroed`.

2. Arbitrary masks never break exactness. The same graphs with random rows, columns, biases,
   BN scales/shifts and per-channel constants zeroed, plus unstructured zeros (not
   group-aware; BatchNorm often untouched, so zeroed filters become non-zero constants). The
   shrunk model must match, and every all-zero slice left in a weight (output axis, and the
   input axis of group-1 convs and Gemm/MatMul) must be explained in `result.kept_zeroed`.

Matching is checked here, not by onnxshrink: `shrink(..., validate=False)`, then onnxruntime
sessions of our own (models/randgraph.py: one thread, no graph optimizations) run the input
with the masks applied and the shrunk model on 2 random inputs (a dynamic batch of 2, then 3);
every output must have the same shape and max |shrunk - ref| <= 1e-5 * max |ref|, and the
shrunk model must not have more float parameters.

ONNXSHRINK_PROPERTY_EXAMPLES sets the examples per property.

A failing example is printed by hypothesis as a `spec` dict plus the drawn mask choices; the
notes add the graph in ONNX text form and the zeroed slices, and the model (and masks .npz) is
saved under $TMPDIR/onnxshrink_property/ for a standalone reproduction (`onnx.load` + `shrink`).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import zlib
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from conftest import init as initializer_value
from hypothesis import HealthCheck, Phase, event, example, given, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from onnx import helper, numpy_helper

from models.randgraph import BATCHES, compare_outputs, float_params, ort_session, rounding_only
from onnxshrink import shrink

RTOL = 1e-5
OPSETS = (11, 13, 17, 18, 20)
ACTS = (
    "Relu",
    "LeakyRelu",
    "Clip",
    "Sigmoid",
    "HardSigmoid",
    "HardSwish",
    "Tanh",
    "Gelu",
    "Elu",
    "Softplus",
)


# ====================================================================== graph builder
@dataclass
class T:
    """A 4-D activation [1, C, h, w]. `ids[c]` is the channel id of channel c; `vals[c]` what
    channel c holds when its class is zeroed: an [h, w] constant map, or None if not known."""

    name: str
    ids: list[int]
    h: int
    w: int
    vals: list
    zero_padded: bool = False  # the output of a Pad with constant 0 (see Bug 5)

    @property
    def c(self) -> int:
        return len(self.ids)

    def to(self, name: str, vals=None, h: int | None = None, w: int | None = None) -> T:
        return T(name, self.ids, h or self.h, w or self.w, self.vals if vals is None else vals)


@dataclass
class Weighted:
    """A Conv / ConvTranspose / Gemm / MatMul node and the channel ids on both sides."""

    node: str
    op: str
    weight: str
    out_axis: int  # output-channel axis of the weight
    in_axis: int
    out_ids: list[int] | None  # None: a graph output (every channel kept)
    in_ids: list[int]
    spatial: int = 1  # input features per channel id (Flatten of a map)
    group: int = 1


def act_value(op: str, v):
    """An activation of a constant map (None: not known)."""
    if v is None:
        return None
    x = np.asarray(v, dtype=np.float64)
    with np.errstate(all="ignore"):
        return {
            "Relu": lambda: np.maximum(x, 0.0),
            "LeakyRelu": lambda: np.where(x >= 0, x, 0.1 * x),
            "Clip": lambda: np.clip(x, -0.8, 1.3),
            "Sigmoid": lambda: 1.0 / (1.0 + np.exp(-x)),
            "HardSigmoid": lambda: np.clip(0.25 * x + 0.4, 0.0, 1.0),
            "HardSwish": lambda: x * np.clip(x / 6 + 0.5, 0.0, 1.0),
            "Tanh": lambda: np.tanh(x),
            "Gelu": lambda: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
            "Elu": lambda: np.where(x > 0, x, 0.7 * np.expm1(x)),
            "Softplus": lambda: np.log1p(np.exp(x)),
        }[op]()


def pool_value(op: str, v, k: int, s: int, pad: int, include_pad: bool):
    """MaxPool / AveragePool of a constant map (None: not known)."""
    if v is None:
        return None
    fill = -np.inf if op == "MaxPool" else 0.0
    x = np.pad(v, pad, constant_values=fill)
    ones = np.pad(np.ones_like(v), pad)
    h, w = (x.shape[0] - k) // s + 1, (x.shape[1] - k) // s + 1
    out = np.empty((h, w))
    for i in range(h):
        for j in range(w):
            win = (slice(i * s, i * s + k), slice(j * s, j * s + k))
            if op == "MaxPool":
                out[i, j] = x[win].max()
            else:
                out[i, j] = x[win].sum() / (k * k if include_pad else ones[win].sum())
    return out


@dataclass
class Net:
    opset: int
    seed: int
    no_bn: bool = False  # build no BatchNormalization (an exclusion, see below)
    dynamic: bool = False  # a dynamic batch size "N" (checked with N = 2 and 3)
    nodes: list = field(default_factory=list)
    inits: dict = field(default_factory=dict)
    parent: list = field(default_factory=list)  # union-find over channel ids
    members: list = field(default_factory=list)  # id -> [(initializer, axis, index)]
    weighted: list = field(default_factory=list)
    constraints: list = field(default_factory=list)  # (blocks of ids, balanced)
    maskable: list = field(default_factory=list)  # (initializer, axis) for arbitrary masks
    interface: list = field(default_factory=list)  # ids of graph input channels
    counter: int = 0

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    # ---------------------------------------------------------------- bookkeeping
    def fresh(self, k: int) -> list[int]:
        start = len(self.parent)
        self.parent.extend(range(start, start + k))
        self.members.extend([] for _ in range(k))
        return list(range(start, start + k))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def member(self, ids: list[int], init: str, axis: int) -> None:
        for k, i in enumerate(ids):
            self.members[i].append((init, axis, k))

    def classes(self) -> list[int]:
        return sorted({self.find(i) for i in range(len(self.parent))})

    # ---------------------------------------------------------------- graph pieces
    def name(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def init(self, name: str, arr) -> str:
        self.inits[name] = np.asarray(arr)
        return name

    def randn(self, *shape, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def ints(self, name: str, values) -> str:
        return self.init(name, np.asarray(values, dtype=np.int64))

    def node(self, op: str, inputs: list[str], n_out: int = 1, name: str | None = None, **attrs):
        name = name or self.name(op.lower())
        outs = [f"{name}_out{k}" if n_out > 1 else f"{name}_out" for k in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        return outs if n_out > 1 else outs[0]

    def act(self, x: T, op: str | None) -> T:
        if op is None:
            return x
        if (op == "HardSwish" and self.opset < 14) or (op == "Gelu" and self.opset < 20):
            op = "Relu"
        n = self.name(op.lower())
        ins = [x.name]
        attrs = {}
        if op == "LeakyRelu":
            attrs["alpha"] = 0.1
        elif op == "Elu":
            attrs["alpha"] = 0.7
        elif op == "HardSigmoid":
            attrs.update(alpha=0.25, beta=0.4)
        elif op == "Clip":
            ins += [
                self.init(f"{n}.min", np.float32(-0.8)),
                self.init(f"{n}.max", np.float32(1.3)),
            ]
        y = self.node(op, ins, name=n, **attrs)
        return x.to(y, [act_value(op, v) for v in x.vals])

    def conv(
        self,
        x: T,
        cout: int,
        k: int = 3,
        stride: int = 1,
        pad: int | None = None,
        group: int = 1,
        bias: bool = True,
        out_ids: list[int] | None = None,
    ) -> T:
        n = self.name("conv")
        if pad is None:
            pad = k // 2
        if (min(x.h, x.w) + 2 * pad - k) // stride + 1 < 2:
            pad = k // 2  # keep maps at 2 x 2 at least (Pad reflect needs 2)
        cin = x.c
        fan_in = cin // group * k * k
        w = self.init(f"{n}.weight", self.randn(cout, cin // group, k, k, scale=fan_in**-0.5))
        ins = [x.name, w]
        ids = out_ids if out_ids is not None else self.fresh(cout)
        self.member(ids, w, 0)
        self.maskable += [(w, 0), (w, 1)]
        if bias:
            b = self.init(f"{n}.bias", self.randn(cout, scale=0.5))
            ins.append(b)
            self.member(ids, b, 0)
            self.maskable.append((b, 0))
        attrs = {"kernel_shape": [k, k], "pads": [pad] * 4, "strides": [stride, stride]}
        if group > 1:
            attrs["group"] = group
        y = self.node("Conv", ins, name=n, **attrs)
        h = (x.h + 2 * pad - k) // stride + 1
        ww = (x.w + 2 * pad - k) // stride + 1
        self.weighted.append(Weighted(n, "Conv", w, 0, 1, ids, list(x.ids), group=group))
        self.constraints.append(([ids], False))
        return T(y, ids, h, ww, [np.zeros((h, ww))] * cout)  # zeroed filter and bias: 0

    def bn(self, x: T) -> T:
        if self.no_bn:
            return x
        n = self.name("bn")
        c = x.c
        s = self.init(f"{n}.weight", self.randn(c, scale=0.5) + np.float32(1.0))
        b = self.init(f"{n}.bias", self.randn(c, scale=0.5))
        m = self.init(f"{n}.running_mean", self.randn(c, scale=0.5))
        v = self.init(f"{n}.running_var", self.rng.uniform(0.5, 2.0, c).astype(np.float32))
        self.member(x.ids, s, 0)
        self.member(x.ids, b, 0)
        self.maskable += [(s, 0), (b, 0)]
        y = self.node("BatchNormalization", [x.name, s, b, m, v], name=n, epsilon=1e-5)
        return x.to(y, [np.zeros((x.h, x.w))] * c)  # zeroed scale and shift: 0

    def gemm(self, x: str, in_ids: list[int], nout: int, trans_b: bool, out_ids, spatial=1) -> str:
        n = self.name("gemm")
        k = len(in_ids) * spatial
        wv = self.randn(nout, k, scale=k**-0.5)
        w = self.init(f"{n}.weight", wv if trans_b else wv.T.copy())
        b = self.init(f"{n}.bias", self.randn(nout, scale=0.5))
        out_axis = 0 if trans_b else 1
        if out_ids is not None:
            self.member(out_ids, w, out_axis)
            self.member(out_ids, b, 0)
        self.maskable += [(w, 0), (w, 1), (b, 0)]
        self.weighted.append(
            Weighted(n, "Gemm", w, out_axis, 1 - out_axis, out_ids, list(in_ids), spatial)
        )
        return self.node("Gemm", [x, w, b], name=n, transB=int(trans_b))

    def matmul(self, x: str, in_ids: list[int], nout: int) -> str:
        n = self.name("matmul")
        k = len(in_ids)
        w = self.init(f"{n}.weight", self.randn(k, nout, scale=k**-0.5))
        b = self.init(f"{n}.bias", self.randn(nout, scale=0.5))
        self.maskable += [(w, 0), (w, 1), (b, 0)]
        self.weighted.append(Weighted(n, "MatMul", w, 1, 0, None, list(in_ids)))
        y = self.node("MatMul", [x, w], name=n)
        return self.node("Add", [y, b])

    # ---------------------------------------------------------------- model
    @property
    def n(self) -> int:
        """The batch size in a literal Reshape target: 0 copies a dynamic one."""
        return 0 if self.dynamic else 1

    def model(self, x0: str, c0: int, h0: int, w0: int, out: str, nout: int) -> onnx.ModelProto:
        batch = "N" if self.dynamic else 1
        graph = helper.make_graph(
            self.nodes,
            "random_cnn",
            [helper.make_tensor_value_info(x0, onnx.TensorProto.FLOAT, [batch, c0, h0, w0])],
            [helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, [batch, nout])],
            [numpy_helper.from_array(v, k) for k, v in self.inits.items()],
        )
        opsets = [helper.make_opsetid("", self.opset)]
        m = helper.make_model(graph, opset_imports=opsets, producer_name="test_property")
        m.ir_version = helper.find_min_ir_version_for(opsets)
        onnx.checker.check_model(m, full_check=True)
        return m


# ====================================================================== stages
def _down(x: T, s: int) -> int:
    return 2 if s == 2 and min(x.h, x.w) >= 6 else 1


def stage_conv(net: Net, x: T, p: dict) -> T:
    pad = p["k"] // 2 if p["pad"] else 0
    y = net.conv(x, p["width"], p["k"], _down(x, p["stride"]), pad, bias=p["bias"])
    if p["bn"]:
        y = net.bn(y)
    return net.act(y, p["act"])


def stage_gconv(net: Net, x: T, p: dict) -> T:
    c = x.c
    divisors = [g for g in range(2, c) if c % g == 0]
    if divisors and not p["depthwise"]:
        g = divisors[p["g"] % len(divisors)]
        m = p["mult"]
        y = net.conv(x, g * m, p["k"], 1, bias=p["bias"], group=g)
        ci = c // g
        net.constraints.append(([x.ids[k * ci : (k + 1) * ci] for k in range(g)], True))
        net.constraints.append(([y.ids[k * m : (k + 1) * m] for k in range(g)], True))
    else:
        m = 1 if p["depthwise"] else p["mult"]
        # A depthwise output channel belongs to the class of the channel it filters.
        ids = list(x.ids) if m == 1 else net.fresh(c * m)
        if m > 1:
            for k, i in enumerate(ids):
                net.union(i, x.ids[k // m])
        y = net.conv(x, c * m, p["k"], 1, bias=p["bias"], group=c, out_ids=ids)
        net.constraints.pop()  # the classes are the input's
    if p["bn"]:
        y = net.bn(y)
    return net.act(y, p["act"])


def stage_pool(net: Net, x: T, p: dict) -> T:
    k = p["k"]
    s = _down(x, p["stride"])
    pad = 1 if p["pad"] else 0
    if (min(x.h, x.w) + 2 * pad - k) // s + 1 < 2:
        pad = 1  # keep maps at 2 x 2 at least
    attrs = {"kernel_shape": [k, k], "strides": [s, s], "pads": [pad] * 4}
    include = p["op"] == "AveragePool" and pad and p["include_pad"]
    if p["op"] == "AveragePool" and pad:
        attrs["count_include_pad"] = int(p["include_pad"])
    vals = [pool_value(p["op"], v, k, s, pad, include) for v in x.vals]
    y = net.node(p["op"], [x.name], **attrs)
    return x.to(y, vals, (x.h + 2 * pad - k) // s + 1, (x.w + 2 * pad - k) // s + 1)


def stage_residual(net: Net, x: T, p: dict) -> T:
    h = net.conv(x, p["mid"], 3, bias=not p["bn"])
    if p["bn"]:
        h = net.bn(h)
    h = net.act(h, p["act"] or "Relu")
    h = net.conv(h, x.c, p["k"], bias=not p["bn"], out_ids=x.ids)  # writes into the stream
    net.constraints.pop()
    if p["bn"]:
        h = net.bn(h)
    ins = [x.name, h.name] if p["skip_first"] else [h.name, x.name]
    y = x.to(net.node("Add", ins))  # the branch adds 0 to a zeroed stream channel
    return net.act(y, p["post_act"])


def stage_concat(net: Net, x: T, p: dict) -> T:
    outs = []
    for b in p["branches"]:
        if b is None:
            outs.append(x)
            continue
        if b == "pool":
            op = "MaxPool"
            y = net.node(op, [x.name], kernel_shape=[3, 3], pads=[1] * 4, strides=[1, 1])
            outs.append(x.to(y, [pool_value(op, v, 3, 1, 1, False) for v in x.vals]))
            continue
        y = net.conv(x, b["width"], b["k"], bias=not b["bn"])
        if b["bn"]:
            y = net.bn(y)
        outs.append(net.act(y, b["act"]))
    y = net.node("Concat", [o.name for o in outs], axis=-3 if p["neg_axis"] else 1)
    return T(y, [i for o in outs for i in o.ids], x.h, x.w, [v for o in outs for v in o.vals])


def stage_split(net: Net, x: T, p: dict) -> T:
    c = x.c
    n = min(p["parts"], c)
    if n < 2:
        return x
    cuts = sorted(net.rng.choice(np.arange(1, c), n - 1, replace=False).tolist())
    sizes = np.diff([0, *cuts, c]).tolist()
    nm = net.name(p["via"])
    if p["via"] == "slice":
        parts = []
        for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, c], strict=True)):
            end = b if k < n - 1 else 2**62
            ins = [x.name, net.ints(f"{nm}.starts{k}", [a]), net.ints(f"{nm}.ends{k}", [end])]
            parts.append(net.node("Slice", [*ins, net.ints(f"{nm}.axes{k}", [1])]))
    else:
        if net.opset >= 18 and p["num_outputs"]:
            step = -(-c // n)
            even = [min(step, c - step * k) for k in range(n)]
            if min(even) >= 1:
                sizes = even
        if net.opset < 13:
            parts = net.node("Split", [x.name], n_out=n, name=nm, axis=1, split=sizes)
        elif net.opset >= 18 and p["num_outputs"] and sizes == even:
            parts = net.node("Split", [x.name], n_out=n, name=nm, axis=1, num_outputs=n)
        else:
            split = net.ints(f"{nm}.split", sizes)
            parts = net.node("Split", [x.name, split], n_out=n, name=nm, axis=1)
    starts = np.cumsum([0, *sizes]).tolist()
    blocks, outs = [], []
    for k, (part_name, sz) in enumerate(zip(parts, sizes, strict=True)):
        sl = slice(starts[k], starts[k] + sz)
        part = T(part_name, x.ids[sl], x.h, x.w, x.vals[sl])
        blocks.append(part.ids)
        width = p["widths"][k % len(p["widths"])]
        outs.append(part if width is None else net.act(net.conv(part, width, p["k"]), p["act"]))
    net.constraints.append((blocks, False))  # every Split part keeps a channel
    y = net.node("Concat", [o.name for o in outs], axis=1)
    return T(y, [i for o in outs for i in o.ids], x.h, x.w, [v for o in outs for v in o.vals])


def stage_chanop(net: Net, x: T, p: dict) -> T:
    op = p["op"]
    c = x.c
    if op == "Div":
        v = net.rng.uniform(0.5, 2.0, c) * net.rng.choice([-1.0, 1.0], c)
    elif op == "PRelu":
        v = net.rng.uniform(-0.5, 0.5, c)
    else:
        v = net.randn(c)
    v = v.astype(np.float32)
    shape = [1, c, 1, 1] if p["rank4"] else [c, 1, 1]
    const = net.init(net.name("const"), v.reshape(shape))
    if op != "Div":
        net.maskable.append((const, len(shape) - 3))
    x_first = p["x_first"] or op in ("Div", "PRelu")
    ins = [x.name, const] if x_first else [const, x.name]
    fn = {
        "Mul": lambda a, b: a * b,
        "Add": lambda a, b: a + b,
        "Sub": (lambda a, b: a - b) if x_first else (lambda a, b: b - a),
        "Div": lambda a, b: a / b,
        "PRelu": lambda a, b: np.where(a >= 0, a, a * b),
    }[op]
    vals = [None if a is None else fn(a, float(b)) for a, b in zip(x.vals, v, strict=True)]
    y = x.to(net.node(op, ins), vals)
    return net.act(y, p["act"])


def stage_se(net: Net, x: T, p: dict) -> T:
    c, r = x.c, p["r"]
    g = net.node("GlobalAveragePool", [x.name])
    f = net.node("Flatten", [g])
    mid = net.fresh(r)
    h = net.gemm(f, x.ids, r, p["trans_b"], mid)
    net.constraints.append(([mid], False))
    h = net.node("Relu", [h])
    s = net.gemm(h, mid, c, p["trans_b"], x.ids)  # the gate rows belong to the stream's classes
    s = net.node(p["gate"], [s])
    if p["to4d"] == "unsqueeze":
        if net.opset < 13:
            s = net.node("Unsqueeze", [s], axes=[2, 3])
        else:
            s = net.node("Unsqueeze", [s, net.ints(net.name("axes"), [2, 3])])
    else:
        shape = [net.n, c, 1, 1] if p["to4d"] == "reshape" else [net.n, -1, 1, 1]
        s = net.node("Reshape", [s, net.ints(net.name("shape"), shape)])
    ins = [x.name, s] if p["x_first"] else [s, x.name]
    gate0 = act_value(p["gate"], 0.0)  # a zeroed gate row and bias: gate(0)
    return x.to(net.node("Mul", ins), [None if v is None else v * gate0 for v in x.vals])


def stage_misc(net: Net, x: T, p: dict) -> T:
    kind = p["what"]
    c, h, w = x.c, x.h, x.w
    if kind == "resize":
        if max(h, w) > 6:
            return x
        nm = net.name("resize")
        empty = net.init(f"{nm}.empty", np.zeros(0, np.float32))
        if p["flag"] and not net.dynamic:  # sizes name the batch size
            sizes = net.ints(f"{nm}.sizes", [1, c, 2 * h, 2 * w])
            ins = [x.name, empty, empty, sizes] if net.opset < 13 else [x.name, "", "", sizes]
        else:
            scales = net.init(f"{nm}.scales", np.asarray([1, 1, 2, 2], np.float32))
            ins = [x.name, empty, scales] if net.opset < 13 else [x.name, "", scales]
        mode = "linear" if p["alt"] else "nearest"
        vals = [
            None
            if v is None or (mode == "linear" and not np.all(v == v.flat[0]))
            else v.repeat(2, axis=0).repeat(2, axis=1)
            for v in x.vals
        ]
        return x.to(net.node("Resize", ins, name=nm, mode=mode), vals, 2 * h, 2 * w)
    if kind == "pad":
        nm = net.name("pad")
        pads = net.ints(f"{nm}.pads", [0, 0, 1, 1, 0, 0, 1, 1])
        mode = ("constant", "reflect", "edge")[p["mode"]]
        ins = [x.name, pads]
        np_mode = {"reflect": "reflect", "edge": "edge"}.get(mode, "constant")
        fill = 0.3 if mode == "constant" and p["flag"] else 0.0
        if fill:
            ins.append(net.init(f"{nm}.value", np.float32(fill)))
        kw = {"constant_values": fill} if np_mode == "constant" else {}
        vals = [None if v is None else np.pad(v, 1, mode=np_mode, **kw) for v in x.vals]
        y = x.to(net.node("Pad", ins, name=nm, mode=mode), vals, h + 2, w + 2)
        y.zero_padded = mode == "constant" and not fill
        return y
    if kind == "identity":
        return x.to(net.node("Dropout" if p["flag"] else "Identity", [x.name]))
    if kind == "transpose":
        t = net.node("Transpose", [x.name], perm=[0, 2, 3, 1])
        scale = net.randn(c)
        const = net.init(net.name("nhwc_scale"), scale)
        net.maskable.append((const, 0))
        t = net.node("Mul", [t, const])
        t = net.node("Transpose", [t], perm=[0, 3, 1, 2])
        vals = [None if v is None else v * float(s) for v, s in zip(x.vals, scale, strict=True)]
        return x.to(t, vals)
    if kind == "unsqueeze":
        if net.opset < 13:
            u = net.node("Unsqueeze", [x.name], axes=[0])
            u = net.node("Relu", [u])
            u = net.node("Squeeze", [u], axes=[0])
        else:
            u = net.node("Unsqueeze", [x.name, net.ints(net.name("axes"), [0])])
            u = net.node("Relu", [u])
            u = net.node("Squeeze", [u, net.ints(net.name("axes"), [0])])
        return x.to(u, [act_value("Relu", v) for v in x.vals])
    if kind == "reshape":
        to3 = [net.n, c, h * w] if p["flag"] else [0, 0, -1]
        r = net.node("Reshape", [x.name, net.ints(net.name("shape"), to3)])
        r = net.node("Softplus", [r])
        back = [net.n, c, h, w] if p["alt"] else [net.n, -1, h, w]
        r = net.node("Reshape", [r, net.ints(net.name("shape"), back)])
        return x.to(r, [act_value("Softplus", v) for v in x.vals])
    if kind == "upconv":
        if max(h, w) > 5:
            return x
        n = net.name("convt")
        cout = p["width"]
        wt = net.init(f"{n}.weight", net.randn(c, cout, 2, 2, scale=(c * 4) ** -0.5))
        ids = net.fresh(cout)
        net.member(ids, wt, 1)
        net.maskable += [(wt, 0), (wt, 1)]
        ins = [x.name, wt]
        if p["flag"]:
            b = net.init(f"{n}.bias", net.randn(cout, scale=0.5))
            net.member(ids, b, 0)
            net.maskable.append((b, 0))
            ins.append(b)
        y = net.node("ConvTranspose", ins, name=n, kernel_shape=[2, 2], strides=[2, 2])
        net.weighted.append(Weighted(n, "ConvTranspose", wt, 1, 0, ids, list(x.ids)))
        net.constraints.append(([ids], False))
        return T(y, ids, 2 * h, 2 * w, [np.zeros((2 * h, 2 * w))] * cout)
    raise AssertionError(kind)


STAGES = {
    "conv": stage_conv,
    "gconv": stage_gconv,
    "pool": stage_pool,
    "residual": stage_residual,
    "concat": stage_concat,
    "split": stage_split,
    "chanop": stage_chanop,
    "se": stage_se,
    "misc": stage_misc,
}


def head(net: Net, x: T, p: dict) -> tuple[str, int]:
    n_out = p["n_out"]
    kind = p["kind"]
    if kind == "flatten" and x.c * x.h * x.w > 400:
        kind = "gap"
    if kind == "flatten":
        f = net.node("Flatten", [x.name], axis=1)
        return net.gemm(f, x.ids, n_out, p["trans_b"], None, spatial=x.h * x.w), n_out
    if kind == "gap":
        g = net.node(p["pool"], [x.name])
        if p["to2d"] == "flatten":
            f = net.node("Flatten", [g])
        elif p["to2d"] == "reshape":
            f = net.node("Reshape", [g, net.ints(net.name("shape"), [net.n, -1])])
        elif net.opset < 13:
            f = net.node("Squeeze", [g], axes=[2, 3])
        else:
            f = net.node("Squeeze", [g, net.ints(net.name("axes"), [2, 3])])
    else:
        op = p["reduce"]
        if (op == "ReduceSum" and net.opset >= 13) or net.opset >= 18:
            f = net.node(op, [x.name, net.ints(net.name("axes"), [2, 3])], keepdims=0)
        else:
            f = net.node(op, [x.name], axes=[2, 3], keepdims=0)
    if p["matmul"]:
        return net.matmul(f, x.ids, n_out), n_out
    return net.gemm(f, x.ids, n_out, p["trans_b"], None), n_out


def build(spec: dict, no_bn: bool = False) -> tuple[onnx.ModelProto, Net]:
    net = Net(spec["opset"], spec["seed"], no_bn=no_bn, dynamic=spec.get("batch") == "N")
    ids = net.fresh(spec["c"])
    net.interface = list(ids)  # graph input channels are never removed
    x = T("input", ids, spec["h"], spec["w"], [None] * len(ids))
    for p in spec["stages"]:
        x = STAGES[p["kind"]](net, x, p)
    out, n_out = head(net, x, spec["head"])
    y = net.node("Identity", [out], name="output_identity")
    model = net.model("input", spec["c"], spec["h"], spec["w"], y, n_out)
    return model, net


# ====================================================================== strategies
ACT = st.sampled_from((None, *ACTS))


def _stage(kind: str, **fields) -> st.SearchStrategy:
    return st.fixed_dictionaries({"kind": st.just(kind), **fields})


CONV_BRANCH = st.fixed_dictionaries(
    {"width": st.integers(1, 5), "k": st.sampled_from([1, 3]), "bn": st.booleans(), "act": ACT}
)
BRANCHES = st.tuples(  # one conv branch at least, then identity / pool / conv branches
    CONV_BRANCH,
    st.lists(st.one_of(st.none(), st.just("pool"), CONV_BRANCH), min_size=1, max_size=2),
    st.integers(0, 2),
).map(lambda t: [*t[1][: t[2]], t[0], *t[1][t[2] :]])
CONV = _stage(
    "conv",
    width=st.integers(2, 8),
    k=st.sampled_from([1, 3]),
    stride=st.sampled_from([1, 2]),
    pad=st.booleans(),
    bias=st.booleans(),
    bn=st.booleans(),
    act=ACT,
)
STAGE = st.one_of(
    CONV,
    _stage(
        "gconv",
        depthwise=st.booleans(),
        g=st.integers(0, 3),
        mult=st.integers(1, 3),
        k=st.sampled_from([1, 3]),
        bias=st.booleans(),
        bn=st.booleans(),
        act=ACT,
    ),
    _stage(
        "pool",
        op=st.sampled_from(["MaxPool", "AveragePool"]),
        k=st.sampled_from([2, 3]),
        stride=st.sampled_from([1, 2]),
        pad=st.booleans(),
        include_pad=st.booleans(),
    ),
    _stage(
        "residual",
        mid=st.integers(1, 6),
        k=st.sampled_from([1, 3]),
        bn=st.booleans(),
        act=ACT,
        post_act=ACT,
        skip_first=st.booleans(),
    ),
    _stage(
        "concat",
        branches=BRANCHES,
        neg_axis=st.booleans(),
    ),
    _stage(
        "split",
        parts=st.integers(2, 3),
        via=st.sampled_from(["split", "slice"]),
        num_outputs=st.booleans(),
        widths=st.lists(st.one_of(st.none(), st.integers(1, 4)), min_size=3, max_size=3),
        k=st.sampled_from([1, 3]),
        act=ACT,
    ),
    _stage(
        "chanop",
        op=st.sampled_from(["Mul", "Add", "Sub", "Div", "PRelu"]),
        rank4=st.booleans(),
        x_first=st.booleans(),
        act=ACT,
    ),
    _stage(
        "se",
        r=st.integers(1, 4),
        trans_b=st.booleans(),
        gate=st.sampled_from(["Sigmoid", "HardSigmoid"]),
        to4d=st.sampled_from(["unsqueeze", "reshape", "reshape-1"]),
        x_first=st.booleans(),
    ),
    _stage(
        "misc",
        what=st.sampled_from(
            ["resize", "pad", "identity", "transpose", "unsqueeze", "reshape", "upconv"]
        ),
        flag=st.booleans(),
        alt=st.booleans(),
        mode=st.integers(0, 2),
        width=st.integers(2, 5),
    ),
)
HEAD = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["gap", "flatten", "reduce"]),
        "pool": st.sampled_from(["GlobalAveragePool", "GlobalMaxPool"]),
        "to2d": st.sampled_from(["flatten", "reshape", "squeeze"]),
        "reduce": st.sampled_from(["ReduceMean", "ReduceMax", "ReduceSum"]),
        "matmul": st.booleans(),
        "trans_b": st.booleans(),
        "n_out": st.integers(2, 5),
    }
)
SPEC = st.fixed_dictionaries(
    {
        "opset": st.sampled_from(OPSETS),
        "batch": st.sampled_from([1, "N"]),
        "seed": st.integers(0, 2**16),
        "c": st.integers(2, 8),
        "h": st.integers(4, 10),
        "w": st.integers(4, 10),
        # a conv stem first, so that the stages see channels that can be zeroed
        "stages": st.tuples(CONV, st.lists(STAGE, min_size=1, max_size=4)).map(
            lambda t: [t[0], *t[1]]
        ),
        "head": HEAD,
    }
)


# ====================================================================== masks
def repair(net: Net, zeroed: set[int]) -> set[int]:
    """Un-zero classes until every constraint holds: each block keeps a channel and blocks of a
    grouped conv keep equally many (what onnxshrink would otherwise keep, with a reason)."""
    zeroed = set(zeroed) - {net.find(i) for i in fixed_ids(net)}
    changed = True
    while changed:
        changed = False
        for blocks, balanced in net.constraints:
            counts = [sum(net.find(i) not in zeroed for i in b) for b in blocks]
            target = max(max(counts), 1) if balanced else 1
            for b, n in zip(blocks, counts, strict=True):
                if n < target:
                    z = next(net.find(i) for i in b if net.find(i) in zeroed)
                    zeroed.discard(z)
                    changed = True
                    break
            if changed:
                break
    return zeroed


def zero_classes(net: Net, zeroed: set[int]) -> dict[str, list[tuple[int, int]]]:
    """(initializer -> [(axis, index)]) of the producers of the zeroed classes."""
    where = defaultdict(list)
    for i in range(len(net.parent)):
        if net.find(i) in zeroed:
            for init, axis, k in net.members[i]:
                where[init].append((axis, k))
    return dict(where)


def apply_zeros(model: onnx.ModelProto, where: dict, as_masks: bool):
    """Zero the slices in the model's weights, or return them as a masks dict."""
    masks = {}
    for t in model.graph.initializer:
        if t.name not in where:
            continue
        arr = numpy_helper.to_array(t).copy()
        m = np.ones(arr.shape, np.uint8)
        for axis, k in where[t.name]:
            if axis == "elem":
                m.reshape(-1)[k] = 0
            else:
                m[(slice(None),) * axis + (k,)] = 0
        if as_masks:
            masks[t.name] = m
        else:
            t.CopyFrom(numpy_helper.from_array(np.where(m == 1, arr, 0).astype(arr.dtype), t.name))
    return masks or None


# ====================================================================== checks
OUT_DIR = os.path.join(tempfile.gettempdir(), "onnxshrink_property")


def _note(msg: str) -> None:
    try:
        note(msg)
    except InvalidArgument:  # outside hypothesis (the fixed tests): pytest shows stdout
        print(msg)


def describe(model: onnx.ModelProto, where: dict, masks) -> None:
    """Notes for a failing example: the model file, the graph with its weights as typed inputs,
    and the zeroed slices."""
    os.makedirs(OUT_DIR, exist_ok=True)
    data = model.SerializeToString()
    path = os.path.join(OUT_DIR, f"model_{zlib.crc32(data):08x}.onnx")
    onnx.save(model, path)
    if masks:
        np.savez(path.replace(".onnx", "_masks.npz"), **masks)
    light = onnx.GraphProto()
    light.CopyFrom(model.graph)
    del light.initializer[:]
    for t in model.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT and np.prod(t.dims) > 4:
            light.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            light.initializer.append(t)
    _note(f"model saved to {path} (masks: {'_masks.npz' if masks else 'zeros in the weights'})")
    _note(onnx.printer.to_text(light))
    _note(f"zeroed slices (initializer: [(axis, index)]): {where}")


def masked_reference(model: onnx.ModelProto, masks) -> onnx.ModelProto:
    """The model with the masks applied (itself when the masks are its zeros)."""
    if not masks:
        return model
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    for t in ref.graph.initializer:
        if t.name in masks:
            arr = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array(np.where(masks[t.name] == 1, arr, 0).astype(arr.dtype), t.name))
    return ref


def check_in_onnxruntime(reference: onnx.ModelProto, shrunk: onnx.ModelProto) -> None:
    """Independently of onnxshrink.proof: the shrunk model loads, has the reference's
    outputs, matches it on 2 random inputs (a dynamic batch of 2, then 3) within RTOL of each
    output's max magnitude (or by rounding only: models.randgraph.rounding_only), and has no
    more float parameters."""
    dims = reference.graph.input[0].type.tensor_type.shape.dim
    rng = np.random.default_rng(0)
    ref_sess, sess = ort_session(reference), ort_session(shrunk)
    names = [o.name for o in ref_sess.get_outputs()]
    assert [o.name for o in sess.get_outputs()] == names
    for n in BATCHES:
        shape = [d.dim_value if d.HasField("dim_value") else n for d in dims]
        feed = {"input": rng.standard_normal(shape).astype(np.float32)}
        diffs = compare_outputs(names, ref_sess.run(None, feed), sess.run(None, feed))
        off = {d.name for d in diffs if d.max_abs_err > RTOL * d.max_ref}
        # an output that is a remainder of cancellation: judged against the two models' own
        # rounding, in float32 and float64 (a wrong function differs in float64 too)
        rounding = rounding_only(reference, shrunk, feed) if off else set()
        for name in sorted(off & rounding):
            event(f"output off by rounding only: {name}")
        for d in diffs:
            assert d.got_shape == d.ref_shape, f"{d.name} (batch {n}): shape {d.got_shape}, expected {d.ref_shape}"
            assert d.name in rounding or d.max_abs_err <= RTOL * d.max_ref, (
                f"shrunk model does not match on {d.name} (batch {n}): max |shrunk - ref| = "
                f"{d.max_abs_err:.3g}, max |ref| = {d.max_ref:.3g}, relative error {d.rel_err:.3g}"
            )
    before, after = float_params(reference), float_params(shrunk)
    assert after <= before, f"float parameters grew from {before} to {after}"


def run_shrink(model: onnx.ModelProto, masks=None):
    dims = model.graph.input[0].type.tensor_type.shape.dim
    shape = [d.dim_value or 2 for d in dims]  # a dynamic batch: 2
    result = shrink(model, masks=masks, validate=False, input_shapes={"input": shape})
    check_in_onnxruntime(masked_reference(model, masks), result.model)
    assert result.barriers == [], result.barriers
    return result


def shrunk_weight(result, rec: Weighted) -> tuple[np.ndarray, int] | None:
    """The weight of node `rec.node` in the shrunk model and the node's group count; None when
    the node was removed."""
    nodes = {n.name: n for n in result.model.graph.node}
    if rec.node not in nodes:
        return None
    node = nodes[rec.node]
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    name = node.input[1]
    if name != rec.weight:  # restacked grouped weights get a fresh name; a plain slice keeps it
        assert rec.op == "Conv" and group > 1, (rec.node, name, rec.weight)
    return initializer_value(result.model, name), group


def sides(rec: Weighted, w: np.ndarray, group: int) -> tuple[int, int]:
    """(output channels, input features) of a shrunk weight."""
    if rec.op == "Conv":
        return w.shape[0], w.shape[1] * group
    if rec.op == "ConvTranspose":
        return w.shape[1] * group, w.shape[0]
    return w.shape[rec.out_axis], w.shape[rec.in_axis]


def check_exact_and_maximal(net: Net, result, zeroed: set[int]) -> None:
    def kept(ids):
        return sum(net.find(i) not in zeroed for i in ids)

    # One exception to maximality: a zeroed class whose constant (a non-zero activation of 0,
    # through padding) varies over the map stays when folding it would need a constant map
    # larger than the weights its removal saves. Then every zero slice left must be explained
    # by that, and the model must not have grown.
    costly = [k for k in result.kept_zeroed if "larger than the weights" in k.reason]
    if costly:
        # (a grouped conv's equal groups may keep one more: each keep is checked just below)
        assert all(k.kind in ("not-absorbable", "structure") for k in result.kept_zeroed), result.kept_zeroed
        check_zeros_explained(net, result)
        assert result.after.params <= result.before.params
        return

    for rec in net.weighted:
        found = shrunk_weight(result, rec)
        assert found is not None, f"{rec.op} node {rec.node} vanished from the shrunk model"
        w, group = found
        out_n, in_n = sides(rec, w, group)
        if rec.out_ids is None:  # a graph output keeps everything
            want_out = net.inits[rec.weight].shape[rec.out_axis]
        else:
            want_out = kept(rec.out_ids)
        want_in = kept(rec.in_ids) * rec.spatial
        if rec.spatial > 1 and in_n <= want_in:
            # a flattened map's features that are 0 at every input (a zero Pad's border, kept 0
            # by a Mul, a ReLU, ...) may go with the channels: at least what the channels
            # remove goes, and the outputs are checked in onnxruntime (run_shrink)
            want_in = in_n
        assert (out_n, in_n) == (want_out, want_in), (
            f"{rec.op} {rec.node}: shrunk to {out_n} out x {in_n} in, expected "
            f"{want_out} x {want_in}; kept_zeroed={result.kept_zeroed}"
        )
    assert result.kept_zeroed == [], result.kept_zeroed


def check_zeros_explained(net: Net, result) -> None:
    """Every all-zero slice left in a weight, along its output axis and (group 1) its input
    axis, is explained in kept_zeroed."""
    for rec in net.weighted:
        found = shrunk_weight(result, rec)
        if found is None:  # the node computed constants only and was removed
            continue
        w = found[0]
        axes = [rec.out_axis] + ([rec.in_axis] if rec.group == 1 else [])
        for axis in axes:
            side = "output" if axis == rec.out_axis else "input"
            zero = ~np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1).any(axis=1)
            explained = sum(
                k.count for k in result.kept_zeroed if k.tensor == rec.weight and k.axis == axis
            )
            assert zero.sum() <= explained, (
                f"{rec.op} {rec.node}: {int(zero.sum())} all-zero {side} slice(s) of "
                f"{rec.weight} (axis {axis}) kept, {explained} explained; "
                f"kept_zeroed={result.kept_zeroed}"
            )


def fixed_ids(net: Net) -> list[int]:
    """Channel ids the group property must not zero."""
    return list(net.interface)


def zeroable(net: Net) -> list[int]:
    """Classes the group property may zero: not graph-input channels."""
    fixed = {net.find(i) for i in fixed_ids(net)}
    return [c for c in net.classes() if c not in fixed]


def group_zeroing(net: Net, flags: list[bool]) -> set[int]:
    """The zeroable classes flagged, then un-zeroed as `repair` needs."""
    return repair(net, {c for c, f in zip(zeroable(net), flags, strict=False) if f})


def arbitrary_zeroing(net: Net, model: onnx.ModelProto, seed: int, p: float) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    where = defaultdict(list)
    for init, axis in net.maskable:
        n = shapes[init][axis]
        for k in np.flatnonzero(rng.random(n) < p):
            where[init].append((axis, int(k)))
    for init, _ in net.maskable:  # some unstructured zeros too
        if len(shapes[init]) > 1 and rng.random() < 0.3:
            size = int(np.prod(shapes[init]))
            for k in np.flatnonzero(rng.random(size) < p):
                where[init].append(("elem", int(k)))
    return dict(where)


# ====================================================================== properties
def _event(msg: str) -> None:
    with contextlib.suppress(InvalidArgument):  # outside hypothesis (the fixed tests)
        event(msg)


@contextlib.contextmanager
def described(model: onnx.ModelProto, where: dict, masks):
    """On failure, note the model and masks (see `describe`)."""
    try:
        yield
    except Exception:
        describe(model, where, masks)
        raise


def _check_group_property(spec: dict, flags: list[bool], as_masks: bool) -> None:
    model, net = build(spec)
    zeroed = group_zeroing(net, flags)
    _event(f"stages: {len(spec['stages'])}")
    _event(f"zeroed classes: {min(len(zeroed), 5)}{'+' if len(zeroed) >= 5 else ''}")
    where = zero_classes(net, zeroed)
    masks = apply_zeros(model, where, as_masks)
    with described(model, where, masks):
        result = run_shrink(model, masks)
        check_exact_and_maximal(net, result, zeroed)


def _check_arbitrary_property(spec: dict, seed: int, p: float, as_masks: bool) -> None:
    model, net = build(spec)
    where = arbitrary_zeroing(net, model, seed, p)
    masks = apply_zeros(model, where, as_masks)
    with described(model, where, masks):
        result = run_shrink(model, masks)
        check_zeros_explained(net, result)


PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("ONNXSHRINK_PROPERTY_EXAMPLES", "250")),
    # the same examples on every run: a CI run is not a search (two runs on 2026-11-29 each drew
    # a new case). ONNXSHRINK_PROPERTY_RANDOM=1 draws new ones; what they find becomes a fixed test
    derandomize=not os.environ.get("ONNXSHRINK_PROPERTY_RANDOM"),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # no explain phase: it re-runs a failing example hundreds of times for little insight here
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)


@PROPERTY_SETTINGS
@given(spec=SPEC, data=st.data())
def test_whole_group_masks_removed_exactly_and_maximally(spec, data):
    _, net = build(spec)
    n = len(zeroable(net))
    flags = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="zero class")
    if n:  # one class at least
        flags[data.draw(st.integers(0, n - 1), label="and zero class")] = True
    as_masks = data.draw(st.booleans(), label="as masks dict")
    _check_group_property(spec, flags, as_masks)


def _known(stages: list[dict], opset: int = 11) -> dict:
    head = dict(kind="gap", pool="GlobalAveragePool", to2d="flatten", reduce="ReduceMean")
    head.update(matmul=False, trans_b=False, n_out=2)
    return dict(opset=opset, seed=0, c=2, h=4, w=4, stages=stages, head=head)


_CONV_1X1 = dict(kind="conv", width=2, k=1, stride=1, pad=False, bias=False, bn=False, act=None)
_RESIDUAL = dict(kind="residual", mid=1, k=1, bn=False, act=None, post_act=None, skip_first=False)
_PAD = dict(kind="misc", what="pad", flag=False, alt=False, mode=0, width=2)
_MAXPOOL = dict(kind="pool", op="MaxPool", k=2, stride=1, pad=False, include_pad=False)


@PROPERTY_SETTINGS
@given(
    spec=SPEC,
    seed=st.integers(0, 2**16),
    p=st.sampled_from([0.15, 0.35, 0.6]),
    as_masks=st.booleans(),
)
# The minimal failing examples hypothesis found for the excluded bugs (they pass while excluded).
@example(spec=_known([{**_CONV_1X1, "bn": True}]), seed=0, p=0.15, as_masks=False)  # Bug 1
@example(spec=_known([_RESIDUAL]), seed=0, p=0.35, as_masks=False)  # Bug 2
@example(spec=_known([_CONV_1X1, _RESIDUAL]), seed=0, p=0.15, as_masks=False)  # Bug 3
@example(
    spec=_known([{**_CONV_1X1, "width": 4, "bn": True}, _PAD, _MAXPOOL], 17),
    seed=0,
    p=0.15,
    as_masks=False,
)  # Bug 5
# An output that is a remainder of cancellation (its bias and half its weights zeroed): the
# shrunk model, its BN-shifted constant channels folded into the MatMul's bias, differs from the
# reference by 1e-8 on outputs of 2.3e-4, rounding the reference has too (rounding_only).
@example(
    spec=dict(
        opset=11, batch=1, seed=869, c=4, h=4, w=5,
        stages=[
            dict(kind="conv", width=8, k=3, stride=1, pad=True, bias=True, bn=True, act="Clip"),
            dict(kind="pool", op="AveragePool", k=3, stride=1, pad=False, include_pad=False),
        ],
        head=dict(kind="gap", pool="GlobalAveragePool", to2d="flatten", reduce="ReduceMean",
                  matmul=True, trans_b=False, n_out=3),
    ),
    seed=66,
    p=0.35,
    as_masks=False,
)  # fmt: skip
def test_arbitrary_masks_never_break_exactness(spec, seed, p, as_masks):
    _check_arbitrary_property(spec, seed, p, as_masks)


# ====================================================================== fixed examples
# One graph per stage type (after a conv stem with BN and Tanh): stem + stage + GAP/Gemm head.
def _conv(**kw) -> dict:
    base = dict(kind="conv", width=6, k=3, stride=1, pad=True, bias=True, bn=True, act="Tanh")
    return {**base, **kw}


def _misc(what: str, **kw) -> dict:
    return {**dict(kind="misc", what=what, flag=True, alt=False, mode=0, width=4), **kw}


def _split(**kw) -> dict:
    base = dict(kind="split", parts=3, via="split", num_outputs=False, widths=[2, None, 3])
    return {**base, "k": 3, "act": "Tanh", **kw}


FIXED = {
    "conv": _conv(act="Relu", stride=2),
    "conv_1x1_sigmoid": _conv(k=1, pad=False, act="Sigmoid"),  # constants 0.5 into the head
    "gconv": dict(kind="gconv", depthwise=False, g=1, mult=2, k=3, bias=True, bn=True, act="Elu"),
    "depthwise": dict(
        kind="gconv", depthwise=True, g=0, mult=1, k=3, bias=False, bn=True, act=None
    ),
    "depthwise_x2": dict(
        kind="gconv", depthwise=False, g=0, mult=2, k=1, bias=True, bn=False, act=None
    ),
    "avgpool": dict(kind="pool", op="AveragePool", k=3, stride=2, pad=True, include_pad=True),
    "maxpool": dict(kind="pool", op="MaxPool", k=2, stride=1, pad=False, include_pad=False),
    "residual": dict(
        kind="residual", mid=4, k=3, bn=True, act="Relu", post_act="Relu", skip_first=True
    ),
    "concat": dict(
        kind="concat",
        branches=[None, dict(width=3, k=1, bn=True, act="Sigmoid"), "pool"],
        neg_axis=True,
    ),
    "split": _split(),
    "split_num_outputs": _split(num_outputs=True, widths=[None, 2, 2]),
    "slice": _split(parts=2, via="slice", widths=[3, None], k=1, act=None),
    "chanop_add": dict(kind="chanop", op="Add", rank4=False, x_first=False, act="Sigmoid"),
    "chanop_prelu": dict(kind="chanop", op="PRelu", rank4=True, x_first=True, act=None),
    "se": dict(kind="se", r=3, trans_b=True, gate="Sigmoid", to4d="reshape", x_first=True),
    "se_unsqueeze": dict(
        kind="se", r=2, trans_b=False, gate="HardSigmoid", to4d="unsqueeze", x_first=False
    ),
    "resize_sizes": _misc("resize"),
    "resize_scales": _misc("resize", flag=False, alt=True),
    "pad": _misc("pad"),
    "pad_reflect": _misc("pad", mode=1),
    "dropout": _misc("identity"),
    "transpose": _misc("transpose"),
    "unsqueeze": _misc("unsqueeze"),
    "reshape": _misc("reshape", alt=True),
    "upconv": _misc("upconv"),
}
HEADS = {
    "gap_flatten_gemm": dict(kind="gap", pool="GlobalAveragePool", to2d="flatten", matmul=False),
    "gmp_squeeze_matmul": dict(kind="gap", pool="GlobalMaxPool", to2d="squeeze", matmul=True),
    "gap_reshape_gemm": dict(kind="gap", pool="GlobalAveragePool", to2d="reshape", matmul=False),
    "flatten_map_gemm": dict(kind="flatten", pool="", to2d="", matmul=False),
    "reducemean_gemm": dict(kind="reduce", pool="", to2d="", reduce="ReduceMean", matmul=False),
    "reducesum_matmul": dict(kind="reduce", pool="", to2d="", reduce="ReduceSum", matmul=True),
}


def fixed_spec(stage: str, head: str = "gap_flatten_gemm", opset: int = 17) -> dict:
    h = {"reduce": "ReduceMean", "trans_b": True, "n_out": 3, **HEADS[head]}
    stages = [_conv(), FIXED[stage]]
    return dict(opset=opset, seed=7, c=3, h=5, w=5, stages=stages, head=h)


def _fixed_group(spec: dict, as_masks: bool) -> None:
    _, net = build(spec)
    flags = [k % 2 == 1 for k in range(len(zeroable(net)))]  # every other class
    _check_group_property(spec, flags, as_masks)


@pytest.mark.parametrize("name", sorted(FIXED))
@pytest.mark.parametrize("as_masks", [False, True], ids=["zeros", "masks"])
def test_fixed_stage_group_masks(name, as_masks):
    _fixed_group(fixed_spec(name), as_masks)


@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_stage_arbitrary_masks(name):
    _check_arbitrary_property(fixed_spec(name), seed=3, p=0.35, as_masks=False)


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("opset", [11, 13, 18])
def test_fixed_heads_and_opsets(head, opset):
    _fixed_group(fixed_spec("split", head, opset), as_masks=False)
    _check_arbitrary_property(fixed_spec("se", head, opset), seed=5, p=0.35, as_masks=True)


def test_a_zero_padded_map_flattened_into_a_gemm_may_lose_its_border_with_a_channel():
    """Hypothesis's find (2026-11-29): conv -> 2 MaxPools -> Mul -> Pad (constant 0) -> Flatten
    -> Gemm, one channel zeroed. The shrink drops the channel's 16 features and the 12 border
    features of the other (0 in every channel), the pads going: exact, and more than the
    channels alone. Both counts are allowed; the outputs are checked in onnxruntime."""
    spec = dict(
        opset=11, batch=1, seed=0, c=2, h=4, w=4,
        stages=[
            _CONV_1X1, _MAXPOOL, _MAXPOOL,
            dict(kind="chanop", op="Mul", rank4=False, x_first=False, act=None),
            _PAD,
        ],
        head=dict(kind="flatten", pool="GlobalAveragePool", to2d="flatten", reduce="ReduceMean",
                  matmul=False, trans_b=False, n_out=2),
    )  # fmt: skip
    model, net = build(spec)
    flags = [False] * len(zeroable(net))
    flags[0] = True
    zeroed = group_zeroing(net, flags)
    masks = apply_zeros(model, zero_classes(net, zeroed), False)
    result = run_shrink(model, masks)  # (checked in onnxruntime against the zeroed input)
    gemm = next(r for r in net.weighted if r.op == "Gemm")
    w, group = shrunk_weight(result, gemm)
    assert sides(gemm, w, group) == (2, 4)  # 1 channel x the 2 x 2 inside of the pad
    check_exact_and_maximal(net, result, zeroed)


_FLATTEN_HEAD = dict(kind="flatten", pool="GlobalAveragePool", to2d="flatten", reduce="ReduceMean",
                     matmul=False, trans_b=False, n_out=2)  # fmt: skip


def test_a_zero_border_kept_zero_by_a_mul_may_go_with_a_channel():
    """Hypothesis's find (2026-11-29, CI): conv -> Pad (constant 0) -> Mul by a per-channel
    constant -> Flatten -> Gemm, one channel zeroed: the border stays 0 through the Mul and goes
    too (16 of the 36 features kept, against the 36 the channels alone leave)."""
    stages = [_CONV_1X1, _PAD, dict(kind="chanop", op="Mul", rank4=False, x_first=False, act=None)]
    spec = dict(opset=11, batch=1, seed=0, c=2, h=4, w=4, stages=stages, head=_FLATTEN_HEAD)
    _check_group_property(spec, [True, False], as_masks=False)


def test_a_grouped_conv_may_keep_a_channel_beside_a_costly_constant():
    """Hypothesis's find (2026-11-29, CI): conv -> Concat(Sigmoid(conv), it) -> grouped 3x3 conv,
    two classes zeroed. The grouped conv keeps one zeroed channel for its equal groups
    (structure) beside a Sigmoid(0) channel whose border fold would cost more than it saves
    (not-absorbable); both are explained, nothing grows."""
    branch = dict(width=3, k=1, bn=False, act="Sigmoid")
    stages = [
        {**_CONV_1X1, "width": 3},
        dict(kind="concat", branches=[branch, None], neg_axis=False),
        dict(kind="gconv", depthwise=False, g=0, mult=1, k=3, bias=False, bn=False, act=None),
    ]
    head = dict(kind="gap", pool="GlobalAveragePool", to2d="flatten", reduce="ReduceMean",
                matmul=False, trans_b=False, n_out=2)  # fmt: skip
    spec = dict(opset=11, batch=1, seed=0, c=2, h=4, w=4, stages=stages, head=head)
    _check_group_property(spec, [True, False, False, False, False, True, False, False], as_masks=False)

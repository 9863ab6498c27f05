"""onnxruntime's `MatMulNBits` (com.microsoft): Y = A @ dequantize(B)^T + bias, the weight stored
as block-wise quantized integers (int4 from onnxruntime's `MatMulNBitsQuantizer` and the
onnxruntime-genai model builder; 2 and 8 bits too).

Inputs: A [..., K]; B uint8 [N, n_blocks, blob], each row's K weights in blocks of
`block_size`, `8 / bits` codes a byte, the lowest bits first (the last block zero-padded past K);
scales [N, n_blocks] (or flat, [N * n_blocks]); zero_points uint8 [N, ceil(n_blocks * bits / 8)]
(or flat), one code per block packed the same way, each row padded to whole bytes (absent: the
middle code, 2^(bits-1)); g_idx (refused: act-order); bias [N]. Weight (n, k) is
(code - zero point) * scale of its block (n, k // block_size).

- Output features N go by rows: B's row, its scales, zero points and bias element; attribute N.
- Input features K go only by whole blocks: a block's codes are one blob and its scale one
  number, so a block goes when no kept output reads any of its features (all their codes at the
  zero point, or scale 0) or they are constant zero in A; a block some kept output reads keeps all
  of its features (those unread stay, their weights zero: requantizing the rest into new blocks
  would give them other scales). The coupled groups see this: a block's features leave together
  (a unit of `block_size` FFN neurons, a head when head_dim is a multiple of the block).
- An output feature whose weights are all zero (or read only features of A that are constant
  zero) is the constant bias (0 without one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Handler,
    KeepView,
    OpNode,
    Quantized,
    Reader,
    Reason,
    RewriteView,
    RuntimeQuantized,
    WeightAxes,
    compress,
    int_attr,
    register,
)
from onnxshrink.ops.oracle import declare_cases

A, B, SCALES, ZERO_POINTS, G_IDX, BIAS = range(6)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """The codes of packed bytes along the last axis (the lowest bits first): [..., m] uint8 ->
    [..., m * 8 / bits]."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def fill_byte(zero: np.ndarray, bits: int) -> np.ndarray:
    """The byte every code of which is `zero` (codes of `bits` bits): what a zeroed element of
    packed codes is stored as."""
    z = np.asarray(zero).astype(np.uint8)
    byte = np.zeros_like(z)
    for j in range(8 // bits):
        byte |= z << np.uint8(j * bits)
    return byte


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """`unpack`'s inverse; the last axis padded with code 0 to whole bytes."""
    per = 8 // bits
    m = -(-codes.shape[-1] // per)
    padded = np.zeros((*codes.shape[:-1], m * per), np.uint8)
    padded[..., : codes.shape[-1]] = codes
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    grouped = padded.reshape(*codes.shape[:-1], m, per) << shifts
    return np.bitwise_or.reduce(grouped, axis=-1).astype(np.uint8)


class Layout:
    """A MatMulNBits node's sizes and its weight's parameters as [N, n_blocks] arrays."""

    def __init__(self, node: gs.Node | OpNode):
        self.k = int_attr(node, "K", 0)
        self.n = int_attr(node, "N", 0)
        self.bits = int_attr(node, "bits", 4)
        self.block = int_attr(node, "block_size", 0)
        self.blocks = -(-self.k // self.block) if self.block > 0 else 0

    def problem(self, node: gs.Node, reader: Reader) -> str | None:
        """Why the rule cannot read this node (None: it can)."""
        if self.bits not in (2, 4, 8) or self.block <= 0 or self.k <= 0 or self.n <= 0:
            return f"attributes bits={self.bits}, block_size={self.block}, K={self.k}, N={self.n}"
        if ir.present(node, G_IDX) is not None:
            return "g_idx (act-order) reorders the input features"
        w = reader.value(node.inputs[B])
        blob = self.block * self.bits // 8
        if w is None or w.dtype != np.uint8 or w.shape != (self.n, self.blocks, blob):
            return "B is not a constant uint8 [N, n_blocks, blob]"
        s = reader.value(ir.present(node, SCALES))
        if s is None or s.size != self.n * self.blocks:
            return "scales are not a constant of N x n_blocks"
        zp = ir.present(node, ZERO_POINTS)
        if zp is not None:
            z = reader.value(zp)
            if z is None or z.dtype != np.uint8 or z.size != self.n * self.zp_bytes():
                return "zero points are not packed uint8 constants (a float zero point is refused)"
        return None

    def zp_bytes(self) -> int:
        return -(-self.blocks * self.bits // 8)

    def scales(self, reader: Reader, node: gs.Node) -> np.ndarray:
        return np.asarray(reader.value(node.inputs[SCALES])).reshape(self.n, self.blocks)

    def zeros(self, reader: Reader, node: gs.Node) -> np.ndarray:
        """The zero point of each block, as codes: [N, n_blocks]."""
        zp = ir.present(node, ZERO_POINTS)
        if zp is None:
            return np.full((self.n, self.blocks), 1 << (self.bits - 1), np.uint8)
        z = np.asarray(reader.value(zp)).reshape(self.n, self.zp_bytes())
        return unpack(z, self.bits)[:, : self.blocks]

    def live(self, reader: Reader, node: gs.Node) -> np.ndarray:
        """Where a weight is not zero: [N, K] bools (code off its zero point, scale not 0)."""
        w = unpack(np.asarray(reader.value(node.inputs[B])), self.bits)  # [N, n_blocks, block]
        zero = self.zeros(reader, node)[:, :, None]
        scaled = self.scales(reader, node)[:, :, None] != 0
        return ((w != zero) & scaled).reshape(self.n, -1)[:, : self.k]


@register("MatMulNBits", domain="com.microsoft")
class MatMulNBits(Handler):
    evaluate_with_ort = True

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        if i == B and rank == 3:  # [N, n_blocks, blob]: rows are outputs, blocks inputs
            return WeightAxes(0, 1, "linear")
        return WeightAxes(0, None, "vector") if i == BIAS and rank == 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        return {"weight": B, "bias": BIAS}

    def qdq_form(self, node: OpNode) -> RuntimeQuantized:
        """At accuracy_level 4 onnxruntime quantizes A to int8 per block at run time."""
        return RuntimeQuantized("accuracy_level")

    def quantized_input(self, node: OpNode, i: int, rank: int) -> Quantized | None:
        """B: codes packed `bits` to a byte, in blocks along axis 1 with a scale and zero point
        per block (`Quantized.bits`, `Quantized.block`)."""
        if i != B or rank != 3:
            return None
        zp = ZERO_POINTS if node.has_input(ZERO_POINTS) else None
        lay = Layout(node)
        return Quantized((SCALES,), zp, 0, bits=lay.bits, block=lay.block)

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        return int(np.prod(output)) * Layout(node).k

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """An output feature whose weights are all zero on the features of A that are not
        constant zero: its bias (0 without one), whatever A is."""
        a, y, lay = node.inputs[A], node.outputs[0], Layout(node)
        r = ir.rank(y)
        if r is None or lay.problem(node, ctx) is not None:
            return None
        c = ctx.const(a)
        silent = c.slice_zero(r - 1, lay.k) if c is not None else np.zeros(lay.k, bool)
        zero_rows = ~lay.live(ctx, node)[:, ~silent].any(axis=1)
        if not zero_rows.any():
            return None
        bias_t = ir.present(node, BIAS)
        dtype = np.dtype(y.dtype) if y.dtype is not None else np.dtype(np.float32)
        bias = ctx.value(bias_t) if bias_t is not None else np.zeros(lay.n, dtype)
        if bias is None:
            return None
        shape = [1] * (r - 1) + [lay.n]
        value = np.where(zero_rows, bias, 0).astype(dtype).reshape(shape)
        return [compress(zero_rows.reshape(shape), value)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        a, y, lay = node.inputs[A], node.outputs[0], Layout(node)
        r = ir.rank(a)
        why = lay.problem(node, ks)
        if why is None and (r is None or r < 2 or ir.rank(y) != r or ks.size(a, r - 1) != lay.k):
            why = "shapes unknown"
        if why is not None:
            ks.barrier(node, Reason("barrier", node.name, node.op, why))
            return
        assert r is not None
        b = node.inputs[B]
        ks.demand(a, pin=False)
        ks.demand(b, pin=False)
        for j in range(r - 1):
            ks.couple(a, j, y, j)
        ks.couple(b, 0, y, r - 1)
        ks.pin(b, 2)
        # a feature k is in block k // block_size; a kept block keeps all of its features
        ks.couple_map(a, r - 1, b, 1, np.arange(lay.k) // lay.block)
        for slot in (SCALES, ZERO_POINTS):  # sliced from their [N, n_blocks] view in `rewrite`
            ks.demand(ir.present(node, slot))
        bias = ir.present(node, BIAS)
        if bias is not None:
            ks.demand(bias, pin=False)
            ks.couple(bias, 0, y, r - 1)
        kept_a = ks.kept(a, r - 1)
        if kept_a is None or kept_a.all():
            return
        live = ks.memo(("nbits-live", node.name), lambda: lay.live(ks, node))
        ky = ks.kept(y, r - 1)
        reads = live[ky].any(axis=0) if ky is not None else live.any(axis=0)
        c = ks.const(a)
        silent = c.slice_zero(r - 1, lay.k) if c is not None else np.zeros(lay.k, bool)
        needed = reads & ~silent
        ks.need(a, r - 1, needed)
        block_of = np.arange(lay.k) // lay.block
        partial = np.isin(block_of, block_of[needed]) & ~needed
        if partial.any():  # (the couple_map above keeps them too: this says why)
            block_whole = Reason(
                "structure",
                node.name,
                node.op,
                f"a quantization block of {lay.block} input features stays whole while a kept "
                "output reads any of them (its weights for this feature are zero)",
            )
            ks.keep(a, r - 1, partial, block_whole)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        a, y, lay = node.inputs[A], node.outputs[0], Layout(node)
        r = ir.rank(y)
        assert r is not None
        rows = rw.kept_static(y, r - 1)
        blocks = rw.kept_static(node.inputs[B], 1)
        k = int(rw.kept_static(a, r - 1).sum())
        if rows.all() and blocks.all():
            return
        scales = np.asarray(rw.original(node.inputs[SCALES]))
        flat = scales.ndim == 1
        kept_scales = scales.reshape(lay.n, lay.blocks)[rows][:, blocks]
        rw.replace_input(node, SCALES, kept_scales.reshape(-1) if flat else kept_scales)
        zp = ir.present(node, ZERO_POINTS)
        if zp is not None:
            z = np.asarray(rw.original(zp))
            codes = unpack(z.reshape(lay.n, lay.zp_bytes()), lay.bits)[:, : lay.blocks][rows][
                :, blocks
            ]
            packed = pack(codes, lay.bits)
            rw.replace_input(node, ZERO_POINTS, packed.reshape(-1) if z.ndim == 1 else packed)
        node.attrs["K"] = k
        node.attrs["N"] = int(rows.sum())


declare_cases(excluded={
    "MatMulNBits": "its weight is packed int4 codes with per-block scales, which random "
    "initializers do not make; tests/ops/test_matmul_nbits.py checks it in onnxruntime",
})

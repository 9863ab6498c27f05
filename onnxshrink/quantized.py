"""What a quantized constant's "zero" is: the integer that dequantizes to 0.

An integer constant an op dequantizes (`Handler.quantized_input`: a DequantizeLinear's input, a
ConvInteger's or MatMulInteger's weight, a QLinearConv's weight, a MatMulNBits' packed codes)
reads as (q - zero point) * scale. Removing one of its elements means removing its dequantized
value: setting it to its zero point (per tensor, per channel or per block, as the op that reads
it says), not to 0, which reads as -zero point * scale. Both the prune (its groups, its
compensation) and a mask on an integer weight (`bind.apply`) mean this, and find how the
constant is dequantized here (`dequant_reads`: one walk, so that the two cannot disagree on a
zero point), whatever the graph is held as (an onnx-graphsurgeon graph or an onnx model's
nodes): a `Readers` says what the walk asks of the graph, an `Inputs` gives a node's constant
inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from onnxshrink.core.handler import Handler, OpNode

N = TypeVar("N")
#: how many value-moving ops (Gather, Reshape, ...) the walk follows from the constant
MAX_MOVES = 8


@dataclass
class Dequant:
    """How a quantized constant's integers read as real numbers: (q - zero) * scale, each shaped
    to broadcast against the tensor (a scalar, or a vector along one axis); scale None: unknown
    (taken as 1)."""

    zero: np.ndarray
    scale: np.ndarray | None
    bits: int = 0  # block-wise (MatMulNBits): codes packed `bits` to a byte, zero and scale per block

    def fill(self) -> np.ndarray:
        """What a removed element is set to: the zero point (for packed codes, the byte every
        code of which is the zero point), broadcast against the tensor."""
        if not self.bits:
            return self.zero
        from onnxshrink.ops.matmul_nbits import fill_byte

        return fill_byte(self.zero, self.bits)


class Inputs(Protocol):
    """A node's inputs, as the reading below needs them."""

    def given(self, slot: int) -> bool:
        """Is input `slot` present (not absent, not the empty name)?"""
        ...

    def constant(self, slot: int) -> tuple[str, np.ndarray] | None:
        """Input `slot`'s name and value when it is a constant; else None."""
        ...


def dequant_of(q: Any, shape: tuple[int, ...], inputs: Inputs, params: set[str]) -> Dequant | None:
    """The zero point and scale `q` (an `ops.Quantized`) names among `inputs`, shaped against a
    constant of `shape`; the names of those read are added to `params`. None when a zero point is
    not a constant or does not fit. A scale computed at run time: Dequant(zero, None)."""

    def shaped(slot: int) -> np.ndarray | None:
        got = inputs.constant(slot)
        if got is None:
            return None
        name, v = got
        if v.size == 1:
            return v.reshape(())
        if q.axes and v.shape == tuple(shape[a] for a in q.axes if 0 <= a < len(shape)):
            params.add(name)
            return v.reshape([shape[a] if a in q.axes else 1 for a in range(len(shape))])
        if v.ndim != 1 or not 0 <= q.axis < len(shape) or v.shape[0] != shape[q.axis]:
            return None
        params.add(name)
        return v.reshape([-1 if a == q.axis else 1 for a in range(len(shape))])

    if q.block:
        return _block_dequant(q, shape, inputs, params)
    return _zero_and_scale(q, inputs, shaped, run_time_scale=True)


def along_axis(v: np.ndarray | None, axis: int, shape: tuple[int, ...]) -> np.ndarray | None:
    """A scale (a scalar, or a vector along `axis`), shaped against a tensor of `shape`; None
    when it is neither."""
    if v is None:
        return None
    v = np.asarray(v, dtype=np.float64)
    if v.size == 1:
        return v.reshape(())
    if v.ndim != 1 or not 0 <= axis < len(shape) or v.shape[0] != shape[axis]:
        return None
    return v.reshape([-1 if a == axis else 1 for a in range(len(shape))])


def _block_dequant(q: Any, shape: tuple[int, ...], inputs: Inputs, params: set[str]) -> Dequant | None:
    """A block-wise quantized weight [rows, blocks, bytes] (`Quantized.block`): its zero point and
    scale per (row, block), [rows, blocks, 1], the zero points unpacked to codes (absent: the
    middle code); None when one is not a constant of that size."""
    from onnxshrink.ops.matmul_nbits import unpack

    if not q.bits:
        return _blocked_along(q, shape, inputs, params)
    if len(shape) != 3 or q.bits not in (2, 4, 8):
        return None
    rows, blocks = shape[0], shape[1]
    zero = np.full((rows, blocks, 1), 1 << (q.bits - 1), np.int64)
    if q.zero_point is not None and inputs.given(q.zero_point):
        got = inputs.constant(q.zero_point)
        if got is None:
            return None
        name, z = got
        per_row = -(-blocks * q.bits // 8)
        if z.dtype != np.uint8 or z.size != rows * per_row:
            return None
        zero = unpack(z.reshape(rows, per_row), q.bits)[:, :blocks, None].astype(np.int64)
        params.add(name)
    scale: np.ndarray | None = None
    for slot in q.scales:
        got = inputs.constant(slot) if inputs.given(slot) else None
        if got is None or got[1].size != rows * blocks:
            return None
        params.add(got[0])
        v = np.asarray(got[1], dtype=np.float64).reshape(rows, blocks, 1)
        scale = v if scale is None else scale * v
    return Dequant(zero, scale, q.bits)


def _blocked_along(q: Any, shape: tuple[int, ...], inputs: Inputs, params: set[str]) -> Dequant | None:
    """A block-wise DequantizeLinear's input (one integer an element; its parameters of its shape
    but ceil(n / block) along `axis`): zero point and scale repeated over their blocks, of the
    input's shape; None when one is not a constant of that shape."""
    if not 0 <= q.axis < len(shape):
        return None
    n = shape[q.axis]
    want = tuple(-(-n // q.block) if a == q.axis else d for a, d in enumerate(shape))

    def full(slot: int) -> np.ndarray | None:
        got = inputs.constant(slot) if inputs.given(slot) else None
        if got is None or tuple(got[1].shape) != want:
            return None
        params.add(got[0])
        return np.repeat(got[1], q.block, axis=q.axis).take(np.arange(n), axis=q.axis)

    return _zero_and_scale(q, inputs, full, run_time_scale=False)


def _zero_and_scale(
    q: Any, inputs: Inputs, read: Callable[[int], np.ndarray | None], run_time_scale: bool
) -> Dequant | None:
    """The Dequant of `q`'s zero point and scales, each read by `read` (None: not a constant of
    the form it wants). A scale that is not: Dequant(zero, None) with `run_time_scale`, else
    None (no member)."""
    zero = np.zeros((), np.int64)
    if q.zero_point is not None and inputs.given(q.zero_point):
        z = read(q.zero_point)
        if z is None:
            return None
        zero = z.astype(np.int64)
    scale: np.ndarray | None = None
    for slot in q.scales:
        v = read(slot)
        if v is None:
            return Dequant(zero, None) if run_time_scale else None
        scale = v.astype(np.float64) if scale is None else scale * v
    return Dequant(zero, scale)


def same_zero(found: list[Dequant]) -> bool:
    """Do every reader's zero points agree (then the constant has one "zero")?"""
    return bool(found) and all(
        d.bits == found[0].bits and d.zero.shape == found[0].zero.shape and np.array_equal(d.zero, found[0].zero)
        for d in found
    )


# ---------------------------------------------------------------------- the walk
@dataclass
class Moved(Generic[N]):
    """Where a node moves a constant's values (its output 0): the (node, input) that read them
    there, and that tensor's dims (-1 where dynamic; None: unknown)."""

    readers: list[tuple[N, int]]
    dims: tuple[int, ...] | None


class Readers(Protocol[N]):
    """A graph as the walk reads it (its nodes of type N: an onnx-graphsurgeon node, or the
    index of an onnx model's node)."""

    def facts(self, node: N) -> tuple[Handler | None, OpNode]:
        """The node's handler (None: an op no handler knows) and static facts."""
        ...

    def inputs(self, node: N) -> Inputs:
        """The node's inputs, as `dequant_of` reads them."""
        ...

    def applied_scale(self, node: N, i: int) -> np.ndarray | None:
        """`Handler.applied_scale` where the graph can tell it, else None (unknown)."""
        ...

    def moved(self, node: N, i: int) -> Moved[N] | None:
        """Where `node`'s output 0 (which holds values of its input i) is read; None where
        the values leave the walk: a graph's output (given out as the integers they are), a
        change of element type (they no longer read as the constant's integers)."""
        ...


def dequant_reads(
    graph: Readers[N], node: N, i: int, shape: tuple[int, ...], params: set[str], depth: int = 0
) -> list[Dequant] | None:
    """How input i of `node` (a constant of `shape`) is dequantized: by `node` itself, or, where
    `node` only moves its values (a Gather of an integer embedding table, a Reshape), by every
    reader of what it moves them to (quantize_dynamic's and the QOperator form's embeddings:
    Gather, then DequantizeLinear or QLinearAdd). None: read as plain integers. The names of the
    zero points and scales read (vectors sliced with the constant) are added to `params`."""
    handler, op = graph.facts(node)
    if handler is None:
        return None
    q = handler.quantized_input(op, i, len(shape))
    if q is not None:
        d = dequant_of(q, shape, graph.inputs(node), params)
        if d is not None and not q.scales:
            d.scale = along_axis(graph.applied_scale(node, i), q.axis, shape)
        return [d] if d is not None else None
    if depth >= MAX_MOVES or i not in handler.moves_values(op):
        return None
    moved = graph.moved(node, i)
    return _moved_reads(graph, moved, shape, depth) if moved is not None else None


def _moved_reads(
    graph: Readers[N], moved: Moved[N], shape: tuple[int, ...], depth: int
) -> list[Dequant] | None:
    """How every reader of moved values dequantizes them (readers of their sizes only aside).
    Through a move only a per-tensor zero point holds: it is every element's wherever it goes;
    so does a per-tensor scale, and another is unknown here (None). Where the moved tensor's
    dims are unknown the constant's stand for them (past a move only their rank can matter)."""
    dims = moved.dims if moved.dims is not None else shape
    found: list[Dequant] = []
    for reader, slot in _value_readers(graph, moved.readers):
        ds = dequant_reads(graph, reader, slot, dims, set(), depth + 1)
        if ds is None or any(d.zero.size != 1 for d in ds):
            return None
        found += [Dequant(d.zero, d.scale if d.scale is not None and d.scale.size == 1 else None, d.bits) for d in ds]
    return found or None


def _value_readers(graph: Readers[N], readers: Iterable[tuple[N, int]]) -> list[tuple[N, int]]:
    """The readers of a tensor's values: not those of its sizes only (Shape, Size)."""
    out = []
    for node, slot in readers:
        handler, _ = graph.facts(node)
        if handler is None or slot not in handler.sizes_only:
            out.append((node, slot))
    return out


@dataclass
class Readings(Generic[N]):
    """How a constant's readers read it: the dequantizations found, and the readers that read it
    as plain integers."""

    found: list[Dequant]
    plain: list[N]


def readings(
    graph: Readers[N], readers: Iterable[tuple[N, int]], shape: tuple[int, ...], params: set[str]
) -> Readings[N]:
    """How each (node, input) of `readers` that reads the values of a constant of `shape` reads
    it (`dequant_reads`)."""
    out: Readings[N] = Readings([], [])
    for node, slot in _value_readers(graph, readers):
        ds = dequant_reads(graph, node, slot, shape, params)
        if ds is None:
            out.plain.append(node)
        else:
            out.found += ds
    return out

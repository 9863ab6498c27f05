"""Zeroed weights that stay on disk: a mapped weight with some of its slices zeroed, written row
block by row block to a spill file and mapped back read-only, never held whole in memory.

A prune zeroes slices of nearly every weight of an LLM (a hidden-width group touches every
projection): the verification of its groups and its reference would otherwise hold a copy of
the whole model. A weight held in memory (a model without external data, a small tensor) is
zeroed in a copy, as before."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.core import nonzero
from onnxshrink.io import weights
from onnxshrink.io.weights import DataWriter, WeightStore, tensor_proto

# Weights at least this large, mapped from external data, are spilled rather than copied.
SPILL_BYTES = 1 << 20


def spills(arr: np.ndarray, writer: DataWriter | None) -> bool:
    """Is `arr` zeroed through `writer` (a large mapped weight), not in a copy?"""
    return writer is not None and arr.nbytes >= SPILL_BYTES and arr.ndim > 0 and writer.store.owns(arr)


def zeroed(
    arr: np.ndarray,
    slices: Sequence[tuple[int, np.ndarray]],
    zero: np.ndarray | None = None,
    writer: DataWriter | None = None,
    name: str = "",
) -> np.ndarray:
    """`arr` with each (axis, indices) of `slices` set to zero (to `zero`, a quantized weight's
    zero point broadcast against it): written through `writer` and mapped back when `spills`,
    else a copy in memory."""
    if writer is None or not spills(arr, writer):
        out = np.array(arr)
        for axis, idx in slices:
            zero_slice(out, axis, idx, zero)
        return out
    made = writer.write(name, _blocks(arr, slices, zero), arr.shape, arr.dtype)
    weights.trim()  # the mapped rows read go back to the page cache
    _derive_pattern(arr, made, slices, zero)
    return made


def _derive_pattern(
    arr: np.ndarray, made: np.ndarray, slices: Sequence[tuple[int, np.ndarray]], zero: np.ndarray | None
) -> None:
    """The non-zero pattern of a zeroed matrix, derived from its original's when a pass already
    computed that (the analysis that found the groups), and remembered: the shrink's analysis
    of the reference then does not scan it again. Not for a quantized weight zeroed to a
    zero point that is not 0 (its zeroed slices are not zeros)."""
    if arr.ndim != 2 or (zero is not None and np.any(zero)):
        return
    before = nonzero.known(arr)
    if before is None:
        return
    rows = [idx for axis, idx in slices if axis == 0]
    cols = [idx for axis, idx in slices if axis == 1]
    after = nonzero.zeroed(
        before, np.concatenate(rows) if rows else None, np.concatenate(cols) if cols else None
    )
    if after is not None:
        nonzero.remember(made, after)


def _blocks(arr: np.ndarray, slices: Sequence[tuple[int, np.ndarray]], zero: np.ndarray | None) -> Iterator[np.ndarray]:
    start = 0
    full = None if zero is None else np.broadcast_to(zero, arr.shape)
    keep = _keep_bits(arr, slices) if zero is None else None
    for block in weights.row_blocks(arr):
        stop = start + len(block)
        if keep is None:
            out = np.array(block)
        else:  # copied with the zeroed slices of the other axes cleared, in one pass
            out = np.empty(block.shape, block.dtype)
            np.bitwise_and(block.view(keep.dtype), keep, out=out.view(keep.dtype))
        fill = None if full is None else full[start:stop]
        for axis, idx in slices:
            if axis == 0:
                rows = idx[(idx >= start) & (idx < stop)] - start
                if len(rows):
                    zero_slice(out, 0, rows, fill)
            elif keep is None:
                zero_slice(out, axis, idx, fill)
        yield out
        start = stop


def _keep_bits(arr: np.ndarray, slices: Sequence[tuple[int, np.ndarray]]) -> np.ndarray | None:
    """For zeroing slices along axes other than the first: a mask of the element's bits, all
    ones where kept and 0 where zeroed, broadcast along the first axis (block & mask is the
    block with those slices set to 0, bit for bit: +0.0, as zero_slice writes; a fancy-index
    assignment per block costs three copies). None when there are none, or the bits cannot be
    read so (a strided array, an element not of 1, 2, 4 or 8 bytes)."""
    inner = [(axis, idx) for axis, idx in slices if axis != 0]
    if not inner or not arr.flags.c_contiguous or arr.dtype.itemsize not in (1, 2, 4, 8):
        return None
    bits = np.dtype(f"u{arr.dtype.itemsize}")
    keep = np.full((1, *arr.shape[1:]), np.iinfo(bits).max, bits)
    for axis, idx in inner:
        zero_slice(keep, axis, idx)
    return keep


def zero_slice(values: np.ndarray, axis: int, indices: np.ndarray, zero: np.ndarray | None = None) -> None:
    """values[..., indices, ...] = 0 along `axis`, in place; `zero`: what zero is (a quantized
    weight's zero point, broadcast against `values`)."""
    index: list[Any] = [slice(None)] * values.ndim
    index[axis] = indices
    if zero is None or not np.any(zero):
        values[tuple(index)] = 0
    else:
        values[tuple(index)] = np.broadcast_to(zero, values.shape)[tuple(index)]


@dataclass
class Disk:
    """Where a streamed model's weights are read (its external data in `base_dir`, mapped by
    `store`) and where its zeroed weights are written (`writer`, a spill file)."""

    base_dir: str
    store: WeightStore
    writer: DataWriter

    def read(self, t: onnx.TensorProto) -> np.ndarray:
        """An initializer's values: mapped when stored externally (by absolute path, a spilled
        one, or relative to `base_dir`), else read from the TensorProto."""
        if t.data_location == onnx.TensorProto.EXTERNAL:
            return self.store.array(t, self.base_dir)
        return numpy_helper.to_array(t)

    def proto(self, name: str, arr: np.ndarray) -> onnx.TensorProto:
        """The TensorProto of `arr`: referring to the spill file by absolute path when it was
        spilled (the proof inlines such weights a segment at a time), else holding its values."""
        where = self.store.location(arr) if self.store.owns(arr) else None
        if where is not None and where.path == self.writer.path:
            return tensor_proto(name, arr, where, None)
        return numpy_helper.from_array(np.asarray(arr), name)

"""Zeroed weights that stay on disk: a mapped weight with some of its slices zeroed, written row
block by row block to a spill file and mapped back read-only, never held whole in memory.

A prune zeroes slices of nearly every weight of an LLM (a hidden-width group touches every
projection): the verification of its groups and its reference would otherwise hold a copy of
the whole model. A weight held in memory (a model without external data, a small tensor) is
zeroed in a copy, as before."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.core import nonzero
from onnxshrink.core.zeroed import ZeroedWeight, zero_slice
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
    made = writer.write(name, ZeroedWeight(arr, slices, zero).blocks(), arr.shape, arr.dtype)
    weights.trim()  # the mapped rows read go back to the page cache
    _derive_pattern(arr, made, slices, zero)
    return made


def deferred(
    arr: np.ndarray, slices: Sequence[tuple[int, np.ndarray]], zero: np.ndarray | None, writer: DataWriter, name: str
) -> onnx.TensorProto | None:
    """The TensorProto of `arr` with `slices` zeroed, in a range of `writer`'s file reserved
    for it and written only when first mapped (`DataWriter.reserve`), when it `spills`; None
    when it does not (`zeroed` makes it then)."""
    if not spills(arr, writer):
        return None
    where = writer.reserve(name, arr.shape, arr.dtype, ZeroedWeight(arr, slices, zero))
    return tensor_proto(name, arr, where, None)


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

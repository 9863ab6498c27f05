"""A weight with some of its slices zeroed, made from the original as it is read.

A prune's reference is its input with the chosen groups' slices zeroed. For an LLM that is
nearly every weight (a hidden-width group touches every projection), and writing the zeroed
copies costs as much as writing the model. The shrink needs few of those values: the analysis
asks a matrix's non-zero pattern (derived from the original's and the zeroed slices) and the
rows a constant input multiplies, and the rewrite keeps the slices that are not zeroed (read
from the original, any zeroed one it keeps set to zero). `ZeroedWeight` answers those from the
original; what asks for the whole values gets them written first (`io.weights.DataWriter.reserve`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxshrink.core import nonzero
from onnxshrink.io import weights


@dataclass
class ZeroedWeight:
    """`original` (a mapped weight) with each (axis, indices) of `slices` set to zero (to
    `zero`, a quantized weight's zero point broadcast against it, when given)."""

    original: np.ndarray
    slices: Sequence[tuple[int, np.ndarray]]
    zero: np.ndarray | None = None
    _pattern: list[nonzero.Pattern | None] = field(default_factory=list, repr=False)  # once made

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.original.shape)

    def blocks(self) -> Iterator[np.ndarray]:
        """The zeroed weight's row blocks, in order (C order), each made in one pass."""
        arr, zero = self.original, self.zero
        start = 0
        full = None if zero is None else np.broadcast_to(zero, arr.shape)
        keep = _keep_bits(arr, self.slices) if zero is None else None
        for block in weights.row_blocks(arr):
            stop = start + len(block)
            if keep is None:
                out = np.array(block)
            else:  # copied with the zeroed slices of the other axes cleared, in one pass
                out = np.empty(block.shape, block.dtype)
                np.bitwise_and(block.view(keep.dtype), keep, out=out.view(keep.dtype))
            fill = None if full is None else full[start:stop]
            for axis, idx in self.slices:
                if axis == 0:
                    rows = idx[(idx >= start) & (idx < stop)] - start
                    if len(rows):
                        zero_slice(out, 0, rows, fill)
                elif keep is None:
                    zero_slice(out, axis, idx, fill)
            yield out
            start = stop

    def pattern(self) -> nonzero.Pattern | None:
        """The non-zero pattern of the zeroed matrix, derived from the original's (a pass over
        the original when no earlier pass made it), without making the zeroed one; None when it
        cannot be derived (not a matrix, zeroed to a zero point that is not 0, many scattered
        zeros)."""
        if self.original.ndim != 2 or (self.zero is not None and np.any(self.zero)):
            return None
        if not self._pattern:
            rows = [idx for axis, idx in self.slices if axis == 0]
            cols = [idx for axis, idx in self.slices if axis == 1]
            self._pattern.append(
                nonzero.zeroed(
                    nonzero.pattern(self.original),
                    np.concatenate(rows) if rows else None,
                    np.concatenate(cols) if cols else None,
                )
            )
        return self._pattern[0]

    def rows(self, used: np.ndarray) -> np.ndarray:
        """The zeroed weight's rows `used` (a bool mask or indices along axis 0), in memory."""
        index = np.flatnonzero(used) if np.asarray(used).dtype == bool else np.asarray(used)
        return self.kept({0: index})

    def kept(self, index: dict[int, np.ndarray]) -> np.ndarray:
        """The zeroed weight sliced to `index` ({axis: sorted indices kept}), in memory."""
        if not self.original.ndim:
            return np.array(self.original)
        shape = tuple(len(index[a]) if a in index else n for a, n in enumerate(self.original.shape))
        blocks = list(self.kept_blocks(index))
        return np.concatenate(blocks) if blocks else np.zeros(shape, self.original.dtype)

    def kept_blocks(self, index: dict[int, np.ndarray]) -> Iterator[np.ndarray]:
        """The row blocks of the zeroed weight sliced to `index` ({axis: sorted indices kept}),
        read from the original: a zeroed slice that is kept is set to zero in a copy of each
        block it crosses (the others are the original's slices, uncopied)."""
        arr = self.original
        kept = {a: np.asarray(index[a]) if a in index else np.arange(n) for a, n in enumerate(arr.shape)}
        rest = [(a, idx) for a, idx in index.items() if a > 0]
        inner = [(a, np.flatnonzero(np.isin(kept[a], cut))) for a, cut in self.slices if a > 0]
        inner = [(a, at) for a, at in inner if len(at)]  # zeroed and kept: their place in the slice
        start = 0
        for block in weights.row_blocks(arr, index.get(0)):
            rows = kept[0][start : start + len(block)]
            start += len(block)
            for a, idx in rest:
                block = weights.take(block, idx, a)
            at_rows = [np.flatnonzero(np.isin(rows, cut)) for a, cut in self.slices if a == 0]
            cuts = [(0, at) for at in at_rows if len(at)] + inner
            if not cuts:
                yield block
                continue
            block = np.array(block)
            fill = None
            if self.zero is not None:
                fill = np.broadcast_to(self.zero, arr.shape)[rows]
                for a, idx in rest:
                    fill = np.take(fill, idx, axis=a)
            for axis, at in cuts:
                zero_slice(block, axis, at, fill)
            yield block

    def known_pattern(self) -> nonzero.Pattern | None:
        """The non-zero pattern of the zeroed matrix when it is known without a pass: derived by
        `pattern` already, or from the original's when a pass made that; else None."""
        if self._pattern:
            return self._pattern[0]
        before = nonzero.known(self.original)
        if not self.slices or before is None:
            return before
        return self.pattern()


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

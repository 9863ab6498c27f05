"""Constant elements of a tensor (`ConstInfo`) and their algebra: what the forward pass records
and what a handler's `constants` rule returns.

A constant is any element whose value does not depend on the graph inputs: a zeroed filter's
bias, BatchNorm's shift on a zeroed channel, sigmoid(0) = 0.5, every initializer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir


@dataclass
class ConstInfo:
    """Constant elements of one tensor.

    `mask` (bool) and `value` have the tensor's rank; each of their dims is either the tensor's
    static size or 1, meaning "the same for every index of that axis" (always 1 on dynamic axes,
    so a recorded constant never depends on a dynamic size). `value` is valid where `mask` holds.
    """

    mask: np.ndarray
    value: np.ndarray
    whole: bool = False  # value is the entire tensor as it is (initializers, folded constants)

    @property
    def full(self) -> bool:
        return bool(self.mask.all())

    @staticmethod
    def of_array(values: np.ndarray) -> ConstInfo:
        values = np.asarray(values)
        return ConstInfo(np.ones((1,) * values.ndim, dtype=bool), values, whole=True)

    @staticmethod
    def of_constant(t: gs.Constant) -> ConstInfo:
        """`of_array` of an initializer's values, read only when first asked for when they are
        not loaded yet (a weight written to disk only when mapped: `_LazyWhole`)."""
        lazy = getattr(t, "_values", None)
        if getattr(lazy, "deferred", None) is not None:
            return _LazyWhole(lazy)
        return ConstInfo.of_array(t.values)

    def matrix_pattern(self) -> Any:
        """The non-zero pattern (core.nonzero.Pattern) of a whole 2-D constant."""
        from onnxshrink.core import nonzero

        return nonzero.pattern(self.value)

    def matrix_rows(self, used: np.ndarray) -> np.ndarray:
        """Rows `used` (bool) of a whole 2-D constant."""
        return np.asarray(self.value[used])

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def matrix_dtype(self) -> np.dtype:
        return self.value.dtype

    def slice_constant(self, axis: int, size: int) -> np.ndarray:
        """Per index along `axis`: is the whole slice constant?"""
        m = self.mask
        other = tuple(a for a in range(m.ndim) if a != axis)
        return _per_index(np.asarray(m.all(axis=other)) if other else m, size)

    def slice_values(self, axis: int, size: int) -> np.ndarray:
        """Per index along `axis`: the value at the slice's first element (its value when the
        slice is uniform)."""
        return _per_index(self._rows(axis)[:, 0], size)

    def slice_zero(self, axis: int, size: int) -> np.ndarray:
        """Per index along `axis`: is the slice constant and zero everywhere?"""
        zero = ~(self._rows(axis) != 0).any(axis=1)
        return self.slice_constant(axis, size) & _per_index(zero, size)

    def slice_uniform(self, axis: int, size: int) -> np.ndarray:
        """Per index along `axis`: is the slice constant with one value (no variation elsewhere)?"""
        const = self.slice_constant(axis, size)
        v = self.value
        if all(v.shape[a] == 1 for a in range(v.ndim) if a != axis):
            return const
        rows = np.moveaxis(v, axis, 0).reshape(v.shape[axis], -1)
        return const & _per_index(rows.max(axis=1) == rows.min(axis=1), size)

    def _rows(self, axis: int) -> np.ndarray:
        """The values (at the mask's shape) as one row per index along `axis`."""
        v = np.broadcast_to(self.value, np.broadcast_shapes(self.value.shape, self.mask.shape))
        return np.moveaxis(v, axis, 0).reshape(v.shape[axis], -1)


class _LazyWhole(ConstInfo):
    """A whole initializer's ConstInfo whose values are loaded when first read (from its lazy
    values: the tensor itself may hold its sliced values by then, in the rewrite)."""

    def __init__(self, lazy: Any):  # no dataclass fields but these
        self.mask = np.ones((1,) * len(lazy.shape), dtype=bool)
        self.whole = True
        self._lazy = lazy
        self._loaded: np.ndarray | None = None

    @property
    def zeroed(self) -> Any:
        """What makes the values (`core.zeroed.ZeroedWeight`): their pattern and rows without them."""
        return self._lazy.deferred

    @property
    def value(self) -> np.ndarray:
        if self._loaded is None:
            self._loaded = np.asarray(self._lazy.load())
        return self._loaded

    @value.setter
    def value(self, v: np.ndarray) -> None:
        raise AttributeError("a whole initializer's values are its own")

    def matrix_pattern(self) -> Any:
        if self._loaded is None:
            derived = self.zeroed.pattern()
            if derived is not None:
                return derived
        return super().matrix_pattern()

    def matrix_rows(self, used: np.ndarray) -> np.ndarray:
        return np.asarray(self.zeroed.rows(used)) if self._loaded is None else super().matrix_rows(used)

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return tuple(self.zeroed.shape)

    @property
    def matrix_dtype(self) -> np.dtype:
        return self.zeroed.original.dtype



def _per_index(flags: np.ndarray, size: int) -> np.ndarray:
    """One entry per index of an axis of `size`, from a compressed (size-1) or full array."""
    flags = flags.reshape(-1)
    return np.broadcast_to(flags, (size,)) if flags.size == 1 else flags


def compress(mask: np.ndarray, value: np.ndarray) -> ConstInfo | None:
    """Drop axes along which mask and value do not vary; None when nothing is constant."""
    if not mask.any():
        return None
    value = np.where(mask, value, np.zeros((), value.dtype)) if value.shape == mask.shape else value
    for a in range(mask.ndim):
        if mask.shape[a] > 1 and _uniform_along(mask, a) and _uniform_along(value, a):
            mask = mask.take([0], axis=a)
            value = value.take([0], axis=a) if value.shape[a] > 1 else value
        elif value.shape[a] > 1 and mask.shape[a] == 1 and mask.all() and _uniform_along(value, a):
            value = value.take([0], axis=a)
    return ConstInfo(mask, value)


def _uniform_along(a: np.ndarray, axis: int) -> bool:
    if a.shape[axis] <= 1:
        return True
    first = a.take([0], axis=axis)
    return bool(np.all(a == first))


def expand_to(arr: np.ndarray, shape: Sequence[int | None]) -> np.ndarray | None:
    """Broadcast a compressed array to a static shape (dynamic dims stay 1); None if impossible."""
    target = []
    for have, want in zip(arr.shape, shape, strict=True):
        if want is None:
            if have != 1:
                return None
            target.append(1)
        else:
            target.append(want)
    return np.broadcast_to(arr, target)


def static_batch1(t: gs.Tensor) -> list[int] | None:
    """Static dims with a dynamic leading (batch) axis taken as 1; None if another dim is dynamic."""
    d = ir.dims(t)
    if d is None:
        return None
    out = []
    for i, v in enumerate(d):
        if isinstance(v, int) and v >= 0:
            out.append(v)
        elif i == 0:
            out.append(1)
        else:
            return None
    return out

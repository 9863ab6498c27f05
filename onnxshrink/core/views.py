"""The views of the analysis a handler receives.

- `ConstView` (forward, `constants`): which elements of the outputs are input-independent.
- `KeepView` (backward, `keep` and `settle`): which indices of the inputs the kept outputs need,
  and which axes must keep the same indices.
- `RewriteView` (`rewrite`): the kept sets, the original values, and the edits to make.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Protocol, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt
import onnx_graphsurgeon as gs

from onnxshrink.core.reasons import Reason
from onnxshrink.core.symbols import SymValue
from onnxshrink.core.values import ConstInfo

T = TypeVar("T")

#: indices of one axis: a boolean mask over the axis, or the kept indices themselves
IndexMask: TypeAlias = npt.ArrayLike

#: one attribute's value as a graph node holds it: a number, a string, a tensor, a graph, or a
#: list of numbers or strings
AttributeValue: TypeAlias = (
    int | float | str | bytes | gs.Tensor | gs.Graph | Sequence[int] | Sequence[float] | Sequence[str]
)


# ---------------------------------------------------------------------- views
class ConstView(Protocol):
    """What `constants` reads: the constant elements known so far (and the shape values of an
    earlier pass, when there was one)."""

    @property
    def opset(self) -> int: ...

    @property
    def tensors(self) -> Mapping[str, gs.Tensor]:
        """Every tensor of every scope, by name."""


    def sym(self, t: gs.Tensor | None) -> SymValue | None: ...

    def const(self, t: gs.Tensor | None) -> ConstInfo | None: ...

    def value(self, t: gs.Tensor | None) -> np.ndarray | None: ...

    def evaluate(self, node: gs.Node, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]: ...


class ShapeView(Protocol):
    """What `shape_value` and `refine_dims` read: the shape values known so far."""

    @property
    def opset(self) -> int: ...

    @property
    def tensors(self) -> Mapping[str, gs.Tensor]:
        """Every tensor of every scope, by name."""

    syms: dict[str, SymValue]

    def is_shape(self, t: gs.Tensor | None) -> bool: ...

    def sym(self, t: gs.Tensor | None) -> SymValue | None: ...

    def value(self, t: gs.Tensor | None) -> np.ndarray | None: ...


class KeepView(Protocol):
    """What `keep` and `settle` read and grow: kept index sets per tensor axis."""

    @property
    def opset(self) -> int: ...

    @property
    def tensors(self) -> Mapping[str, gs.Tensor]:
        """Every tensor of every scope, by name."""


    def const(self, t: gs.Tensor | None) -> ConstInfo | None: ...

    def value(self, t: gs.Tensor | None) -> np.ndarray | None: ...

    def sym(self, t: gs.Tensor | None) -> SymValue | None: ...

    def size(self, t: gs.Tensor, axis: int) -> int | None: ...

    def kept(self, t: gs.Tensor, axis: int) -> np.ndarray | None: ...

    def periodic(self, t: gs.Tensor, axis: int) -> bool: ...

    def adopt(self, t: gs.Tensor, axis: int, n: int) -> bool: ...

    def reason_ids(self, t: gs.Tensor, axis: int) -> np.ndarray: ...

    def why(self, t: gs.Tensor, axis: int) -> list[Reason | None]:
        """Why each index of the axis is kept so far (None: not kept), e.g. the interface."""

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T: ...

    def demand(self, t: gs.Tensor | None, pin: bool = True) -> None: ...

    def is_read(self, t: gs.Tensor) -> bool: ...

    def keep(
        self, t: gs.Tensor, axis: int, mask: IndexMask, reason: Reason = ..., why: np.ndarray | None = None
    ) -> None: ...

    def need(self, t: gs.Tensor, axis: int, mask: IndexMask, why: np.ndarray | None = None) -> None:
        """The kept outputs read these indices of input `t` (a dependence the handler derives,
        e.g. from a weight's non-zeros). `keep` is for what the op's structure requires. With
        `--analysis replay`, needs are found by replaying the node instead."""

    def pin(self, t: gs.Tensor, axis: int | None = None, reason: Reason = ...) -> None: ...

    def pin_refs(self, sym: SymValue, reason: Reason) -> None:
        """Keep whole the tensor axes a shape value refers to (it is used as data)."""

    def couple(
        self, t1: gs.Tensor, a1: int, t2: gs.Tensor, a2: int, meet: gs.Node | None = None
    ) -> None: ...

    def couple_map(
        self, small: gs.Tensor, sa: int, big: gs.Tensor, ba: int, idx: np.ndarray
    ) -> None: ...

    def block(
        self, x: gs.Tensor, in_axes: list[int], y: gs.Tensor, out_axes: list[int], site: gs.Node
    ) -> None: ...

    def unit(
        self,
        t1: gs.Tensor,
        a1: int,
        idx1: np.ndarray,
        t2: gs.Tensor,
        a2: int,
        idx2: np.ndarray,
        kind: str | None = None,
    ) -> None:
        """Index idx1[k] of t1's axis a1 goes only with idx2[k] of t2's axis a2 (for the coupled
        groups). `kind`: where an op offers several ways to cut the same indices into units,
        the kind of unit this tie makes (the groups keep the ties of the kinds they are asked
        for, `CouplingLog.kinds`); None: a tie every way holds."""

    def normalizes(self, t: gs.Tensor, axis: int) -> None: ...

    def selects(self, t: gs.Tensor, axis: int) -> None: ...

    def claim(self, node: gs.Node, i: int) -> None: ...

    def barrier(self, node: gs.Node, reason: Reason | None = None) -> None: ...

    def note(self, node: gs.Node, text: str) -> None: ...


class RewriteView(Protocol):
    """What `rewrite` reads (the analysis, the original values) and the edits it makes."""

    @property
    def opset(self) -> int: ...

    @property
    def tensors(self) -> Mapping[str, gs.Tensor]:
        """Every tensor of every scope, by name."""


    def kept(self, t: gs.Tensor, axis: int) -> np.ndarray | None: ...

    def kept_count(self, t: gs.Tensor, axis: int) -> int | None: ...

    def is_read(self, t: gs.Tensor) -> bool: ...

    def kept_static(self, t: gs.Tensor, axis: int) -> np.ndarray: ...

    def kept_part(self, t: gs.Tensor, values: np.ndarray) -> np.ndarray: ...

    def const(self, t: gs.Tensor | None) -> ConstInfo | None: ...

    def value(self, t: gs.Tensor | None) -> np.ndarray | None: ...

    def original(self, t: gs.Tensor | None) -> np.ndarray | None: ...

    def sym(self, t: gs.Tensor | None) -> SymValue | None: ...

    def current(self, t: gs.Tensor) -> np.ndarray: ...

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T: ...

    def evaluate(self, node: gs.Node, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]: ...

    def constant(self, values: np.ndarray, hint: str) -> gs.Constant: ...

    def replace_input(self, node: gs.Node, i: int, values: np.ndarray) -> gs.Constant: ...

    def add_node(
        self,
        op: str,
        inputs: list[gs.Tensor],
        hint: str,
        attrs: dict[str, AttributeValue] | None = None,
        dtype: npt.DTypeLike | None = None,
    ) -> gs.Variable: ...

    def add_to_output(self, node: gs.Node, out_index: int, addend: gs.Tensor) -> None: ...

    def insert_after(
        self,
        node: gs.Node,
        out_index: int,
        op: str,
        operands: list[gs.Tensor],
        hint: str,
        suffix: str = "raw",
        attrs: dict[str, AttributeValue] | None = None,
    ) -> gs.Variable: ...

    def bypass(self, node: gs.Node, i: int) -> None: ...

    def absorb_into_reader(self, node: gs.Node, out_index: int, values: np.ndarray, channels: int) -> bool: ...

    def add_constant(
        self,
        node: gs.Node,
        out_index: int,
        values: np.ndarray,
        channels: int,
        into: str | None = None,
    ) -> None: ...

    def slice1d(self, t: gs.Tensor, p: int) -> gs.Variable: ...

    def concat1d(self, parts: list[gs.Tensor]) -> gs.Variable: ...

    def ones_map(self, x: gs.Tensor, dtype: npt.DTypeLike) -> gs.Tensor: ...

    def record_fold(self, node: gs.Node, channels: int, into: str) -> None: ...

    def check_removed_constant(
        self, node: gs.Node, c: ConstInfo | None, axis: int, removed: np.ndarray
    ) -> None: ...


#: any of the views, for helpers that only read values (`reader.value(t)`, `reader.const(t)`)
Reader = ConstView | KeepView | RewriteView

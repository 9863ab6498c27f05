"""The handler contract: what one op family declares, and the views of the analysis it receives.

A handler is the only place that knows what its ops mean. The analysis and the rewrite call it
at each step, through one of three views:

- `ConstView` (forward, `constants`): which elements of the outputs are input-independent.
- `KeepView` (backward, `keep` and `settle`): which indices of the inputs the kept outputs need,
  and which axes must keep the same indices.
- `RewriteView` (`rewrite`): the kept sets, the original values, and the edits to make.

Rules every handler follows (the analysis checks the first two):
1. `keep` demands every input the node reads (`ks.demand(t)`, or `ks.barrier(node)`), with
   `pin=False` only for inputs whose every axis it constrains itself. What the kept outputs
   read is `ks.need`; what the op's structure requires (tied axes, whole blocks, equal groups,
   constants it cannot absorb) is `ks.couple`, `ks.pin` and `ks.keep`.
2. Sets only grow: a handler adds to what is kept, never removes.
3. A removed input index that a kept output still reads must be a constant the handler absorbs
   in `rewrite` (`rw.check_removed_constant`).

The static facts (`sizes_only`, `weight_axes`, `param_inputs`, `macs`, ...) are read from a
node's op type and attributes only, so that binding and reports can ask them of an ONNX node
before any analysis.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxshrink.analyze.constants import ConstInfo
from onnxshrink.analyze.keep import Reason
from onnxshrink.analyze.shapes import SymValue

T = TypeVar("T")
Dims = list[int | str | None]


# ---------------------------------------------------------------------- views
class ConstView(Protocol):
    """What `constants` reads: the constant elements known so far (and the shape values of an
    earlier pass, when there was one)."""

    opset: int
    tensors: Mapping[str, gs.Tensor]

    def sym(self, t: gs.Tensor | None) -> SymValue | None: ...

    def const(self, t: gs.Tensor | None) -> ConstInfo | None: ...

    def value(self, t: gs.Tensor | None) -> np.ndarray | None: ...

    def evaluate(self, node: gs.Node, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]: ...


class ShapeView(Protocol):
    """What `shape_value` and `refine_dims` read: the shape values known so far."""

    opset: int
    tensors: Mapping[str, gs.Tensor]
    syms: dict[str, SymValue]

    def is_shape(self, t: gs.Tensor | None) -> bool: ...

    def sym(self, t: gs.Tensor | None) -> SymValue | None: ...

    def value(self, t: gs.Tensor | None) -> np.ndarray | None: ...


class KeepView(Protocol):
    """What `keep` and `settle` read and grow: kept index sets per tensor axis."""

    opset: int
    tensors: Mapping[str, gs.Tensor]

    def const(self, t: gs.Tensor | None) -> ConstInfo | None: ...

    def value(self, t: gs.Tensor | None) -> np.ndarray | None: ...

    def sym(self, t: gs.Tensor | None) -> SymValue | None: ...

    def size(self, t: gs.Tensor, axis: int) -> int | None: ...

    def kept(self, t: gs.Tensor, axis: int) -> np.ndarray | None: ...

    def periodic(self, t: gs.Tensor, axis: int) -> bool: ...

    def adopt(self, t: gs.Tensor, axis: int, n: int) -> bool: ...

    def reason_ids(self, t: gs.Tensor, axis: int) -> np.ndarray: ...

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T: ...

    def demand(self, t: gs.Tensor | None, pin: bool = True) -> None: ...

    def is_read(self, t: gs.Tensor) -> bool: ...

    def keep(
        self, t: gs.Tensor, axis: int, mask: Any, reason: Reason = ..., why: np.ndarray | None = None
    ) -> None: ...

    def need(self, t: gs.Tensor, axis: int, mask: Any, why: np.ndarray | None = None) -> None:
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
        query_ranks: bool | None = None,
    ) -> None: ...

    def normalizes(self, t: gs.Tensor, axis: int) -> None: ...

    def claim(self, node: gs.Node, i: int) -> None: ...

    def barrier(self, node: gs.Node, reason: Reason | None = None) -> None: ...

    def note(self, node: gs.Node, text: str) -> None: ...


class RewriteView(Protocol):
    """What `rewrite` reads (the analysis, the original values) and the edits it makes."""

    opset: int
    tensors: Mapping[str, gs.Tensor]

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
        attrs: dict[str, Any] | None = None,
        dtype: Any = None,
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
        attrs: dict[str, Any] | None = None,
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

    def ones_map(self, x: gs.Tensor, dtype: Any) -> gs.Tensor: ...

    def record_fold(self, node: gs.Node, channels: int, into: str) -> None: ...

    def check_removed_constant(
        self, node: gs.Node, c: ConstInfo | None, axis: int, removed: np.ndarray
    ) -> None: ...


#: any of the views, for helpers that only read values (`reader.value(t)`, `reader.const(t)`)
Reader = ConstView | KeepView | RewriteView


# ---------------------------------------------------------------------- static facts
@dataclass(frozen=True)
class OpNode:
    """A node as static facts see it: its op, attributes and input names (from an ONNX
    NodeProto, before any analysis, or from a gs.Node)."""

    op: str
    attrs: Mapping[str, Any]
    inputs: tuple[str, ...]
    domain: str = ""

    @staticmethod
    def of(node: onnx.NodeProto | gs.Node) -> OpNode:
        if isinstance(node, onnx.NodeProto):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            return OpNode(node.op_type, attrs, tuple(node.input), node.domain)
        names = tuple(t.name if t is not None else "" for t in node.inputs)
        return OpNode(node.op, node.attrs, names, node.domain or "")

    def has_input(self, i: int) -> bool:
        return i < len(self.inputs) and bool(self.inputs[i])


@dataclass(frozen=True)
class WeightAxes:
    """How an op reads a weight input: its output-channel axis, its input-channel axis (None
    for a vector), and the layer family, whose framework layout it has (`linear`: torch stores
    [out, in]; `conv`, `embedding`, `vector`: stored as the op reads them)."""

    out: int
    inp: int | None
    family: str


@dataclass(frozen=True)
class Quantized:
    """How an op reads an integer input as real numbers: (q - zero point) * scale. The scale is
    the product of the inputs at `scales` (none: the op applies no scale of its own: the graph
    may, after it), the zero point the input at `zero_point` (None: 0); each a scalar, or a
    vector along `axis` of the input. Block-wise (`block` > 0: MatMulNBits): the input is
    [rows, blocks, bytes] of codes packed `bits` to a byte, a scale and zero point per (row,
    block), the zero points packed alike."""

    scales: tuple[int, ...]
    zero_point: int | None
    axis: int
    bits: int = 0
    block: int = 0


@dataclass(frozen=True)
class HeadAxis:
    """Where a fused attention op's query heads are (for the coupled groups, which cannot see
    heads packed inside the op): output `output`'s axis `axis` holds them in consecutive blocks
    of `size`; a head's query and key dims number `head_dim`; `rep` consecutive query heads
    read one K/V head."""

    output: int
    axis: int
    size: int
    head_dim: int
    #: query heads per K/V head (grouped-query attention; consecutive query heads share one)
    rep: int = 1
    #: the (input, axis) pairs holding K/V heads (alone, or packed with the query heads)
    kv: tuple[tuple[int, int], ...] = ()


# ---------------------------------------------------------------------- the handler
class Handler:
    """One op family. Subclasses override what differs from "a barrier that folds nothing"."""

    #: inputs read only for their sizes (Shape, Size): masks and pruning leave what they read
    sizes_only: ClassVar[tuple[int, ...]] = ()
    #: evaluated with onnxruntime (heavy kernels) rather than onnx's reference evaluator
    evaluate_with_ort: ClassVar[bool] = False
    #: a function of its inputs (random ops are not): constant inputs give a constant output
    deterministic: ClassVar[bool] = True
    #: output 0 is input 0 itself (Identity): a name that stands for its input
    is_alias: ClassVar[bool] = False

    # -------------------------------------------------------------- analysis
    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """Forward: per output, its input-independent elements and their values (None: none)."""
        return None

    def body_constants(self, node: gs.Node, ctx: ConstView) -> Mapping[str, ConstInfo] | None:
        """For an op with subgraphs, before its bodies are walked: the constant elements of the
        bodies' inputs, by name (None: none, every body input is live)."""
        return None

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        """The symbolic value of output 0 when this node computes a shape value (an integer
        vector of sizes) from shape-valued inputs; None when it computes data."""
        return None

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        """Output 0's dims where shape inference left them unknown but the inputs tell."""
        return None

    def refine_output_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> list[Dims | None]:
        """Every output's dims where shape inference left them unknown (ops with several
        outputs override this; by default output 0's, `refine_dims`)."""
        return [self.refine_dims(node, consts, view)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        """Backward: add what the inputs must keep for the kept outputs; tie axes."""
        ks.barrier(node)

    def settle(self, node: gs.Node, ks: KeepView) -> None:
        """Structural needs decided once the closure is stable (equal groups, non-empty parts)."""
        return None

    def may_drop_inputs(self, node: gs.Node) -> tuple[int, ...]:
        """Inputs that may lose every index along an axis (e.g. a Concat branch removed whole)."""
        return ()

    # -------------------------------------------------------------- rewrite
    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        """After initializers are sliced: fix attributes, shape inputs, fold removed constants."""
        return None

    def absorb_addend(self, node: gs.Node, i: int, values: np.ndarray, rw: RewriteView) -> bool:
        """Take a constant added to input i into the node's own constants (True if done)."""
        return False

    # -------------------------------------------------------------- static facts
    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        """How input i (a constant of `rank`) is read, when it is a layer's weight or a
        per-channel vector (bias, norm scale)."""
        return None

    def quantized_input(self, node: OpNode, i: int, rank: int) -> Quantized | None:
        """When input i (of `rank`) holds quantized integers: how the op dequantizes them (a
        quantized weight "is zero" where it equals its zero point)."""
        return None

    def applied_scale(self, node: gs.Node, i: int) -> np.ndarray | None:
        """For a quantized input whose op applies no scale of its own (`Quantized.scales` empty):
        the scale the graph applies after the op, when the graph shows it (None: unknown)."""
        return None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        """Input index of each framework parameter this op reads ({"weight": 1, "bias": 2});
        `constant` says which inputs are initializers."""
        return {}

    def passes_axes(self, node: OpNode, i: int, rank: int) -> list[int] | None:
        """When output 0 is input i with its axes permuted (Identity, Cast, Transpose): the
        input axis of each output axis; else None."""
        return None

    def index_inputs(self, node: OpNode) -> Mapping[int, tuple[int, int]]:
        """Inputs that hold indices into another: {index input: (table input, axis)}."""
        return {}

    def input_dims(
        self, node: OpNode, dims: Callable[[str], Sequence[int | None] | None]
    ) -> Mapping[int, Mapping[int, int]]:
        """Sizes the op requires of its inputs' axes, derived from its attributes and the static
        dims of its other inputs (`dims`: a tensor's dims by name, None where unknown):
        {input index: {axis: size}}. The sizes chosen for a model's dynamic input dims follow
        them (a fused attention's past cache: its head size is the query's)."""
        return {}

    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        """Inputs whose elements output 0 holds with their values unchanged (moved, selected or
        repeated: Reshape, Gather's data, Concat), to follow a graph input to what compares it."""
        return ()

    def extends(self, node: OpNode) -> dict[int, tuple[int, int]]:
        """Outputs that are an input extended along an axis, the rest of it unchanged (a KV
        cache's present from its past: Concat(past, new) on the sequence axis, a fused attention's
        present_key from past_key): output index -> (input index, axis). A graph input and the
        graph output that extends it are one state the runtime feeds back, which may lose indices
        on its other axes (analyze/cache.py)."""
        return {}

    def compares(self, node: OpNode) -> bool:
        """Output 0 compares inputs 0 and 1 elementwise (Equal, Less, ...): a constant an
        integer input is compared with is a value to draw for it (validate.compared_values)."""
        return False

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        """Multiply-accumulates of one run, from static shapes (dynamic dims as 1)."""
        return 0

    def multiplies(self, node: OpNode) -> bool:
        """Its output is the elementwise product of its operands (a gate, `silu(g) * u`): how
        the coupled groups tell a gated neuron from channels summed (a residual Add)."""
        return False

    def constant_value(self, node: OpNode) -> np.ndarray | None:
        """The value a node produces without inputs (a Constant node), else None."""
        return None

    def constant_tensor(self, node: OpNode, name: str) -> onnx.TensorProto | None:
        """That value as a tensor named `name` (Constant: the node's own tensor, not a copy)."""
        value = self.constant_value(node)
        return None if value is None else onnx.numpy_helper.from_array(np.asarray(value), name)

    def head_axis(self, node: gs.Node) -> HeadAxis | None:
        """For a fused attention op whose keep closure ties each head's (or K/V head's) slices
        together: where its query heads are, so a group holding them is a head (or a K/V
        group with its query heads), of the right head_dim."""
        return None

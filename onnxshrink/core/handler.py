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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, SupportsFloat, SupportsInt, cast

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxshrink.core.symbols import SymValue
from onnxshrink.core.values import ConstInfo
from onnxshrink.core.views import AttributeValue, ConstView, KeepView, RewriteView, ShapeView

Dims = list[int | str | None]


# ---------------------------------------------------------------------- static facts
@dataclass(frozen=True)
class OpNode:
    """A node as static facts see it: its op, attributes and input names (from an ONNX
    NodeProto, before any analysis, or from a gs.Node)."""

    op: str
    attrs: Mapping[str, AttributeValue]
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



# The op's schema, not the type checker, says which kind each attribute is: these read one of a
# node (an OpNode, or a graph's gs.Node) as that kind: an INT, FLOAT, INTS or STRING attribute,
# `default` when it is absent.
def int_attr(node: OpNode | gs.Node, name: str, default: int = 0) -> int:
    return int(cast(SupportsInt, node.attrs.get(name, default)))


def float_attr(node: OpNode | gs.Node, name: str, default: float = 0.0) -> float:
    return float(cast(SupportsFloat, node.attrs.get(name, default)))


def ints_attr(node: OpNode | gs.Node, name: str, default: Sequence[int] = ()) -> list[int]:
    return [int(v) for v in cast(Sequence[SupportsInt], node.attrs.get(name, default))]


def str_attr(node: OpNode | gs.Node, name: str, default: str = "") -> str:
    value = node.attrs.get(name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


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
    #: a parameter may also hold these axes of the input, in order (DynamicQuantizeLSTM's
    #: per-column scale [dirs, 4 * hidden] of W [dirs, input, 4 * hidden]: (0, 2))
    axes: tuple[int, ...] = ()


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


@dataclass(frozen=True)
class IntegerProduct:
    """Output 0 sums products of inputs 0 and 1, which integer kernels compute exactly from
    quantized operands: a convolution (`window`: the attributes ConvInteger takes, as the op has
    them) or a matrix product (MatMulInteger, after the transposes `trans_a`, `trans_b`; times
    `alpha`). A weight's per-channel scale runs along input 1's axis `out_axis`; `bias`: the
    input added after (times `beta`), None: none."""

    window: Mapping[str, AttributeValue] | None
    out_axis: int
    bias: int | None = None
    trans_a: bool = False
    trans_b: bool = False
    alpha: float = 1.0
    beta: float = 1.0


@dataclass(frozen=True)
class Dequantizes:
    """Output 0 is input 0 dequantized elementwise, (q - zero point) * scale: the scale input 1,
    the zero point input 2 (absent: 0), per tensor or along `axis` (as the op has it: negative
    counts from the end), in blocks of `block` along it (0: not block-wise)."""

    axis: int
    block: int


@dataclass(frozen=True)
class Quantizes:
    """Output 0 is input 0 quantized: of its zero point's type (input 2), without one `dtype`."""

    dtype: int


@dataclass(frozen=True)
class RuntimeQuantized:
    """The op may quantize a float operand at run time, as its INT attribute `attribute` asks
    (0: it computes in float32)."""

    attribute: str


#: an op's part in a quantized model's arithmetic, as the proof computes it (Handler.qdq_form)
QdqForm = IntegerProduct | Dequantizes | Quantizes | RuntimeQuantized

class InputTypes(Protocol):
    """A node's inputs as shape inference knows them, for `Handler.output_types`."""

    def dims(self, i: int) -> Dims | None:
        """Input i's dims (ints, symbolic names, None where unknown); None when its rank is
        unknown too."""
        ...

    def known_dims(self, i: int) -> Dims:
        """Input i's dims, which the rule needs: LookupError when unknown (the inference then
        stops, as when one of its own rules fails)."""
        ...

    def dtype(self, i: int) -> int:
        """Input i's ONNX element type."""
        ...

    def float_op_dims(self, op: str, inputs: Sequence[int], channels_last: bool = False) -> Dims | None:
        """Output 0's dims if the node were the float op `op` (Conv, AveragePool) of its inputs
        `inputs`, with its attributes; for `channels_last`, input 0 and the output are laid out
        [N, spatial..., C]. None where the shape inference of the node itself knows them or
        where neither does."""
        ...


@dataclass(frozen=True)
class BiasSlot:
    """Where a layer op that reads a weight matrix at input `weight` adds one constant per
    output channel, so that a constant added to its output can be folded into it (a prune's
    compensation): output 0's channel axis (`axis`; -1: the last), the input holding the op's
    own bias (`bias`; None: it has none, an Add after it may hold one) with its channels at
    (axis, rank) as it broadcasts (`bias_layout`), the rank the weight must have (`weight_rank`;
    None: any), the attributes whose ratio scales a value added to the output into the bias
    (`gain`: Gemm's alpha / beta), and the attribute that must be 1 (`groups`: a grouped Conv
    maps input channels to output channels by group)."""

    axis: int
    bias: int | None = None
    bias_layout: tuple[int, int] = (0, 1)
    weight: int = 1
    weight_rank: int | None = None
    gain: tuple[str, str] | None = None
    groups: str | None = None


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
    #: its bodies are alternatives, one of which runs, and output j is that body's output j
    #: (If's branches): what it returns is made there, and only one body's work is done
    runs_one_body: ClassVar[bool] = False

    #: a fused attention op: the attributes declaring its (query heads, K/V heads), which a
    #: runtime's config repeats (K/V heads: the query heads' count when the attribute is absent);
    #: None for any other op
    head_attrs: ClassVar[tuple[str, str] | None] = None
    #: a layer op that adds a bias per output channel: where (see BiasSlot); None for other ops
    channel_bias: ClassVar[BiasSlot | None] = None

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

    def sizes_value(self, node: OpNode, shapes: Sequence[list[int] | None]) -> np.ndarray | None:
        """Its output from its inputs' static shapes alone (`shapes`, None where unknown), for a
        node that reads only sizes (Shape, Size), else None."""
        return None

    def reads_along(
        self, node: OpNode, i: int, axis: int, dims: Sequence[int], values: Mapping[str, np.ndarray]
    ) -> np.ndarray | None:
        """The indices along `axis` of input i (of static shape `dims`) whose values it reads, from
        its constant inputs (`values`, by name); None: every index (what an op reads by default)."""
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

    def qdq_form(self, node: OpNode) -> QdqForm | None:
        """Its part in a quantized model's arithmetic, which the proof computes as integer kernels
        do (proof/qdq.py): a product of dequantized operands it runs in integers, the
        DequantizeLinear making an operand, the QuantizeLinear typing one, an op whose run-time
        quantization it turns off. None: it computes as it is."""
        return None

    def adds(self, node: OpNode) -> bool:
        """Its output is the elementwise sum of its operands (a residual connection's Add): how
        the coupled groups find a block's residual branches."""
        return False

    #: onnx's and onnxruntime's shape inference know no output types of this op (onnxruntime's
    #: QOperator contrib ops its symbolic shape inference lacks): `output_types` declares them
    types_unknown_to_inference: ClassVar[bool] = False

    def output_types(self, node: OpNode, inputs: InputTypes) -> list[tuple[Dims | None, int] | None] | None:
        """For an op `types_unknown_to_inference`: each output's dims (None: unknown, rank too)
        and ONNX element type, from its inputs' (None for an output, or for all: left as shape
        inference left it)."""
        return None

    #: its output is a value of its own, read from no input (Constant)
    is_constant: ClassVar[bool] = False
    #: its outputs are drawn at random, not computed (RandomNormal, Bernoulli): never folded
    draws_random: ClassVar[bool] = False

    def form_since(self, op: str) -> int:
        """The oldest opset of the form in which the rewrite inserts a node of `op`, where that
        form is newer than the op (Add's multidirectional broadcasting: 7)."""
        return 1

    def resized_bounds(
        self, node: OpNode, consts: Mapping[str, np.ndarray], base: Dims, now: Dims
    ) -> list[list[int]] | None:
        """For an op that clamps bounds into its input's size (Slice): its constant bounds
        (starts, ends, axes, steps; `consts`: constant values by name) rewritten to output one
        element more (or fewer) along each axis that is dynamic in the model (`base`: the input's
        dims there) and whose output size varies with that size (`now`: the input's dims at a
        probe's sizes). None: no such axis, or bounds that are not constants."""
        return None

    def body_runs(self, node: OpNode, shapes: Mapping[str, list[int]], scalars: Mapping[str, int]) -> int:
        """How many times an op with bodies runs them, where the graph fixes it (a Loop's trip
        count, a Scan's sequence length; `shapes`: static dims and `scalars`: integer scalars'
        values, by name); else 1."""
        return 1

    def carried(self, node: OpNode) -> list[tuple[int, int, int]]:
        """The values an op carries through the runs of its body (a Loop's), in its outputs'
        order: (its initial value's input, the body's input, the body's output)."""
        return []

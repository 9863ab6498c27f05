"""Coupled channel groups: every set of parameter slices that can only be removed together.

The groups come from the keep closure itself (`analyze.coupling`): the analysis runs once on the
model with a `CouplingLog`, and every connected set of indices that holds a layer's weight
channels is a group (a conv channel with its BatchNorm and the next layer's input columns; a
residual stream's channel in every conv that writes or reads it; a head of head_dim channels
in Q, K, V and the output projection; a K/V head with the query heads that read it; a gated
FFN neuron's gate and up rows and down column). Groups of the same parameter slices form a
*layer* (what a per-layer pruning ratio applies to).

A group is *exact* when removing it (zeroing every member) shrinks exactly to the model without
it. It is not when the closure reads its axis whole for a stated reason (a LayerNorm over the
hidden size, a graph input or output, an unsupported op). Whether the closure removes a group
when it is zeroed is checked the way the shrink will see it: a prune checks the groups it
chose on the analysis of its reference (`kept_when_zeroed`: those kept are not exact, and it
chooses again). A listing (`find_groups(verify=True)`) says of each group whether it is removable
on its own: each exact group is zeroed alone and the analysis run (`_verify_alone`), while the
model is small enough (`ALONE_BUDGET`). Zeroed together is not the same question, in either
direction: zeroing more may leave a consumer dead that the group alone keeps live (the last live
channel of a Conv's input, in a residual branch whose block group, zeroed with it, empties the
branch: alone, the Conv keeps one channel, the group's), and may empty an axis the group alone
does not. Above the budget, half of each layer is zeroed at a time (`_verify_halves`, two
analyses), and the listing says that this is what was checked.

Quantized weights are weights: an integer constant an op dequantizes (`Handler.quantized_input`:
a DequantizeLinear's input, a QLinearConv's weight or int32 bias, a MatMulInteger's weight) is a
member like a float one, read in the role its dequantized value has (a Conv's weight through
the DequantizeLinear that feeds it). Its "zero" is its zero point (per tensor or per channel),
its magnitude that of its dequantized values; the scales and zero points that slice with it are
not zeroed (its channel is zero whatever its scale). How its zero point is read: `quantized`.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze import Analysis, analyze, lookup
from onnxshrink.analyze.coupling import CouplingLog, Partition
from onnxshrink.bind.graph import ModelIndex, Site, is_fused_batchnorm, module_of_dynamo_node
from onnxshrink.core.handler import Handler, OpNode, WeightAxes
from onnxshrink.core.reasons import LIVE
from onnxshrink.core.registry import Lookup
from onnxshrink.io.model import Scratch
from onnxshrink.io.weights import WeightStore
from onnxshrink.prepare import FLOAT_TYPES, default_opset, prepare
from onnxshrink.prune import spill
from onnxshrink.quantized import Dequant, Moved, readings, same_zero

SCHEMA = "onnxshrink.groups/1"
KV_ALONE = (
    "a K/V head goes with all the query heads that read it, which are units by rank here "
    "(--units head); --units kv_group prunes K/V heads with their query heads"
)
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class ParamRef:
    """A framework parameter the exporter recorded for a slice (the module scope on the node that
    reads it, and the input's role), and the slice's axis in the framework's own layout."""

    name: str
    axis: int
    shape: tuple[int, ...]


@dataclass(slots=True)
class Member:
    """The indices `indices` along `axis` of initializer `initializer`, as node `node` reads it.
    Slotted: a 1.1 B LLaMA has 848 K members, held through the prune, and each one's own
    attribute dict cost 120 bytes more and one more object for every collection to scan."""

    initializer: str
    axis: int
    indices: np.ndarray
    node: str
    op: str
    role: str | None  # the reading op's name for the input: "weight", "bias", ...
    side: str  # "out": the op's output channels; "in": its input channels; "": neither
    params: list[ParamRef]
    tensor: str  # its name in the analysis (an untied copy when several nodes share it)
    input_index: int = 0
    matrix: bool = False  # a layer's weight matrix (not a per-channel vector)
    family: str = ""  # the reading op's layer family: conv, linear, embedding, vector
    site: tuple[str, int] = ("", 0)  # (first output of the reading node, input index)
    # an input-side weight matrix: the activation it multiplies, (tensor, axis, indices)
    data: tuple[str, int, np.ndarray] | None = None

    def with_indices(self, indices: np.ndarray) -> Member:
        """A copy holding `indices` (a template's, per component it holds), every field by
        hand: faster than dataclasses.replace, which a member per component made slow."""
        return Member(
            self.initializer, self.axis, indices, self.node, self.op, self.role, self.side, self.params,
            self.tensor, self.input_index, self.matrix, self.family, self.site, self.data,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "initializer": self.initializer,
            "axis": self.axis,
            "indices": [int(i) for i in self.indices],
            "node": self.node,
            "op": self.op,
            "role": self.role,
            "side": self.side,
            "params": [{"name": p.name, "axis": p.axis, "shape": list(p.shape)} for p in self.params],
        }


# A member template (one per weight axis and node reading it), the activation it multiplies per
# component (`_Finder._data_of`), and the components it holds with the indices of each
Template = tuple[Member, dict[int, tuple[str, int, np.ndarray]], list[int], list[np.ndarray]]


@dataclass
class Unit:
    """What one group is: `kind` channel | neuron | gated_neuron | head | kv_group | conv_group |
    recurrent_unit | width | block; `channels` its channels in the layer that produces it (head_dim for a head or
    a K/V head, the channels of one group of a grouped conv; 1 for a block). A `width` group is
    a channel of a residual stream some LayerNorm or RMSNorm normalizes (the hidden size); a
    `block` is a repeated block's residual branches whole (`branches` of them: a transformer
    layer's attention and MLP), every parameter they hold, removed when zeroed."""

    kind: str
    channels: int
    head_dim: int | None = None
    query_heads: int | None = None
    branches: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "channels": self.channels}
        if self.head_dim is not None:
            out["head_dim"] = self.head_dim
        if self.query_heads is not None:
            out["query_heads"] = self.query_heads
        if self.branches is not None:
            out["branches"] = self.branches
        return out



@dataclass
class Group:
    id: int
    layer: int
    members: list[Member]
    unit: Unit
    params: int  # parameters removed with it
    exact: bool
    reason: str | None = None  # why it is not exact

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "layer": self.layer,
            "exact": self.exact,
            "reason": self.reason,
            "unit": self.unit.to_dict(),
            "size": self.unit.channels,
            "params": self.params,
            "members": [m.to_dict() for m in self.members],
        }


@dataclass
class Layer:
    """Groups over the same parameter slices (a conv's output channels with everything coupled
    to them; a layer's heads): what a per-layer ratio applies to."""

    id: int
    name: str
    groups: list[int]
    kind: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "kind": self.kind, "groups": self.groups}


@dataclass
class Block:
    """Where a block group's residual stream is read (the stream operand of its first branch's
    Add, `before`) and left (its last Add's output, `after`), and the stream's channel axis:
    what its influence is measured on."""

    before: str
    after: str
    axis: int


@dataclass
class GroupSet:
    groups: list[Group]
    layers: list[Layer]
    model: str = ""
    untied: dict[str, str] = field(default_factory=dict)  # analysis tensor -> initializer
    # the members' values, by analysis tensor (not written to JSON)
    arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    # sum of |w|^p per index of (tensor, axis, p), computed once (prune.importance)
    norms: dict[tuple[str, int, int], np.ndarray] = field(default_factory=dict, repr=False)
    # quantized members (by analysis tensor): their zero points and scales
    dequant: dict[str, Dequant] = field(default_factory=dict, repr=False)
    # the scales and zero points of quantized members: sliced with their channels, never zeroed
    quant_params: set[str] = field(default_factory=set, repr=False)
    blocks: dict[int, Block] = field(default_factory=dict, repr=False)  # block group id -> its stream
    # how `exact` was checked: "alone" (each group zeroed on its own), "halves" (half of each
    # layer zeroed together), "" (not checked: the prune checks the groups it chooses)
    checked: str = ""

    def exact(self) -> list[Group]:
        return [g for g in self.groups if g.exact]

    def not_exact(self, kept: Mapping[int, str]) -> None:
        """The groups an analysis keeps some index of ({group id: why}) are not exact, for that."""
        for gid, why in kept.items():
            self.groups[gid].exact, self.groups[gid].reason = False, why

    def zeroed_members(self, groups: Iterable[Group]) -> list[Member]:
        """The members whose slices zeroing `groups` sets to zero (or to their zero point)."""
        return [m for g in groups for m in g.members if m.tensor not in self.quant_params]

    def zero_of(self, tensor: str) -> np.ndarray | None:
        """What "zero" is for a member tensor: its zero point when it is quantized, else None (0)."""
        d = self.dequant.get(tensor)
        return d.fill() if d is not None else None

    def real(self, tensor: str) -> np.ndarray:
        """A member's values as real numbers (dequantized when quantized)."""
        values = self.arrays[tensor]
        d = self.dequant.get(tensor)
        if d is None:
            return values
        if d.bits:  # [rows, blocks, block_size]: the codes unpacked, per-block zero and scale
            from onnxshrink.ops.matmul_nbits import unpack

            values = unpack(values, d.bits)
        real = values.astype(np.float64) - d.zero
        return real * d.scale if d.scale is not None else real

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "checked": self.checked,
            "layers": [layer.to_dict() for layer in self.layers],
            "groups": [g.to_dict() for g in self.groups],
        }


# ---------------------------------------------------------------------- finding them
def find_groups(
    model: onnx.ModelProto,
    base_dir: str | Path | None = None,
    name: str = "",
    verify: bool = True,
    query_ranks: bool = False,
    progress: bool = False,
    store: WeightStore | None = None,
) -> GroupSet:
    """Every coupled group of `model` (its weights in `base_dir` when stored externally).
    `verify`: check each exact group by zeroing it and running the closure (see the module
    docstring). `query_ranks`: grouped-query attention's query heads are `head` units by their
    rank in the K/V groups (the query heads of rank r in every group: removing them leaves
    every K/V head serving one fewer), not `kv_group` units with their K/V head; the K/V heads
    are then listed, not exact (they go with all their query heads). External weights are
    mapped by `store` (a new one when None), read as the analysis reads them, and the members'
    `arrays` are those mapped views: the weights stay on disk. `progress`: bars over the
    analysis's first pass and the verification's two analyses, on a terminal."""
    store = store or WeightStore()
    # A million members, none in a cycle, and the analysis's objects: the collector would only
    # rescan them, young and again as they age; paused until the one collection below. That
    # frees the analysis: its graph and onnx-graphsurgeon's nodes and tensors refer to each
    # other, freed only by the cyclic collector whenever it next ran (a 1.1 B-parameter prune
    # carried 7 GiB of it into the next phase). Made before the collector resumes, it leaves it
    # no young objects to scan first.
    with _no_collection():
        result = _group_set(model, base_dir, name, query_ranks, progress, store)
        gc.collect()
    if verify:
        _verify(result, model, base_dir, default_opset(model), store, progress)
    return result


def _group_set(
    model: onnx.ModelProto,
    base_dir: str | Path | None,
    name: str,
    query_ranks: bool,
    progress: bool,
    store: WeightStore,
) -> GroupSet:
    """`find_groups` without the verification: the analysis, its partition and the groups."""
    graph, untied = prepare(model, base_dir, store)
    opset = default_opset(model)
    log = CouplingLog(_cuts(query_ranks))
    analysis = analyze(graph, opset, lookup(opset), untied, log=log, progress=progress)
    part = log.partition()
    index = ModelIndex(model, str(base_dir) if base_dir else None)
    finder = _Finder(analysis, part, index, untied, query_ranks)
    groups, layers = finder.build(progress)
    tensors = ir.all_tensors(graph)
    copies = copies_of(graph, untied)
    held = dict.fromkeys(map(attrgetter("tensor"), every_member(groups)))  # in the members' order
    shapes = {t: tuple(int(d) for d in tensors[t].shape) for t in held}
    shapes |= {t: tuple(int(d) for d in tensors[t].shape) for readers in copies.values() for t in readers}
    groups, layers = tie_copies(groups, layers, copies, shapes)
    blocks = finder.blocks(groups, layers)
    held = dict.fromkeys(map(attrgetter("tensor"), every_member(groups)))  # (tied: copies added)
    arrays = {t: np.asarray(tensors[t].values) for t in held}
    result = GroupSet(groups, layers, name, untied, arrays, blocks=blocks)
    result.dequant = {k: v for k, v in finder.dequant.items() if k in arrays}
    result.quant_params = finder.quant_params & set(arrays)
    return result


def every_member(groups: Iterable[Group]) -> Iterator[Member]:
    """The groups' members, in order (iterated without a Python step per member)."""
    return chain.from_iterable(map(attrgetter("members"), groups))


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """The cyclic collector paused (as it was before, after): building many objects that form
    no cycles, it would scan the growing heap again and again for nothing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _cuts(query_ranks: bool) -> tuple[str, ...]:
    """The unit kinds to cut into where an op offers a choice (`CouplingLog.kinds`): grouped-query
    attention's query heads as `head`s by rank, or as a `kv_group` with their K/V head."""
    return ("head",) if query_ranks else ("kv_group",)


def _read_width(members: list[Member], d: int) -> int:
    """A head's width as the linear layers reading it see it (their columns of it), when they
    agree and it divides the `d` rows each producer holds (a packed Q/K/V projection holds a
    head's rows in each of its slots); else `d`."""
    widths = {len(m.indices) for m in members if m.side == "in" and m.matrix}
    w = widths.pop() if len(widths) == 1 else d
    return w if w < d and d % w == 0 else d


class _Finder:
    def __init__(
        self, analysis: Analysis, part: Partition, index: ModelIndex, untied: dict[str, str], query_ranks: bool
    ):
        self.analysis = analysis
        self.query_ranks = query_ranks
        self.part = part
        self.index = index
        self.untied = untied
        self.opset = analysis.opset
        # the original model's node index of each analysis node (by its first output's name)
        self.node_of = {out: k for k, n in enumerate(index.nodes) for out in n.output[:1]}
        self.dequant: dict[str, Dequant] = {}
        self.quant_params: set[str] = set()
        self.listed: set[int] = set()  # the components that are groups (`build`)
        # K/V heads without their query heads (`query_ranks`), with their head_dim
        self.kv_alone: dict[int, int] = {}
        self.heads = self._fused_heads()
        self.readers = _GraphReaders(analysis)
        # per node (by id): does it multiply its operands (`_product`)
        self._multiplies: dict[int, bool] = {}
        # per activation: its components' indices (`_data_of`), for every weight reading it
        self._data: dict[str, dict[int, tuple[str, int, np.ndarray]]] = {}

    def build(self, progress: bool = False) -> tuple[list[Group], list[Layer]]:
        templates = self._templates()
        # each group's members in the order it lists them (by initializer, axis and node, ties
        # in the order found): the templates sorted once, not every group's members
        templates.sort(key=lambda e: (e[0].initializer, e[0].axis, e[0].node))
        comps, bounds, layouts, declared, members = self._by_component(templates)
        whole = self._read_whole()  # an axis an op reads whole (kernel taps) is no group
        listed = [k for k in np.flatnonzero(declared).tolist() if comps[k] not in whole]
        self.listed = {comps[k] for k in listed}
        tensors = self.analysis.keep.tensors
        shapes = {m.tensor: tuple(int(d) for d in tensors[m.tensor].shape) for m, _, _, _ in templates}
        gated = self._gated_components()
        groups: list[Group] = []
        layer_of: dict[tuple[tuple[str, int], ...], int] = {}
        layers: list[Layer] = []
        # A layer's groups share their layout (the templates and counts they take) and so their
        # layer, unit and size: found once per layout and what the unit reads of the component
        alike: dict[tuple[object, ...], tuple[Layer, Unit, int]] = {}
        texts: dict[int, str] = {}  # each reason's text, by id (`_reason`)
        normalized, reasons = self.part.normalized, self.part.reasons
        from onnxshrink.progress import bar

        with bar(len(listed), "groups: listing them", "group", progress) as shown:
            for k in listed:
                comp = comps[k]
                ms = members[bounds[k] : bounds[k + 1]]
                heads, kv = self.heads.get(comp), self.kv_alone.get(comp)
                key = (layouts[bounds[k] : bounds[k + 1]].tobytes(), heads, kv, comp in normalized, comp in gated)
                if key not in alike:
                    unit = self._unit(comp, ms, gated)
                    layer_key = tuple(sorted({(m.tensor, m.axis) for m in ms}))
                    if layer_key not in layer_of:
                        layer_of[layer_key] = len(layers)
                        layers.append(Layer(len(layers), _layer_name(ms, unit.kind), [], unit.kind))
                    alike[key] = (layers[layer_of[layer_key]], unit, _params(ms, shapes))
                layer, unit, params = alike[key]
                # (most components are pinned by nothing: no reason to look for)
                reason = self._reason(comp, texts) if kv is not None or comp in reasons else None
                g = Group(len(groups), layer.id, ms, unit, params, reason is None, reason)
                layer.groups.append(g.id)
                groups.append(g)
                shown.update(1)
        return groups, layers

    def _reason(self, comp: int, texts: dict[int, str]) -> str | None:
        """Why the group of `comp` is not exact (None: it is): the first reason that pins it other
        than LIVE (`Partition.blocking`'s first), or that its query heads are units of their own.
        Components share their reasons' objects: each one's text is made once (`texts`, by id;
        the reasons live as long as the partition), not for every pin of every component."""
        if comp in self.kv_alone:  # its query heads are ranks here, units of their own
            return KV_ALONE
        first = next((r for r in self.part.reasons.get(comp, ()) if r != LIVE), None)
        if first is None:
            return None
        text = texts.get(id(first))
        if text is None:
            text = texts[id(first)] = str(first)
        return text

    @staticmethod
    def _by_component(
        templates: list[Template],
    ) -> tuple[list[int], list[int], np.ndarray, np.ndarray, list[Member]]:
        """Every component some template holds (ascending), where its members start and end in
        `members` (each template's copy with the component's indices, in the templates' order),
        its layout (per member, its template and how many indices it takes, as one int64: the
        component's run of them is its layout), and whether some member declares it (a weight's
        output or input side: groups). Sorted as arrays, not gathered member by member in
        per-component lists: a 1.1 B LLaMA has 848 K members."""
        sizes = [len(ids) for _, _, ids, _ in templates]
        comp = np.fromiter(chain.from_iterable(ids for _, _, ids, _ in templates), np.int64, sum(sizes))
        count = np.fromiter((len(i) for _, _, _, parts in templates for i in parts), np.int64, len(comp))
        which = np.repeat(np.arange(len(templates), dtype=np.int64), sizes)
        made: list[Member] = []
        for member, data, ids, parts in templates:
            copy = member.with_indices
            mine = [copy(idx) for idx in parts]
            if data:
                for m, c in zip(mine, ids, strict=True):
                    m.data = data.get(c)
            made.extend(mine)
        order = np.argsort(comp, kind="stable")  # by component, each one's members in template order
        ranked = comp[order]
        starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]]) if len(ranked) else np.zeros(0, np.int64)
        side = np.fromiter((bool(m.side) for m, _, _, _ in templates), bool, len(templates))
        declared = np.logical_or.reduceat(side[which[order]], starts) if len(starts) else np.zeros(0, bool)
        members = [made[k] for k in order.tolist()]
        layouts = (which[order] << 32) | count[order]
        return ranked[starts].tolist(), [*starts.tolist(), len(order)], layouts, declared, members

    def _templates(self) -> list[Template]:
        """Per weight axis that holds components and per node reading it: the member template,
        the activation it multiplies (`_data_of`), the components (ascending) and each one's
        indices (`_parts`)."""
        out = []
        for t in list(self.analysis.keep.tensors.values()):
            if not isinstance(t, gs.Constant) or not (_is_float(t) or self._quantized(t)):
                continue
            for axis in range(len(t.shape)):
                key = (t.name, axis)
                if key not in self.part.offsets:
                    continue
                ids, parts = _parts(self.part.of(key))
                for member, read in self._members(t, axis):
                    out.append((member, self._data_of(member, read), ids, parts))
        return out

    def _data_of(self, m: Member, read: tuple[gs.Node, int]) -> dict[int, tuple[str, int, np.ndarray]]:
        """For a weight matrix read along its input axis: the activation it multiplies (the
        op's other operand, a Conv's or Gemm's data), per component, as (tensor, axis, indices)."""
        node, slot = read
        if m.side != "in" or not m.matrix or slot not in (0, 1):
            return {}
        x = node.inputs[1 - slot] if len(node.inputs) > 1 else None
        if x is None or isinstance(x, gs.Constant):
            return {}
        out = self._data.get(x.name)
        if out is None:  # the same for every weight reading x (shared, never changed)
            out = self._data[x.name] = {}
            for axis in range(len(x.shape or [])):
                if (x.name, axis) in self.part.offsets:
                    for comp, idx in _split(self.part.of((x.name, axis))):
                        out.setdefault(comp, (x.name, axis, idx))
        return out

    def _read_whole(self) -> set[int]:
        """The components pinned by LIVE alone: an op reads their axis whole by its structure, not
        for a reason."""
        return {c for c, reasons in self.part.reasons.items() if reasons and all(r == LIVE for r in reasons)}

    def _quantized(self, t: gs.Constant) -> bool:
        """Is `t` an integer constant its readers dequantize (a quantized weight or bias)? Its zero
        point and scale are recorded (`dequant`), and they are marked as its parameters."""
        if t.name in self.dequant:
            return True
        params: set[str] = set()
        readers = [(node, next(k for k, x in enumerate(node.inputs) if x is t)) for node in t.outputs]
        got = readings(self.readers, readers, tuple(int(n) for n in t.shape), params)
        if got.plain or not same_zero(got.found):
            return False
        self.dequant[t.name] = got.found[0]
        self.quant_params |= params
        return True

    def _read_as(
        self, node: gs.Node, i: int, rank: int, depth: int = 0
    ) -> tuple[gs.Node, int, WeightAxes | None, bool]:
        """The node whose reading gives input i of `node` its role: `node` itself, or, through
        ops that pass the input's axes on (DequantizeLinear, Cast, Transpose), the op that reads
        their output (a Conv reading a dequantized weight). With it: its input index, how it
        reads the weight (in the weight's own axes), and whether the way there permuted axes."""
        handler = self.analysis.handler_for(node)
        if handler is None:
            return node, i, None, False
        op = OpNode.of(node)
        perm = handler.passes_axes(op, i, rank) if depth < 8 else None
        readers = node.outputs[0].outputs if perm is not None and node.outputs else []
        if perm is None or len(readers) != 1:
            return node, i, handler.weight_axes(op, i, rank), False
        reader = readers[0]
        slot = next(k for k, x in enumerate(reader.inputs) if x is node.outputs[0])
        got, k, wa, permuted = self._read_as(reader, slot, rank, depth + 1)
        if wa is not None:  # the reader's axes are this node's output axes: perm maps them back
            wa = WeightAxes(perm[wa.out], perm[wa.inp] if wa.inp is not None else None, wa.family)
        return got, k, wa, permuted or perm != list(range(rank))

    def _members(self, t: gs.Constant, axis: int) -> list[tuple[Member, tuple[gs.Node, int]]]:
        """One member template per node reading `t` (untied: usually one), with the node (and
        its input) that gives it its role."""
        out = []
        for node in t.outputs:
            i = next(k for k, x in enumerate(node.inputs) if x is t)
            role, side, matrix, family = None, "", False, ""
            site = (node.outputs[0].name if node.outputs else "", i)
            reader, slot, wa, permuted = self._read_as(node, i, len(t.shape))
            shape = tuple(int(d) for d in t.shape)
            handler = self.analysis.handler_for(reader)
            if handler is not None:
                via = reader.inputs[slot]
                constant = [isinstance(x, gs.Constant) or x is via for x in reader.inputs]
                roles = handler.param_inputs(OpNode.of(reader), constant)
                role = next((r for r, k in roles.items() if k == slot), None)
                if wa is not None:
                    side = "out" if axis == wa.out else "in" if axis == wa.inp else ""
                    matrix, family = wa.inp is not None, wa.family
            out.append((
                Member(
                    self.untied.get(t.name, t.name),
                    axis,
                    np.zeros(0, np.int64),
                    node.name,
                    node.op,
                    role,
                    side,
                    # the framework's layout is known where the weight is read as it is stored
                    [] if permuted else self._params(reader, slot, axis, side, shape),
                    t.name,
                    i,
                    matrix,
                    family,
                    site,
                ),
                (reader, slot),
            ))
        return out

    def _params(
        self, node: gs.Node, i: int, axis: int, side: str, shape: tuple[int, ...]
    ) -> list[ParamRef]:
        """The framework parameters the exporter recorded for input i of `node`: its module scope
        and the input's role, in the framework's layout (a Linear weight a MatMul reads is
        stored transposed); or the tensor's own name where the exporter kept the framework's
        (see `_own_name`). A BatchNorm the exporter folded into a conv: the fused weight's
        output channels are the BatchNorm's scale and shift (zeroing both zeroes the channel).
        A torch export whose nodes record no module (their metadata dropped by a later tool):
        the tensor's own name alone, where it is the framework's by its role."""
        k = self.node_of.get(node.outputs[0].name) if node.outputs else None
        if k is None:
            return []
        module = self.index.framework[k] or ""  # a module called again: the one module
        if not (module_of_dynamo_node(self.index.nodes[k]) or self.index.model.producer_name == "pytorch"):
            return []  # node names read as module paths only where torch's exporter wrote them
        handler, op = self.index.facts[k]
        if handler is None or i in handler.sizes_only:
            return []  # (a Shape reads no parameter's values)
        roles = handler.param_inputs(op, self.index.constant_inputs(k))
        role = next((r for r, slot in roles.items() if slot == i), None)
        inputs = self.index.nodes[k].input
        layout = self.index.layout(Site(k, i)) if i < len(inputs) else None
        transposed = layout is not None and layout.transposed and len(shape) == 2

        def ref(name: str) -> ParamRef:
            return ParamRef(name, 1 - axis, shape[::-1]) if transposed else ParamRef(name, axis, shape)

        own = self._own_name(inputs[i] if i < len(inputs) else "", module, role)
        if not module:
            return [ref(own)] if own is not None else []
        if is_fused_batchnorm(self.index.nodes[k]):
            mine = [ref(own)] if own is not None else []
            if side != "out":
                return mine
            n = (shape[axis],)
            return [ParamRef(f"{module}.weight", 0, n), ParamRef(f"{module}.bias", 0, n), *mine]
        if own is not None:
            return [ref(own)]
        if layout is None and len(shape) > 1:
            # a tensor the exporter made (its own name is not the parameter's) that its op gives
            # no axis roles: the parameter's shape is not this one (a PReLU slope [C] stored as
            # [C, 1, 1]), and no scope name binds back to it (bind.Binder.by_scope): under onnx/
            return []
        return [ref(f"{module}.{role}")] if role is not None else []

    def _own_name(self, tensor: str, module: str, role: str | None) -> str | None:
        """The tensor's own name when it is the framework's: torch's exporters name a parameter
        or buffer they read as it is by its state_dict name. It is one when it names a tensor of
        the reading node's module (a buffer read as a weight: Silero's
        `stft.forward_basis_buffer`, which `module.role` would call `stft.weight`), or when its
        last part is the role it is read in (a conv's `weight` that the exporter fused with the
        BatchNorm after it, whose node records only the BatchNorm's scope). A name the exporter
        made (`val_12`, `mul_1`, a fused conv's `conv.weight_bias`) is neither."""
        name = self.index.resolve(tensor)
        if name is None or "." not in name:
            return None
        owner, _, last = name.rpartition(".")
        return name if owner == module or (role is not None and last == role) else None

    def _carried(self, node: gs.Node) -> list[np.ndarray]:
        """Each operand's components over all its axes (ascending, once each): a gate (silu(g) *
        u) has a component in two operands, a product that scales it (a dynamically quantized
        layer's output times its scale) in one."""
        out = []
        for t in node.inputs:
            axes = range(len(t.shape)) if t is not None and t.shape is not None else range(0)
            held = [self.part.of((t.name, a)) for a in axes if (t.name, a) in self.part.offsets]
            out.append(np.unique(np.concatenate(held)) if held else np.zeros(0, np.int64))
        return out

    def _fused_heads(self) -> dict[int, tuple[int, int, bool]]:
        """Per component holding a fused attention op's query heads (`Handler.head_axis`): its
        head_dim, how many query heads it holds (one: a head; more: a K/V head's group, or
        the query heads of one rank in every K/V group) and whether they are such a rank. With
        `query_ranks`, the components of its K/V heads alone are recorded (`kv_alone`)."""
        out: dict[int, tuple[int, int, bool]] = {}
        for node in self.analysis.graph.nodes:
            handler = self.analysis.handler_for(node)
            at = handler.head_axis(node) if handler is not None else None
            if at is None or at.output >= len(node.outputs):
                continue
            key = (node.outputs[at.output].name, at.axis)
            if key not in self.part.offsets:
                continue
            mine = set()
            for comp, idx in _split(self.part.of(key)):
                heads = np.unique(idx // at.size)
                # one query head of each K/V group, all of one rank
                rank = len(heads) > 1 and len(np.unique(heads % at.rep)) == 1
                rank &= len(np.unique(heads // at.rep)) == len(heads)
                out[comp] = (at.head_dim, len(idx) // at.size, bool(at.rep > 1 and rank))
                mine.add(comp)
            if not self.query_ranks or at.rep == 1:
                continue
            for i, axis in at.kv:
                t = node.inputs[i] if i < len(node.inputs) else None
                if t is not None and t.name and (t.name, axis) in self.part.offsets:
                    for c in np.unique(self.part.of((t.name, axis))):
                        if int(c) not in mine:
                            self.kv_alone[int(c)] = at.head_dim
        return out

    def _unit(self, comp: int, members: list[Member], gated: set[int]) -> Unit:
        """What the group is, from its members: the layers producing it (weight matrices read
        along their output axis) own one channel each (a channel; a neuron when they are all
        linear layers, gated when an elementwise product combines them), or blocks of
        channels (a head of head_dim channels; a K/V head, whose query heads own more)."""
        if comp in self.heads:  # heads packed in a fused op's weights: the op says where
            d, query_heads, rank = self.heads[comp]
            if rank:  # a query head of each K/V group: they go together
                return Unit("head", d, head_dim=d, query_heads=query_heads)
            if query_heads > 1:
                return Unit("kv_group", d, head_dim=d, query_heads=query_heads)
            return Unit("head", d, head_dim=d)
        if comp in self.kv_alone:
            d = self.kv_alone[comp]
            return Unit("kv_group", d, head_dim=d, query_heads=0)
        producers = [m for m in members if m.side == "out" and m.matrix]
        counts = sorted({len(m.indices) for m in producers}) or [1]
        families = {m.family for m in producers}
        if "recurrent" in families:  # an LSTM/GRU/RNN hidden unit: its gate rows in W and R
            return Unit("recurrent_unit", 1)
        if counts[-1] > 1 and comp in self.part.normalized and families <= {"linear", "embedding"}:
            return Unit("width", counts[0])  # a quantization block of the width (MatMulNBits)
        if counts[-1] > 1 and families != {"linear"}:  # a grouped conv's group
            return Unit("conv_group", counts[0])
        if counts[-1] > 1:
            d = counts[0]
            if counts[-1] != d:
                return Unit("kv_group", d, head_dim=d, query_heads=counts[-1] // d)
            if comp in gated:  # a quantization block of gated neurons (MatMulNBits)
                return Unit("gated_neuron", d)
            return Unit("head", d, head_dim=_read_width(members, d))
        if comp in self.part.normalized:
            return Unit("width", 1)
        if producers and families == {"linear"}:
            return Unit("gated_neuron" if comp in gated else "neuron", 1)
        return Unit("channel", 1)

    def _gated_components(self) -> set[int]:
        """The components an elementwise product of two operands carrying them combines (silu(g)
        * u): per product node they meet at, all at once, as arrays (a LLaMA's gates hold a
        hundred thousand)."""
        out: set[int] = set()
        for n, held in self.part.meeting.values():
            carried = self._carried(n)
            if not carried or not self._product(n):
                continue
            ids, operands = np.unique(np.concatenate(carried), return_counts=True)
            twice = ids[operands > 1]  # carried by two operands or more
            if len(twice):
                out.update(np.intersect1d(twice, np.concatenate(held)).tolist())
        return out

    def _product(self, node: gs.Node) -> bool:
        """Does `node` multiply its operands (once per node)?"""
        got = self._multiplies.get(id(node))
        if got is None:
            h = self.analysis.handler_for(node)
            got = self._multiplies[id(node)] = h is not None and h.multiplies(OpNode.of(node))
        return got


    # ------------------------------------------------------------------ blocks
    def blocks(self, groups: list[Group], layers: list[Layer]) -> dict[int, Block]:
        """Block groups (appended to `groups`, in one layer of kind `block`): the residual
        branches of each repeated block of the model (`segment.blocks`: a transformer's
        layers), each group every parameter its branches hold. A branch is the operand of an
        Add that nodes only it reads compute, holding weight matrices, when the other operand
        (the stream) holds none; zeroing all of it makes the operand a constant zero, and the
        Add goes with everything only it read (`ops.elementwise.Elementwise.constant_operand`)."""
        from onnxshrink.proof.segment import blocks as repeated

        branches = residual_branches(self.analysis.graph, self.analysis.handler_for)
        if not branches:
            return {}
        found = repeated(self.index.model)
        cuts = found.cuts if found is not None else []
        by_block: dict[int, list[Branch]] = defaultdict(list)
        for b in branches:
            k = self.node_of.get(b.add.outputs[0].name)
            if k is None:
                continue
            key = int(np.searchsorted(cuts, k, side="right")) if found is not None else k
            by_block[key].append(b)
        layer = Layer(len(layers), "blocks", [], "block")
        out: dict[int, Block] = {}
        for key in sorted(by_block):
            members = [m for b in by_block[key] for m in self._branch_members(b)]
            if not members:
                continue
            first, last = by_block[key][0], by_block[key][-1]
            g = Group(
                len(groups),
                layer.id,
                members,
                Unit("block", 1, branches=len(by_block[key])),
                sum(int(np.prod(self.analysis.keep.tensors[m.tensor].shape)) for m in members),
                exact=True,
            )
            groups.append(g)
            layer.groups.append(g.id)
            stream = first.add.inputs[1 - first.index]
            out[g.id] = Block(stream.name, last.add.outputs[0].name, self._stream_axis(last.add.outputs[0]))
        if layer.groups:
            layers.append(layer)
        return out

    def _branch_members(self, b: Branch) -> list[Member]:
        """Every parameter the branch holds, whole: the inputs its nodes read as weights, biases
        or scales (not the constants they compute with: an epsilon, a reshape's shape)."""
        out = []
        for node in b.nodes:
            op = OpNode.of(node)
            handler = self.analysis.handler_for(node)
            for i, t in enumerate(node.inputs):
                if not isinstance(t, gs.Constant) or handler is None:
                    continue
                if not _is_float(t) and t.name not in self.dequant:  # quantized weights too
                    continue
                wa, via = handler.weight_axes(op, i, len(t.shape)), node
                if wa is None and t.name in self.dequant:  # dequantized for the op reading it
                    via, _, wa, _ = self._read_as(node, i, len(t.shape))
                if wa is None:
                    continue
                for m, (reader, _) in self._members(t, wa.out):
                    if reader is via:
                        out.append(m.with_indices(np.arange(int(t.shape[wa.out]))))
        return out

    def _stream_axis(self, y: gs.Tensor) -> int:
        """The stream's channel axis: the one whose indices are groups (else the last)."""
        for axis in range(len(y.shape or [])):
            key = (y.name, axis)
            if key in self.part.offsets and self.listed & {int(c) for c in self.part.of(key)}:
                return axis
        return len(y.shape or [1]) - 1


@dataclass
class Branch:
    add: gs.Node
    index: int  # the branch's operand of the Add
    nodes: list[gs.Node]


def residual_branches(graph: gs.Graph, handler_for: Lookup) -> list[Branch]:
    """Every Add of two tensors of its output's shape where one operand is a branch (the nodes
    only it reads hold a weight matrix) and the other is not: a residual branch."""
    from onnxshrink import ir

    order = {id(n): k for k, n in enumerate(graph.nodes)}
    outputs = {id(t) for t in graph.outputs}
    found = []
    for add in graph.nodes:
        handler = handler_for(add)
        if handler is None or not handler.adds(OpNode.of(add)):
            continue
        if len(add.inputs) != 2 or len(add.outputs) != 1:
            continue
        yd = ir.dims(add.outputs[0])
        ops = add.inputs
        if yd is None or any(isinstance(t, gs.Constant) or ir.dims(t) != yd for t in ops):
            continue
        owned = [_owned(t, add, order, outputs) if t.inputs else [] for t in ops]
        holds = [any(_reads_matrix(n, handler_for) for n in nodes) for nodes in owned]
        if holds[0] != holds[1]:
            i = 0 if holds[0] else 1
            found.append(Branch(add, i, sorted(owned[i], key=lambda n: order[id(n)])))
    return found


def _owned(t: gs.Tensor, add: gs.Node, order: dict[int, int], outputs: set[int]) -> list[gs.Node]:
    """The nodes whose every output only `add` (through `t`) or other such nodes read."""
    import heapq

    owned: dict[int, gs.Node] = {}
    heap = [(-order[id(t.inputs[0])], id(t.inputs[0]), t.inputs[0])]
    seen = {id(t.inputs[0])}
    while heap:
        _, _, node = heapq.heappop(heap)
        ok = all(
            id(out) not in outputs
            and all(id(r) in owned or (r is add and out is t) for r in out.outputs)
            for out in node.outputs
        )
        if not ok or any(isinstance(v, gs.Graph) for v in node.attrs.values()):
            continue
        owned[id(node)] = node
        for x in node.inputs:
            p = x.inputs[0] if isinstance(x, gs.Variable) and x.inputs else None
            if p is not None and id(p) not in seen and id(p) in order:
                seen.add(id(p))
                heapq.heappush(heap, (-order[id(p)], id(p), p))
    return list(owned.values())


def _reads_matrix(node: gs.Node, handler_for: Lookup) -> bool:
    handler = handler_for(node)
    if handler is None:
        return False
    op = OpNode.of(node)
    for i, t in enumerate(node.inputs):
        if isinstance(t, gs.Constant) and len(t.shape) >= 2:
            wa = handler.weight_axes(op, i, len(t.shape))
            if wa is not None and wa.inp is not None and wa.family in ("linear", "conv"):
                return True
            if wa is None and handler.quantized_input(op, i, len(t.shape)) is not None:
                return True  # a quantized matrix dequantized for the op after (QDQ)
    return False


def gather_slices(items: Iterable[tuple[K, int, np.ndarray]]) -> dict[tuple[K, int], np.ndarray]:
    """The indices of every (key, axis) of `items`, gathered: each sliced axis is then zeroed
    once, not once per member (a layer's thousands of groups each hold one index of it)."""
    gathered: dict[tuple[K, int], list[np.ndarray]] = {}
    for key, axis, idx in items:
        gathered.setdefault((key, axis), []).append(idx)
    return {k: np.unique(np.concatenate(v)) for k, v in gathered.items()}


def cuts_by_tensor(members: Iterable[Member]) -> dict[str, list[tuple[int, np.ndarray]]]:
    """Each tensor's slices the members zero, as (axis, indices) with each axis's indices
    gathered (`gather_slices`): what `spill.zeroed` takes."""
    cuts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for (name, axis), idx in gather_slices((m.tensor, m.axis, m.indices) for m in members).items():
        cuts.setdefault(name, []).append((axis, idx))
    return cuts


class _GraphReaders:
    """The analysis' graph, as `quantized.dequant_reads` walks it."""

    def __init__(self, analysis: Analysis):
        self.handler_for = analysis.handler_for
        self.outputs = {id(t) for g in ir.scopes(analysis.graph) for t in g.outputs}

    def facts(self, node: gs.Node) -> tuple[Handler | None, OpNode]:
        return self.handler_for(node), OpNode.of(node)

    def inputs(self, node: gs.Node) -> _NodeInputs:
        return _NodeInputs(node)

    def applied_scale(self, node: gs.Node, i: int) -> np.ndarray | None:
        handler = self.handler_for(node)
        return handler.applied_scale(node, i) if handler is not None else None

    def moved(self, node: gs.Node, i: int) -> Moved[gs.Node] | None:
        y = node.outputs[0] if len(node.outputs) == 1 else None
        if y is None or id(y) in self.outputs or y.dtype != node.inputs[i].dtype:
            return None  # a value the graph gives out, or a Cast that changes the values' type
        readers = [(r, k) for r in y.outputs for k, v in enumerate(r.inputs) if v is y]
        dims = ir.dims(y)
        return Moved(readers, tuple(d if isinstance(d, int) else -1 for d in dims) if dims is not None else None)


class _NodeInputs:
    """An onnx-graphsurgeon node's inputs, as `quantized.dequant_of` reads them."""

    def __init__(self, node: gs.Node):
        self.node = node

    def given(self, slot: int) -> bool:
        return ir.present(self.node, slot) is not None

    def constant(self, slot: int) -> tuple[str, np.ndarray] | None:
        p = ir.present(self.node, slot)
        return (p.name, np.asarray(p.values)) if isinstance(p, gs.Constant) else None


def _is_float(t: gs.Constant) -> bool:
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)) in FLOAT_TYPES
    except (TypeError, KeyError):
        return False


def _split(comps: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(component, indices) pairs of an axis whose index i is in component comps[i]."""
    ids, parts = _parts(comps)
    return zip(ids, parts, strict=True)


def _parts(comps: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
    """The components of an axis whose index i is in component comps[i] (ascending), and the
    indices of each (ascending: the argsort is stable). Components of one size (a layer's
    channels, heads) are the rows of the order, views made at once, not a slice each."""
    order = np.argsort(comps, kind="stable")
    ranked = comps[order]
    if not len(ranked):
        return [], []
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    ids = ranked[starts].tolist()
    size = len(order) // len(ids)
    if size * len(ids) == len(order) and bool(np.all(np.diff(starts) == size)):
        return ids, list(order.reshape(len(ids), size))
    bounds = [*starts.tolist(), len(order)]  # Python ints: slicing by them is cheaper
    return ids, [order[bounds[k] : bounds[k + 1]] for k in range(len(ids))]


def _params(members: list[Member], shapes: dict[str, tuple[int, ...]]) -> int:
    """Elements the members hold (a tensor sliced along several axes counted once)."""
    return sliced_elements({(m.tensor, m.axis): len(m.indices) for m in members}, shapes)


def sliced_elements(counts: Mapping[tuple[str, int], int], shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Elements the slices {(tensor, axis): how many indices} take out of the tensors of
    `shapes` (a tensor sliced along several axes counted once)."""
    per_tensor: dict[str, dict[int, int]] = defaultdict(dict)
    for (name, axis), k in counts.items():
        per_tensor[name][axis] = k
    total = 0
    for name, axes in per_tensor.items():
        shape = shapes[name]
        if len(axes) == 1:  # the usual member: k slices of one axis
            ((a, k),) = axes.items()
            total += math.prod(shape) // shape[a] * k
        else:
            total += math.prod(shape) - math.prod(n - axes.get(a, 0) for a, n in enumerate(shape))
    return total


def _layer_name(members: list[Member], kind: str = "") -> str:
    """The weights producing the layer's channels, by the framework's names where recorded; a
    recurrent layer's units by its node (its packed weights have no framework name)."""
    producers = [m for m in members if m.side == "out" and m.matrix] or members
    if kind == "recurrent_unit" and not any(m.params for m in producers):
        nodes = sorted({f"{m.node or m.initializer} ({m.op})" for m in producers})
        return nodes[0] + (f" (+{len(nodes) - 1})" if len(nodes) > 1 else "")
    names = sorted({m.params[0].name if m.params else m.initializer for m in producers})
    return names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else "")


# ---------------------------------------------------------------------- checking them
# Each exact group is zeroed alone and analyzed (one analysis of the model each) while exact
# groups x nodes is at most this (an analysis costs about 2 ms a node: a listing's check then
# takes up to about 10 s; every random graph of tools/sweep.py is below it, a 37-node ResNet's
# 338 groups above); above it, half of each layer at a time (two analyses).
ALONE_BUDGET = 5_000


def alone_cost(gset: GroupSet, model: onnx.ModelProto) -> tuple[int, int]:
    """(exact groups, nodes in every graph): their product is what checking each alone costs."""
    return len(gset.exact()), sum(len(g.node) for g in ir.all_graphs(model.graph))


def _verify(
    result: GroupSet, model: onnx.ModelProto, base_dir, opset: int, store: WeightStore, progress: bool = False
) -> None:
    """Mark not exact, with the analysis's reason, each exact group the closure keeps a member
    of when it is zeroed: each alone within `ALONE_BUDGET`, else half of each layer at a time."""
    groups, nodes = alone_cost(result, model)
    if groups * nodes <= ALONE_BUDGET:
        result.checked = "alone"
        _verify_alone(result, model, base_dir, opset, store, progress)
    else:
        result.checked = "halves"
        _verify_halves(result, model, base_dir, opset, store, progress)


def _verify_alone(
    result: GroupSet, model: onnx.ModelProto, base_dir, opset: int, store: WeightStore, progress: bool = False
) -> None:
    """Each exact group zeroed on its own, the closure run, and the group marked not exact when
    the closure keeps a member of it (what zeroing it alone in the model leaves). The model is
    prepared once (a small one: within `ALONE_BUDGET`); each group's slices are zeroed in its
    graph for its analysis, and their values put back after."""
    from onnxshrink.progress import bar

    graph, untied = prepare(model, base_dir, store)
    tensors = ir.all_tensors(graph)
    # the groups zero already (a pruned model's): zeroed alone, the model is itself, one analysis
    zero = [g for g in result.exact() if _zero_already(result, g)]
    kept = kept_when_zeroed(analyze(graph, opset, lookup(opset), untied), zero) if zero else {}
    done = {g.id for g in zero}
    exact = [g for g in result.exact() if g.id not in done]
    with bar(len(exact), "groups: checking each zeroed alone", "group", progress) as shown:
        for g in exact:
            cuts = cuts_by_tensor(result.zeroed_members([g]))
            held = {name: tensors[name].values for name in cuts if name in tensors}
            for name in held:
                tensors[name].values = spill.zeroed(result.arrays[name], cuts[name], result.zero_of(name))
            try:
                kept |= kept_when_zeroed(analyze(graph, opset, lookup(opset), untied), [g])
            finally:
                for name, values in held.items():
                    tensors[name].values = values
            shown.update(1)
    result.not_exact(kept)


def _zero_already(result: GroupSet, group: Group) -> bool:
    """Every slice the group zeroes holds zeros already (a quantized one: not checked, False)."""
    for m in result.zeroed_members([group]):
        if m.tensor in result.dequant or np.take(result.arrays[m.tensor], m.indices, axis=m.axis).any():
            return False
    return True


def _verify_halves(
    result: GroupSet, model: onnx.ModelProto, base_dir, opset: int, store: WeightStore, progress: bool = False
) -> None:
    """Zero the exact groups, half of each layer at a time (a layer left empty is a different
    question: `max ratio` keeps one), run the closure, and mark not exact any group the
    closure keeps a member of, with its reason."""
    by_layer: dict[int, list[Group]] = defaultdict(list)
    for g in result.exact():
        by_layer[g.layer].append(g)
    from onnxshrink.progress import bar

    with bar(2, "groups: verifying by zeroing them", "half", progress) as shown:
        for half in (0, 1):
            _verify_half(result, model, base_dir, opset, store, by_layer, half)
            shown.update(1)


def _verify_half(
    result: GroupSet,
    model: onnx.ModelProto,
    base_dir,
    opset: int,
    store: WeightStore,
    by_layer: dict[int, list[Group]],
    half: int,
) -> None:
    """One half of every layer's exact groups zeroed and verified (see `_verify_halves`)."""
    chosen = [g for layer in by_layer.values() for k, g in enumerate(layer) if k % 2 == half]
    if not chosen:
        return
    scratch = Scratch(store, None)  # a large mapped weight is zeroed on disk, not in memory
    graph, untied = _zeroed_graph(result, model, base_dir, store, chosen, scratch)
    result.not_exact(kept_when_zeroed(analyze(graph, opset, lookup(opset), untied), chosen))
    # its spilled weights are mapped views of files deleted here: their pages are the page
    # cache's (the maps go whenever the collector frees the graph, not worth a collection)
    scratch.discard_spills()


def kept_when_zeroed(analysis: Analysis, groups: Iterable[Group]) -> dict[int, str]:
    """The `groups` (by id) the closure of `analysis` keeps some index of, each with why, where
    `analysis` is of a model with them all zeroed. Each member is found where it is read (the
    node making its site's output, that node's input), so that the analysis may be of another
    copy of the model (the prune's reference, whose shared weights are untied anew)."""
    ks = analysis.keep
    reader = {n.outputs[0].name: n for n in ir.flat_nodes(analysis.graph) if n.outputs}
    tensors = ir.all_tensors(analysis.graph)

    def read_as(m: Member) -> gs.Tensor | None:
        """The member's tensor: read at its site when that reads its weight (a compensation's
        Add may have taken the site's name), else by its name; None: not in this model."""
        node = reader.get(m.site[0])
        at = node.inputs[m.site[1]] if node is not None and m.site[1] < len(node.inputs) else None
        for t in (at, tensors.get(m.tensor)):
            if t is not None and (t.name == m.tensor or analysis.untied.get(t.name, t.name) in (m.tensor, m.initializer)):
                return t
        return None

    # where a member is read depends on its site and names alone: found once for the members
    # that share them (a layer's groups each hold a slice of the same weights)
    found: dict[tuple[tuple[str, int], str, str], gs.Tensor | None] = {}
    located = []
    for g in groups:
        for m in g.members:
            key = (m.site, m.tensor, m.initializer)
            t = found[key] if key in found else found.setdefault(key, read_as(m))
            located.append((g, m, t))
    # each zeroed axis asked once; members one by one only where some index stays (rare)
    axes = gather_slices((t.name, m.axis, m.indices) for _, m, t in located if t is not None)
    named = {t.name: t for _, _, t in located if t is not None}
    suspect = set()
    for (name, axis), idx in axes.items():
        kept = ks.kept(named[name], axis)
        if kept is not None and kept[idx].any():
            suspect.add((name, axis))
    out: dict[int, str] = {}
    if not suspect:
        return out
    for g, m, t in located:
        if t is None or (t.name, m.axis) not in suspect or g.id in out:
            continue
        kept = ks.kept(t, m.axis)
        if kept is not None and kept[m.indices].any():
            j = int(m.indices[np.flatnonzero(kept[m.indices])[0]])
            out[g.id] = f"{m.initializer} (axis {m.axis}) is kept when it is zeroed: {ks.why(t, m.axis)[j]}"
    return out


def _zeroed_graph(
    result: GroupSet, model: onnx.ModelProto, base_dir, store: WeightStore, chosen: list[Group], scratch: Scratch
) -> tuple[gs.Graph, dict[str, str]]:
    """The analysis graph with the `chosen` groups zeroed (a large mapped weight written to a
    spill file of `scratch`, never copied whole into memory)."""
    graph, untied = prepare(model, base_dir, store)
    tensors = ir.all_tensors(graph)
    per_tensor = cuts_by_tensor(result.zeroed_members(chosen))
    writer = scratch.spill()
    for name, values in result.arrays.items():  # read already: not converted again
        if name in tensors:  # the values the analysis read (prepare's, untouched), zeroed
            cut = per_tensor.get(name)
            tensors[name].values = values if cut is None else spill.zeroed(values, cut, result.zero_of(name), writer, name)
    writer.close()
    return graph, untied


# ---------------------------------------------------------------------- shared weights
# A weight several nodes read (an LSTMCell stepped over time, a block called on several inputs,
# tied embeddings) has one copy per reader in the analysis (prepare.tie), so that each use can
# be sliced on its own. But it has one set of values, and a framework one mask per parameter:
# a slice of it goes from every reader or from none. So groups holding one slice through
# different copies are one group (neuron j of a block called three times), a group takes its
# slices from every copy of the weight (whether the closure then removes them all is checked
# as for any member: `kept_when_zeroed`), and parameters are counted once per weight.
@dataclass(frozen=True)
class Reader:
    """Where a copy of a shared weight is read: the node, its first output, the input index."""

    node: str
    op: str
    output: str
    index: int


def copies_of(graph: gs.Graph, untied: dict[str, str]) -> dict[str, dict[str, Reader]]:
    """Every analysis tensor of each shared initializer (its copies and itself), with its reader."""
    out: dict[str, dict[str, Reader]] = defaultdict(dict)
    for node in ir.flat_nodes(graph):
        for i, t in enumerate(node.inputs):
            if isinstance(t, gs.Constant) and (t.name in untied or t.name in untied.values()):
                first = node.outputs[0].name if node.outputs else ""
                out[untied.get(t.name, t.name)].setdefault(t.name, Reader(node.name, node.op, first, i))
    return dict(out)


def tie_copies(
    groups: list[Group], layers: list[Layer], copies: dict[str, dict[str, Reader]], shapes: dict[str, tuple[int, ...]]
) -> tuple[list[Group], list[Layer]]:
    """`groups` with those holding one slice of a weight through different copies merged, each
    taking its slices of a shared weight from every copy, its parameters counted once per
    weight (`shapes`: by analysis tensor). A slice of zeros too: the shrink stores a weight
    once for all its readers when their slicings would hold more (`analyze.shared`)."""
    # (an LLM's shared rotary tables: no group holds them; asked of all members at once)
    if not copies or set(map(attrgetter("initializer"), every_member(groups))).isdisjoint(copies):
        return groups, layers
    touched = [g for g in groups if any(m.initializer in copies for m in g.members)]
    sets = _merged(groups, touched, copies)
    if any(len(s) > 1 for s in sets):
        groups, layers = _rebuilt(groups, layers, sets)
        touched = [g for g in groups if any(m.initializer in copies for m in g.members)]
    for g in touched:
        g.members = _every_copy(g.members, copies)
        g.params = weight_params(g.members, shapes)
    return groups, layers


def weight_params(members: list[Member], shapes: dict[str, tuple[int, ...]]) -> int:
    """Elements the members' slices hold, each weight counted once whatever copies read it
    (`shapes`: by analysis tensor; a slice is what any copy holds of it)."""
    cuts = gather_slices((m.initializer, m.axis, m.indices) for m in members)
    return sliced_elements({k: len(v) for k, v in cuts.items()}, {m.initializer: shapes[m.tensor] for m in members})


def _merged(groups: list[Group], touched: list[Group], copies: dict[str, dict[str, Reader]]) -> list[list[int]]:
    """The groups' ids in sets holding a common slice of a shared weight (each in order;
    `touched`: the groups holding a slice of one)."""
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    held: dict[tuple[str, int], list[tuple[np.ndarray, int]]] = defaultdict(list)
    for g in touched:
        for m in g.members:
            if m.initializer in copies:
                held[(m.initializer, m.axis)].append((m.indices, g.id))
    for parts in held.values():  # sorted by index, neighbours holding the same index are one set
        index = np.concatenate([np.asarray(ix, np.int64).reshape(-1) for ix, _ in parts])
        owner = np.concatenate([np.full(np.size(ix), gid, np.int64) for ix, gid in parts])
        order = np.lexsort((owner, index))
        index, owner = index[order], owner[order]
        same = (index[1:] == index[:-1]) & (owner[1:] != owner[:-1])
        for a, b in zip(owner[:-1][same].tolist(), owner[1:][same].tolist(), strict=True):
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[rb] = ra
    sets: dict[int, list[int]] = defaultdict(list)
    for g in groups:
        sets[root(g.id)].append(g.id)
    return sorted(sets.values())


def _rebuilt(groups: list[Group], layers: list[Layer], sets: list[list[int]]) -> tuple[list[Group], list[Layer]]:
    """One group per set (members joined; exact when all were), renumbered, and the layers
    again: groups over the same parameter slices, named as the first group's layer was."""
    out: list[Group] = []
    new_layers: list[Layer] = []
    layer_of: dict[tuple[tuple[str, int], ...], int] = {}
    for ids in sets:
        first = groups[ids[0]]
        members = [m for i in ids for m in groups[i].members]
        blocked = [groups[i].reason for i in ids if not groups[i].exact]
        key = tuple(sorted({(m.initializer, m.axis) for m in members}))
        if key not in layer_of:
            layer_of[key] = len(new_layers)
            old = layers[first.layer]
            new_layers.append(Layer(len(new_layers), old.name, [], old.kind))
        layer = new_layers[layer_of[key]]
        g = Group(len(out), layer.id, members, first.unit, first.params, not blocked, blocked[0] if blocked else None)
        layer.groups.append(g.id)
        out.append(g)
    return out, new_layers


def _every_copy(members: list[Member], copies: dict[str, dict[str, Reader]]) -> list[Member]:
    """`members` with each slice of a shared weight taken from every copy of it (read where
    that copy is read): the union of the copies' indices along each axis."""
    out = [m for m in members if m.initializer not in copies]
    by_axis: dict[tuple[str, int], list[Member]] = defaultdict(list)
    for m in members:
        if m.initializer in copies:
            by_axis[(m.initializer, m.axis)].append(m)
    for (name, _), ms in by_axis.items():
        every = np.unique(np.concatenate([m.indices for m in ms]))
        mine: dict[str, list[Member]] = defaultdict(list)
        for m in ms:
            mine[m.tensor].append(m)
        for tensor, at in sorted(copies[name].items()):
            own = mine.get(tensor) or [  # a reader the group did not reach: read there
                replace(ms[0], tensor=tensor, node=at.node, op=at.op, site=(at.output, at.index),
                        input_index=at.index, indices=np.zeros(0, np.int64), data=None)
            ]  # fmt: skip
            idx = np.union1d(np.concatenate([m.indices for m in own]), every)
            if len(idx):
                out.append(own[0] if np.array_equal(own[0].indices, idx) else own[0].with_indices(idx))
    return out

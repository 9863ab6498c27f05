"""What the keep closure ties together, recorded while it runs, and the coupled groups it implies.

The keep closure (`keep.py`) is the one place that knows which indices must leave together: its
handlers tie axes indexed alike (`couple`), map indices (`couple_map`: Concat offsets, slices,
gathers), view one flat index space in two shapes (`block`: a Reshape to heads x head dims), and
tie a grouped conv's channels per group (`unit`). A `CouplingLog` handed to the closure records
those calls; `partition()` turns them into connected components over every index of every
tensor axis: a component is a set of indices that can only be removed together.

Where the closure reads an axis whole (`pin`), its components cannot be removed; the reasons are
kept (a normalization over the axis, a graph input or output, an unsupported op). A reshape's
index space is cut into units along the outermost factor of its two shapes' common refinement
that is not read whole (a head of head_dim channels, a conv channel of H*W flattened features, a
K/V head with the query heads that read it); its inner axes are not units. Factors read whole
are skipped: an axis pinned, or whose indices are slots each picked out by a constant scalar
Gather (the q, k, v thirds of a packed projection: its heads are the units), and a batch factor
merged before heads ([T, B, E] -> [T, B*H, hd]): the heads are then carried by period, and a
later B*H -> [B, H] split is cut by heads, not by batch. With a dynamic batch the block holds
only its static axes and the periodic ones (B*H kept by its period H: its inner index, of size
H); the dynamic sizes leading it are no units.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink.core.reasons import LIVE, AxisKey, Reason


@dataclass
class _Block:
    x: AxisKey
    sides: tuple[list[AxisKey], list[AxisKey]]
    sizes: tuple[list[int], list[int]]
    site: gs.Node


Digit = tuple[int, int]  # (stride, size): the digit (i // stride) % size of an axis's index i


@dataclass
class _Factor:
    """One factor of a block's common refinement: its size, and on each side the axis that holds
    it as (key, the axis's size, the factor's stride within the axis)."""

    size: int
    at: list[tuple[AxisKey, int, int]]


class CouplingLog:
    """The ties and pins the keep closure's handlers declared (each recorded once)."""

    def __init__(self, kinds: Collection[str] = ()) -> None:
        # Where an op ties the same indices into units more than one way (`KeepView.unit` with
        # a kind: grouped-query attention's query heads with their K/V head, or by rank), the
        # kinds of unit kept; a tie of another kind is not recorded (both would merge the units)
        self.kinds = frozenset(kinds)
        self.sizes: dict[AxisKey, int] = {}
        self.equal: dict[tuple[AxisKey, AxisKey], gs.Node | None] = {}
        self.mapped: dict[tuple[AxisKey, AxisKey], np.ndarray] = {}
        self.paired: dict[tuple[AxisKey, AxisKey], tuple[np.ndarray, np.ndarray]] = {}
        self.blocks: dict[tuple[tuple[AxisKey, ...], tuple[AxisKey, ...]], _Block] = {}  # by its sides
        self.pins: dict[AxisKey, list[Reason]] = defaultdict(list)
        self.normalized: set[AxisKey] = set()  # axes a LayerNorm/RMSNorm normalizes
        self.selected: set[AxisKey] = set()  # axes a constant scalar Gather picks slots from

    def _axis(self, name: str, axis: int, size: int | None) -> AxisKey | None:
        if size is None or size < 1:
            return None
        key = (name, axis)
        self.sizes[key] = size
        return key

    # ------------------------------------------------------------ called by KeepState
    def pinned(self, name: str, sizes: list[int | None], axis: int | None, reason: Reason) -> None:
        for a in range(len(sizes)) if axis is None else [axis]:
            key = self._axis(name, a, sizes[a] if a < len(sizes) else None)
            if key is not None and reason not in self.pins[key]:
                self.pins[key].append(reason)

    def normalizes(self, name: str, axis: int, size: int | None) -> None:
        key = self._axis(name, axis, size)
        if key is not None:
            self.normalized.add(key)

    def selects(self, name: str, axis: int, size: int | None) -> None:
        key = self._axis(name, axis, size)
        if key is not None:
            self.selected.add(key)

    def same(self, n1: str, a1: int, n2: str, a2: int, size: int, meet: gs.Node | None) -> None:
        k1, k2 = self._axis(n1, a1, size), self._axis(n2, a2, size)
        known = k1 is not None and k2 is not None and (k1, k2) in self.equal
        if k1 is not None and k2 is not None and k1 != k2 and (meet is not None or not known):
            self.equal[(k1, k2)] = meet

    def maps(self, small: str, sa: int, ns: int, big: str, ba: int, nb: int, idx: np.ndarray) -> None:
        k1, k2 = self._axis(small, sa, ns), self._axis(big, ba, nb)
        if k1 is not None and k2 is not None:
            self.mapped[(k1, k2)] = np.asarray(idx, dtype=np.int64).reshape(-1)

    def pairs(
        self,
        n1: str,
        a1: int,
        s1: int,
        idx1: np.ndarray,
        n2: str,
        a2: int,
        s2: int,
        idx2: np.ndarray,
        kind: str | None = None,
    ) -> None:
        if kind is not None and kind not in self.kinds:
            return  # a way to cut these indices into units other than the one asked for
        k1, k2 = self._axis(n1, a1, s1), self._axis(n2, a2, s2)
        if k1 is not None and k2 is not None:
            self.paired[(k1, k2)] = (idx1.astype(np.int64), idx2.astype(np.int64))

    def block(
        self,
        x: str,
        in_axes: list[int],
        in_sizes: list[int | None],
        y: str,
        out_axes: list[int],
        out_sizes: list[int | None],
        site: gs.Node,
    ) -> None:
        if any(s is None for s in [*in_sizes, *out_sizes]):
            return  # the closure pins such axes whole
        sides = ([(x, a) for a in in_axes], [(y, b) for b in out_axes])
        sizes = ([int(s) for s in in_sizes if s is not None], [int(s) for s in out_sizes if s is not None])
        for keys, ns in zip(sides, sizes, strict=True):
            for k, n in zip(keys, ns, strict=True):
                self._axis(k[0], k[1], n)
        key = (tuple(sides[0]), tuple(sides[1]))
        self.blocks[key] = _Block(sides[0][0], sides, sizes, site)

    # ------------------------------------------------------------ the components
    def partition(self) -> Partition:
        return Partition(self)


@dataclass
class Partition:
    """Component ids for every index of every recorded axis, and why components are pinned."""

    log: CouplingLog
    offsets: dict[AxisKey, int] = field(init=False)
    label: np.ndarray = field(init=False)
    # component -> reasons it cannot be removed (LIVE alone: an op reads the axis whole)
    reasons: dict[int, list[Reason]] = field(init=False)
    # per elementwise node that combines indices (by id): the node, and the component of each
    # index of every axis it ties (a LLaMA's products and sums tie a million indices: held as
    # the arrays `of` gives, not a list of nodes per component)
    meeting: dict[int, tuple[gs.Node, list[np.ndarray]]] = field(init=False)
    # components a LayerNorm or RMSNorm normalizes over (a residual stream's width)
    normalized: set[int] = field(init=False)

    def __post_init__(self) -> None:
        log = self.log
        blocks = list(log.blocks.values())
        inner_pins: dict[AxisKey, Reason] = {}
        edges_a: list[np.ndarray] = []
        edges_b: list[np.ndarray] = []
        self.offsets = {}
        total = 0
        for key, n in log.sizes.items():
            self.offsets[key] = total
            total += n

        def link(k1: AxisKey, i1: np.ndarray, k2: AxisKey, i2: np.ndarray) -> None:
            n1, n2 = log.sizes[k1], log.sizes[k2]
            ok = (i1 >= 0) & (i1 < n1) & (i2 >= 0) & (i2 < n2)
            edges_a.append(self.offsets[k1] + i1[ok])
            edges_b.append(self.offsets[k2] + i2[ok])

        for (k1, k2) in log.equal:
            r = np.arange(log.sizes[k1])
            link(k1, r, k2, r)
        for (k1, k2), idx in log.mapped.items():
            link(k1, np.arange(len(idx)), k2, idx)
        for (k1, k2), (i1, i2) in log.paired.items():
            link(k1, i1, k2, i2)
        whole = _whole_digits(log, blocks) if blocks else {}
        for b in blocks:
            self._cut_block(b, link, inner_pins, whole)
        a = np.concatenate(edges_a) if edges_a else np.zeros(0, np.int64)
        c = np.concatenate(edges_b) if edges_b else np.zeros(0, np.int64)
        self.label = _components(total, a, c)

        self.reasons = defaultdict(list)
        pins = dict(log.pins)
        for key, why in inner_pins.items():
            pins.setdefault(key, []).append(why)
        for key, reasons in pins.items():
            once: list[Reason] = []
            for why in reasons:
                if why not in once:
                    once.append(why)
            for comp in np.unique(self.of(key)).tolist():
                have = self.reasons.get(comp)
                if have is None:  # (most: an axis's components are pinned by one key)
                    self.reasons[comp] = list(once)
                else:
                    have.extend(r for r in once if r not in have)
        held = [self.of(key) for key in log.normalized]
        self.normalized = set(np.unique(np.concatenate(held)).tolist()) if held else set()
        self.meeting = {}
        for (k1, _), meet in log.equal.items():
            if meet is not None:
                self.meeting.setdefault(id(meet), (meet, []))[1].append(self.of(k1))

    @staticmethod
    def _cut_block(
        b: _Block, link, inner_pins: dict[AxisKey, Reason], whole: dict[AxisKey, set[Digit]]
    ) -> None:
        """Units along a reshape: its index space is cut along the outermost factor of the two
        shapes' common refinement that is not read whole (`_is_whole`; else the innermost);
        every axis holding that factor maps its indices to the factor's digit (a batch factor
        before it carries the units by period); axes inside it are not units. Shapes whose
        sizes do not nest: no units at all."""
        factors = _refine(b)
        if factors is None:
            for keys in b.sides:
                for k in keys:
                    inner_pins[k] = Reason(
                        "structure", b.site.name, b.site.op, "a reshape between two shapes whose sizes do not nest"
                    )
            return
        if not factors:
            return  # everything is size 1
        u = next((f for f in factors if not _is_whole(f, whole)), factors[-1])
        anchor, _, a_stride = u.at[-1]
        for k, n, stride in u.at:
            r = np.arange(n)
            link(k, r, anchor, ((r // stride) % u.size) * a_stride)
        why = Reason(
            "structure",
            b.site.name,
            b.site.op,
            "it is an inner axis of a reshape (e.g. the head dims of heads x head dims): "
            "units are whole blocks of the outer axis",
        )
        inside = factors[factors.index(u) + 1 :]
        held = {k for f in factors[: factors.index(u) + 1] for k, _, _ in f.at}
        for k in {k for f in inside for k, _, _ in f.at} - held:
            inner_pins[k] = why

    def of(self, key: AxisKey) -> np.ndarray:
        """Component id of each index of the axis `key`."""
        o = self.offsets[key]
        return self.label[o : o + self.log.sizes[key]]

    def blocking(self, comp: int) -> list[Reason]:
        """Why component `comp` cannot be removed: empty when it can; reasons other than an op
        reading the axis whole (LIVE) first."""
        reasons = self.reasons.get(comp, [])
        return [r for r in reasons if r != LIVE] + [r for r in reasons if r == LIVE]


def _tied_classes(log: CouplingLog) -> dict[AxisKey, list[AxisKey]]:
    """Each axis tied index for index (`equal`) to others: the axes of its class."""
    near: dict[AxisKey, list[AxisKey]] = defaultdict(list)
    for k1, k2 in log.equal:
        near[k1].append(k2)
        near[k2].append(k1)
    classes: dict[AxisKey, list[AxisKey]] = {}
    for start in near:
        if start in classes:
            continue
        members, todo = [start], [start]
        classes[start] = members
        while todo:
            for k in near[todo.pop()]:
                if k not in classes:
                    classes[k] = members
                    members.append(k)
                    todo.append(k)
    return classes


def _whole_digits(log: CouplingLog, blocks: list[_Block]) -> dict[AxisKey, set[Digit]]:
    """The digits of each axis that are read whole: every index of an axis pinned, or whose
    slots constant scalar Gathers pick out, or tied index for index to one; and, across a
    reshape, a factor read whole that is part of a wider axis on the other side (a batch merged
    with heads), tied on likewise."""
    classes = _tied_classes(log)
    whole: dict[AxisKey, set[Digit]] = {}

    def add(key: AxisKey, digit: Digit) -> bool:
        fresh = False
        for k in classes.get(key, [key]):
            have = whole.setdefault(k, set())
            fresh |= digit not in have
            have.add(digit)
        return fresh

    for key in [k for k, reasons in log.pins.items() if reasons] + sorted(log.selected):
        add(key, (1, log.sizes[key]))
    refined = [f for f in (_refine(b) for b in blocks) if f]
    changed = True
    while changed:
        changed = False
        for factors in refined:
            for f in (f for f in factors if _is_whole(f, whole)):
                for k, n, stride in f.at:
                    if f.size < n:
                        changed |= add(k, (stride, f.size))
    return whole


def _is_whole(f: _Factor, whole: dict[AxisKey, set[Digit]]) -> bool:
    """Is factor `f` read whole: on some side, a whole digit covers it, where the digit is a
    part of its axis or `f` is the whole axis (an axis read whole tells nothing about which of
    several factors it holds would be units)."""
    for k, n, stride in f.at:
        for s, m in whole.get(k, ()):
            if s <= stride and stride * f.size <= s * m and (m < n or f.size == n):
                return True
    return False


def _refine(b: _Block) -> list[_Factor] | None:
    """The common refinement of a block's two shapes (size-1 axes aside), outermost factor
    first: every boundary between axes of either side is one between factors. None when the
    sizes do not nest (a boundary of one side falls inside a factor of the other)."""
    spans: list[list[tuple[AxisKey, int, int]]] = []  # per side: (key, size, stride), innermost first
    bounds: set[int] = set()
    for keys, ns in zip(b.sides, b.sizes, strict=True):
        stride, span = 1, []
        for k, n in reversed([(k, n) for k, n in zip(keys, ns, strict=True) if n > 1]):
            span.append((k, n, stride))
            bounds.add(stride)
            stride *= n
        bounds.add(stride)
        spans.append(span)
    edges = sorted(bounds)
    if any(hi % lo for lo, hi in zip(edges, edges[1:], strict=False)):
        return None
    factors = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        at = []
        for span in spans:
            holder = next((x for x in span if x[2] <= lo and hi <= x[2] * x[1]), None)
            if holder is None:
                return None  # the two sides' sizes differ
            k, n, s = holder
            at.append((k, n, lo // s))
        factors.append(_Factor(hi // lo, at))
    return factors[::-1]


def _components(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Connected components of n nodes and edges (a[k], b[k]), as the smallest node id in each
    (label propagation with pointer jumping, vectorized)."""
    label = np.arange(n, dtype=np.int64)
    if not len(a):
        return label
    while True:
        la, lb = label[a], label[b]
        if np.array_equal(la, lb):
            return label
        low = np.minimum(la, lb)
        np.minimum.at(label, la, low)
        np.minimum.at(label, lb, low)
        while True:  # every node points straight at its root
            nxt = label[label]
            if np.array_equal(nxt, label):
                break
            label = nxt

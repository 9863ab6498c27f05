"""The keep closure: which indices of every tensor axis must stay, grown to a fixpoint.

Every (tensor, axis) with a static size has a set of kept indices, empty at first. Graph
outputs and inputs keep everything; each live node's handler then adds what its inputs must
keep for its kept outputs (backward, "indirect sparsity") and ties axes that must agree
(elementwise coupling, Concat offsets, Reshape blocks, ...). Sets only grow, so the walk ends.

What is never kept is removable: either nothing downstream reads it, or it is a constant that
every reader absorbs (see the Conv/Gemm handlers). A tensor "exists" after shrinking when some
live node reads it and none of its axes is empty; a node is live when one of its outputs exists.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze.cache import free_axes
from onnxshrink.analyze.constants import ConstContext
from onnxshrink.analyze.coupling import CouplingLog
from onnxshrink.analyze.replay import Replayed, ReplayError, reaches, replay
from onnxshrink.analyze.shared import union_if_larger
from onnxshrink.core.handler import Dims
from onnxshrink.core.reasons import INTERFACE, LIVE, PROOF, AxisKey, Reason
from onnxshrink.core.registry import Lookup
from onnxshrink.core.symbols import SymValue
from onnxshrink.core.values import ConstInfo
from onnxshrink.core.views import IndexMask
from onnxshrink.errors import InternalError
from onnxshrink.io import weights

T = TypeVar("T")


class KeepState:
    """Kept index sets per tensor axis, plus what handlers need to read while growing them."""

    def __init__(
        self,
        graph: gs.Graph,
        consts: ConstContext,
        syms: dict[str, SymValue],
        handler_for: Lookup,
        pins: Iterable[AxisKey] = (),
        mode: str = "rules",
        free_inputs: bool = False,
        log: CouplingLog | None = None,
        untied: dict[str, str] | None = None,
        share_copies: bool = False,
    ):
        self.graph = graph
        # {copy: original} of the initializers several nodes read (prepare.tie), each stored
        # once per distinct slicing; `share_copies`: the copies of a weight whose slicings
        # together hold more than it keep their union (`analyze.shared`)
        self.untied = untied or {}
        self.share_copies = share_copies
        # Records what the handlers tie and pin (analyze.coupling.CouplingLog), for the coupled
        # groups; None: nothing is recorded. It never changes what is kept.
        self.log = log
        self.pins = frozenset(pins)
        self.free_inputs = free_inputs  # graph inputs not pinned (the test bench's oracle)
        # "rules": a handler's needs are its own; "replay": they are found by replaying the node
        # (analyze/replay.py), the handler still giving its structure.
        self.mode = mode
        self._needed_axes: dict[int, set[tuple[int, int]]] = {}  # id(node) -> (input, axis)
        # id(node) -> (input, axis) -> the slices its handler's rule needs (--analysis replay)
        self._ruled: dict[int, dict[tuple[int, int], np.ndarray]] = {}
        self._visiting: gs.Node | None = None
        self.opset = consts.opset
        self.tensors = ir.all_tensors(graph)  # every scope's: bodies are analyzed in place
        self.consts = consts
        self.syms = syms
        self.handler_for = handler_for
        self._kept: dict[str, list[np.ndarray | None]] = {}
        # Dynamic axes kept by a period (see `adopt`), and dynamic axes pinned (never adopt one).
        self._periodic: set[AxisKey] = set()
        self._whole: set[AxisKey] = set()
        self._why: dict[str, list[np.ndarray | None]] = {}
        self.demanded: set[str] = set()
        self.reasons: list[Reason] = []
        self._reason_id: dict[Reason, int] = {}
        self._claimed: set[tuple[int, int]] = set()
        # id(node) -> why it is a barrier (by identity: node names may be empty)
        self.barriers: dict[int, Reason] = {}
        # id(node) -> (name, op, what a handler found worth reporting: a replay's finding)
        self.notes: dict[int, tuple[str, str, str]] = {}
        # tensor -> the nodes whose keep rule read its kept set (by id(node)): a rule may read a
        # tensor it neither reads nor writes (a Reshape whose target is Shape(t) ties its output
        # to t's axes), and must run again when that set grows, as for its own tensors.
        self._readers: dict[str, dict[int, gs.Node]] = {}
        self.nodes = ir.flat_nodes(graph)  # every node of every scope, in topological order
        self._consumers, self._producer = self._links(self.nodes)
        self._memo: dict[Hashable, Any] = {}  # each key's own type: the compute it was given
        self._changes = 0
        self._queue: deque[gs.Node] = deque()
        self._queued: set[int] = set()

    @staticmethod
    def _links(nodes: list[gs.Node]) -> tuple[dict[str, list[gs.Node]], dict[str, gs.Node]]:
        """Each tensor's consumers (a node with bodies consumes their inputs and outputs too: its
        handler ties them) and its producer, by name."""
        consumers: dict[str, list[gs.Node]] = {}
        producer: dict[str, gs.Node] = {}
        for node in nodes:
            for t in node.inputs:
                consumers.setdefault(t.name, []).append(node)
            for t in node.outputs:
                producer[t.name] = node
            for body in ir.bodies(node):
                for t in [*body.inputs, *body.outputs]:
                    consumers.setdefault(t.name, []).append(node)
        return consumers, producer

    # ---------------------------------------------------------------- queries
    def forget(self) -> None:
        """Drop what was derived from the weights (kept sets and reasons stay)."""
        self._memo.clear()

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """Facts a handler derives from constants (e.g. a weight's zero pattern) once per run."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def dims(self, t: gs.Tensor) -> Dims | None:
        return ir.dims(t)

    def size(self, t: gs.Tensor, axis: int) -> int | None:
        return ir.static_dim(t, axis)

    def const(self, t: gs.Tensor | None) -> ConstInfo | None:
        return self.consts.const(t)

    def value(self, t: gs.Tensor | None) -> np.ndarray | None:
        return self.consts.value(t)

    def sym(self, t: gs.Tensor | None) -> SymValue | None:
        return None if t is None else self.syms.get(t.name)

    def _state(self, t: gs.Tensor) -> list[np.ndarray | None]:
        st = self._kept.get(t.name)
        if st is None:
            d = ir.dims(t) or []
            st = [np.zeros(v, dtype=bool) if isinstance(v, int) and v >= 0 else None for v in d]
            self._kept[t.name] = st
            self._why[t.name] = [None if a is None else np.full(a.shape, -1, np.int32) for a in st]
        return st

    def kept(self, t: gs.Tensor, axis: int) -> np.ndarray | None:
        """Bool mask of kept indices along `axis`; None when the axis is not prunable (all kept)."""
        if self._visiting is not None:
            self._readers.setdefault(t.name, {})[id(self._visiting)] = self._visiting
        st = self._state(t)
        return st[axis] if axis < len(st) else None

    def periodic(self, t: gs.Tensor, axis: int) -> bool:
        """Is this dynamic axis kept by a period (`adopt`)?"""
        return (t.name, axis) in self._periodic

    def adopt(self, t: gs.Tensor, axis: int, n: int) -> bool:
        """Dynamic axis `axis` of `t` is indexed outer * n + inner, a dynamic size merged with
        static ones row-major (the (batch, heads) axis of an einsum lowering's batched MatMul):
        its kept set is then that of the inner index, the same for every outer one, a mask of
        size n. True when it is kept so (now or before, by the same period); False when it is a
        static axis, has another period, or was pinned whole."""
        st = self._state(t)
        d = ir.dims(t)
        if axis >= len(st) or d is None or isinstance(d[axis], int) or (t.name, axis) in self._whole:
            return False
        if st[axis] is not None:
            return self.periodic(t, axis) and len(st[axis]) == n  # type: ignore[arg-type]
        st[axis] = np.zeros(n, dtype=bool)
        self._why[t.name][axis] = np.full(n, -1, np.int32)
        self._periodic.add((t.name, axis))
        self._changes += 1
        self._touch(t)
        return True

    def _reasons(self, t: gs.Tensor, axis: int) -> np.ndarray:
        """Reason ids of the kept indices of a prunable axis (-1: not kept)."""
        w = self._why[t.name][axis]
        assert w is not None
        return w

    def reason_ids(self, t: gs.Tensor, axis: int) -> np.ndarray:
        """Why each index of a prunable axis is kept, as ids `keep(..., why=)` takes: a handler
        that maps indices (not one to one) carries the reasons along."""
        self._state(t)
        return self._reasons(t, axis).copy()

    def why(self, t: gs.Tensor, axis: int) -> list[Reason | None]:
        self._state(t)
        w = self._why[t.name][axis] if axis < len(self._why[t.name]) else None
        if w is None:
            return []
        return [self.reasons[i] if i >= 0 else None for i in w]

    def is_read(self, t: gs.Tensor) -> bool:
        """Does a live node (or the graph's interface) read `t`? An optional output nothing
        reads constrains nothing."""
        return t.name in self.demanded

    def exists(self, t: gs.Tensor) -> bool:
        if t.name not in self.demanded:
            return False
        return all(a is None or a.any() for a in self._state(t))

    def node_live(self, node: gs.Node) -> bool:
        return any(self.exists(t) for t in node.outputs)

    def kept_masks(self) -> dict[str, dict[int, np.ndarray]]:
        """Every tensor that exists and loses indices: its kept mask per axis that loses some."""
        out: dict[str, dict[int, np.ndarray]] = {}
        for (name, a) in self.removed():
            k = self._kept[name][a]
            assert k is not None
            out.setdefault(name, {})[a] = k.copy()
        return out

    def removed(self) -> dict[AxisKey, int]:
        """Every prunable axis of a tensor that exists and loses indices: how many it loses."""
        out: dict[AxisKey, int] = {}
        for name, axes in self._kept.items():
            if name not in self.demanded:
                continue
            for a, k in enumerate(axes):
                if k is not None and len(k) and not k.all():
                    out[(name, a)] = int((~k).sum())
        return out

    # ---------------------------------------------------------------- growth
    def _rid(self, reason: Reason) -> int:
        rid = self._reason_id.get(reason)
        if rid is None:
            rid = self._reason_id[reason] = len(self.reasons)
            self.reasons.append(reason)
        return rid

    def _touch(self, t: gs.Tensor) -> None:
        p = self._producer.get(t.name)
        if p is not None:
            self._enqueue(p)
        for c in self._consumers.get(t.name, ()):
            self._enqueue(c)
        for r in self._readers.get(t.name, {}).values():
            self._enqueue(r)

    def _enqueue(self, node: gs.Node) -> None:
        if id(node) not in self._queued:
            self._queued.add(id(node))
            self._queue.append(node)

    def demand(self, t: gs.Tensor | None, pin: bool = True) -> None:
        """A live node reads `t`. With pin (the safe default) every index of it is kept; pass
        pin=False only when the handler itself constrains every axis of `t`."""
        if t is None:
            return
        if t.name not in self.demanded:
            self.demanded.add(t.name)
            self._touch(t)
        if pin:
            self.pin(t)

    def keep(
        self, t: gs.Tensor, axis: int, mask: IndexMask, reason: Reason = LIVE, why: np.ndarray | None = None
    ) -> None:
        st = self._state(t)
        arr = st[axis] if axis < len(st) else None
        if arr is None:
            return
        mask = np.asarray(mask)
        if mask.dtype != bool:
            m = np.zeros(arr.shape, dtype=bool)
            m[mask] = True
            mask = m
        new = mask & ~arr
        if not new.any():
            return
        arr |= new
        self._changes += 1
        self._reasons(t, axis)[new] = why[new] if why is not None else self._rid(reason)
        self._touch(t)

    def need(self, t: gs.Tensor, axis: int, mask: IndexMask, why: np.ndarray | None = None) -> None:
        """The kept outputs of the node being visited read these indices of its input `t`.
        With --analysis replay, found by replaying the node instead, for the inputs a replay
        draws (computed, floating point); a weight's or an integer input's needs stay the rule's."""
        if self.mode == "replay" and self._visiting is not None and self._drawable(t):
            node = self._visiting
            arr = self._state(t)[axis] if axis < len(self._state(t)) else None
            for i, x in enumerate(node.inputs):
                if x is t:
                    self._needed_axes.setdefault(id(node), set()).add((i, axis))
                    if arr is not None:  # what the rule needs: the replay redraws it together
                        ruled = self._ruled.setdefault(id(node), {})
                        rule = ruled.setdefault((i, axis), np.zeros(arr.shape, bool))
                        m = np.asarray(mask)
                        rule[m if m.dtype == bool else m.astype(np.intp)] = True
            return
        self.keep(t, axis, mask, why=why)

    def _drawable(self, t: gs.Tensor) -> bool:
        """Does a replay draw this input's values (see _replay)?"""
        return (
            self.value(t) is None
            and t.dtype is not None
            and bool(np.issubdtype(np.dtype(t.dtype), np.floating))
        )

    def pin(self, t: gs.Tensor, axis: int | None = None, reason: Reason = LIVE) -> None:
        st = self._state(t)
        if self.log is not None:
            self.log.pinned(t.name, [None if k is None else len(k) for k in st], axis, reason)
        for a in range(len(st)) if axis is None else [axis]:
            k = st[a] if a < len(st) else None
            if k is not None:
                self.keep(t, a, np.ones(k.shape, dtype=bool), reason)
            elif a < len(st):
                self._whole.add((t.name, a))  # a dynamic axis: never kept by a period

    def couple(
        self, t1: gs.Tensor, a1: int, t2: gs.Tensor, a2: int, meet: gs.Node | None = None
    ) -> None:
        """Axis a1 of t1 and a2 of t2 are indexed alike: keep the same indices in both. `meet`
        is the elementwise node combining them, if any: where a constant index of one meets a
        live index of the other there, that is recorded as the reason the constant stays."""
        k1, k2 = self.kept(t1, a1), self.kept(t2, a2)
        if k1 is None and k2 is None:
            return
        # a dynamic axis indexed like one kept by a period is kept by that period too
        if k1 is None and k2 is not None and self.periodic(t2, a2) and self.adopt(t1, a1, len(k2)):
            k1 = self.kept(t1, a1)
        elif k2 is None and k1 is not None and self.periodic(t1, a1) and self.adopt(t2, a2, len(k1)):
            k2 = self.kept(t2, a2)
        if k1 is None or k2 is None or k1.shape != k2.shape:
            self.pin(t1, a1)
            self.pin(t2, a2)
            return
        if self.log is not None:
            self.log.same(t1.name, a1, t2.name, a2, len(k1), meet)
        self._flow(t1, a1, t2, a2, meet)
        self._flow(t2, a2, t1, a1, meet)

    def _flow(self, src: gs.Tensor, sa: int, dst: gs.Tensor, da: int, meet: gs.Node | None) -> None:
        ks, kd = self.kept(src, sa), self.kept(dst, da)
        assert ks is not None and kd is not None  # couple() checked
        new = ks & ~kd
        if not new.any():
            return
        why = self._reasons(src, sa).copy()
        if meet is not None:
            cd, cs = self.const(dst), self.const(src)
            if cd is not None:
                dconst = cd.slice_constant(da, len(kd))
                sconst = (
                    cs.slice_constant(sa, len(ks)) if cs is not None else np.zeros(len(ks), bool)
                )
                meets = new & dconst & ~sconst
                if meets.any():
                    why[meets] = self._rid(Reason("meets-live", meet.name, meet.op))
        self.keep(dst, da, new, why=why)

    def couple_map(
        self, small: gs.Tensor, sa: int, big: gs.Tensor, ba: int, idx: np.ndarray
    ) -> None:
        """Index j of `small` along `sa` is index idx[j] of `big` along `ba` (a slice, a Concat
        part, a gather): kept indices and their reasons flow both ways."""
        ks_, kb = self.kept(small, sa), self.kept(big, ba)
        if ks_ is None or kb is None:
            self.pin(small, sa)
            self.pin(big, ba)
            return
        idx = np.asarray(idx, dtype=np.int64)
        if self.log is not None:
            self.log.maps(small.name, sa, len(ks_), big.name, ba, len(kb), idx)
        if ks_.any():
            mask = np.zeros(kb.shape, bool)
            mask[idx[ks_]] = True
            why = np.full(kb.shape, -1, np.int32)
            why[idx[ks_]] = self._reasons(small, sa)[ks_]
            self.keep(big, ba, mask, why=why)
        sel = kb[idx]
        if sel.any():
            self.keep(small, sa, sel, why=self._reasons(big, ba)[idx])

    def note(self, node: gs.Node, text: str) -> None:
        """Something about `node` the report should say (e.g. what its replay found)."""
        self.notes[id(node)] = (node.name, node.op, text)

    def block(
        self, x: gs.Tensor, in_axes: list[int], y: gs.Tensor, out_axes: list[int], site: gs.Node
    ) -> None:
        """Records (for the coupled groups) that `x`'s axes `in_axes` and `y`'s `out_axes` are
        one flat index space viewed in two shapes (a Reshape's heads x head dims). Keeps nothing:
        the handler keeps the product sets itself."""
        if self.log is not None:  # a periodic axis: its inner index, of the period's size
            sizes = [[self._block_size(t, a) for a in axes] for t, axes in ((x, in_axes), (y, out_axes))]
            self.log.block(x.name, in_axes, sizes[0], y.name, out_axes, sizes[1], site)

    def _block_size(self, t: gs.Tensor, axis: int) -> int | None:
        if self.periodic(t, axis):
            return len(self._state(t)[axis])  # type: ignore[arg-type]  # periodic: a mask
        return self.size(t, axis)

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
        """Records (for the coupled groups) that index idx1[k] of t1's axis a1 is removed only
        together with idx2[k] of t2's axis a2 (a grouped conv's groups). Keeps nothing.
        `kind`: the unit kind of one of several ways to cut the same indices (the log records
        it only when asked for that kind: `CouplingLog.kinds`); None: every way."""
        n1, n2 = self.size(t1, a1), self.size(t2, a2)
        if self.log is not None and n1 is not None and n2 is not None:
            self.log.pairs(t1.name, a1, n1, np.asarray(idx1), t2.name, a2, n2, np.asarray(idx2), kind)

    def normalizes(self, t: gs.Tensor, axis: int) -> None:
        """Records (for the coupled groups) that a LayerNorm or RMSNorm normalizes over `t`'s
        axis (its channels are a residual stream's width). Keeps nothing."""
        if self.log is not None:
            self.log.normalizes(t.name, axis, self.size(t, axis))

    def selects(self, t: gs.Tensor, axis: int) -> None:
        """Records (for the coupled groups) that a constant scalar index picks one index of `t`'s
        axis out (a Gather of slot q, k or v of a packed projection): its indices are slots,
        each read by itself, not units. Keeps nothing."""
        if self.log is not None:
            self.log.selects(t.name, axis, self.size(t, axis))

    def claim(self, node: gs.Node, i: int) -> None:
        """The handler uses shape-valued input i as a size and constrains what it refers to."""
        self._claimed.add((id(node), i))

    def barrier(self, node: gs.Node, reason: Reason | None = None) -> None:
        """Keep every index of every input and output of `node`."""
        reason = reason or Reason("barrier", node.name, node.op)
        self.barriers.setdefault(id(node), reason)
        outer = [t for t in ir.outer_inputs(node) if self.tensors.get(t.name) is t]
        for t in [*node.inputs, *outer]:
            if t is not None and t.name:
                self.demand(t, pin=False)
                self.pin(t, reason=reason)
        for t in node.outputs:
            self.pin(t, reason=reason)
        self._pin_symbol_deps(node, all_inputs=True, reason=reason)

    def pin_refs(self, sym: SymValue, reason: Reason) -> None:
        for ref in sym.deps():
            t = self.tensors.get(ref.tensor)
            if t is not None:
                self.pin(t, ref.axis, reason)

    def _pin_symbol_deps(
        self, node: gs.Node, all_inputs: bool = False, reason: Reason | None = None
    ) -> None:
        for i, t in enumerate(node.inputs):
            s = self.sym(t)
            if s is None or (not all_inputs and (id(node), i) in self._claimed):
                continue
            self.pin_refs(s, reason or Reason("shape", node.name, node.op))

    def _pin_interface(self, t: gs.Tensor, free: set[int]) -> None:
        if not free:
            self.pin(t, reason=INTERFACE)
            return
        for a in range(len(self._state(t))):
            if a not in free:
                self.pin(t, a, INTERFACE)

    # ---------------------------------------------------------------- fixpoint
    def run(self, progress: bool = False) -> None:
        """The closure to its fixed point (`progress`: a count of the nodes visited, on a
        terminal: how many visits a graph needs is known only at the end)."""
        from onnxshrink.progress import bar

        with bar(None, "analysis: the keep closure", "visit", progress) as shown:
            self._run(shown)

    def _run(self, shown: Any) -> None:
        free = free_axes(self.graph, self.handler_for)  # a state (KV cache) input and the output fed back into it
        for t in self.graph.outputs:
            self.demand(t, pin=False)
            self._pin_interface(t, free.get(t.name, set()))
            s = self.sym(t)
            if s is not None:
                self.pin_refs(s, INTERFACE)
        for t in self.graph.inputs if not self.free_inputs else ():
            self._pin_interface(t, free.get(t.name, set()))
        for name, axis in sorted(self.pins):
            t = self.tensors.get(name)
            if t is not None:
                self.pin(t, axis, PROOF)
        for node in reversed(self.nodes):
            self._enqueue(node)
        while True:
            while self._queue:
                node = self._queue.popleft()
                self._queued.discard(id(node))
                if self.node_live(node):
                    self._visit(node)
                    shown.update(1)
            if not self._repair():
                break

    def _visit(self, node: gs.Node) -> None:
        handler = self.handler_for(node)
        if node.outputs and all(t.name in self.syms for t in node.outputs) and not ir.bodies(node):
            # A shape computation: its values flow on symbolically; consumers decide.
            for i, t in enumerate(node.inputs):
                if t is not None and t.name:
                    self.demand(t, pin=i not in handler.sizes_only)
            return
        self._visiting = node
        try:
            handler.keep(node, self)
        finally:
            self._visiting = None
        weights.trim()
        if self.mode == "replay" and id(node) in self._needed_axes:
            self._replay_needs(node)
        for i, t in enumerate(node.inputs):  # the contract: a handler demands what it reads
            if t is not None and t.name and t.name not in self.demanded:
                raise InternalError(
                    f"{type(handler).__name__}.keep did not demand input {i} of {node.op} node "
                    f"{node.name!r}"
                )
        self._pin_symbol_deps(node)

    def _replay_needs(self, node: gs.Node) -> None:
        """What the handler's needs would be, found by replaying the node (--analysis replay):
        the input slices a kept output element can change. Constant slices keep their values and
        are not drawn: whether they may go is the handler's (it absorbs them, or keeps them).
        The slices the handler's rule needs are redrawn together first, in one run a draw
        (`presumed`): when they reach a kept output they are kept without a run each (keeping
        is always safe; on ResNet-50 that is every live channel, one run per channel before).
        Every other slice, the ones the rule would let go, is probed alone in every draw, as
        before: a dependency a rule misses is still found."""
        wanted = sorted(self._needed_axes[id(node)])
        kept = []
        for y in node.outputs:
            kept.append(
                [self.kept(y, b) for b in range(len(ir.dims(y) or []))] if self.exists(y) else None
            )
        # A slice found to reach a kept output is needed for good (kept sets only grow): its
        # other draws are skipped, and the memo stays true as the sets grow.
        found = self.memo(
            ("replay", id(node), tuple(wanted)), lambda: self._replay(node, wanted, kept)
        )
        if isinstance(found, str):  # cannot replay it: the handler's own needs, then
            self.mode, handler = "rules", self.handler_for(node)
            try:
                self._visiting = node
                handler.keep(node, self)
            finally:
                self._visiting, self.mode = None, "replay"
            self.note(node, f"not replayed ({found}): its rules' needs are kept")
            return
        for i, a in wanted:
            t = node.inputs[i]
            st = self._state(t)
            have = st[a] if a < len(st) else None
            if have is None:
                continue  # not prunable: kept whole (keep() would do nothing)
            # (a slice kept already needs no witness: keep() would change nothing)
            joint = found.joint.get((i, a))
            needed = np.flatnonzero(found.needed(i, a, kept) & ~have)
            for j, w in zip(needed, found.witnesses(i, a, needed, kept), strict=True):
                if w is None:
                    detail = ""
                elif joint is not None and joint[j]:  # settled with the rule's other needs
                    others = int(joint.sum()) - 1
                    detail = (
                        f"redrawn together with the {others} other slice{'s' * (others != 1)} its "
                        f"rule needs, output {node.outputs[w[0]].name!r} index {w[2]} (axis {w[1]}) changes"
                    )
                else:
                    detail = f"output {node.outputs[w[0]].name!r} index {w[2]} (axis {w[1]}) depends on it"
                self.keep(t, a, [int(j)], Reason("replay", node.name, node.op, detail))

    def _replay(
        self,
        node: gs.Node,
        wanted: list[tuple[int, int]],
        kept: list[list[np.ndarray | None] | None],
    ) -> Replayed | str:
        inputs: list[np.ndarray | None] = []
        live: list[bool] = []
        fixed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for i, t in enumerate(node.inputs):
            value = self.value(t) if t is not None and t.name else None
            if t is None or not t.name:
                inputs.append(None)
                live.append(False)
            elif value is not None:
                inputs.append(np.asarray(value))
                live.append(False)
            else:
                shape = [d if isinstance(d, int) else 1 for d in (ir.dims(t) or [])]
                if (
                    ir.dims(t) is None
                    or t.dtype is None
                    or any(not isinstance(d, int) for d in (ir.dims(t) or [])[1:])
                ):
                    return f"input {i} has no static shape"
                inputs.append(np.zeros(shape, np.dtype(t.dtype)))
                live.append(np.issubdtype(np.dtype(t.dtype), np.floating))
                c = self.const(t)
                if c is not None:
                    fixed[i] = (c.mask, c.value)
        axes: dict[int, list[int]] = {}
        # Slices kept already stay kept whatever the replay finds (sets only grow): not probed.
        known: dict[tuple[int, int], np.ndarray] = {}
        for i, a in wanted:
            if live[i]:
                axes.setdefault(i, []).append(a)
                k = self.kept(node.inputs[i], a)
                if k is not None:
                    known[(i, a)] = k.copy()
        try:
            found = replay(
                node, inputs, live, axes, self.opset, fixed=fixed,
                enough=lambda i, a, rows: reaches(rows, kept), known=known, whole=False,
                presumed=self._ruled.get(id(node)),
            )  # fmt: skip
        except ReplayError as exc:
            return str(exc)
        # Only the relation is read here; the memo would otherwise hold every node's output.
        found.outputs, found.depends = [], []
        return found

    def _repair(self) -> bool:
        """Once the closure is stable, structural choices: each live node's handler settles what
        its structure needs (equal groups, non-empty Split parts), and a live node whose demanded
        input lost every index of an axis keeps one. Made only now, so that no early, arbitrary
        pick locks in more than the final sets need. True if anything was added."""
        before = self._changes
        for node in self.nodes:
            if not self.node_live(node):
                continue
            handler = self.handler_for(node)
            if id(node) not in self.barriers:
                handler.settle(node, self)
            for i, t in enumerate(node.inputs):
                if t is None or t.name not in self.demanded:
                    continue
                if i in handler.may_drop_inputs(node):
                    continue
                self._keep_one_per_axis(t, Reason("structure", node.name, node.op, "an input needs at least one channel"))
        for t in self.graph.outputs:  # a graph output exists, even a state no other output reads
            if t.name in self.demanded:
                self._keep_one_per_axis(t, Reason("interface", detail="a graph output keeps at least one index of each axis"))
        if self.share_copies:
            why = Reason("structure", detail="a weight several nodes read is stored once: sliced for them all")
            for ts, union in self.larger_copies():
                for t in ts:
                    for a, k in enumerate(union):
                        self.keep(t, a, k, why)
        return self._changes != before

    def larger_copies(self) -> list[tuple[list[gs.Tensor], list[np.ndarray]]]:
        """The copies of each weight several nodes read whose slicings together hold more than
        the weight, with the union of their kept indices per axis (`analyze.shared`)."""
        copies: dict[str, list[str]] = {}
        for copy, base in self.untied.items():
            copies.setdefault(base, [base]).append(copy)
        out = []
        for names in copies.values():
            ts = [self.tensors[n] for n in names if n in self.tensors and n in self.demanded]
            union = union_if_larger([self._state(t) for t in ts])
            if union is not None:
                out.append((ts, union))
        return out

    def stored(self) -> int:
        """Elements the demanded constants keep, a weight several nodes read counted once per
        distinct slicing (as `prepare.tie.retie` stores it)."""
        seen: set[tuple[str, bytes]] = set()
        total = 0
        for name, t in self.tensors.items():
            if not isinstance(t, gs.Constant) or name not in self.demanded:
                continue
            st = self._state(t)
            kept = [int(k.sum()) if k is not None else int(n) for k, n in zip(st, t.shape, strict=True)]
            key = (self.untied.get(name, name), b"".join(np.packbits(k).tobytes() for k in st if k is not None))
            if key not in seen:
                seen.add(key)
                total += math.prod(kept)
        return total

    def _keep_one_per_axis(self, t: gs.Tensor, why: Reason) -> None:
        """Index 0 of each axis of `t` whose every index would go."""
        for a, k in enumerate(self._state(t)):
            if k is not None and len(k) and not k.any():
                self.keep(t, a, [0], why)

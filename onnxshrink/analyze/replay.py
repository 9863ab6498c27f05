"""Replay one node in onnxruntime to read off what its outputs depend on.

A handler's rules say, for an op they know, which input indices a kept output needs. The replay
finds the same thing for any op onnxruntime can run, by experiment: the node runs on random
values for its live inputs (constant inputs hold their values), then again with one slice of one
input (index j along axis a) drawn anew; the output elements that change depend on that slice.
Their projections on each output axis give, per (input, axis), a relation: slice j can change
output index k along axis b.

A false "does not depend" would remove a channel that is needed, so the draws are chosen to
cross the kinks of piecewise ops (ReLU's 0, Clip's bounds, Shrink's lambda): several draws,
with base values and new values at different scales and of both signs, and the relation is the
union over draws. The replay only ever adds to what is kept. Runs are in float64 where the
runtime has the kernel (a change is then never lost to rounding), else in the model's type.

(The design named a torch autograd replay. onnx2torch, the converter it would need, depends on
torchvision, which cannot be installed beside the torch this project pins; onnxruntime runs the
very kernels the proof uses, every standard and contrib op, and a finite redraw also crosses
the flat regions where a gradient is zero.)
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from onnxshrink.core.evaluate import _attrs
from onnxshrink.errors import first_line
from onnxshrink.io.weights import HANDED, handed

# Per draw: (scale, sign) of the base values and of the redrawn slice; sign 0 draws both signs,
# +1 only positive values, -1 only negative ones. Scales over four orders of magnitude leave the
# flat region of a clip, a shrink or a saturation in some draw; two draws move every redrawn
# value across zero (ReLU's kink), both ways.
DRAWS = (
    ((1.0, 0), (3.0, 0)),
    ((0.1, 0), (1.0, 0)),
    ((10.0, 0), (0.1, 0)),
    ((1.0, 1), (1.0, -1)),
    ((1.0, -1), (1.0, 1)),
    ((0.3, 0), (30.0, 0)),
)
_IR_VERSION = 8

# enough(input, axis, rows): see replay().
Enough = Callable[[int, int, list[list[np.ndarray]]], bool]


def reaches(
    rows: Sequence[Sequence[np.ndarray]], kept: Sequence[Sequence[np.ndarray | None] | None]
) -> bool:
    """Do one slice's changes (`rows[o][b]`: the indices of output o along axis b) reach a kept
    index on every axis of some used output? (`kept` as in Replayed.needed.)"""
    for rows_o, used in zip(rows, kept, strict=True):
        if used is None:
            continue
        if all(
            row.any() if len(used) != len(rows_o) or used[b] is None else (row & used[b]).any()
            for b, row in enumerate(rows_o)
        ):
            return True
    return False


class ReplayError(RuntimeError):
    """The node cannot be replayed (an op or a type onnxruntime does not run, unknown shapes)."""


@dataclass
class Replayed:
    """What one replay found.

    `relation[(i, a)][o][b]`: bool [size of input i's axis a, size of output o's axis b]: slice j
    of input i along axis a changes index k of output o along axis b (in some draw).
    `depends[o]`: bool, output o's shape: the element changes with some live input slice.
    `joint[(i, a)]`: bool per slice: settled by a run that redrew it with the other presumed
    slices (`replay(presumed=...)`); its relation row is that run's changes."""

    relation: dict[tuple[int, int], list[list[np.ndarray]]]
    depends: list[np.ndarray]
    outputs: list[np.ndarray]  # output values of the first draw's base run (or zeros: replay's `whole`)
    joint: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A boolean or integer output (a comparison, IsInf, a rounding) may change only on the
        # rare values random draws never hit (equality, infinities): what it depends on is not
        # read off the draws (`judged` is False). It is taken to depend on every input element,
        # and is never constant.
        self.judged = [bool(np.issubdtype(out.dtype, np.floating)) for out in self.outputs]
        for o, judged in enumerate(self.judged):
            if not judged:
                self.depends[o][...] = True
                for axes in self.relation.values():
                    for r in axes[o]:
                        r[...] = True

    def needed(
        self, i: int, a: int, kept: Sequence[Sequence[np.ndarray | None] | None]
    ) -> np.ndarray:
        """Slices of input i along axis a that a kept output element may depend on. `kept[o]`:
        per axis of output o, its kept indices (None: all); None when output o is unused. A
        slice is needed when, for some used output, its changes reach a kept index on every
        axis (a sound over-approximation of reaching a kept element)."""
        rel = self.relation[(i, a)]
        need = np.zeros(rel[0][0].shape[0] if rel and rel[0] else 0, dtype=bool)
        for o, axes in enumerate(rel):
            used = kept[o]
            if used is None:
                continue
            reach = np.ones_like(need)
            for b, r in enumerate(axes):
                k = used[b] if len(used) == len(axes) else None
                reach &= r.any(axis=1) if k is None else (r & k[None, :]).any(axis=1)
            need |= reach
        return need

    def witnesses(
        self, i: int, a: int, slices: np.ndarray, kept: Sequence[Sequence[np.ndarray | None] | None]
    ) -> list[tuple[int, int, int] | None]:
        """`witness` of each of `slices`, found for all of them at once."""
        n = len(slices)
        # Per slice: the best rank so far, (a size-1 axis, hits) as one number; its place.
        best = np.full(n, np.iinfo(np.int64).max, np.int64)
        where = np.zeros((n, 3), np.int64)
        for o, axes in enumerate(self.relation[(i, a)]):
            used = kept[o]
            if used is None:
                continue
            for b, r in enumerate(axes):
                if not r.shape[1]:
                    continue  # no index to reach
                k = used[b] if len(used) == len(axes) else None
                rows = r[slices] if k is None else r[slices] & k
                hits = rows.sum(axis=1)
                rank = hits + (r.shape[1] == 1) * (1 << 40)  # a size-1 axis explains nothing
                better = (hits > 0) & (rank < best)
                best[better] = rank[better]
                where[better] = np.stack(
                    [np.full(n, o), np.full(n, b), rows.argmax(axis=1)], axis=1
                )[better]
        found = best < np.iinfo(np.int64).max
        return [tuple(int(x) for x in w) if f else None for w, f in zip(where, found, strict=True)]  # type: ignore[misc]


def _model(
    node: gs.Node,
    inputs: Sequence[np.ndarray | None],
    live: Sequence[bool],
    opset: int,
    copies: int = 1,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The node alone, or `copies` copies of it side by side (each its own live inputs
    `i{k}.{c}` and outputs `o{k}.{c}`): the inputs that are not live are initializers, shared,
    which kernels prepack once (a weight fed anew at every run is repacked at every run:
    MatMulNBits' int4 weights cost 7x the product itself). Returned with the arrays of the
    initializers that the model names but does not hold (`_session` hands them to onnxruntime
    as they lie: a conv's weights are not copied into a proto, serialized and parsed again)."""
    domain = node.domain or ""
    attrs = _attrs(node)
    nodes, graph_inputs = [], []
    for c in range(copies):
        names = [
            "" if a is None else f"i{k}.{c}" if v else f"i{k}"
            for k, (a, v) in enumerate(zip(inputs, live, strict=True))
        ]
        outs = [f"o{k}.{c}" for k in range(len(node.outputs))]
        nodes.append(helper.make_node(node.op, names, outs, domain=domain, **attrs))
        graph_inputs += [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a, v in zip(names, inputs, live, strict=True)
            if a is not None and v
        ]
    initializers, weights = [], {}
    for k, (a, v) in enumerate(zip(inputs, live, strict=True)):
        if a is None or v:
            continue
        if a.nbytes >= _HANDED_BYTES and a.dtype in HANDED:
            initializers.append(handed(f"i{k}", a))
            weights[f"i{k}"] = np.ascontiguousarray(a)
        else:
            initializers.append(onnx.numpy_helper.from_array(np.asarray(a), f"i{k}"))
    outputs = [
        onnx.ValueInfoProto(name=f"o{k}.{c}") for c in range(copies) for k in range(len(node.outputs))
    ]
    graph = helper.make_graph(nodes, "replay", graph_inputs, outputs, initializers)
    imports = [helper.make_opsetid("", opset)]
    if domain not in ("", "ai.onnx"):
        imports.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=imports, ir_version=_IR_VERSION), weights


# Constant inputs of these types (io.weights.HANDED) and at least this size are handed to
# onnxruntime as arrays (io.weights.handed); smaller ones, or of other types, are serialized
# into the model.
_HANDED_BYTES = 1024


def _session(model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # The op's own kernel, as the model defines it: no rewrite (a fusion, a layout change).
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if weights:
        # (The OrtValues refer to the arrays' memory: the caller keeps the arrays alive.)
        names = list(weights)
        so.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in names])
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _digest(node: gs.Node, inputs: Sequence[np.ndarray | None], live: Sequence[bool], opset: int) -> bytes:
    """What a node's session depends on: op, domain, attributes, opset, every input's shape and
    type, and the inputs that are not live (they are the session's initializers): the bytes of
    a small one, a large one's identity (`_identity`)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(helper.make_node(node.op, [], [], domain=node.domain or "", **_attrs(node)).SerializeToString())
    h.update(f"{opset}|{len(node.outputs)}".encode())
    for a, v in zip(inputs, live, strict=True):
        if a is None:
            h.update(b"|none")
            continue
        h.update(f"|{a.dtype.str}{a.shape}{bool(v)}".encode())
        if not v:
            ident = _identity(a) if a.nbytes >= _IDENTITY_BYTES else None
            h.update(np.ascontiguousarray(a).data if ident is None else b"@%d" % ident)
    return h.digest()


def _identity(a: np.ndarray) -> int | None:
    """A number for the array object, given when it is first seen and never given again (its
    entry goes with the array): a key that holds it cannot meet another array, even one at the
    same address later. Within a shrink a constant is one array, never written to: the key
    stands for its values without reading them (hashing ResNet-50's weights cost a tenth of a
    second). Equal arrays that are distinct objects get sessions of their own: only time.
    None when the array cannot be referred to weakly (then its bytes are hashed)."""
    held = _IDENTITIES.get(id(a))
    if held is not None and held[0]() is a:
        return held[1]
    address = id(a)

    def gone(ref: weakref.ref[np.ndarray], address: int = address) -> None:
        if _IDENTITIES.get(address, (None,))[0] is ref:
            del _IDENTITIES[address]

    try:
        ref = weakref.ref(a, gone)
    except TypeError:
        return None
    _IDENTITIES[address] = (ref, next(_NUMBERS))
    return _IDENTITIES[address][1]


# Constants of this size and more are keyed by identity (`_identity`), smaller ones by bytes.
_IDENTITY_BYTES = 1 << 16
_IDENTITIES: dict[int, tuple[weakref.ref[np.ndarray], int]] = {}
_NUMBERS = itertools.count()


class NodeRunner:
    """The node in a session of its own: in float64 when onnxruntime runs it so, else as given.
    `live`: the inputs fed at each run (the others, fixed, are the session's initializers).
    Sessions are built once per node and form (`NodeRunner.of`). A node that runs in little
    time also gets a session of several copies of it (`run_many`): one call runs many probes,
    each copy the same kernel on its own inputs."""

    def __init__(
        self,
        node: gs.Node,
        inputs: Sequence[np.ndarray | None],
        opset: int,
        live: Sequence[bool] | None = None,
    ):
        # The op alone (not the graph's node: a cached runner must not hold the graph alive).
        self.node = gs.Node(
            node.op, domain=node.domain, attrs=dict(node.attrs),
            outputs=[gs.Variable(f"o{k}") for k in range(len(node.outputs))],
        )  # fmt: skip
        self.opset = opset
        self.live = list(live) if live is not None else [a is not None for a in inputs]
        self._copies: int | None = None
        self._many: Any = None
        self._runs = 0
        self._first = 0.0  # seconds of the first run
        self._steady: float | None = None  # seconds of the last run but the first
        self._forms: list[tuple[tuple[int, ...], np.dtype]] | None = None
        self._out_bytes = 0
        self.key = b""
        failure: Exception | None = None
        # Widened only when onnxruntime has the float64 kernel (asked with shapes and types).
        wide = [None if a is None else np.broadcast_to(np.zeros((), _wide(a.dtype)), a.shape) for a in inputs]
        forms = (None, list(inputs)) if _kernel(node, wide, opset) else (list(inputs),)
        for arrays in forms:
            try:
                arrays = arrays if arrays is not None else [_widen(a) for a in inputs]
                model, self.weights = _model(node, arrays, self.live, opset)
                self.session = _session(model, self.weights)
                self.templates = arrays
                if len(forms) > 1:  # it runs (else the next form is tried)
                    self._runs, self._steady = 0, None
                    self.run(arrays)
                break
            except Exception as exc:  # no kernel for these types: try the next
                failure = exc
        else:
            raise ReplayError(f"onnxruntime cannot run it ({first_line(failure or Exception())})")
        # What the session holds (its initializers; copies may prepack their own).
        self.nbytes = sum(a.nbytes for a in self.templates if a is not None)

    @property
    def forms(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """The outputs' shapes and types (those of the first run; one of the templates if none
        ran yet)."""
        if self._forms is None:
            self.run(self.templates)
        assert self._forms is not None
        return self._forms

    @property
    def copies(self) -> int:
        """Copies of the node in the session of `run_many`: decided when first asked, on the
        time of a steady run (the last run but the first: a replay's own, else one more run of
        the templates), unless the first run was far too slow for copies anyway (a large conv:
        a first run pays allocations and prepacking)."""
        if self._copies is None:
            while self._steady is None and (not self._runs or self._first < _COLD * _BATCH_BELOW):
                self.run(self.templates)
            self._copies = 1
            if self._steady is not None and self._steady < _BATCH_BELOW:
                # Copies share the initializers, but each kernel may prepack its own copy of them.
                each = sum(a.nbytes for a in self.templates if a is not None) + self._out_bytes
                self._copies = int(max(1, min(_COPIES, _BATCH_BYTES // max(each, 1))))
                self.nbytes += self._copies * each if self._copies > 1 else 0
        return self._copies

    @copies.setter
    def copies(self, copies: int) -> None:
        self._copies = copies

    @classmethod
    def of(
        cls,
        node: gs.Node,
        inputs: Sequence[np.ndarray | None],
        opset: int,
        live: Sequence[bool] | None = None,
    ) -> NodeRunner:
        """The runner of this node and form, built once (nodes alike share it: a model's repeated
        blocks are replayed with one session per form)."""
        live = list(live) if live is not None else [a is not None for a in inputs]
        key = _digest(node, inputs, live, opset)
        runner = _RUNNERS.get(key)
        if runner is None:
            try:
                runner = cls(node, inputs, opset, live)
                runner.key = key
            except ReplayError as exc:
                runner = ReplayError(str(exc))  # (no traceback: its frames hold the graph)
            _RUNNERS[key] = runner
            held = sum(r.nbytes for r in _RUNNERS.values() if isinstance(r, NodeRunner))
            while len(_RUNNERS) > 1 and (len(_RUNNERS) > _RUNNERS_KEPT or held > _RUNNERS_BYTES):
                gone = _RUNNERS.popitem(last=False)[1]
                held -= gone.nbytes if isinstance(gone, NodeRunner) else 0
        else:
            _RUNNERS.move_to_end(key)
        if isinstance(runner, ReplayError):
            raise ReplayError(str(runner))
        return runner

    def _feeds(self, inputs: Sequence[np.ndarray | None], c: int = 0) -> dict[str, np.ndarray]:
        return {
            f"i{k}.{c}": np.asarray(a, order="C")
            for k, (a, v) in enumerate(zip(inputs, self.live, strict=True))
            if a is not None and v
        }

    def run(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        start = time.perf_counter()
        try:
            outputs = [np.asarray(o) for o in self.session.run(None, self._feeds(inputs))]
        except Exception as exc:
            if self._runs:
                raise
            # The session was built but the node does not run: it cannot be replayed (and the
            # cache says so from now on).
            failed = f"onnxruntime cannot run it ({first_line(exc)})"
            if _RUNNERS.get(self.key) is self:
                _RUNNERS[self.key] = ReplayError(failed)
            raise ReplayError(failed) from None
        seconds = time.perf_counter() - start
        if self._runs:
            self._steady = seconds
        else:
            self._first = seconds
            self._forms = [(o.shape, o.dtype) for o in outputs]
            self._out_bytes = sum(o.nbytes for o in outputs)
        self._runs += 1
        return outputs

    def run_many(self, probes: Sequence[Sequence[np.ndarray | None]]) -> list[list[np.ndarray]]:
        """`run` of each of `probes`: groups of `copies` of them in one call each (a session of
        copies pays off over full groups only), the rest one by one."""
        full = len(probes) - len(probes) % self.copies if self.copies > 1 else 0
        if full and self._many is None:
            try:
                model, weights = _model(self.node, self.templates, self.live, self.opset, self.copies)
                self._many = _session(model, weights)
            except Exception:  # a session of copies is only faster: run them one by one
                self.copies, full = 1, 0
        n = len(self.node.outputs)
        out: list[list[np.ndarray]] = []
        for start in range(0, full, self.copies):
            feeds: dict[str, np.ndarray] = {}
            for c in range(self.copies):
                feeds.update(self._feeds(probes[start + c], c))
            got = self._many.run(None, feeds)
            out += [[np.asarray(o) for o in got[c * n : (c + 1) * n]] for c in range(self.copies)]
        return out + [self.run(p) for p in probes[full:]]


def _kernel(node: gs.Node, inputs: Sequence[np.ndarray | None], opset: int) -> bool:
    """False if onnxruntime has no kernel for the node with inputs of these types (checked with
    every input fed, so that no weight is copied into a model only to be refused). onnxruntime
    picks a kernel by op, domain, opset and input types: the answer is kept per those and the
    attributes (every conv of a model then tries no float64 session it would be refused)."""
    op = helper.make_node(node.op, [], [], domain=node.domain or "", **_attrs(node)).SerializeToString()
    key = (op, opset, tuple(None if a is None else a.dtype.str for a in inputs))
    if key not in _KERNELS:
        try:
            _session(_model(node, inputs, [a is not None for a in inputs], opset)[0])
            _KERNELS[key] = True
        except Exception as exc:
            _KERNELS[key] = "NOT_IMPLEMENTED" not in str(exc)
    return _KERNELS[key]


_KERNELS: dict[tuple[bytes, int, tuple[str | None, ...]], bool] = {}


# Sessions (or why a node cannot run) by _digest, least recently used first, up to
# _RUNNERS_KEPT of them and _RUNNERS_BYTES of inputs: a replay and the checks after it
# (commutes, a second analysis) reuse the node's session.
_RUNNERS: OrderedDict[bytes, NodeRunner | ReplayError] = OrderedDict()
_RUNNERS_KEPT = 8
_RUNNERS_BYTES = 1 << 28
# A node whose run takes less than this gets a session of copies, up to _COPIES of them and
# _BATCH_BYTES of inputs and outputs (the per-call cost is then shared).
_BATCH_BELOW = 5e-4
_COLD = 20  # a first run at most this many times slower than steady ones
_COPIES = 32
_BATCH_BYTES = 1 << 26


def _wide(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if np.issubdtype(dtype, np.floating) else dtype


def _widen(a: np.ndarray | None) -> np.ndarray | None:
    if a is None or not np.issubdtype(a.dtype, np.floating):
        return a
    return a.astype(np.float64)


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elements that differ by more than rounding; `b` may stack several runs' outputs along a
    leading axis, each compared with `a`. (A kernel may round an element differently when
    another element of the tensor changes: onnxruntime's vectorized float64 Cos does, by an ulp.
    A change that small is no dependence the proof could see.)"""
    if not np.issubdtype(a.dtype, np.floating):
        return a != b
    if not b.ndim:  # a scalar: numpy's operators would give scalars, not arrays
        return _changed(a.reshape(1), b.reshape(1)).reshape(())
    rel = 1e-9 if a.dtype == np.float64 else 1e-5
    with np.errstate(all="ignore"):
        diff = np.subtract(b, a)
        np.abs(diff, out=diff)
        if np.isfinite(diff).all():  # both sides finite: the usual case, on whole arrays
            scale = np.abs(b)
            np.maximum(scale, np.abs(a), out=scale)
            scale *= rel
            return diff > scale
        changed = a != b
        a = np.broadcast_to(a, b.shape)
        x, y = a[changed], b[changed]  # the elements that differ at all
        big = np.abs(x - y) > rel * np.maximum(np.abs(x), np.abs(y))
    nan_x, nan_y, inf_x, inf_y = np.isnan(x), np.isnan(y), np.isinf(x), np.isinf(y)
    # NaN on one side only, or an infinity on one side or of the other sign, is a change too.
    changed[changed] = (
        (big & ~(nan_x | nan_y)) | (nan_x != nan_y) | (inf_x | inf_y) & ~(nan_x & nan_y)
    )
    return changed


def _same_shape(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise ReplayError(
            f"its output shape changed with its input values ({a.shape} vs {b.shape})"
        )


# Probes whose outputs are compared together (bytes of one output, stacked): bounds the memory.
_STACK_BYTES = 1 << 25


def replay(
    node: gs.Node,
    inputs: Sequence[np.ndarray | None],
    live: Sequence[bool],
    axes: Mapping[int, Sequence[int]],
    opset: int,
    seed: int = 0,
    fixed: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None,
    enough: Enough | None = None,
    known: Mapping[tuple[int, int], np.ndarray] | None = None,
    whole: bool = True,
    presumed: Mapping[tuple[int, int], np.ndarray] | None = None,
) -> Replayed:
    """Replay `node`. `inputs`: an array per input (its value for constant inputs, any array of
    the right shape and type for live ones; None for absent ones); `live`: which inputs are live
    (drawn at random); `axes`: per live input, the axes whose slices are probed; `fixed`: per
    live input, (mask, value) of its constant elements, which keep their values (a slice of
    constants only is not redrawn: nothing depends on it changing). `enough(i, axis, rows)`:
    is what slice j of input i along `axis` was found to change (`rows[o][b]`: the indices of
    output o along axis b) all the caller needs to know? Its later draws are then skipped (a
    caller asking which slices reach kept outputs stops at the first that does); `depends` and
    the relation are then partial for that slice. `known[(i, axis)]`: slices the caller needs
    no finding about (they are kept already): not probed, their relation rows stay empty.
    `whole`: also redraw each live input whole, for `depends`; without, `depends` holds what
    the slices' probes changed only, and a draw's base is drawn and run only when a probe needs
    it (the values then come from the generator in the order they are needed), and when no
    slice is to be probed nothing runs (`outputs` are then zeros).
    `presumed[(i, axis)]` (with `enough`): slices the caller expects to be needed. In each draw
    those still pending are first redrawn together, in one run; if what that run changes is
    `enough`, each of them is settled with that union as its relation row (keeping is always
    safe: this can only keep more than probing them alone would), else they are probed alone.
    A slice is found unneeded only by probes of it alone, in every draw.

    The probes are run draw by draw: draw d of every slice the earlier draws did not settle,
    each slice redrawn alone (its values from one fresh draw of the whole input), the outputs
    compared with the draw's base run together."""
    fixed = fixed or {}
    for i, given in enumerate(inputs):
        if live[i] and (given is None or not np.issubdtype(given.dtype, np.floating)):
            raise ReplayError(
                f"input {i} is live and not floating point: its values cannot be drawn"
            )
    runner = NodeRunner.of(node, inputs, opset, live)
    key = None
    if enough is None and known is None and whole:  # a whole replay: the same node and form, the same one
        key = _whole_replay_key(runner, seed, axes, fixed)
        if key in _REPLAYS:
            _REPLAYS.move_to_end(key)
            return _REPLAYS[key]
    found = _replay(runner, inputs, live, axes, seed, fixed, enough, known, whole, presumed)
    if key is not None:
        _remember(key, found)
    return found


def _whole_replay_key(
    runner: NodeRunner,
    seed: int,
    axes: Mapping[int, Sequence[int]],
    fixed: Mapping[int, tuple[np.ndarray, np.ndarray]],
) -> bytes:
    """What a whole replay's finding depends on: the node's form, the draws, the constant elements."""
    h = hashlib.blake2b(runner.key, digest_size=20)
    h.update(repr((seed, sorted((i, list(a)) for i, a in axes.items()))).encode())
    for i, (mask, value) in sorted(fixed.items()):
        for a in (np.asarray(mask), np.asarray(value)):
            h.update(f"|{i}{a.dtype.str}{a.shape}".encode())
            h.update(np.ascontiguousarray(a).data)
    return h.digest()


def _remember(key: bytes, found: Replayed) -> None:
    """Keep a whole replay's finding, the least recently used ones going past _REPLAYS_BYTES."""
    _REPLAYS[key] = found
    held = sum(_nbytes(r) for r in _REPLAYS.values())
    while len(_REPLAYS) > 1 and held > _REPLAYS_BYTES:
        held -= _nbytes(_REPLAYS.popitem(last=False)[1])


def _nbytes(found: Replayed) -> int:
    arrays = [*found.outputs, *found.depends]
    arrays += [r for axes in found.relation.values() for per_output in axes for r in per_output]
    return sum(a.nbytes for a in arrays)


# Whole replays (no `enough`, no `known`) by node, form and what is probed, least recently
# used first, up to _REPLAYS_BYTES: the constants' walk and the keep closure replay a node with
# no rule alike, and a prune analyzes the model twice.
_REPLAYS: OrderedDict[bytes, Replayed] = OrderedDict()
_REPLAYS_BYTES = 1 << 26


def _replay(
    runner: NodeRunner,
    inputs: Sequence[np.ndarray | None],
    live: Sequence[bool],
    axes: Mapping[int, Sequence[int]],
    seed: int,
    fixed: Mapping[int, tuple[np.ndarray, np.ndarray]],
    enough: Enough | None,
    known: Mapping[tuple[int, int], np.ndarray] | None,
    whole: bool,
    presumed: Mapping[tuple[int, int], np.ndarray] | None = None,
) -> Replayed:
    draws = _Draws(runner, live, fixed, seed)
    live_inputs = [k for k, is_live in enumerate(live) if is_live]
    if not whole and not any(
        _unsettled(fixed.get(i), known, i, axis, runner.templates[i].shape).any()  # type: ignore[union-attr]
        for i in live_inputs
        for axis in axes.get(i, ())
    ):
        return _unprobed(runner, live_inputs, axes)
    # Without `whole`, only the first draw's base runs here; the others when a slice is probed.
    draws.run_bases(live_inputs if whole else None)
    first = draws.outs[0]
    assert first is not None
    relation: dict[tuple[int, int], list[list[np.ndarray]]] = {}
    joint: dict[tuple[int, int], np.ndarray] = {}
    for i in live_inputs:
        shape = draws.base(0)[i].shape  # type: ignore[union-attr]
        for axis in axes.get(i, ()):
            rel = relation.setdefault(
                (i, axis), [[np.zeros((shape[axis], n), bool) for n in o.shape] for o in first]
            )
            pending = _unsettled(fixed.get(i), known, i, axis, shape)
            for d in range(len(DRAWS)):
                todo = _still_to_show(rel, pending, i, axis, enough)
                if not len(todo):
                    break
                _probe_draw(draws, d, i, axis, todo, rel, pending, enough, presumed, joint)
    return Replayed(relation, draws.depends, first, joint)


class _Draws:
    """The draws of one replay: each draw's base values (drawn when first asked for: a draw no
    probe reaches costs no drawing, and redrawing a large input whole costs more than running a
    cheap node), its base run's outputs, and the output elements some live element changes."""

    def __init__(
        self,
        runner: NodeRunner,
        live: Sequence[bool],
        fixed: Mapping[int, tuple[np.ndarray, np.ndarray]],
        seed: int,
    ):
        self.runner, self.live, self.fixed = runner, live, fixed
        self.rng = np.random.default_rng(seed)
        self.depends: list[np.ndarray] = []
        self.bases: list[list[np.ndarray | None] | None] = [None] * len(DRAWS)
        self.outs: list[list[np.ndarray] | None] = [None] * len(DRAWS)

    def base(self, d: int) -> list[np.ndarray | None]:
        """Draw d's base values."""
        base = self.bases[d]
        if base is None:
            scale, sign = DRAWS[d][0]
            base = self.bases[d] = [
                _fix(_draw(self.rng, a, scale, sign), self.fixed.get(i)) if self.live[i] and a is not None else a
                for i, a in enumerate(self.runner.templates)
            ]
        return base

    def out(self, d: int) -> list[np.ndarray]:
        """Draw d's base run's outputs (run when first asked for, after the first draw's)."""
        out = self.outs[d]
        if out is None:
            first = self.outs[0]
            assert first is not None
            out = self.outs[d] = self.runner.run(self.base(d))
            for o, after in enumerate(out):
                _same_shape(first[o], after)
        return out

    def run_bases(self, whole: Sequence[int] | None) -> None:
        """Run the first draw's base; with `whole` (the live inputs), every draw's, each input
        of `whole` also redrawn whole: every element it reaches (a scalar input too)."""
        for d, (_, (new_scale, new_sign)) in enumerate(DRAWS if whole is not None else DRAWS[:1]):
            base = self.base(d)
            out = self.outs[d] = self.runner.run(base)
            if not d:
                self.depends = [np.zeros(o.shape, dtype=bool) for o in out]
            for i in whole or ():
                values = _draw(self.rng, base[i], new_scale, new_sign)  # type: ignore[arg-type]
                redrawn = list(base)
                redrawn[i] = _fix(values, self.fixed.get(i))
                for o, after in enumerate(self.runner.run(redrawn)):
                    _same_shape(out[o], after)
                    self.depends[o] |= _changed(out[o], after)


def _unprobed(runner: NodeRunner, live_inputs: list[int], axes: Mapping[int, Sequence[int]]) -> Replayed:
    """A replay with nothing to probe: nothing drawn or run (the outputs' shapes and types are
    those of the runner's first run, their values zeros)."""
    zeros = [np.zeros(shape, dtype) for shape, dtype in runner.forms]
    sizes = {i: runner.templates[i].shape for i in live_inputs}  # type: ignore[union-attr]
    return Replayed(
        {
            (i, axis): [[np.zeros((sizes[i][axis], n), bool) for n in o.shape] for o in zeros]
            for i in live_inputs
            for axis in axes.get(i, ())
        },
        [np.zeros(o.shape, bool) for o in zeros],
        zeros,
    )


def _still_to_show(
    rel: list[list[np.ndarray]], pending: np.ndarray, i: int, axis: int, enough: Enough | None
) -> np.ndarray:
    """The pending slices a probe may still show something of, `pending` updated: not those
    whose changes reach every index of every output axis already (the relation is a union over
    draws), nor those whose changes are all the caller asks (`enough`)."""
    full = np.ones(len(pending), bool)
    for rel_o in rel:
        for r in rel_o:
            full &= r.all(axis=1)
    pending &= ~full
    if enough is not None:
        for j in np.flatnonzero(pending):
            if enough(i, axis, [[r[j] for r in rel_o] for rel_o in rel]):
                pending[j] = False
    return np.flatnonzero(pending)


def _probe_draw(
    draws: _Draws,
    d: int,
    i: int,
    axis: int,
    todo: np.ndarray,
    rel: list[list[np.ndarray]],
    pending: np.ndarray,
    enough: Enough | None,
    presumed: Mapping[tuple[int, int], np.ndarray] | None,
    joint: dict[tuple[int, int], np.ndarray],
) -> None:
    """Draw d's probes of the slices `todo` of input i along `axis`: the presumed ones together
    first (settled when that run's changes are `enough`), then each other one alone."""
    new_scale, new_sign = DRAWS[d][1]
    x = draws.base(d)[i]
    assert x is not None
    shape = x.shape
    # The new values of the slices to probe (slice k: slice todo[k] of the input).
    fresh = _draw(draws.rng, np.take(x, todo, axis=axis), new_scale, new_sign)
    if i in draws.fixed:
        mask, value = (np.take(np.broadcast_to(f, shape), todo, axis=axis) for f in draws.fixed[i])
        fresh = np.where(mask, value, fresh).astype(fresh.dtype)
    out = draws.out(d)
    alone = np.ones(len(todo), bool)  # (places in todo) still to probe alone
    if enough is not None and presumed is not None and (i, axis) in presumed:
        together = np.asarray(presumed[(i, axis)], bool)[todo]
        if together.sum() > 1:
            rows = _together(
                draws.runner, draws.base(d), out, i, axis, todo[together], fresh[_at(axis, together)], draws.depends
            )
            if enough(i, axis, rows):
                for o, rows_o in enumerate(rows):
                    for b, row in enumerate(rows_o):
                        rel[o][b][todo[together]] |= row
                pending[todo[together]] = False
                alone &= ~together
                joint.setdefault((i, axis), np.zeros(shape[axis], bool))[todo[together]] = True
    if alone.any():
        _probe(draws.runner, draws.base(d), out, i, axis, todo[alone], fresh[_at(axis, alone)], rel, draws.depends)


def _unsettled(
    fixed: tuple[np.ndarray, np.ndarray] | None,
    known: Mapping[tuple[int, int], np.ndarray] | None,
    i: int,
    axis: int,
    shape: tuple[int, ...],
) -> np.ndarray:
    """Per slice of input i along `axis`: is it to be probed? Not a slice of constants only
    (never redrawn), nor one the caller knows."""
    pending = ~_settled(fixed, shape, axis)
    if known is not None and (i, axis) in known:
        pending &= ~np.asarray(known[(i, axis)], bool)
    return pending


def _at(axis: int, which: np.ndarray) -> tuple[slice | np.ndarray, ...]:
    return (slice(None),) * axis + (which,)


def _together(
    runner: NodeRunner,
    base: list[np.ndarray | None],
    out: list[np.ndarray],
    i: int,
    axis: int,
    slices: np.ndarray,
    fresh: np.ndarray,
    depends: list[np.ndarray],
) -> list[list[np.ndarray]]:
    """Run `base` with every slice of `slices` of input i along `axis` from `fresh` (slice k:
    slices[k]) at once: per output o and axis b, the indices the run changes."""
    x = base[i]
    assert x is not None
    part = x.copy()
    part[_at(axis, slices)] = fresh
    rows: list[list[np.ndarray]] = []
    for o, after in enumerate(runner.run([part if n == i else a for n, a in enumerate(base)])):
        _same_shape(out[o], after)
        changed = _changed(out[o], after)
        depends[o] |= changed
        other = [tuple(k for k in range(changed.ndim) if k != b) for b in range(changed.ndim)]
        rows.append([np.asarray(changed.any(axis=axes)) for axes in other])
    return rows


def _probe(
    runner: NodeRunner,
    base: list[np.ndarray | None],
    out: list[np.ndarray],
    i: int,
    axis: int,
    todo: np.ndarray,
    fresh: np.ndarray,
    rel: list[list[np.ndarray]],
    depends: list[np.ndarray],
) -> None:
    """Run `base` with slice j of input i along `axis` from `fresh`, for each j of `todo`; what
    each changes joins the relation (its rows j) and `depends`."""
    x = base[i]
    assert x is not None
    size = max((o.nbytes for o in out), default=1) + x.nbytes
    step = max(1, _STACK_BYTES // max(size, 1))
    for start in range(0, len(todo), step):
        chunk = todo[start : start + step]
        got = [np.empty((len(chunk), *o.shape), o.dtype) for o in out]
        for k, outputs in enumerate(_runs(runner, base, i, axis, chunk, fresh, start)):
            for o, after in enumerate(outputs):
                _same_shape(out[o], after)
                got[o][k] = after
        for o, stacked in enumerate(got):
            changed = _changed(out[o], stacked)
            if not out[o].size:
                continue  # nothing to change
            if not out[o].ndim:
                depends[o] |= changed.any()
                continue
            # Probes that change every element (a dense op's, often all): their rows are full.
            every = changed.reshape(len(chunk), -1).all(axis=1)
            if every.any():
                depends[o][...] = True
            else:
                depends[o] |= changed.any(axis=0)
            for b in range(out[o].ndim):
                rel[o][b][chunk[every]] = True
            if every.all():
                continue
            some = changed[~every]
            for b in range(out[o].ndim):
                other = tuple(k + 1 for k in range(out[o].ndim) if k != b)
                rel[o][b][chunk[~every]] |= some.any(axis=other)


def _runs(
    runner: NodeRunner,
    base: list[np.ndarray | None],
    i: int,
    axis: int,
    chunk: np.ndarray,
    fresh: np.ndarray,
    first: int,
) -> Iterator[list[np.ndarray]]:
    """The outputs of `base` with slice j of input i along `axis` replaced, for each j of
    `chunk` in order, by slice first + k of `fresh` (k: j's place in `chunk`): one input buffer
    changed and restored, or a copy per probe when the runner runs several in one call."""
    x = base[i]
    assert x is not None

    def index(j: int) -> tuple[slice | int, ...]:
        return (slice(None),) * axis + (j,)

    if runner.copies < 2:
        part = x.copy()
        redrawn = list(base)
        redrawn[i] = part
        for k, j in enumerate(chunk):
            part[index(int(j))] = fresh[index(first + k)]
            yield runner.run(redrawn)
            part[index(int(j))] = x[index(int(j))]  # restored for the next slice
        return
    for start in range(0, len(chunk), runner.copies):
        probes = []
        for k, j in enumerate(chunk[start : start + runner.copies], first + start):
            part = x.copy()
            part[index(int(j))] = fresh[index(k)]
            probes.append([part if n == i else a for n, a in enumerate(base)])
        yield from runner.run_many(probes)


def commutes(
    node: gs.Node,
    inputs: Sequence[np.ndarray | None],
    live: Sequence[bool],
    sliced: Sequence[int],
    axis: int,
    opset: int,
    seed: int = 1,
) -> bool:
    """Does removing indices along `axis` of inputs `sliced` remove the same indices of every
    output, and change nothing else? The op then treats those indices as channels on their own
    (as an activation does); one that splits the axis into groups or heads does not. Checked
    for a few subsets (the first index, a random half), on random values for the live inputs."""
    key = _digest(node, inputs, live, opset) + repr((list(sliced), axis, seed)).encode()
    if key not in _COMMUTES:
        _COMMUTES[key] = _commutes(node, inputs, live, sliced, axis, opset, seed)
        while len(_COMMUTES) > 4096:
            _COMMUTES.popitem(last=False)
    return _COMMUTES[key]


_COMMUTES: OrderedDict[bytes, bool] = OrderedDict()


def _commutes(
    node: gs.Node,
    inputs: Sequence[np.ndarray | None],
    live: Sequence[bool],
    sliced: Sequence[int],
    axis: int,
    opset: int,
    seed: int,
) -> bool:
    rng = np.random.default_rng(seed)
    n = inputs[sliced[0]].shape[axis]  # type: ignore[union-attr]
    subsets = [np.arange(1, n), np.sort(rng.choice(n, size=max(1, n // 2), replace=False))]
    try:
        full = NodeRunner.of(node, inputs, opset, live)
        values = [
            _draw(rng, a, 1.0, 0) if live[i] and a is not None else a
            for i, a in enumerate(full.templates)
        ]
        whole = full.run(values)
        for keep in subsets:
            part = [
                np.take(v, keep, axis=axis) if i in sliced and v is not None else v
                for i, v in enumerate(values)
            ]
            got = NodeRunner.of(node, part, opset, live).run(part)
            for w, g in zip(whole, got, strict=True):
                want = np.take(w, keep, axis=axis)
                if want.shape != g.shape or not np.allclose(
                    g, want, rtol=1e-9 if g.dtype == np.float64 else 1e-5, atol=0, equal_nan=True
                ):
                    return False
    except (ReplayError, IndexError, ValueError):
        return False
    return True


def _fix(values: np.ndarray, fixed: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """`values` with the constant elements set to their values."""
    if fixed is None:
        return values
    mask, value = fixed
    return np.where(
        np.broadcast_to(mask, values.shape), np.broadcast_to(value, values.shape), values
    ).astype(values.dtype)


def _settled(
    fixed: tuple[np.ndarray, np.ndarray] | None, shape: tuple[int, ...], axis: int
) -> np.ndarray:
    """Per index along `axis`: is its whole slice constant?"""
    if fixed is None:
        return np.zeros(shape[axis], dtype=bool)
    mask = np.broadcast_to(fixed[0], shape)
    other = tuple(k for k in range(len(shape)) if k != axis)
    return np.asarray(mask.all(axis=other)) if other else mask


_P = ParamSpec("_P")
_R = TypeVar("_R")
_scopes = [0]  # calls of a `scoped` function running now


def scoped(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` (a shrink, a prune, an analysis) with the replay's caches (sessions, whole replays,
    commutes checks) kept while it runs and freed when the outermost such call returns: within
    one call they are hit as before (a prune analyzes twice, a failed proof re-analyzes); after
    it nothing holds the sessions' weights (up to _RUNNERS_BYTES + _REPLAYS_BYTES)."""

    @functools.wraps(fn)
    def within(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        _scopes[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _scopes[0] -= 1
            if not _scopes[0]:
                _RUNNERS.clear()
                _REPLAYS.clear()
                _COMMUTES.clear()

    return within


def _draw(rng: np.random.Generator, like: np.ndarray, scale: float, sign: int) -> np.ndarray:
    values = np.asarray(rng.standard_normal(like.shape))  # (a 0-d array for a scalar)
    if sign:  # (in place: the same products as `sign * abs(values) * scale`, no copies)
        np.abs(values, out=values)
        values *= sign
    values *= scale
    return values.astype(like.dtype, copy=False)

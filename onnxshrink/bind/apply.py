"""The reference model: the input with every mask applied, checked against the input itself.

The proof compares the shrunk model with this reference, so the reference must be the model the
user means. Most inputs are masked models exported as they are: their weights already hold the
zeros the masks describe, and applying the masks must change nothing. A mask that would change
such a model (along the wrong axis of a square weight, from another model) is refused by name,
with how many weights it would change; a model that holds none of the masks' zeros was exported
before masking, and the masks are applied.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.bind.binding import Binding, BoundMasks
from onnxshrink.bind.graph import ModelIndex, Site
from onnxshrink.errors import ShrinkError
from onnxshrink.io import weights
from onnxshrink.io.weights import DataWriter, tensor_proto
from onnxshrink.ir import all_graphs
from onnxshrink.masks import core

SPILL_BYTES = 1024  # masked weights at least this large go to the spill file

UNMASKED_FLAG = "--unmasked-input"


@dataclass
class Effect:
    """What applying one mask would do to the model as given."""

    name: str
    initializer: str
    masked: int = 0  # elements the mask zeroes or recomputes
    changed: int = 0  # of those, elements whose value would change
    largest: float = 0.0  # the largest |value| that would change
    informative: bool = False  # the initializer holds non-zero values where the mask applies

    @property
    def state(self) -> str:
        if self.masked == 0 or (self.changed == 0 and not self.informative):
            return "silent"  # masks nothing, or only an all-zero tensor (a zero bias)
        if self.changed == 0:
            return "applied"
        return "unapplied" if self.changed == self.masked else "partly"


def _effect(index: ModelIndex, b: Binding) -> Effect:
    e = Effect(b.mask, b.initializer)
    if b.attach is not None:
        idx, rows = b.replace  # type: ignore[misc]
        nz = np.abs(rows) > 0
        e.masked = e.changed = int(nz.sum())
        e.largest = float(np.abs(rows).max(initial=0.0))
        e.informative = e.changed > 0
        return e
    arr = index.array(b.initializer)
    # a quantized weight's masked elements are at its zero point: what they are measured from
    fill = index.zero_of(b.initializer)
    axis = _one_axis(b.values)
    if axis is not None and b.values.shape == arr.shape:  # one flag per slice: those slices
        zero = np.flatnonzero(core(b.values).reshape(-1) == 0)
        hit = np.take(arr, zero, axis=axis)
        if fill is not None:
            hit = hit.astype(np.int64) - np.take(np.broadcast_to(fill, arr.shape), zero, axis=axis)
        e.masked = hit.size
    else:
        zeroed = np.broadcast_to(b.values == 0, arr.shape)
        hit = arr[zeroed]
        if fill is not None:
            hit = hit.astype(np.int64) - np.broadcast_to(fill, arr.shape)[zeroed]
        e.masked = int(zeroed.sum())
    e.changed = int(np.count_nonzero(hit))
    if e.changed:  # (a model exported masked holds none: nothing to widen)
        e.largest = float(np.abs(hit[hit != 0].astype(np.float64)).max(initial=0.0))
    e.informative = bool(np.any(arr if fill is None else arr.astype(np.int64) - fill))
    if b.replace is not None:
        idx, rows = b.replace
        now = arr[idx].astype(np.float64)
        flat_now, flat_new = now.reshape(len(idx), -1), rows.reshape(len(idx), -1)
        scale = np.maximum(np.abs(flat_now).max(axis=1), np.abs(flat_new).max(axis=1))
        differs = (np.abs(flat_now - flat_new) > 1e-5 * scale[:, None] + 1e-12).any(axis=1)
        e.masked += int(differs.sum()) * flat_now.shape[1]
        e.changed += int(differs.sum()) * flat_now.shape[1]
        if differs.any():
            e.largest = max(e.largest, float(np.abs(flat_new - flat_now)[differs].max()))
    return e


def _one_axis(values: np.ndarray) -> int | None:
    """The axis of a mask held as one flag per slice of it (a broadcast view, see
    masks.compact), or None."""
    held = [a for a, st in enumerate(values.strides) if st != 0 and values.shape[a] > 1]
    return held[0] if len(held) == 1 and values.ndim > 1 else None


def check_reference(
    bound: BoundMasks, input_masked: bool | None = None, source: str = "masks"
) -> bool:
    """Does the model already hold every mask's zeros? With `input_masked` None, decided from
    the weights (and refused when they disagree); True demands it; False skips the check.
    Returns whether the masks change nothing (the reference is the model as given)."""
    index = bound.index
    if input_masked is False or index is None or not bound.bindings:
        return not bound.bindings
    effects: dict[str, Effect] = {}
    for b in bound.bindings:
        e = _effect(index, b)
        weights.trim()  # the mapped weights it read go back to the page cache
        if b.mask in effects:  # one mask over several bindings (a folded BatchNorm's pair)
            f = effects[b.mask]
            f.masked, f.changed = f.masked + e.masked, f.changed + e.changed
            f.largest, f.informative = max(f.largest, e.largest), f.informative or e.informative
        else:
            effects[b.mask] = e
    states = defaultdict(list)
    for e in effects.values():
        states[e.state].append(e)
    wrong = states["partly"] + (states["unapplied"] if states["applied"] or input_masked else [])
    if not wrong:
        return not states["unapplied"]
    held = len(states["applied"])
    lines = "; ".join(_describe(e) for e in wrong[:5])
    more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
    raise ShrinkError(
        f"{source}: {len(wrong)} mask(s) do not match the model: {lines}{more}. "
        + (
            f"The model already holds the zeros of {held} other mask(s), so it was exported "
            "masked and applying these would change it: "
            if held
            else ""
        )
        + "a mask along the wrong axis of a weight, or a mask of another model, does this. "
        f"If the model was exported before these masks were applied, pass {UNMASKED_FLAG} "
        "(API: input_masked=False) and they are applied."
    )


def _describe(e: Effect) -> str:
    already = e.masked - e.changed
    return (
        f"'{e.name}' (initializer '{e.initializer}') would change {e.changed:,} of the "
        f"{e.masked:,} weights it masks (largest |w| {e.largest:.3g})"
        + (f", the other {already:,} are already zero" if already else "")
    )


def apply_masks(
    model: onnx.ModelProto,
    bound: BoundMasks,
    base_dir: str | None = None,
    spill: DataWriter | None = None,
) -> onnx.ModelProto:
    """The reference model: each mask applied to the readers its parameter stands for (an
    initializer shared by parameters that end up different is untied, each copy named after its
    parameter when that name is free). External weights are read from `base_dir`; the masked
    ones are held in the model, or with a `spill` writer written to its file, which the model
    then refers to by absolute path (onnxshrink reads it; onnxruntime is given those weights
    inline, a segment at a time: validate.run_model)."""
    if not bound.bindings:
        return model
    index = bound.index if bound.index is not None and bound.index.model is model else None
    ref = _Reference(model, index or ModelIndex(model, base_dir), spill)
    per_init: dict[str, list[Binding]] = defaultdict(list)
    for b in bound.bindings:
        if b.attach is not None:
            _attach(ref.model, ref.nodes, ref.index, b, ref.taken)
        else:
            per_init[b.initializer].append(b)
    for name, bindings in per_init.items():
        ref.mask(name, bindings, bound.shared)
        weights.trim()  # the mapped weight read goes back to the page cache
    return ref.model


class _Reference:
    """The reference model being made: a copy of the model, its nodes as `ModelIndex` numbers
    them, its weights by name, and the names taken."""

    def __init__(self, model: onnx.ModelProto, index: ModelIndex, spill: DataWriter | None):
        self.index, self.spill = index, spill
        self.model = onnx.ModelProto()
        self.model.CopyFrom(model)
        graphs = list(all_graphs(self.model.graph))
        self.nodes = [n for g in graphs for n in g.node]  # as ModelIndex numbers them
        self.inits = {t.name: t for g in graphs for t in g.initializer}
        for name, k in index.constant_nodes.items():  # weights held by Constant nodes: their tensor
            self.inits[name] = _constant_value_attribute(self.nodes[k], index.inits[name])
        outputs = {o for n in self.nodes for o in n.output}
        self.taken = set(self.inits) | outputs | {i.name for g in graphs for i in g.input}

    def mask(self, name: str, bindings: list[Binding], shared: dict[str, list[str]]) -> None:
        """Initializer `name` with its bindings' masks applied, one variant per set of bindings
        its readers see: the first in its place, each other a copy its readers are pointed to
        (its owner's name recorded in `shared`)."""
        index = self.index
        readers: dict[tuple[int, ...], list[Site]] = defaultdict(list)
        for s in index.sites[name]:
            readers[tuple(j for j, b in enumerate(bindings) if b.sites is None or s in b.sites)].append(s)
        arr = index.array(name)
        fill = index.zero_of(name)  # a quantized weight's masked elements: its zero point
        variants = {key: _masked(arr, [bindings[j] for j in key], fill) for key in readers}
        first, *others = sorted(variants, key=lambda key: (len(key) > 0, key))
        t = self.inits[name]
        held = name in index.constant_nodes  # a Constant node's tensor keeps its own name
        _store(t, variants[first], None if held else self.spill, t.name if held else None)
        made: list[tuple[str, np.ndarray]] = [(t.name, variants[first])]
        for key in others:
            # a variant equal to one already stored is that tensor (as the prune reties its copies)
            same = next((n for n, v in made if np.array_equal(v, variants[key])), None)
            if same is None:
                owner = bindings[key[0]].mask
                same = self._copy(name, owner, variants[key])
                made.append((same, variants[key]))
                shared.setdefault(name, []).append(owner)
            if same != t.name:
                for s in readers[key]:  # (a copy is in the main graph: seen from every body)
                    self.nodes[s.node].input[s.input] = same

    def _copy(self, name: str, owner: str, values: np.ndarray) -> str:
        """A new initializer holding `values`, named after the parameter `owner` when free."""
        copy = owner if owner not in self.taken else f"{name}__{owner}"
        while copy in self.taken:
            copy += "_"
        self.taken.add(copy)
        self.model.graph.initializer.append(onnx.TensorProto())
        _store(self.model.graph.initializer[-1], values, self.spill, copy)
        return copy


def _constant_value_attribute(node: onnx.NodeProto, value: onnx.TensorProto) -> onnx.TensorProto:
    """The tensor a Constant node holds, to be masked in place: its `value` attribute (a node
    holding its value otherwise, `value_floats`, is given it as a `value` tensor)."""
    for a in node.attribute:
        if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
            return a.t
    del node.attribute[:]
    node.attribute.append(onnx.helper.make_attribute("value", value))
    return node.attribute[0].t


def _masked(arr: np.ndarray, bindings: list[Binding], zero: np.ndarray | None = None) -> np.ndarray:
    for b in bindings:
        arr = b.masked(arr, zero)
    return arr


def _store(
    t: onnx.TensorProto, values: np.ndarray, spill: DataWriter | None, name: str | None = None
) -> None:
    name = name or t.name
    if spill is None or values.nbytes < SPILL_BYTES:
        t.CopyFrom(numpy_helper.from_array(values, name))
        return
    arr = spill.write(name, weights.row_blocks(values), values.shape, values.dtype)
    where = spill.store.location(arr)
    assert where is not None
    t.CopyFrom(tensor_proto(name, arr, where, None))


def _attach(
    ref: onnx.ModelProto, nodes: list[onnx.NodeProto], index: ModelIndex, b: Binding, taken: set[str]
) -> None:
    """A bias the exporter dropped (it was zero) that the masks make non-zero."""
    node = nodes[b.attach.node]  # type: ignore[union-attr]
    w = index.array(index.resolve(node.input[1]) or "")
    bias = b.masked(np.zeros(w.shape[0], w.dtype))
    name = b.initializer
    while name in taken:
        name += "_"
    taken.add(name)
    ref.graph.initializer.append(numpy_helper.from_array(bias, name))
    while len(node.input) < 3:
        node.input.append("")
    node.input[2] = name

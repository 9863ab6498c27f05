"""`--masks-out` and `--weights-out`: the zeroed slices as a framework state dict, under the
parameter names the exporter recorded, written beside their name and renamed over it only once
the prune has passed."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnxshrink import ir
from onnxshrink.core import OpNode
from onnxshrink.errors import ShrinkError, file_access
from onnxshrink.masks import ONNX_SECTION
from onnxshrink.ops import handler_for_op, is_constant_node
from onnxshrink.prepare import default_opset
from onnxshrink.prune.groups import Member, ParamRef, gather_slices
from onnxshrink.prune.spill import zero_slice


# ---------------------------------------------------------------------- masks out
@dataclass
class MaskSlices:
    """The slices the masks zero, per (name, shape) and axis, the initializers left out, and
    what was done with a parameter the model reads at several places (`notes`)."""

    zeroed: dict[tuple[tuple[str, tuple[int, ...]], int], np.ndarray]
    skipped: list[str]
    notes: list[str] = field(default_factory=list)
    _made: dict[str, np.ndarray] | None = field(default=None, repr=False)

    def masks(self) -> dict[str, np.ndarray]:
        """The 0/1 masks, made once."""
        if self._made is None:
            self._made = {}
            for ((name, shape), axis), idx in self.zeroed.items():
                if name not in self._made:
                    self._made[name] = np.ones(shape, np.float32)
                zero_slice(self._made[name], axis, idx)
        return self._made


Key = tuple[tuple[str, tuple[int, ...]], int]  # ((name, shape), axis)
Slice = tuple[tuple[str, tuple[int, ...]], int, np.ndarray]
# members read alike (one params list, one tensor and axis), with all their indices: a layer's
# thousands of groups each hold one index of it (ResNet-50 at 0.5: 38,848 members, 159 such)
Alike = tuple[Member, list[np.ndarray]]


def mask_slices(
    model: onnx.ModelProto, members: list[Member], framework: bool = True, untied: Mapping[str, str] | None = None
) -> MaskSlices:
    """What the 0/1 masks of the zeroed slices are, as a framework state dict: under the
    framework parameter names the exporter recorded (in the framework's layout), and nothing
    else. A slice of a tensor with no framework name (a graph-only constant: an LSTM's packed
    weights, a product the exporter folded) goes under the tensor's ONNX name in a section of
    its own, `onnx/NAME`, which a strict loader drops and onnxshrink reads back; in a model that
    records no framework names at all (`framework` False: paddle2onnx, tf2onnx, spox exports)
    the tensors' names are the only names, and stand alone. An initializer several nodes share
    with no parameter name for its slice is listed as skipped (its name would mask every reader).

    One name, one tensor: a name the members give two shapes (two tensors the exporter's
    scopes would name alike) names neither; each goes under `onnx/` by its own name. A
    parameter the model reads at several places (a module called again; `untied`: each
    analysis copy of a shared initializer -> the initializer) is one parameter: its mask zeroes
    what every place zeroed, and a place that kept a slice keeps it (said in `notes`)."""
    shapes = {t.name: tuple(t.dims) for g in ir.all_graphs(model.graph) for t in g.initializer}
    section = ONNX_SECTION if framework else ""
    alike = _alike(members)
    clashes = _clashes(alike)
    skipped: set[str] = set()
    named: list[tuple[Member, list[ParamRef], list[np.ndarray]]] = []
    slices: list[Slice] = []
    shared = {m.initializer for m, _ in alike if m.tensor != m.initializer}
    # a place that reads a shared weight with no name recorded for it (through an Identity) is
    # still a place of the parameter the other places name
    named_as = {(m.initializer, m.axis): m.params for m in members if m.params and m.initializer in shared}
    unnamed: dict[tuple[str, int], list[Alike]] = {}  # shared, no name: by initializer and axis
    for m, indices in alike:
        params = [p for p in m.params or named_as.get((m.initializer, m.axis), []) if p.name not in clashes]
        if params:
            named.append((m, params, indices))
        elif m.initializer not in shared and m.initializer in shapes:
            key = (section + m.initializer, shapes[m.initializer])
            slices.append((key, m.axis, np.concatenate(indices)))
        else:
            unnamed.setdefault((m.initializer, m.axis), []).append((m, indices))
    notes: list[str] = []
    for (base, axis), places in unnamed.items():
        found = _disjoint_union(model, base, axis, places, untied or {})
        if found is None:
            skipped.add(base)
            continue
        slices.append(((section + base, found[1]), axis, found[0]))
        note = f"{base!r} is read in parts by {len(places)} places: its mask zeroes what each zeroed of its part"
        notes += [] if note in notes else [note]
    agreed, more = _agreed(named, untied or {})
    notes += more
    notes += [f"{name!r} names tensors of different shapes ({clashes[name]}): no mask under it" for name in sorted(clashes)]
    return MaskSlices({**gather_slices(slices), **agreed}, sorted(skipped), notes)


def _disjoint_union(
    model: onnx.ModelProto, base: str, axis: int, places: list[Alike], untied: Mapping[str, str]
) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """The indices along `axis` of a shared initializer with no parameter name, zeroed at some of
    the places that read it, as one mask: their union, when every reader reads none of the
    union's indices it did not zero itself (an LSTM's packed weight read one gate at a time by
    Slices, each place zeroing its gate's rows of a unit); else None (one mask would change what
    a place reads). What a reader reads is its op's to say (`Handler.reads_along`: a Slice with
    constant bounds, its range; an op by default, all of it). With the initializer's shape."""
    zeroed: dict[str, np.ndarray] = {}
    for m, indices in places:
        zeroed[m.node] = np.union1d(zeroed.get(m.node, np.zeros(0, np.int64)), np.concatenate(indices))
    union = np.unique(np.concatenate(list(zeroed.values())))

    def reads_it(name: str) -> bool:
        return bool(name) and untied.get(name, name) == base

    # (its readers' copies have its shape; the reference may hold only those)
    dims = next((list(t.dims) for g in ir.all_graphs(model.graph) for t in g.initializer if reads_it(t.name)), None)
    if dims is None:
        return None
    readers = [n for g in ir.all_graphs(model.graph) for n in g.node if any(reads_it(i) for i in n.input)]
    if not set(zeroed) <= {n.name for n in readers}:
        return None  # a place the graph does not show (renamed): say nothing
    values = _small_constants(model, {x for n in readers for x in n.input if not reads_it(x)})
    opset = default_opset(model)
    for node in readers:
        handler, op = handler_for_op(node.op_type, node.domain, opset), OpNode.of(node)
        read = np.zeros(0, np.int64)
        for i, x in enumerate(node.input):
            if reads_it(x):
                got = handler.reads_along(op, i, axis, dims, values) if handler is not None else None
                read = np.union1d(read, np.arange(dims[axis]) if got is None else got)
        if np.isin(np.setdiff1d(union, zeroed.get(node.name, np.zeros(0, np.int64))), read).any():
            return None
    return union, tuple(dims)


def _small_constants(model: onnx.ModelProto, names: set[str]) -> dict[str, np.ndarray]:
    """The values of `names` that are initializers held in the file or Constant nodes' outputs,
    in any graph (a reader's constant bounds)."""
    opset = default_opset(model)
    out: dict[str, np.ndarray] = {}
    for g in ir.all_graphs(model.graph):
        for t in g.initializer:
            if t.name in names and t.data_location != onnx.TensorProto.EXTERNAL:
                out[t.name] = onnx.numpy_helper.to_array(t)
        for n in g.node:
            if n.output and n.output[0] in names and is_constant_node(n, opset):
                handler = handler_for_op(n.op_type, n.domain, opset)
                value = handler.constant_value(OpNode.of(n)) if handler is not None else None
                if value is not None:
                    out[n.output[0]] = np.asarray(value)
    return out


def _alike(members: list[Member]) -> list[Alike]:
    """The members gathered by how they are read (the same params list, tensor, initializer and
    axis), each with the indices of all of them, in the order of their first member."""
    out: dict[tuple[int, str, str, int], Alike] = {}
    for m in members:
        key = (id(m.params), m.tensor, m.initializer, m.axis)  # the members hold their params
        found = out.get(key)
        if found is None:
            out[key] = (m, [m.indices])
        else:
            found[1].append(m.indices)
    return list(out.values())


def _clashes(alike: list[Alike]) -> dict[str, str]:
    """The parameter names the members give tensors of more than one shape, with the tensors."""
    seen: dict[str, dict[tuple[int, ...], set[str]]] = {}
    for m, _ in alike:
        for p in m.params:
            seen.setdefault(p.name, {}).setdefault(p.shape, set()).add(m.initializer)
    return {n: ", ".join(sorted(t for ts in s.values() for t in ts)) for n, s in seen.items() if len(s) > 1}


def _agreed(
    named: list[tuple[Member, list[ParamRef], list[np.ndarray]]], untied: Mapping[str, str]
) -> tuple[dict[Key, np.ndarray], list[str]]:
    """Each named slice's indices zeroed at every place that reads its tensor: the places of an
    initializer are itself and its untied copies."""
    places: dict[str, set[str]] = {}
    for copy, base in untied.items():
        places.setdefault(base, {base}).add(copy)
    per: dict[Key, dict[str, list[np.ndarray]]] = {}
    readers: dict[Key, set[str]] = {}
    for m, params, indices in named:
        for p in params:
            key = ((p.name, p.shape), p.axis)
            per.setdefault(key, {}).setdefault(m.tensor, []).extend(indices)
            readers.setdefault(key, set()).update(places.get(m.initializer, {m.tensor}))
    out: dict[Key, np.ndarray] = {}
    notes: list[str] = []
    for k, by_place in per.items():
        sets = [np.unique(np.concatenate(v)) for v in by_place.values()]
        common = sets[0]
        for s in sets[1:]:
            common = np.intersect1d(common, s)
        if len(by_place) < len(readers[k]):
            common = common[:0]  # a place that zeroed nothing of it
        if any(len(s) != len(common) for s in sets) or len(by_place) < len(readers[k]):
            notes.append(
                f"{k[0][0]!r} is read at {len(readers[k])} places the prune zeroed differently: "
                f"its mask zeroes the {len(common)} slice(s) of axis {k[1]} all of them zeroed"
            )
        if len(common):
            out[k] = common
    return out, notes


def stage_masks(masks: Mapping[str, np.ndarray], path: str | Path) -> Path:
    """The masks (or weights) written to a hidden file beside `path` (same directory, same
    suffix), to be renamed over it."""
    p = Path(path)
    with file_access(path):  # an unwritable place is named as the user gave it
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent.absolute())
        os.close(fd)
        staged = Path(tmp)
        try:
            save_masks(dict(masks), staged)
            as_created(staged)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
    return staged


def as_created(path: str | Path) -> None:
    """The permissions a file created by name would have (mkstemp's are the owner's alone)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def masks_kind(path: str | Path, flag: str = "--masks-out") -> str:
    """The format `save_masks` writes to `path` (by its extension, any case), or a ShrinkError."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".npz", ".safetensors", ".pt", ".pth"):
        raise ShrinkError(f"{flag} {path}: give a .pt, .npz or .safetensors file name.")
    return suffix


def save_masks(masks: dict[str, np.ndarray], path: str | Path) -> None:
    """Write masks as .pt (torch.save of tensors), .npz or .safetensors, by the extension."""
    p = Path(path)
    suffix = masks_kind(p)
    if suffix == ".npz":
        with open(p, "wb") as f:  # a file, not a name: numpy would append ".npz" to "m.NPZ"
            np.savez(f, **masks)  # type: ignore[arg-type]  # names are keywords
    elif suffix == ".safetensors":
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in masks.items()}, str(p))
    elif suffix in (".pt", ".pth"):
        import torch

        torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in masks.items()}, p)

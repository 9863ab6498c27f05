"""`prune`: choose whole groups by importance, zero them, and shrink exactly.

The pruned model is not the input model (it is pruned): it is the input with the chosen groups
zeroed, the *reference*, and the shrink is proven against that reference as any shrink is. The
masks that make the reference are returned (and written with `masks_out`) under the framework's
parameter names the exporter recorded, so that they can be applied in the framework too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.api import ShrinkResult, check_options, read_model, shrink
from onnxshrink.errors import ShrinkError, ValidationFailed, file_access
from onnxshrink.io.model import check_output, load_external
from onnxshrink.options import ShrinkOptions
from onnxshrink.progress import PhaseClock
from onnxshrink.prune.groups import GroupSet, Member, find_groups, gather_slices, zero_slice
from onnxshrink.prune.importance import scores
from onnxshrink.prune.select import LayerPlan, choose
from onnxshrink.report import ModelStats, model_stats
from onnxshrink.validate import resolve_shapes


@dataclass
class PruneResult:
    """What `prune` did: the groups, the plan per layer, the masks, and the exact shrink."""

    groups: GroupSet
    plans: list[LayerPlan]
    slices: MaskSlices  # what the masks zero (`masks` makes them when asked)
    shrink: ShrinkResult
    original: ModelStats  # the unpruned input
    skipped_masks: list[str] = field(default_factory=list)  # shared initializers with no name
    # seconds per phase: load, groups, importance, select, zero (the reference), then the
    # shrink's own phases (its validate is the proof), and masks when written
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def masks(self) -> dict[str, np.ndarray]:
        """Framework parameter (or initializer) name -> 0/1 mask, as `--masks-out` writes them:
        made on first use (a model's worth of arrays, which the pruned model does not need)."""
        return self.slices.masks()

    @property
    def model(self) -> onnx.ModelProto:
        return self.shrink.model

    def removed(self) -> list[int]:
        return [i for p in self.plans for i in p.removed]

    def to_dict(self) -> dict[str, Any]:
        return prune_report(self.plans, self.original, self.skipped_masks, self.shrink.to_dict())


def prune_report(
    plans: list[LayerPlan], original: ModelStats, skipped: list[str], shrink: dict[str, Any]
) -> dict[str, Any]:
    """What --report writes for a prune (`shrink`: the shrink's report, or an empty one of the
    same keys when the shrink made no result)."""
    layers = [
        {
            "layer": p.layer.name,
            "kind": p.layer.kind,
            "groups": p.total,
            "removed": len(p.removed),
            "ignored": p.ignored,
        }
        for p in plans
        if p.total
    ]
    return {
        "layers": layers,
        "original": {"params": original.params, "macs": original.macs},
        "skipped_masks": skipped,
        "shrink": shrink,
    }


def prune(
    model: str | Path | onnx.ModelProto,
    ratio: float,
    output: str | Path | None = None,
    *,
    criterion: str = "l1",
    global_ranking: bool = False,
    ignore: Sequence[str] = (),
    round_to: int | None = None,
    max_layer_ratio: float = 1.0,
    data: list[Mapping[str, np.ndarray]] | None = None,
    masks_out: str | Path | None = None,
    options: ShrinkOptions | None = None,
    **option_values: Any,
) -> PruneResult:
    """Remove `ratio` of every layer's groups (or of all groups, `global_ranking`), the least
    important by `criterion` ("l1", "l2", "random", "activation" on `data`), and shrink exactly.
    Shrink options as for `shrink` (validation is against the model with the groups zeroed)."""
    opts = (options or ShrinkOptions()).but(**option_values)
    check_options(opts)  # before the groups and importance are computed, not at the shrink
    if masks_out is not None:
        masks_kind(masks_out)  # a name it cannot write is refused before any work
    clock = PhaseClock()
    source = read_model(model)
    if output is not None:  # the shrink below sees an in-memory model: guard the input here
        check_output(output, protect=[source.path, *source.data] if source.path is not None else [])
    proto = onnx.ModelProto()
    proto.CopyFrom(source.proto)
    if source.base_dir is not None:
        load_external(proto, Path(source.base_dir), str(source.path))
    # the unpruned input as its file holds it (before the reference is made from it: Constant
    # weights made initializers, a weight copied per reader), at the shapes the proof draws
    original = model_stats(proto, resolve_shapes(proto, opts.input_shapes or {}), source.file_bytes)
    clock.lap("load")
    opts.say("finding the coupled groups ...")
    gset = find_groups(proto, name=str(source.path or ""))
    clock.lap("groups")
    importance = scores(gset, criterion, seed=opts.seed, model=proto, inputs=data)
    clock.lap("importance")
    plans = choose(
        gset,
        importance,
        ratio,
        global_ranking=global_ranking,
        ignore=ignore,
        round_to=round_to,
        max_layer_ratio=max_layer_ratio,
    )
    clock.lap("select")
    chosen = [gset.groups[i] for p in plans for i in p.removed]
    opts.say(f"removing {len(chosen)} of {len(gset.exact())} exact groups ({criterion})")
    members = [m for g in chosen for m in g.members]
    reference = zeroed(proto, gset, members, copy=False)  # proto is this call's own copy
    # after zeroed, which makes Constant weights initializers (as the analysis saw them): their
    # masks were left out as if shared
    slices = mask_slices(reference, members)
    clock.lap("zero")
    # The masks are written before the shrink (a place they cannot be written fails the run
    # before the model is), staged beside their name, and put there only once the shrink has
    # passed: a refused or failed shrink leaves neither.
    staged = _stage_masks(slices, masks_out) if masks_out is not None else None
    clock.lap("masks")
    try:
        # The reference is in memory: say what the input was, so that the output is written as
        # a plain shrink of it would be (external data when the input had it) and never over it.
        external = opts.external_data if opts.external_data is not None else bool(source.data)
        result = shrink(
            reference, None, output, options=opts.but(input_masked=None, external_data=external)
        )
        if staged is not None and masks_out is not None:
            with file_access(masks_out):
                os.replace(staged, masks_out)
    except ValidationFailed as exc:  # its report, as a prune's (the same keys as one that passed)
        if exc.result is not None:
            exc.result.before = original
        shrunk = exc.result.to_dict() if exc.result is not None else ShrinkResult.empty_report()
        exc.report = prune_report(plans, original, slices.skipped, shrunk)
        raise
    finally:
        if staged is not None:
            staged.unlink(missing_ok=True)
    result.before = original  # what the table and the summary compare with: the input
    timings = {**clock.timings, **{f"shrink.{k}": v for k, v in result.timings.items()}}
    return PruneResult(gset, plans, slices, result, original, slices.skipped, timings)


# ---------------------------------------------------------------------- the reference
def zeroed(
    model: onnx.ModelProto, gset: GroupSet, members: list[Member], copy: bool = True
) -> onnx.ModelProto:
    """`model` with every member's slice zeroed (`copy` False: `model` itself, changed). An
    initializer several nodes read is first given one copy per reader (as the analysis saw
    it), so that only the readers in the chosen groups lose their slices; the shrink merges
    the copies that stay equal."""
    out = model
    if copy:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    g = out.graph
    _constants_to_initializers(out, {m.initializer for m in members})
    inits = {t.name: t for t in g.initializer}
    shared = {m.initializer for m in members if m.tensor != m.initializer}
    chosen = {m.initializer for m in members}
    shared |= {original for original in gset.untied.values() if original in chosen}
    values: dict[str, np.ndarray] = {}
    if shared:
        copies = _copy_per_reader(g, gset, shared)
        for name, original in copies.items():
            values[name] = numpy_helper.to_array(inits[original]).copy()
    initializer_of = {m.tensor: m.initializer for m in members}
    for (name, axis), idx in gather_slices((m.tensor, m.axis, m.indices) for m in members).items():
        if name not in values:
            source = inits[name] if name in inits else inits[initializer_of[name]]
            values[name] = numpy_helper.to_array(source).copy()
        zero_slice(values[name], axis, idx)
    for name, v in values.items():
        t = numpy_helper.from_array(v, name)
        if name in inits:
            inits[name].CopyFrom(t)
        else:
            g.initializer.append(t)
    return out


def _copy_per_reader(g: onnx.GraphProto, gset: GroupSet, shared: set[str]) -> dict[str, str]:
    """Point each reader of a shared initializer at the copy the analysis gave it; {copy: original}."""
    site_tensor = {m.site: m.tensor for grp in gset.groups for m in grp.members}
    copies: dict[str, str] = {}
    for node in g.node:
        key = node.output[0] if node.output else ""
        for i, name in enumerate(node.input):
            if name in shared:
                t = site_tensor.get((key, i), name)
                if t != name and gset.untied.get(t) == name:
                    node.input[i] = t
                    copies[t] = name
    return copies


def _constants_to_initializers(model: onnx.ModelProto, names: set[str]) -> None:
    """Nodes that produce one of `names` without inputs (Constant) become initializers: the
    analysis saw them so (prepare does the same)."""
    from onnxshrink.ops import facts
    from onnxshrink.prepare import default_opset

    g, opset = model.graph, default_opset(model)
    for node in list(g.node):
        if node.input or len(node.output) != 1 or node.output[0] not in names:
            continue
        handler, op = facts(node, opset)
        value = handler.constant_value(op) if handler is not None else None
        if value is not None:
            g.initializer.append(numpy_helper.from_array(np.asarray(value), node.output[0]))
            g.node.remove(node)


# ---------------------------------------------------------------------- masks out
@dataclass
class MaskSlices:
    """The slices the masks zero, per (name, shape) and axis, and the initializers left out."""

    zeroed: dict[tuple[tuple[str, tuple[int, ...]], int], np.ndarray]
    skipped: list[str]
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


def mask_slices(model: onnx.ModelProto, members: list[Member]) -> MaskSlices:
    """What the 0/1 masks of the zeroed slices are: under the framework parameter names the
    exporter recorded (in the framework's layout), and under the initializer's own name. An
    initializer several nodes share is named only by its parameters (its own name would mask
    every reader); one with none is listed as skipped."""
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    skipped: set[str] = set()
    slices: list[tuple[tuple[str, tuple[int, ...]], int, np.ndarray]] = []
    shared = {m.initializer for m in members if m.tensor != m.initializer}
    for m in members:
        for p in m.params:
            slices.append(((p.name, p.shape), p.axis, m.indices))
        if m.initializer not in shared and m.initializer in shapes:
            slices.append(((m.initializer, shapes[m.initializer]), m.axis, m.indices))
        elif not m.params:
            skipped.add(m.initializer)
    return MaskSlices(gather_slices(slices), sorted(skipped))


def _stage_masks(slices: MaskSlices, path: str | Path) -> Path:
    """The masks written to a hidden file beside `path` (same directory, same suffix), to be
    renamed over it."""
    p = Path(path)
    with file_access(path):  # an unwritable place is named as the user gave it
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent.absolute())
        os.close(fd)
        staged = Path(tmp)
        try:
            save_masks(slices.masks(), staged)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
    return staged


def masks_kind(path: str | Path) -> str:
    """The format `save_masks` writes to `path` (by its extension, any case), or a ShrinkError."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".npz", ".safetensors", ".pt", ".pth"):
        raise ShrinkError(f"--masks-out {path}: give a .pt, .npz or .safetensors file name.")
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

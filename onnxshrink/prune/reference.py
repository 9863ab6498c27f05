"""The pruned reference: the input with the chosen groups' slices zeroed (a quantized slice set
to its zero point), an initializer several nodes share given one copy per reader, and the
copies that stay equal tied again."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink import ir
from onnxshrink.prune import spill
from onnxshrink.prune.groups import GroupSet, Member, cuts_by_tensor
from onnxshrink.prune.spill import Disk


# ---------------------------------------------------------------------- the reference
def zeroed(
    model: onnx.ModelProto,
    gset: GroupSet,
    members: list[Member],
    copy: bool = True,
    retie: bool = True,
    disk: Disk | None = None,
) -> onnx.ModelProto:
    """`model` with every member's slice zeroed, a quantized one set to its zero point (`copy`
    False: `model` itself, changed). An initializer several nodes read is first given one copy
    per reader (as the analysis saw it), so that only the readers in the chosen groups lose
    their slices; with `retie`, the copies that end up equal are one initializer again (as
    masks applied to the input make them: `bind.apply`), else a reference would hold two equal
    tensors where the masks' has one, and the shrink keeps what its input holds apart. With
    `disk`, external weights are read mapped and the large ones zeroed are written to its spill
    file, tensor by tensor (the reference then refers to it): never the model in memory."""
    out = model
    if copy:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    read = disk.read if disk is not None else numpy_helper.to_array
    _constants_to_initializers(out, {m.initializer for m in members})
    graphs = list(ir.all_graphs(out.graph))  # weights in If/Loop/Scan bodies too
    inits = {t.name: t for g in graphs for t in g.initializer}
    home = {t.name: g for g in graphs for t in g.initializer}
    shared = {m.initializer for m in members if m.tensor != m.initializer}
    chosen = {m.initializer for m in members}
    shared |= {original for original in gset.untied.values() if original in chosen}
    values: dict[str, np.ndarray] = {}  # each tensor made, as read (zeroed as it is stored)
    copies: dict[str, str] = {}
    if shared:
        for g in graphs:  # a copy lives beside its reader (untied uses share one scope)
            for name, original in _copy_per_reader(g, gset, shared).items():
                values[name] = read(inits[original])
                home[name] = g
                copies[name] = original
    initializer_of = {m.tensor: m.initializer for m in members}
    cuts = cuts_by_tensor(members)
    for name in cuts:
        if name not in values:
            values[name] = read(inits[name] if name in inits else inits[initializer_of[name]])
    writer = disk.writer if disk is not None else None
    for name in list(values):
        arr, cut = values.pop(name), cuts.get(name, [])
        t = spill.deferred(arr, cut, gset.zero_of(name), writer, name) if writer is not None else None
        if t is None:
            v = spill.zeroed(arr, cut, gset.zero_of(name), writer, name)
            t = disk.proto(name, v) if disk is not None else numpy_helper.from_array(v, name)
        if name in inits:
            inits[name].CopyFrom(t)
        else:
            home.get(name, out.graph).initializer.append(t)
    if retie:
        retie_copies(out, copies, read)
    return out


def untied(model: onnx.ModelProto, gset: GroupSet, members: list[Member]) -> onnx.ModelProto:
    """A copy of `model` as `zeroed(model, gset, members, retie=False)` makes it when the members
    zero nothing (`compensate.prepare`), its weights where they were: a reader's copy of a shared
    initializer is a copy of its TensorProto (of a streamed model's: the same external data,
    not its values read), and the other tensors are left as they are."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _constants_to_initializers(out, {m.initializer for m in members})
    graphs = list(ir.all_graphs(out.graph))
    inits = {t.name: t for g in graphs for t in g.initializer}
    home = {t.name: g for g in graphs for t in g.initializer}
    shared = {m.initializer for m in members if m.tensor != m.initializer}
    chosen = {m.initializer for m in members}
    shared |= {original for original in gset.untied.values() if original in chosen}
    made: dict[str, str] = {}  # {copy: original}, as `zeroed` makes them
    if shared:
        for g in graphs:
            for name, original in _copy_per_reader(g, gset, shared).items():
                made[name] = original
                home[name] = g
    initializer_of = {m.tensor: m.initializer for m in members}
    for name in cuts_by_tensor(members):
        if name not in made and name not in inits:
            made[name] = initializer_of[name]
    for name, original in made.items():  # in the order `zeroed` writes them
        t = onnx.TensorProto()
        t.CopyFrom(inits[original])
        t.name = name
        if name in inits:
            inits[name].CopyFrom(t)
        else:
            home.get(name, out.graph).initializer.append(t)
    return out


def retie_copies(
    model: onnx.ModelProto,
    copies: Mapping[str, str],
    read: Callable[[onnx.TensorProto], np.ndarray] = numpy_helper.to_array,
) -> None:
    """Each copy ({copy: original}) whose values equal its original's, or an earlier copy's of
    the same original, is that tensor again: its readers read it, and the copy is dropped."""
    graphs = list(ir.all_graphs(model.graph))
    inits = {t.name: (g, t) for g in graphs for t in g.initializer}
    kept: dict[str, list[tuple[str, np.ndarray]]] = {}
    renamed: dict[str, str] = {}
    for name, original in sorted(copies.items(), key=lambda c: (c[1], c[0])):  # a copy's copy after it
        while original in renamed:
            original = renamed[original]
        if name not in inits or original not in inits:
            continue
        if original not in kept:
            kept[original] = [(original, read(inits[original][1]))]
        g, t = inits[name]
        v = read(t)
        # the original (stored where all its readers see it) or a copy beside this one: a copy
        # in a sibling body is out of this reader's scope
        same = next(
            (
                k
                for k, w in kept[original]
                if (k == original or inits[k][0] is g) and w.dtype == v.dtype and np.array_equal(w, v)
            ),
            None,
        )
        if same is None:
            kept[original].append((name, v))
            continue
        renamed[name] = same
        g.initializer.remove(t)
    if renamed:
        for g in graphs:
            for node in g.node:
                for i, x in enumerate(node.input):
                    if x in renamed:
                        node.input[i] = renamed[x]


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

    opset = default_opset(model)
    for g in ir.all_graphs(model.graph):  # a Constant node in a body: an initializer of it
        for node in list(g.node):
            if node.input or len(node.output) != 1 or node.output[0] not in names:
                continue
            handler, op = facts(node, opset)
            value = handler.constant_value(op) if handler is not None else None
            if value is not None:
                g.initializer.append(numpy_helper.from_array(np.asarray(value), node.output[0]))
                g.node.remove(node)

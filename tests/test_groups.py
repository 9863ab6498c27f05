"""Coupled groups (`--groups`): checked against the zoo's own record of which parameter slices
each channel, head or neuron owns, and by masks a simple L1 rule builds from them in PyTorch."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import onnx
import pytest
import torch
from conftest import export_cached, params, shrink_checked, tiny

from models.transformers import TRANSFORMERS
from models.zoo import ZOO, randomize
from onnxshrink.cli import main
from onnxshrink.prune import find_groups
from onnxshrink.prune.reference import zeroed


def exported(zoo_dir, name: str, **export):
    entry = ZOO.get(name) or TRANSFORMERS[name]
    key = tuple(sorted((k, str(v)) for k, v in export.items()))

    def build():
        return randomize(entry.build(), seed=1), entry.inputs(), export

    return randomize(entry.build(), seed=1), export_cached(zoo_dir, ("groups", name, key), build)


def slices(gset) -> dict[tuple[str, int, int], set[int]]:
    """(parameter or initializer name, axis, index) -> the channel groups holding it (blocks hold
    whole weights: they are checked apart)."""
    where: dict[tuple[str, int, int], set[int]] = defaultdict(set)
    for g in gset.groups:
        if g.unit.kind == "block":
            continue
        for m in g.members:
            for i in m.indices:
                where[(m.initializer, m.axis, int(i))].add(g.id)
                for p in m.params:
                    where[(p.name, p.axis, int(i))].add(g.id)
    return where


# LLaMA's "rep" groups (query head r of every K/V group) are not units here: a K/V head with
# its query heads is. ResNeXt's grouped convs are units per conv group.
@pytest.mark.parametrize(
    "name", ["resnet_bottleneck", "se_resnet", "mobilenetv2", "densenet", "vgg", "bert", "gpt", "llama"]
)
def test_every_zoo_channel_is_one_exact_group_and_every_zoo_group_one_layer(zoo_dir, name):
    module, path = exported(zoo_dir, name)
    gset = find_groups(onnx.load(path))
    where = slices(gset)
    for group, members in module.group_members().items():
        if group.endswith(".rep"):
            continue
        layers = set()
        for c in range(module.widths[group]):
            ids = set()
            for param, axis, indices in members:
                for i in indices(c):
                    found = where[(param, axis, int(i))]
                    assert found, f"{param}[{axis}={i}] of {group}/{c} is in no group"
                    ids |= found
            assert len(ids) == 1, f"{group} channel {c} is split over groups {sorted(ids)}"
            g = gset.groups[ids.pop()]
            assert g.exact, g.reason
            layers.add(g.layer)
        assert len(layers) == 1
        assert len(gset.layers[layers.pop()].groups) == module.widths[group]


def test_units_heads_kv_groups_and_neurons(zoo_dir):
    kinds = {}
    for name in ("bert", "llama"):
        _, path = exported(zoo_dir, name)
        gset = find_groups(onnx.load(path))
        kinds[name] = sorted(
            (layer.kind, len(layer.groups), gset.groups[layer.groups[0]].exact) for layer in gset.layers
        )
        if name == "llama":
            kv = next(gset.groups[layer.groups[0]] for layer in gset.layers if layer.kind == "kv_group")
            assert (kv.unit.head_dim, kv.unit.query_heads) == (8, 2)
            # its K and V heads (8 rows each), two query heads (16 rows), their 16 o columns
            d = 32
            assert kv.params == 2 * 8 * d + 16 * d + 16 * d
    # 2 layers: 4 heads, 64 FFN neurons each; the hidden size (32, which LayerNorm / RMSNorm
    # normalize) is a width unit; the 2 blocks (attention and MLP branches each); the graph
    # output's classes or vocabulary are not exact; the embedding rows are looked up by run-time
    # indices.
    assert kinds["bert"] == [
        ("block", 2, True), ("channel", 50, False), ("head", 4, True), ("head", 4, True),
        ("neuron", 3, False), ("neuron", 64, True), ("neuron", 64, True), ("width", 32, True),
    ]  # fmt: skip
    assert kinds["llama"] == [
        ("block", 2, True), ("channel", 50, False), ("gated_neuron", 64, True),
        ("gated_neuron", 64, True), ("kv_group", 2, True), ("kv_group", 2, True), ("neuron", 50, False),
        ("width", 32, True),
    ]  # fmt: skip


def test_a_member_copied_per_component_keeps_every_other_field(zoo_dir):
    """`Member.with_indices` (a template's copy per component: the groups' members) copies every
    field by hand: each field set apart from its default, the copy equals dataclasses.replace.
    The members of a real model's groups hold no attribute dict (slotted: 848 K at 1.1 B)."""
    import dataclasses

    from onnxshrink.prune.groups import Member, ParamRef

    m = Member(
        "w", 1, np.array([3]), "node", "MatMul", "weight", "in", [ParamRef("p.weight", 0, (4, 5))], "w_copy",
        input_index=2, matrix=True, family="linear", site=("y", 2), data=("x", 1, np.array([3])),
    )  # fmt: skip
    defaults = {f.name: f.default for f in dataclasses.fields(Member)}
    assert all(getattr(m, k) is not v for k, v in defaults.items() if v is not dataclasses.MISSING)
    copy = m.with_indices(np.array([0, 2]))
    want = dataclasses.replace(m, indices=copy.indices)
    assert all(getattr(copy, f.name) is getattr(want, f.name) for f in dataclasses.fields(Member))
    assert copy.indices.tolist() == [0, 2] and m.indices.tolist() == [3]
    _, path = exported(zoo_dir, "llama")
    members = [m for g in find_groups(onnx.load(path)).groups for m in g.members]
    assert len(members) > 500 and not any(hasattr(m, "__dict__") for m in members)


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_a_hidden_channel_zeroed_everywhere_it_lives_leaves_exactly(zoo_dir, tmp_path, name):
    # The width group holds the channel in the embedding, every write into the stream, every
    # norm's scale (and bias) and every read: zeroed, all of it goes, through the norms.
    module, path = exported(zoo_dir, name)
    gset = find_groups(onnx.load(path))
    [layer] = [layer for layer in gset.layers if layer.kind == "width"]
    g = gset.groups[layer.groups[3]]
    ops = {m.op for m in g.members}
    assert ("LayerNormalization" if name == "bert" else "Mul") in ops and "Gather" in ops
    masked = zeroed(onnx.load(path), gset, g.members)
    result = shrink_checked(masked)
    assert result.before.params - result.after.params == g.params
    blocks = [gset.groups[i] for i in next(la for la in gset.layers if la.kind == "block").groups]
    assert all(b.unit.branches == 2 for b in blocks)


def test_a_block_zeroed_whole_leaves_with_its_nodes(zoo_dir):
    # The second of two blocks zeroed: the model is the one-block model built natively.
    from models.transformers import Transformer

    _, path = exported(zoo_dir, "llama")
    gset = find_groups(onnx.load(path))
    block = gset.groups[next(la for la in gset.layers if la.kind == "block").groups[1]]
    result = shrink_checked(zeroed(onnx.load(path), gset, block.members))
    assert result.before.params - result.after.params == block.params
    one = export_cached(
        zoo_dir,
        ("llama", "one block"),
        lambda: (
            randomize(Transformer(None, kind="llama", heads=4, kv_heads=2, layers=1), seed=2),
            TRANSFORMERS["llama"].inputs(),
            {},
        ),
    )
    native = onnx.load(one)
    assert result.after.params == params(native)
    assert result.after.nodes == len(native.graph.node)


def l1_masks(module: torch.nn.Module, groups: dict, fraction: float = 0.5) -> tuple[dict, list]:
    """What a framework's pruner does with groups.json: per layer, zero the members of the
    `fraction` exact groups with the smallest L1 (over the slices of its state_dict
    parameters); returns the masks and the groups chosen."""
    state = module.state_dict()

    def params_of(member):
        names = [(p["name"], p["axis"]) for p in member["params"] if p["name"] in state]
        if not names and member["initializer"] in state:
            names = [(member["initializer"], member["axis"])]
        return names

    masks = {n: torch.ones_like(v) for n, v in state.items() if v.is_floating_point()}
    chosen = []
    # channel groups only: a block holds whole weights (its zero biases the exporter drops)
    groups = {**groups, "layers": [la for la in groups["layers"] if la["kind"] != "block"]}
    by_id = {g["id"]: g for g in groups["groups"]}
    for layer in groups["layers"]:
        exact = [by_id[i] for i in layer["groups"] if by_id[i]["exact"]]
        if not exact:
            continue

        def l1(g):
            return sum(
                float(state[n].index_select(a, torch.tensor(m["indices"])).abs().sum())
                for m in g["members"]
                for n, a in params_of(m)
            )

        for g in sorted(exact, key=l1)[: int(len(exact) * fraction)]:
            chosen.append(g)
            for m in g["members"]:
                for n, a in params_of(m):
                    masks[n].index_fill_(a, torch.tensor(m["indices"]), 0.0)
    with torch.no_grad():
        for n, v in module.state_dict(keep_vars=True).items():
            if n in masks:
                v.mul_(masks[n])
    return masks, chosen


def ideal_saving(model: onnx.ModelProto, chosen: list) -> int:
    """Parameters the chosen groups' slices hold, each weight counted once (a weight whose
    rows one group owns and columns another loses the union)."""
    removed: dict[str, dict[int, set]] = defaultdict(lambda: defaultdict(set))
    for g in chosen:
        for m in g["members"]:
            removed[m["initializer"]][m["axis"]] |= set(m["indices"])
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    total = 0
    for name, axes in removed.items():
        kept = np.prod([n - len(axes.get(a, ())) for a, n in enumerate(shapes[name])])
        total += int(np.prod(shapes[name])) - int(kept)
    return total


@pytest.mark.parametrize("name", ["resnet_bottleneck", "mobilenetv2", "llama"])
def test_masks_a_pytorch_l1_rule_builds_from_groups_json_shrink_to_the_ideal_size(zoo_dir, tmp_path, name):
    module, path = exported(zoo_dir, name)
    out = tmp_path / "groups.json"
    assert main([str(path), "--groups", str(out), "-q"]) == 0
    groups = json.loads(out.read_text())
    assert groups["schema"] == "onnxshrink.groups/1"
    _, chosen = l1_masks(module, groups)
    saved = ideal_saving(onnx.load(path), chosen)
    entry = ZOO.get(name) or TRANSFORMERS[name]
    masked = export_cached(tmp_path, ("l1", name), lambda: (module, entry.inputs(), {}))
    result = shrink_checked(masked)  # validation off; compared with the masked export here
    assert result.before.params - result.after.params == saved
    assert saved > 0.3 * result.before.params
    assert not result.kept_zeroed


GROUPED = """
g (float[1, 4, 6, 6] x, float[8, 4, 1, 1] A, float[8, 2, 3, 3] W, float[8] B, float[4, 8, 1, 1] V)
  => (float[1, 4, 6, 6] y) {
  a = Conv (x, A)
  c = Conv <group = 4, pads = [1, 1, 1, 1]> (a, W, B)
  r = Relu (c)
  y = Conv (r, V)
}
"""


def test_a_grouped_conv_group_is_one_unit_on_both_sides():
    gset = find_groups(tiny(GROUPED))
    [layer] = [layer for layer in gset.layers if gset.groups[layer.groups[0]].exact]
    assert len(layer.groups) == 4  # one per conv group, channels 2k and 2k+1 on both sides
    g = gset.groups[layer.groups[1]]
    assert g.unit.kind == "conv_group" and g.unit.channels == 2
    assert {(m.initializer, m.axis, tuple(m.indices)) for m in g.members} >= {
        ("A", 0, (2, 3)), ("W", 0, (2, 3)), ("B", 0, (2, 3)), ("V", 1, (2, 3)),
    }  # fmt: skip
    zeros = {"A": np.s_[2:4], "W": np.s_[2:4], "B": np.s_[2:4], "V": np.s_[:, 2:4]}
    result = shrink_checked(tiny(GROUPED, zero=zeros))
    assert result.before.params - result.after.params == g.params == 2 * 4 + 2 * 18 + 2 + 4 * 2

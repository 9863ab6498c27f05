"""torch.nn.MultiheadAttention's heads as prune units when exported with dynamic axes (issue 34).

With a dynamic batch the Reshape that splits the packed projection into heads takes its target
from the graph: [T, Mul(B, HEADS), Div(E, HEADS)], E read off the input's static width. The head
dim is that literal division (the input's width cannot change: the runtime refuses another) and
the merged B*H axis is kept by its period HEADS (analyze/shapes.py, ops/reshape.py). Each head is
then one exact `head` group, and `prune(units=head)` removes heads: the shrunk model, run at a
batch and sequence other than the export's, equals the input model with exactly those heads'
slices zeroed here (Q, K, V rows of in_proj's weight and bias, out_proj's columns), validation
off. Legacy exporter exported here (dynamic batch; its dynamic-sequence export bakes the key's
length into a reshape, runs only at that length, and its K/V heads stay pinned, with the reason
given), dynamo exporter from models/mha/ (tools/mha_fixtures.py; dynamic batch and sequence).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import params
from onnx import numpy_helper

from models import mha
from models.mha import HD, HEADS, E
from onnxshrink.prune import find_groups, prune

GROUP_PARAMS = 3 * HD * E + 3 * HD + E * HD  # in_proj rows and biases, out_proj columns


@functools.cache
def _legacy(batch_first: bool, biases: bool, seq: bool) -> bytes:
    return mha.export(mha.module(batch_first, biases), batch_first, dynamo=False, seq=seq).SerializeToString()


def legacy(batch_first: bool, biases: bool, seq: bool = False) -> onnx.ModelProto:
    """The legacy exporter's model (exported once per process)."""
    return onnx.ModelProto.FromString(_legacy(batch_first, biases, seq))


def dynamo(batch_first: bool) -> onnx.ModelProto:
    return onnx.load(mha.fixture_path(batch_first))


def packed(model: onnx.ModelProto) -> dict[str, str]:
    """The packed projection's initializers, by how the graph reads them (not by name): the
    [E, 3E] weight a MatMul reads as B, the [3E] bias an Add adds, out_proj's weight a Gemm with
    transB reads (torch's [out, in]) and its bias."""
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type == "MatMul" and inits.get(n.input[1]) == (E, 3 * E):
            out["w"] = n.input[1]
        if n.op_type == "Add" and any(inits.get(i) == (3 * E,) for i in n.input):
            out["b"] = next(i for i in n.input if inits.get(i) == (3 * E,))
        if n.op_type == "Gemm" and inits.get(n.input[1]) == (E, E):
            assert {a.name: a.i for a in n.attribute}.get("transB") == 1
            out["ow"] = n.input[1]
            if len(n.input) > 2 and inits.get(n.input[2]) == (E,):
                out["ob"] = n.input[2]
    assert {"w", "b", "ow"} <= set(out), out
    return out


def randomized(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """The model with its packed projection's weights and biases drawn anew here."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    rng = np.random.default_rng(seed)
    names = set(packed(model).values())
    for t in model.graph.initializer:
        if t.name in names:
            arr = (rng.standard_normal(tuple(t.dims)) * 0.5).astype(np.float32)
            t.CopyFrom(numpy_helper.from_array(arr, t.name))
    return model


def head_rows(h: int) -> list[int]:
    """Head h's rows of the packed projection: in each of the q, k, v slices."""
    return [s * E + h * HD + d for s in range(3) for d in range(HD)]


def head_cols(h: int) -> list[int]:
    return list(range(h * HD, (h + 1) * HD))


def zeroed(model: onnx.ModelProto, heads: list[int]) -> onnx.ModelProto:
    """The input model with these heads' slices zeroed: Q, K, V columns of the pre-transposed
    in_proj weight ([E, 3E]) and its bias, out_proj's columns ([out, in])."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    names = packed(model)
    rows = [r for h in heads for r in head_rows(h)]
    cols = [c for h in heads for c in head_cols(h)]
    for t in model.graph.initializer:
        arr = numpy_helper.to_array(t).copy()
        if t.name == names["w"]:
            arr[:, rows] = 0
        elif t.name == names["b"]:
            arr[rows] = 0
        elif t.name == names["ow"]:
            arr[:, cols] = 0
        else:
            continue
        t.CopyFrom(numpy_helper.from_array(arr, t.name))
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def heads_of(gset, gid: int, w: str) -> list[int]:
    """The heads a group holds, by its members' indices on the in_proj weight's output axis."""
    rows = {int(i) for m in gset.groups[gid].members if m.tensor == w and m.axis == 1 for i in m.indices}
    return sorted({(r % E) // HD for r in rows})


CASES = {
    "legacy-seq_first-batch": lambda: randomized(legacy(False, True), 1),
    "legacy-batch_first-batch": lambda: randomized(legacy(True, True), 2),
    "legacy-default_init": lambda: legacy(False, False),
    "dynamo-seq_first-batch_seq": lambda: dynamo(False),
    "dynamo-batch_first-batch_seq": lambda: randomized(dynamo(True), 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_head_is_one_exact_head_group(case):
    model = CASES[case]()
    gset = find_groups(model)
    w = packed(model)["w"]
    [lay] = [la for la in gset.layers if any(m.tensor == w and m.axis == 1 for g in la.groups for m in gset.groups[g].members)]
    assert lay.kind == "head" and not any(la.kind in ("head", "kv_group") for la in gset.layers if la is not lay)
    assert len(lay.groups) == HEADS and all(gset.groups[g].exact for g in lay.groups)
    assert sorted(h for g in lay.groups for h in heads_of(gset, g, w)) == list(range(HEADS))
    names = packed(model)
    for g in lay.groups:
        [h] = heads_of(gset, g, w)
        group = gset.groups[g]
        assert group.unit.head_dim == HD and group.unit.channels == 3 * HD
        got = {(m.tensor, m.axis): sorted(int(i) for i in m.indices) for m in group.members}
        assert got == {(w, 1): head_rows(h), (names["b"], 0): head_rows(h), (names["ow"], 1): head_cols(h)}
        assert group.params == GROUP_PARAMS


@pytest.mark.parametrize("case", sorted(CASES))
def test_prune_removes_heads_exactly_against_them_zeroed_here(case):
    model = CASES[case]()
    batch_first = "batch_first" in case
    result = prune(model, 0.5, units=["head"], draws=1, price=False, validate=False)
    w = packed(model)["w"]
    gone = sorted(h for gid in result.removed() for h in heads_of(result.groups, gid, w))
    assert len(gone) == HEADS // 2 and len(result.removed()) == HEADS // 2
    assert params(model) - params(result.model) == len(gone) * GROUP_PARAMS
    seq = 7 if case.endswith("seq") else mha.T  # the legacy export runs at its own length only
    for batch in (1, 3):  # neither the export's batch
        x = mha.draw(batch_first, batch, seq, seed=batch)
        want = run(zeroed(model, gone), x)
        got = run(result.model, x)
        assert got.shape == want.shape == x.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # the removal changed the output: the zeroed heads counted
        assert np.abs(run(model, x) - want).max() > 1e-3


def test_legacy_dynamic_sequence_keeps_its_heads_and_says_why():
    """The legacy exporter's dynamic-sequence export reshapes K and V to [T, B*H, HD] with T the
    export's literal 5 against the input's dynamic length: which indices are heads is not
    derivable (at another length the reshape mixes positions into B*H), so nothing is removed,
    and the groups say why."""
    model = randomized(legacy(False, True, seq=True), 5)
    gset = find_groups(model)
    w = packed(model)["w"]
    rows = [g for g in gset.groups if any(m.tensor == w and m.axis == 1 for m in g.members)]
    assert rows and not any(g.exact for g in rows)
    assert all("Reshape" in (g.reason or "") for g in rows), {g.reason for g in rows}
    result = prune(model, 0.5, units=["head"], draws=1, price=False, validate=False)
    assert not result.removed() and params(result.model) == params(model)

"""Heads and K/V groups of fused attention ops as prune units (ops/attention.py, issue 24):
onnxruntime's `Attention` (packed Q|K|V weight inside the op), `MultiHeadAttention`,
`GroupQueryAttention` (with and without a KV cache) and ONNX's opset-23 `Attention`.

Each test prunes with validation off, reads which heads the masks zeroed, checks that they are
whole heads (every slice the layout gives a head, and nothing else of the attention), then
zeroes them in the input itself and compares with onnxruntime against the shrunk model."""

import numpy as np
import onnx
import pytest
from conftest import run, shapes, tiny

from onnxshrink import shrink
from onnxshrink.prune import find_groups, prune

MS = '<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>\n'
RNG = np.random.default_rng(0)


def attrs(model: onnx.ModelProto, op: str) -> dict:
    [node] = [n for n in model.graph.node if n.op_type == op]
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def zeroed(model: onnx.ModelProto, masks: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The input with the masks applied here (numpy): the reference of the independent check."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.name in masks:
            values = onnx.numpy_helper.to_array(t) * masks[t.name].astype(np.float32)
            t.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), t.name))
    return out


def dead(mask: np.ndarray, axis: int) -> list[int]:
    """The indices along `axis` the mask zeroes whole."""
    other = tuple(a for a in range(mask.ndim) if a != axis)
    return np.flatnonzero((mask == 0).all(axis=other)).tolist()


def blocks(heads, size: int, offset: int = 0) -> list[int]:
    return [offset + h * size + j for h in heads for j in range(size)]


def assert_head_units(model: onnx.ModelProto, n: int, head_dim: int | None = None) -> list:
    """The model's `head` units, asserted: n of them, every one exact (of head_dim dims, where
    given)."""
    heads = [g for g in find_groups(model).groups if g.unit.kind == "head"]
    assert len(heads) == n and all(g.exact and head_dim in (None, g.unit.head_dim) for g in heads)
    return heads


def gone_heads(mask: np.ndarray, size: int, n: int = 4) -> list[int]:
    """The heads (of n, `size` rows each) whose rows the output projection's mask zeroes."""
    return [h for h in range(n) if set(blocks([h], size)) <= set(dead(mask, 0))]


def pruned(model: onnx.ModelProto, feeds: dict, ratio: float = 0.5, **kwargs):
    """Prune (validation off), then check the shrunk model against the input with the masks
    applied here, with onnxruntime."""
    result = prune(model, ratio, validate=False, price=False, **kwargs)
    masks = result.masks
    for a, b in zip(run(zeroed(model, masks), feeds), run(result.model, feeds), strict=True):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    return result, masks


def x(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ onnxruntime's Attention
ATTN = MS + """
g (float[1, 5, 8] x, float[8, 24] W, float[24] B, float[8, 8] Wo, float[8] Bo) => (float[1, 5, 8] y) {
  a = com.microsoft.Attention <num_heads = 4> (x, W, B)
  o = MatMul (a, Wo)
  y = Add (o, Bo)
}"""
PER_HEAD = 3 * 8 * 2 + 3 * 2 + 2 * 8  # its Q, K, V columns of W and B, its rows of Wo


@pytest.mark.parametrize("init", ["random", "default"])
def test_contrib_attention_heads_are_groups_and_half_go(init):
    # the library's default: zero biases, a square output projection (random in both)
    values = {"B": np.zeros(24), "Bo": np.zeros(8)} if init == "default" else None
    model = tiny(ATTN, values=values)
    gset = find_groups(model)
    heads = [g for g in gset.groups if g.unit.kind == "head"]
    assert len(heads) == 4 and all(g.exact for g in heads)
    assert {(g.unit.channels, g.unit.head_dim, g.params) for g in heads} == {(2, 2, PER_HEAD)}
    assert [sorted(m.indices.tolist()) for m in heads[1].members if m.initializer == "W"] == [
        blocks([1], 2) + blocks([1], 2, 8) + blocks([1], 2, 16)
    ]

    result, masks = pruned(model, {"x": x(1, 5, 8)})
    gone = gone_heads(masks["Wo"], 2)
    assert len(gone) == 2
    cols = blocks(gone, 2) + blocks(gone, 2, 8) + blocks(gone, 2, 16)
    assert dead(masks["W"], 1) == sorted(cols) and dead(masks["Wo"], 0) == blocks(gone, 2)
    s = shapes(result.model)
    assert s["W"] == (8, 12) and s["B"] == (12,) and s["Wo"] == (4, 8)
    assert attrs(result.model, "Attention")["num_heads"] == 2
    assert result.shrink.before.params - result.shrink.after.params == 2 * PER_HEAD


def test_contrib_attention_qkv_hidden_sizes_slice_each_part_by_its_head_size():
    # Q and K heads of 2, V heads of 3 (V hidden 12): qkv_hidden_sizes shrinks with the heads
    text = ATTN.replace("<num_heads = 4>", "<num_heads = 4, qkv_hidden_sizes = [8, 8, 12]>")
    text = text.replace("float[8, 24] W, float[24] B, float[8, 8] Wo", "float[8, 28] W, float[28] B, float[12, 8] Wo")
    model = tiny(text)
    result, masks = pruned(model, {"x": x(1, 5, 8)})
    gone = gone_heads(masks["Wo"], 3)
    assert len(gone) == 2
    assert dead(masks["W"], 1) == sorted(blocks(gone, 2) + blocks(gone, 2, 8) + blocks(gone, 3, 16))
    assert attrs(result.model, "Attention") == {"num_heads": 2, "qkv_hidden_sizes": [4, 4, 6]}
    assert shapes(result.model)["W"] == (8, 14)


def test_contrib_attention_with_a_past_input_has_groups_the_interface_holds():
    text = MS + """
    g (float[1, 5, 8] x, float[2, 1, 4, 3, 2] past, float[8, 24] W, float[24] B, float[8, 8] Wo) => (float[1, 5, 8] y, float[2, 1, 4, 8, 2] present) {
      a, present = com.microsoft.Attention <num_heads = 4> (x, W, B, , past)
      y = MatMul (a, Wo)
    }"""
    heads = [g for g in find_groups(tiny(text)).groups if g.unit.kind == "head"]
    assert len(heads) == 4 and not any(g.exact for g in heads)
    assert all("graph input or output" in (g.reason or "") for g in heads)


def test_contrib_attention_a_past_computed_in_the_graph_loses_the_heads_slices():
    # past = [keys; values] of a context input, [2, B, heads, positions, head_dim]
    text = MS + """
    g (float[1, 5, 8] x, float[1, 3, 8] ctx, float[8, 24] W, float[24] B, float[8, 8] Wpk, float[8, 8] Wpv, float[8, 8] Wo) => (float[1, 5, 8] y) {
      shape = Constant <value = int64[4] {1, 3, 4, 2}> ()
      zero = Constant <value = int64[1] {0}> ()
      ck = MatMul (ctx, Wpk)
      cv = MatMul (ctx, Wpv)
      ck4 = Reshape (ck, shape)
      cv4 = Reshape (cv, shape)
      kt = Transpose <perm = [0, 2, 1, 3]> (ck4)
      vt = Transpose <perm = [0, 2, 1, 3]> (cv4)
      k5 = Unsqueeze (kt, zero)
      v5 = Unsqueeze (vt, zero)
      past = Concat <axis = 0> (k5, v5)
      a, present = com.microsoft.Attention <num_heads = 4> (x, W, B, , past)
      y = MatMul (a, Wo)
    }"""
    model = tiny(text)
    assert_head_units(model, 4)
    result, masks = pruned(model, {"x": x(1, 5, 8), "ctx": x(1, 3, 8)})
    gone = gone_heads(masks["Wo"], 2)
    assert len(gone) == 2
    assert dead(masks["Wpk"], 1) == dead(masks["Wpv"], 1) == blocks(gone, 2)
    s = shapes(result.model)
    assert s["W"] == (8, 12) and s["Wpk"] == s["Wpv"] == (8, 4)
    assert attrs(result.model, "Attention")["num_heads"] == 2


@pytest.mark.parametrize("heads_axis", [1, 4])
def test_contrib_attention_a_per_head_attention_bias_goes_with_its_heads(heads_axis):
    text = ATTN.replace("float[8] Bo)", f"float[8] Bo, float[1, {heads_axis}, 5, 5] Ab)")
    text = text.replace("(x, W, B)", "(x, W, B, , , Ab)")
    model = tiny(text)
    assert_head_units(model, 4)
    result, masks = pruned(model, {"x": x(1, 5, 8)})
    assert shapes(result.model)["Ab"] == (1, 2 if heads_axis == 4 else 1, 5, 5)
    assert attrs(result.model, "Attention")["num_heads"] == 2


# ------------------------------------------------------------------ MultiHeadAttention
MHA = MS + """
g (float[1, 5, 8] x, float[8, 8] Wq, float[8, 8] Wk, float[8, 8] Wv, float[24] B, float[8, 8] Wo) => (float[1, 5, 8] y) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  a = com.microsoft.MultiHeadAttention <num_heads = 4> (q, k, v, B)
  y = MatMul (a, Wo)
}"""


@pytest.mark.parametrize("init", ["random", "default"])
def test_multihead_attention_heads_go_with_their_projections_and_packed_bias(init):
    model = tiny(MHA, values={"B": np.zeros(24)} if init == "default" else None)
    assert_head_units(model, 4, head_dim=2)
    result, masks = pruned(model, {"x": x(1, 5, 8)})
    gone = gone_heads(masks["Wo"], 2)
    assert len(gone) == 2
    for w in ("Wq", "Wk", "Wv"):
        assert dead(masks[w], 1) == blocks(gone, 2)
    assert dead(masks["B"], 0) == sorted(blocks(gone, 2) + blocks(gone, 2, 8) + blocks(gone, 2, 16))
    s = shapes(result.model)
    assert s["Wq"] == s["Wk"] == s["Wv"] == (8, 4) and s["B"] == (12,) and s["Wo"] == (4, 8)
    assert attrs(result.model, "MultiHeadAttention")["num_heads"] == 2


def test_multihead_attention_a_past_computed_in_the_graph_goes_with_its_heads():
    text = MS + """
    g (float[1, 5, 8] x, float[1, 3, 8] ctx, float[8, 8] Wq, float[8, 8] Wk, float[8, 8] Wv, float[8, 8] Wpk, float[8, 8] Wpv, float[8, 8] Wo) => (float[1, 5, 8] y) {
      q = MatMul (x, Wq)
      k = MatMul (x, Wk)
      v = MatMul (x, Wv)
      shape = Constant <value = int64[4] {1, 3, 4, 2}> ()
      ck = MatMul (ctx, Wpk)
      cv = MatMul (ctx, Wpv)
      ck4 = Reshape (ck, shape)
      cv4 = Reshape (cv, shape)
      past_k = Transpose <perm = [0, 2, 1, 3]> (ck4)
      past_v = Transpose <perm = [0, 2, 1, 3]> (cv4)
      a, pk, pv = com.microsoft.MultiHeadAttention <num_heads = 4> (q, k, v, , , , past_k, past_v)
      y = MatMul (a, Wo)
    }"""
    model = tiny(text)
    assert_head_units(model, 4)
    result, masks = pruned(model, {"x": x(1, 5, 8), "ctx": x(1, 3, 8)})
    gone = gone_heads(masks["Wo"], 2)
    assert len(gone) == 2
    for w in ("Wq", "Wk", "Wv", "Wpk", "Wpv"):
        assert dead(masks[w], 1) == blocks(gone, 2)
    assert shapes(result.model)["Wpk"] == (8, 4)
    assert attrs(result.model, "MultiHeadAttention")["num_heads"] == 2


@pytest.mark.parametrize("heads_axis", [1, 4])
def test_multihead_attention_a_per_head_attention_bias_goes_with_its_heads(heads_axis):
    # [1, heads or 1, S, T] (a relative position bias, ALiBi): a head's slice of it goes too
    text = MHA.replace("float[8, 8] Wo)", f"float[8, 8] Wo, float[1, {heads_axis}, 5, 5] Ab)")
    text = text.replace("(q, k, v, B)", "(q, k, v, B, , Ab)")
    model = tiny(text)
    assert_head_units(model, 4)
    result, masks = pruned(model, {"x": x(1, 5, 8)})
    assert shapes(result.model)["Ab"] == (1, 2 if heads_axis == 4 else 1, 5, 5)
    assert attrs(result.model, "MultiHeadAttention")["num_heads"] == 2


# ------------------------------------------------------------------ GroupQueryAttention
GQA = MS + """
g (float[1, 5, 16] x, float[16, 32] Wq, float[16, 16] Wk, float[16, 16] Wv, float[32, 16] Wo, int32[1] seqlens, int32 total) => (float[1, 5, 16] y) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  a, pk, pv = com.microsoft.GroupQueryAttention <num_heads = 4, kv_num_heads = 2> (q, k, v, , , seqlens, total)
  y = MatMul (a, Wo)
}"""
GQA_FEEDS = {"seqlens": np.array([4], np.int32), "total": np.array(5, np.int32)}


def kv_gone(masks: dict, d: int = 8, rep: int = 2, kv: int = 2) -> list[int]:
    """The K/V heads whose query heads' output rows the masks zero."""
    rows = set(dead(masks["Wo"], 0))
    return [j for j in range(kv) if set(blocks(range(j * rep, (j + 1) * rep), d)) <= rows]


def test_group_query_attention_a_kv_group_is_a_kv_head_with_its_query_heads():
    model = tiny(GQA)
    groups = [g for g in find_groups(model).groups if g.unit.kind == "kv_group"]
    assert len(groups) == 2 and all(g.exact for g in groups)
    assert {(g.unit.head_dim, g.unit.query_heads) for g in groups} == {(8, 2)}
    assert {g.params for g in groups} == {16 * 16 + 2 * 16 * 8 + 16 * 16}
    result, masks = pruned(model, {"x": x(1, 5, 16), **GQA_FEEDS})
    [j] = kv_gone(masks)
    assert dead(masks["Wq"], 1) == blocks(range(2 * j, 2 * j + 2), 8)
    assert dead(masks["Wk"], 1) == dead(masks["Wv"], 1) == blocks([j], 8)
    s = shapes(result.model)
    assert s["Wq"] == (16, 16) and s["Wk"] == s["Wv"] == (16, 8) and s["Wo"] == (16, 16)
    assert {k: v for k, v in attrs(result.model, "GroupQueryAttention").items() if "heads" in k} == {
        "num_heads": 2,
        "kv_num_heads": 1,
    }


def test_group_query_attention_with_packed_qkv_slices_each_part():
    # one projection [16, (4 + 2 + 2) * 8]: Q heads, then K heads, then V heads (head_dim 8)
    text = MS + """
    g (float[1, 5, 16] x, float[16, 64] W, float[64] B, float[32, 16] Wo, int32[1] seqlens, int32 total) => (float[1, 5, 16] y) {
      p = MatMul (x, W)
      qkv = Add (p, B)
      a, pk, pv = com.microsoft.GroupQueryAttention <num_heads = 4, kv_num_heads = 2> (qkv, , , , , seqlens, total)
      y = MatMul (a, Wo)
    }"""
    for values in (None, {"B": np.zeros(64)}):
        model = tiny(text, values=values)
        groups = [g for g in find_groups(model).groups if g.unit.kind == "kv_group"]
        assert len(groups) == 2 and {(g.unit.head_dim, g.unit.query_heads) for g in groups} == {(8, 2)}
        result, masks = pruned(model, {"x": x(1, 5, 16), **GQA_FEEDS})
        [j] = kv_gone(masks)
        cols = blocks(range(2 * j, 2 * j + 2), 8) + blocks([j], 8, 32) + blocks([j], 8, 48)
        assert dead(masks["W"], 1) == dead(masks["B"], 0) == sorted(cols)
        assert shapes(result.model)["W"] == (16, 32) and shapes(result.model)["Wo"] == (16, 16)
        assert attrs(result.model, "GroupQueryAttention")["kv_num_heads"] == 1


GQA_PAST = MS + """
g (float[1, 1, 16] x, float[1, 2, 4, 8] past_k, float[1, 2, 4, 8] past_v, float[16, 32] Wq, float[16, 16] Wk, float[16, 16] Wv, float[32, 16] Wo, int32[1] seqlens, int32 total) => (float[1, 1, 16] y, float[1, 2, 5, 8] pk, float[1, 2, 5, 8] pv) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  a, pk, pv = com.microsoft.GroupQueryAttention <num_heads = 4, kv_num_heads = 2> (q, k, v, past_k, past_v, seqlens, total)
  y = MatMul (a, Wo)
}"""


def test_group_query_attention_a_kv_cache_in_the_interface_goes_with_its_groups():
    # The present outputs extend the past inputs (GroupQueryAttention.extends): one state the
    # runtime feeds back, whose K/V heads go with their groups (analyze/cache.py); the shrunk
    # model's cache shapes say so (tests/test_kv_cache.py checks such models run exactly).
    groups = [g for g in find_groups(tiny(GQA_PAST)).groups if g.unit.kind == "kv_group"]
    assert len(groups) == 2 and all(g.exact for g in groups)
    assert all(g.unit.query_heads == 2 for g in groups)


def test_group_query_attention_a_cache_computed_in_the_graph_goes_with_its_kv_head():
    # The past keys and values are projected from a context input (a prefix): K/V head j's
    # cache is its projection's columns, which go with the group.
    text = MS + """
    g (float[1, 1, 16] x, float[1, 4, 16] ctx, float[16, 32] Wq, float[16, 16] Wk, float[16, 16] Wv, float[16, 16] Wpk, float[16, 16] Wpv, float[32, 16] Wo, int32[1] seqlens, int32 total) => (float[1, 1, 16] y) {
      q = MatMul (x, Wq)
      k = MatMul (x, Wk)
      v = MatMul (x, Wv)
      shape = Constant <value = int64[4] {1, 4, 2, 8}> ()
      ck = MatMul (ctx, Wpk)
      cv = MatMul (ctx, Wpv)
      ck4 = Reshape (ck, shape)
      cv4 = Reshape (cv, shape)
      past_k = Transpose <perm = [0, 2, 1, 3]> (ck4)
      past_v = Transpose <perm = [0, 2, 1, 3]> (cv4)
      a, pk, pv = com.microsoft.GroupQueryAttention <num_heads = 4, kv_num_heads = 2> (q, k, v, past_k, past_v, seqlens, total)
      y = MatMul (a, Wo)
    }"""
    model = tiny(text)
    groups = [g for g in find_groups(model).groups if g.unit.kind == "kv_group"]
    assert len(groups) == 2 and all(g.exact for g in groups)
    assert {m.initializer for m in groups[0].members} == {"Wq", "Wk", "Wv", "Wpk", "Wpv", "Wo"}
    result, masks = pruned(model, {"x": x(1, 1, 16), "ctx": x(1, 4, 16), **GQA_FEEDS})
    [j] = kv_gone(masks)
    for w in ("Wk", "Wv", "Wpk", "Wpv"):
        assert dead(masks[w], 1) == blocks([j], 8)
    s = shapes(result.model)
    assert s["Wq"] == (16, 16) and s["Wpk"] == s["Wpv"] == (16, 8)
    assert attrs(result.model, "GroupQueryAttention")["kv_num_heads"] == 1


# ------------------------------------------------------------------ GroupQueryAttention: query ranks
# With --units head (and not kv_group) a unit is the query heads of one rank r in every K/V
# group (query heads r, rep + r, ...): removing them leaves every K/V head serving rep - 1.
@pytest.mark.parametrize("init", ["random", "default"])
def test_group_query_attention_query_ranks_are_head_units_with_packed_qkv(init):
    # 8 query heads, 2 K/V heads (rep 4), head_dim 8: W [16, (8 + 2 + 2) * 8], bias B
    text = MS + """
    g (float[1, 5, 16] x, float[16, 96] W, float[96] B, float[64, 16] Wo, int32[1] seqlens, int32 total) => (float[1, 5, 16] y) {
      p = MatMul (x, W)
      qkv = Add (p, B)
      a, pk, pv = com.microsoft.GroupQueryAttention <num_heads = 8, kv_num_heads = 2> (qkv, , , , , seqlens, total)
      y = MatMul (a, Wo)
    }"""
    model = tiny(text, values={"B": np.zeros(96)} if init == "default" else None)
    per_rank = 2 * (8 * 16 + 8 + 8 * 16)  # two query heads: W's columns, B's, Wo's rows
    gset = find_groups(model, query_ranks=True)
    heads = [g for g in gset.groups if g.unit.kind == "head"]
    assert len(heads) == 4 and all(g.exact for g in heads)
    assert {(g.unit.head_dim, g.unit.query_heads, g.params) for g in heads} == {(8, 2, per_rank)}
    kv = [g for g in gset.groups if g.unit.kind == "kv_group"]  # K/V heads alone: not units here
    assert len(kv) == 2 and not any(g.exact for g in kv) and all("by rank" in str(g.reason) for g in kv)
    assert {(g.unit.head_dim, g.unit.query_heads, g.params) for g in kv} == {(8, 0, 2 * (8 * 16 + 8))}
    result, masks = pruned(model, {"x": x(1, 5, 16), **GQA_FEEDS}, units=["head"])
    gone = [r for r in range(4) if set(blocks([r, 4 + r], 8)) <= set(dead(masks["W"], 1))]
    assert len(gone) == 2
    want = blocks([j * 4 + r for j in range(2) for r in gone], 8)
    assert dead(masks["W"], 1) == dead(masks["B"], 0) == sorted(want)
    assert dead(masks["Wo"], 0) == sorted(want)
    s = shapes(result.model)
    assert s["W"] == (16, 64) and s["B"] == (64,) and s["Wo"] == (32, 16)
    assert result.shrink.before.params - result.shrink.after.params == 2 * per_rank
    assert {k: v for k, v in attrs(result.model, "GroupQueryAttention").items() if "heads" in k} == {
        "num_heads": 4,
        "kv_num_heads": 2,
    }


def test_group_query_attention_the_least_important_rank_goes_with_its_sinks():
    # Query heads 1 and 3 (rank 1 of both K/V groups) have small weights: --units head removes
    # that rank (l1), with its head sinks; the K/V heads stay whole.
    text = GQA.replace("int32 total)", "int32 total, float[4] Sink)").replace(
        "(q, k, v, , , seqlens, total)", "(q, k, v, , , seqlens, total, , , , , Sink)"
    )
    model = tiny(text)
    rank1 = [*range(8, 16), *range(24, 32)]
    for t in model.graph.initializer:
        if t.name in ("Wq", "Wo"):
            w = onnx.numpy_helper.to_array(t).copy()
            if t.name == "Wq":
                w[:, rank1] *= 1e-3
            else:
                w[rank1, :] *= 1e-3
            t.CopyFrom(onnx.numpy_helper.from_array(w, t.name))
    result, masks = pruned(model, {"x": x(1, 5, 16), **GQA_FEEDS}, units=["head"])
    assert dead(masks["Wq"], 1) == dead(masks["Wo"], 0) == rank1
    assert dead(masks["Sink"], 0) == [1, 3]
    assert "Wk" not in masks and "Wv" not in masks  # the K/V heads stay whole
    s = shapes(result.model)
    assert s["Wq"] == (16, 16) and s["Wk"] == s["Wv"] == (16, 16) and s["Wo"] == (16, 16) and s["Sink"] == (2,)
    assert result.shrink.before.params - result.shrink.after.params == 2 * (16 * 8 + 8 * 16 + 1)
    a = attrs(result.model, "GroupQueryAttention")
    assert a["num_heads"] == 2 and a["kv_num_heads"] == 2


def test_group_query_attention_query_ranks_with_a_kv_cache_in_the_interface():
    # The cache keeps every K/V head (the interface), and a rank of query heads still goes
    model = tiny(GQA_PAST)
    assert not [g for g in find_groups(model).groups if g.unit.kind == "head"]  # K/V groups by default
    feeds = {"x": x(1, 1, 16), "past_k": x(1, 2, 4, 8), "past_v": x(1, 2, 4, 8), **GQA_FEEDS}
    result, masks = pruned(model, feeds, units=["head"])
    [r] = [r for r in range(2) if dead(masks["Wq"], 1) == blocks([r, 2 + r], 8)]
    assert dead(masks["Wo"], 0) == blocks([r, 2 + r], 8)
    assert "Wk" not in masks and "Wv" not in masks  # the K/V heads stay whole
    s = shapes(result.model)
    assert s["Wq"] == (16, 16) and s["Wk"] == s["Wv"] == (16, 16) and s["Wo"] == (16, 16)
    outs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in result.model.graph.output}
    assert outs["pk"] == outs["pv"] == [1, 2, 5, 8]
    a = attrs(result.model, "GroupQueryAttention")
    assert a["num_heads"] == 2 and a["kv_num_heads"] == 2


# ------------------------------------------------------------------ ONNX Attention (opset 23)
ONNX_ATTN = """<ir_version: 10, opset_import: ["" : 23]>
g (float[1, 5, 8] x, float[8, 8] Wq, float[8, 4] Wk, float[8, 4] Wv, float[8, 8] Wo) => (float[1, 5, 8] y) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  a = Attention <q_num_heads = 4, kv_num_heads = 2> (q, k, v)
  y = MatMul (a, Wo)
}"""


def test_onnx_attention_3d_query_ranks_with_units_head():
    # the same packed-hidden form: with --units head a rank of query heads goes (heads 1 and 3
    # or 0 and 2, head_dim 2), q_num_heads 4 -> 2, the K/V heads stay
    model = tiny(ONNX_ATTN, opset=23)
    result, masks = pruned(model, {"x": x(1, 5, 8)}, units=["head"])
    [r] = [r for r in range(2) if dead(masks["Wq"], 1) == blocks([r, 2 + r], 2)]
    assert dead(masks["Wo"], 0) == blocks([r, 2 + r], 2)
    assert "Wk" not in masks and "Wv" not in masks
    assert result.shrink.before.params - result.shrink.after.params == 2 * (8 * 2 + 2 * 8)
    a = attrs(result.model, "Attention")
    assert a["q_num_heads"] == 2 and a["kv_num_heads"] == 2


def test_onnx_attention_3d_kv_groups_go_and_rewrite_the_head_counts():
    model = tiny(ONNX_ATTN)
    groups = [g for g in find_groups(model).groups if g.unit.kind == "kv_group"]
    assert len(groups) == 2 and all(g.exact for g in groups)
    assert {(g.unit.head_dim, g.unit.query_heads) for g in groups} == {(2, 2)}
    result, masks = pruned(model, {"x": x(1, 5, 8)})
    [j] = kv_gone(masks, d=2)
    assert dead(masks["Wq"], 1) == blocks(range(2 * j, 2 * j + 2), 2)
    assert dead(masks["Wk"], 1) == dead(masks["Wv"], 1) == blocks([j], 2)
    assert shapes(result.model)["Wq"] == (8, 4) and shapes(result.model)["Wk"] == (8, 2)
    a = attrs(result.model, "Attention")
    assert a["q_num_heads"] == 2 and a["kv_num_heads"] == 1


def test_onnx_attention_3d_with_a_past_computed_in_the_graph():
    text = """<ir_version: 10, opset_import: ["" : 23]>
    g (float[1, 5, 8] x, float[1, 3, 8] ctx, float[8, 8] Wq, float[8, 4] Wk, float[8, 4] Wv, float[8, 4] Wpk, float[8, 4] Wpv, float[8, 8] Wo) => (float[1, 5, 8] y) {
      q = MatMul (x, Wq)
      k = MatMul (x, Wk)
      v = MatMul (x, Wv)
      shape = Constant <value = int64[4] {1, 3, 2, 2}> ()
      ck = MatMul (ctx, Wpk)
      cv = MatMul (ctx, Wpv)
      ck4 = Reshape (ck, shape)
      cv4 = Reshape (cv, shape)
      past_k = Transpose <perm = [0, 2, 1, 3]> (ck4)
      past_v = Transpose <perm = [0, 2, 1, 3]> (cv4)
      a, pk, pv = Attention <q_num_heads = 4, kv_num_heads = 2> (q, k, v, , past_k, past_v)
      y = MatMul (a, Wo)
    }"""
    model = tiny(text)
    result, masks = pruned(model, {"x": x(1, 5, 8), "ctx": x(1, 3, 8)})
    [j] = kv_gone(masks, d=2)
    assert dead(masks["Wpk"], 1) == dead(masks["Wpv"], 1) == blocks([j], 2)
    assert attrs(result.model, "Attention")["kv_num_heads"] == 1


def test_onnx_attention_4d_heads_are_an_axis_and_half_go():
    text = """<ir_version: 10, opset_import: ["" : 23]>
    g (float[1, 5, 8] x, float[8, 8] Wq, float[8, 8] Wk, float[8, 8] Wv, float[8, 8] Wo) => (float[1, 5, 8] y) {
      q = MatMul (x, Wq)
      k = MatMul (x, Wk)
      v = MatMul (x, Wv)
      shape = Constant <value = int64[4] {1, 5, 4, 2}> ()
      back = Constant <value = int64[3] {1, 5, 8}> ()
      q4 = Reshape (q, shape)
      k4 = Reshape (k, shape)
      v4 = Reshape (v, shape)
      qt = Transpose <perm = [0, 2, 1, 3]> (q4)
      kt = Transpose <perm = [0, 2, 1, 3]> (k4)
      vt = Transpose <perm = [0, 2, 1, 3]> (v4)
      a = Attention <is_causal = 1> (qt, kt, vt)
      at = Transpose <perm = [0, 2, 1, 3]> (a)
      a3 = Reshape (at, back)
      y = MatMul (a3, Wo)
    }"""
    model = tiny(text)
    assert_head_units(model, 4, head_dim=2)
    result, masks = pruned(model, {"x": x(1, 5, 8)})
    gone = gone_heads(masks["Wo"], 2)
    assert len(gone) == 2
    for w in ("Wq", "Wk", "Wv"):
        assert dead(masks[w], 1) == blocks(gone, 2)
    assert shapes(result.model)["Wq"] == (8, 4) and shapes(result.model)["Wo"] == (4, 8)


def test_group_query_attention_with_a_cache_in_the_interface_still_loses_query_heads_by_rank():
    # Masks on query heads 1 and 3 (rank 1 of both groups): the cache keeps every K/V head,
    # but each K/V head now serves one query head.
    model = tiny(GQA_PAST, zero={"Wo": np.s_[[*range(8, 16), *range(24, 32)]]})
    result = shrink(model, validate=False)
    s = shapes(result.model)
    assert s["Wq"] == (16, 16) and s["Wk"] == s["Wv"] == (16, 16) and s["Wo"] == (16, 16)
    a = attrs(result.model, "GroupQueryAttention")
    assert a["num_heads"] == 2 and a["kv_num_heads"] == 2
    feeds = {"x": x(1, 1, 16), "past_k": x(1, 2, 4, 8), "past_v": x(1, 2, 4, 8), **GQA_FEEDS}
    for want, got in zip(run(model, feeds), run(result.model, feeds), strict=True):
        assert np.abs(want - got).max() <= 1e-5 * np.abs(want).max()


# ------------------------------------------------------------------ onnxruntime-optimized ViT
def test_an_optimized_vit_with_fused_attention_loses_half_its_heads_and_neurons(zoo_dir):
    # The zoo ViT (4 heads of 8) exported and fused by onnxruntime's transformer optimizer
    # (Attention with the packed Q|K|V weight where it matches, BiasGelu, SkipLayerNorm): the
    # export test_fused.py makes, its weights drawn again here (its masks' zeros undone).
    from conftest import error_against
    from test_fused import optimized

    model = onnx.load(optimized(zoo_dir, "vit", "masked", "vit"))
    rng = np.random.default_rng(5)
    for t in model.graph.initializer:
        v = onnx.numpy_helper.to_array(t)
        if v.dtype == np.float32 and v.ndim >= 1:
            t.CopyFrom(onnx.numpy_helper.from_array(rng.standard_normal(v.shape).astype(np.float32), t.name))
    fused_heads = [attrs_of(n)["num_heads"] for n in model.graph.node if n.op_type == "Attention"]
    assert fused_heads and set(fused_heads) == {4}
    result = prune(model, 0.5, validate=False, price=False, units=["head", "neuron"])
    heads = [attrs_of(n)["num_heads"] for n in result.model.graph.node if n.op_type == "Attention"]
    assert heads == [2] * len(fused_heads)
    widths = [shapes(result.model)[n.input[1]] for n in result.model.graph.node if n.op_type == "BiasGelu"]
    before = [shapes(model)[n.input[1]] for n in model.graph.node if n.op_type == "BiasGelu"]
    assert [w[0] * 2 for w in widths] == [w[0] for w in before]
    # the removed groups' slices zeroed here (the masks name some by the framework's names)
    values = {t.name: onnx.numpy_helper.to_array(t).copy() for t in model.graph.initializer}
    for i in result.removed():
        for m in result.groups.groups[i].members:
            index = [slice(None)] * values[m.initializer].ndim
            index[m.axis] = m.indices
            values[m.initializer][tuple(index)] = 0
    reference = onnx.ModelProto()
    reference.CopyFrom(model)
    for t in reference.graph.initializer:
        t.CopyFrom(onnx.numpy_helper.from_array(values[t.name], t.name))
    assert error_against(reference, result.model) <= 1e-5


def attrs_of(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_onnx_attention_4d_a_past_computed_in_the_graph_goes_with_its_kv_head():
    text = """<ir_version: 10, opset_import: ["" : 23]>
    g (float[1, 5, 8] x, float[1, 3, 8] ctx, float[8, 8] Wq, float[8, 4] Wk, float[8, 4] Wv, float[8, 4] Wpk, float[8, 4] Wpv, float[8, 8] Wo) => (float[1, 5, 8] y) {
      q = MatMul (x, Wq)
      k = MatMul (x, Wk)
      v = MatMul (x, Wv)
      qs = Constant <value = int64[4] {1, 5, 4, 2}> ()
      ks = Constant <value = int64[4] {1, 5, 2, 2}> ()
      ps = Constant <value = int64[4] {1, 3, 2, 2}> ()
      back = Constant <value = int64[3] {1, 5, 8}> ()
      ck = MatMul (ctx, Wpk)
      cv = MatMul (ctx, Wpv)
      q4 = Reshape (q, qs)
      k4 = Reshape (k, ks)
      v4 = Reshape (v, ks)
      ck4 = Reshape (ck, ps)
      cv4 = Reshape (cv, ps)
      qt = Transpose <perm = [0, 2, 1, 3]> (q4)
      kt = Transpose <perm = [0, 2, 1, 3]> (k4)
      vt = Transpose <perm = [0, 2, 1, 3]> (v4)
      past_k = Transpose <perm = [0, 2, 1, 3]> (ck4)
      past_v = Transpose <perm = [0, 2, 1, 3]> (cv4)
      a, pk, pv = Attention (qt, kt, vt, , past_k, past_v)
      at = Transpose <perm = [0, 2, 1, 3]> (a)
      a3 = Reshape (at, back)
      y = MatMul (a3, Wo)
    }"""
    model = tiny(text)
    groups = [g for g in find_groups(model).groups if g.unit.kind == "kv_group"]
    assert len(groups) == 2 and all(g.exact and g.unit.query_heads == 2 for g in groups)
    result, masks = pruned(model, {"x": x(1, 5, 8), "ctx": x(1, 3, 8)})
    [j] = kv_gone(masks, d=2)
    for w in ("Wk", "Wv", "Wpk", "Wpv"):
        assert dead(masks[w], 1) == blocks([j], 2)
    assert shapes(result.model)["Wpk"] == (8, 2) and shapes(result.model)["Wq"] == (8, 4)


# ------------------------------------------------------------------ KV caches in the interface
def check_cache(model: onnx.ModelProto, result, feeds: dict, pasts: tuple[str, ...], kept: list[int]) -> None:
    """The input with the masks applied here, fed the whole cache (random in the removed K/V
    heads too), against the shrunk model fed the kept K/V heads, with onnxruntime: the output
    equal, each present equal on the kept heads."""
    shrunk_feeds = {k: (v[:, kept] if k in pasts else v) for k, v in feeds.items()}
    want = run(zeroed(model, result.masks), feeds)
    got = run(result.model, shrunk_feeds)
    assert got[0].shape == want[0].shape
    assert np.abs(got[0] - want[0]).max() <= 1e-5 * np.abs(want[0]).max()
    for a, b in zip(want[1:], got[1:], strict=True):
        assert b.shape == a[:, kept].shape
        assert np.abs(a[:, kept] - b).max() <= 1e-5 * np.abs(a).max()


ONNX_CACHE_3D = """<ir_version: 10, opset_import: ["" : 23]>
g (float[1, 2, 8] x, float[1, 2, 3, 2] past_k, float[1, 2, 3, 2] past_v, float[8, 8] Wq, float[8, 4] Wk, float[8, 4] Wv, float[8] Bv, float[8, 8] Wo) => (float[1, 2, 8] y, float[1, 2, 5, 2] pk, float[1, 2, 5, 2] pv) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v0 = MatMul (x, Wv)
  v = Add (v0, Bv)
  a, pk, pv = Attention <q_num_heads = 4, kv_num_heads = 2> (q, k, v, , past_k, past_v)
  y = MatMul (a, Wo)
}""".replace("float[8] Bv", "float[4] Bv")


@pytest.mark.parametrize("init", ["random", "default"])
def test_onnx_attention_3d_a_kv_cache_in_the_interface_goes_with_its_groups(init):
    # Attention.extends: present_key/value extend past_key/value along the sequence, one state
    # the runtime feeds back; a K/V group takes its slice of both (analyze/cache.py).
    model = tiny(ONNX_CACHE_3D, values={"Bv": np.zeros(4)} if init == "default" else None)
    groups = [g for g in find_groups(model).groups if g.unit.kind == "kv_group"]
    assert len(groups) == 2 and all(g.exact and g.unit.query_heads == 2 for g in groups)
    result = prune(model, 0.5, validate=False, price=False)
    masks = result.masks
    [j] = kv_gone(masks, d=2)
    feeds = {"x": x(1, 2, 8), "past_k": x(1, 2, 3, 2), "past_v": x(1, 2, 3, 2)}
    check_cache(model, result, feeds, ("past_k", "past_v"), [1 - j])
    assert dead(masks["Wq"], 1) == blocks(range(2 * j, 2 * j + 2), 2)
    assert dead(masks["Wk"], 1) == dead(masks["Wv"], 1) == dead(masks["Bv"], 0) == blocks([j], 2)
    s = shapes(result.model)
    assert s["Wq"] == (8, 4) and s["Wk"] == s["Wv"] == (8, 2) and s["Bv"] == (2,) and s["Wo"] == (4, 8)
    a = attrs(result.model, "Attention")
    assert a["q_num_heads"] == 2 and a["kv_num_heads"] == 1
    assert result.shrink.before.params - result.shrink.after.params == 8 * 4 + 2 * 8 * 2 + 2 + 4 * 8
    assert [c.text() for c in result.shrink.interface_changes] == [
        "input past_k [1,2,3,2] -> [1,1,3,2]",
        "input past_v [1,2,3,2] -> [1,1,3,2]",
        "output pk [1,2,5,2] -> [1,1,5,2]",
        "output pv [1,2,5,2] -> [1,1,5,2]",
    ]


ONNX_CACHE_4D = """<ir_version: 10, opset_import: ["" : 23]>
g (float[1, 2, 8] x, float[1, 2, 3, 2] past_k, float[1, 2, 3, 2] past_v, float[8, 8] Wq, float[8, 4] Wk, float[8, 4] Wv, float[8, 8] Wo) => (float[1, 2, 8] y, float[1, 2, 5, 2] pk, float[1, 2, 5, 2] pv) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  qs = Constant <value = int64[4] {1, 2, 4, 2}> ()
  ks = Constant <value = int64[4] {1, 2, 2, 2}> ()
  back = Constant <value = int64[3] {1, 2, 8}> ()
  q4 = Reshape (q, qs)
  k4 = Reshape (k, ks)
  v4 = Reshape (v, ks)
  qt = Transpose <perm = [0, 2, 1, 3]> (q4)
  kt = Transpose <perm = [0, 2, 1, 3]> (k4)
  vt = Transpose <perm = [0, 2, 1, 3]> (v4)
  a, pk, pv = Attention (qt, kt, vt, , past_k, past_v)
  at = Transpose <perm = [0, 2, 1, 3]> (a)
  a3 = Reshape (at, back)
  y = MatMul (a3, Wo)
}"""


def test_onnx_attention_4d_a_kv_cache_in_the_interface_goes_with_its_groups():
    model = tiny(ONNX_CACHE_4D)
    groups = [g for g in find_groups(model).groups if g.unit.kind == "kv_group"]
    assert len(groups) == 2 and all(g.exact and g.unit.query_heads == 2 for g in groups)
    result = prune(model, 0.5, validate=False, price=False)
    [j] = kv_gone(result.masks, d=2)
    feeds = {"x": x(1, 2, 8), "past_k": x(1, 2, 3, 2), "past_v": x(1, 2, 3, 2)}
    check_cache(model, result, feeds, ("past_k", "past_v"), [1 - j])
    assert dead(result.masks["Wk"], 1) == dead(result.masks["Wv"], 1) == blocks([j], 2)
    s = shapes(result.model)
    assert s["Wq"] == (8, 4) and s["Wk"] == s["Wv"] == (8, 2) and s["Wo"] == (4, 8)
    assert result.shrink.before.params - result.shrink.after.params == 8 * 4 + 2 * 8 * 2 + 4 * 8
    assert [c.text() for c in result.shrink.interface_changes][::2] == [
        "input past_k [1,2,3,2] -> [1,1,3,2]",
        "output pk [1,2,5,2] -> [1,1,5,2]",
    ]


@pytest.mark.parametrize("init", ["random", "default"])
def test_group_query_attention_a_head_sink_goes_with_its_heads(init):
    # head_sink [num_heads] (one softmax sink a query head, onnxruntime's GQA input 11): a
    # query head's value goes with it, and the sinks of its K/V group's heads with the group
    text = GQA.replace("int32 total)", "int32 total, float[4] Sink)").replace(
        "(q, k, v, , , seqlens, total)", "(q, k, v, , , seqlens, total, , , , , Sink)"
    )
    model = tiny(text, values={"Sink": np.zeros(4)} if init == "default" else None)
    groups = [g for g in find_groups(model).groups if g.unit.kind == "kv_group"]
    assert len(groups) == 2 and all(g.exact for g in groups)
    assert {g.params for g in groups} == {16 * 16 + 2 * 16 * 8 + 16 * 16 + 2}
    result, masks = pruned(model, {"x": x(1, 5, 16), **GQA_FEEDS})
    [j] = kv_gone(masks)
    assert dead(masks["Sink"], 0) == [2 * j, 2 * j + 1]
    s = shapes(result.model)
    assert s["Sink"] == (2,) and s["Wq"] == (16, 16) and s["Wk"] == s["Wv"] == (16, 8)
    assert result.shrink.before.params - result.shrink.after.params == 16 * 16 + 2 * 16 * 8 + 16 * 16 + 2
    assert {k: v for k, v in attrs(result.model, "GroupQueryAttention").items() if "heads" in k} == {
        "num_heads": 2,
        "kv_num_heads": 1,
    }


def test_group_query_attention_a_head_sink_on_query_ranks():
    # Masks on query heads 1 and 3 (rank 1 of both groups): their sinks go, the K/V heads stay
    text = GQA.replace("int32 total)", "int32 total, float[4] Sink)").replace(
        "(q, k, v, , , seqlens, total)", "(q, k, v, , , seqlens, total, , , , , Sink)"
    )
    model = tiny(text, zero={"Wo": np.s_[[*range(8, 16), *range(24, 32)]]})
    result = shrink(model, validate=False)
    s = shapes(result.model)
    assert s["Sink"] == (2,) and s["Wq"] == (16, 16) and s["Wk"] == (16, 16)
    got_sink = onnx.numpy_helper.to_array(next(t for t in result.model.graph.initializer if t.name == "Sink"))
    want_sink = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "Sink"))[[0, 2]]
    assert np.array_equal(got_sink, want_sink)
    feeds = {"x": x(1, 5, 16), **GQA_FEEDS}
    for want, got in zip(run(model, feeds), run(result.model, feeds), strict=True):
        assert np.abs(want - got).max() <= 1e-5 * np.abs(want).max()


# ------------------------------------------------------------------ MultiHeadAttention, packed
def unpacked(model: onnx.ModelProto, slot: int, parts: int) -> onnx.ModelProto:
    """The model with MultiHeadAttention's packed input `slot` ([B, S, heads, parts, d]: QKV in
    the query, KV in the key) given as its 3-D parts, [B, S, heads * d] each (the spec's layout),
    which onnxruntime's CPU kernel runs (it has no packed forms): both sides of a comparison are
    made so here, the same way."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    [k] = [i for i, n in enumerate(g.node) if n.op_type == "MultiHeadAttention"]
    node = g.node[k]
    packed = node.input[slot]
    g.initializer.append(onnx.numpy_helper.from_array(np.array([0, 0, -1], np.int64), "flat3"))
    made, names = [], []
    for p in range(parts):
        g.initializer.append(onnx.numpy_helper.from_array(np.array(p, np.int64), f"part{p}"))
        made.append(onnx.helper.make_node("Gather", [packed, f"part{p}"], [f"{packed}_{p}4"], axis=3))
        made.append(onnx.helper.make_node("Reshape", [f"{packed}_{p}4", "flat3"], [f"{packed}_{p}"]))
        names.append(f"{packed}_{p}")
    inputs = list(node.input) + [""] * (3 - len(node.input))
    inputs[slot : slot + parts] = names
    node.ClearField("input")
    node.input.extend(inputs)
    for n in reversed(made):
        g.node.insert(k, n)
    return out


MHA_QKV5 = MS + """
g (float[1, 5, 8] x, float[8, 24] W, float[24] B, float[8, 8] Wo) => (float[1, 5, 8] y) {
  p = MatMul (x, W)
  s5 = Constant <value = int64[5] {1, 5, 4, 3, 2}> ()
  qkv = Reshape (p, s5)
  a = com.microsoft.MultiHeadAttention <num_heads = 4> (qkv, , , B)
  y = MatMul (a, Wo)
}"""


@pytest.mark.parametrize("init", ["random", "default"])
def test_multihead_attention_packed_qkv_heads_are_its_axis_2(init):
    # W's columns are [heads, Q K V, d]: head h's are 6h .. 6h + 5; B is Q | K | V, each [heads, d]
    model = tiny(MHA_QKV5, values={"B": np.zeros(24)} if init == "default" else None)
    heads = assert_head_units(model, 4, head_dim=2)
    assert {g.params for g in heads} == {8 * 6 + 6 + 2 * 8}
    result = prune(model, 0.5, validate=False, price=False)
    masks = result.masks
    gone = gone_heads(masks["Wo"], 2)
    assert len(gone) == 2 and dead(masks["Wo"], 0) == blocks(gone, 2)
    assert dead(masks["W"], 1) == blocks(gone, 6)
    assert dead(masks["B"], 0) == sorted(blocks(gone, 2) + blocks(gone, 2, 8) + blocks(gone, 2, 16))
    feeds = {"x": x(1, 5, 8)}
    want = run(unpacked(zeroed(model, masks), 0, 3), feeds)[0]
    got = run(unpacked(result.model, 0, 3), feeds)[0]
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    s = shapes(result.model)
    assert s["W"] == (8, 12) and s["B"] == (12,) and s["Wo"] == (4, 8)
    assert attrs(result.model, "MultiHeadAttention")["num_heads"] == 2
    assert result.shrink.before.params - result.shrink.after.params == 2 * (8 * 6 + 6 + 2 * 8)


MHA_KV5 = MS + """
g (float[1, 5, 8] x, float[1, 3, 8] ctx, float[8, 8] Wq, float[8, 16] Wkv, float[8, 8] Wo) => (float[1, 5, 8] y) {
  q = MatMul (x, Wq)
  p = MatMul (ctx, Wkv)
  s5 = Constant <value = int64[5] {1, 3, 4, 2, 2}> ()
  kv = Reshape (p, s5)
  a = com.microsoft.MultiHeadAttention <num_heads = 4> (q, kv)
  y = MatMul (a, Wo)
}"""


def test_multihead_attention_packed_kv_heads_go_with_their_queries():
    model = tiny(MHA_KV5)
    assert_head_units(model, 4)
    result = prune(model, 0.5, validate=False, price=False)
    masks = result.masks
    gone = gone_heads(masks["Wo"], 2)
    assert len(gone) == 2
    assert dead(masks["Wq"], 1) == blocks(gone, 2) and dead(masks["Wkv"], 1) == blocks(gone, 4)
    feeds = {"x": x(1, 5, 8), "ctx": x(1, 3, 8)}
    want = run(unpacked(zeroed(model, masks), 1, 2), feeds)[0]
    got = run(unpacked(result.model, 1, 2), feeds)[0]
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    s = shapes(result.model)
    assert s["Wq"] == (8, 4) and s["Wkv"] == (8, 8) and s["Wo"] == (4, 8)
    assert attrs(result.model, "MultiHeadAttention")["num_heads"] == 2
    assert result.shrink.before.params - result.shrink.after.params == 2 * (8 * 2 + 8 * 4 + 2 * 8)


MHA_KV4 = MS + """
g (float[1, 5, 8] x, float[1, 3, 8] ctx, float[8, 8] Wq, float[8, 8] Wk, float[8, 8] Wv, float[8, 8] Wo) => (float[1, 5, 8] y) {
  q = MatMul (x, Wq)
  k = MatMul (ctx, Wk)
  v = MatMul (ctx, Wv)
  ks = Constant <value = int64[4] {1, 3, 4, 2}> ()
  k4 = Reshape (k, ks)
  v4 = Reshape (v, ks)
  kt = Transpose <perm = [0, 2, 1, 3]> (k4)
  vt = Transpose <perm = [0, 2, 1, 3]> (v4)
  a = com.microsoft.MultiHeadAttention <num_heads = 4> (q, kt, vt)
  y = MatMul (a, Wo)
}"""


def test_multihead_attention_keys_and_values_per_head_go_with_their_heads():
    # a cross-attention's keys and values given per head, [B, heads, L, d]
    model = tiny(MHA_KV4)
    assert_head_units(model, 4, head_dim=2)
    result, masks = pruned(model, {"x": x(1, 5, 8), "ctx": x(1, 3, 8)})
    gone = gone_heads(masks["Wo"], 2)
    assert len(gone) == 2 and dead(masks["Wo"], 0) == blocks(gone, 2)
    for w in ("Wq", "Wk", "Wv"):
        assert dead(masks[w], 1) == blocks(gone, 2)
    s = shapes(result.model)
    assert s["Wq"] == s["Wk"] == s["Wv"] == (8, 4) and s["Wo"] == (4, 8)
    assert attrs(result.model, "MultiHeadAttention")["num_heads"] == 2
    assert result.shrink.before.params - result.shrink.after.params == 2 * 4 * 2 * 8


def test_group_query_attention_a_quantized_caches_channel_scales_keep_every_head():
    # k_scale/v_scale per channel (a quantized cache): their layout is not read here, so no
    # K/V group can go; one scale for the whole cache leaves the groups as they are
    for size, exact in ((16, False), (1, True)):
        text = GQA.replace("int32 total)", f"int32 total, float[{size}] Ks, float[{size}] Vs)").replace(
            "(q, k, v, , , seqlens, total)", "(q, k, v, , , seqlens, total, , , , , , Ks, Vs)"
        )
        groups = [g for g in find_groups(tiny(text)).groups if g.unit.kind == "kv_group"]
        assert len(groups) == 2 and all(g.exact == exact for g in groups)
        if not exact:
            assert all("carries every head" in (g.reason or "") for g in groups)

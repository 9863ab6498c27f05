"""onnxruntime's fused transformer ops (ops/fused_activation.py, ops/fused_norm.py) and fused
attention (ops/attention.py): tiny graphs written with the contrib ops, and the zoo's
transformers passed through onnxruntime's transformer optimizer."""

import numpy as np
import onnx
import pytest
from conftest import export_cached, half_masked, params, shapes, shrink_checked, tiny

from models.transformers import TRANSFORMERS

MS = '<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>\n'

FFN = MS + """
g (float[1, 4, 8] x, float[8, 16] W1, float[16] B1, float[16, 8] W2, float[8] B2, float[8] G, float[8] Beta) => (float[1, 4, 8] y) {{
  h = MatMul (x, W1)
  a = com.microsoft.{act} (h, B1)
  d = MatMul (a, W2)
  y = com.microsoft.SkipLayerNormalization <epsilon = 1e-5> (d, x, G, Beta, B2)
}}"""
NEURONS = [1, 4, 6, 9, 12]
PER_NEURON = 8 + 1 + 8  # its W1 column, its bias, its W2 row


@pytest.mark.parametrize("act", ["BiasGelu", "FastGelu"])
def test_masked_ffn_neurons_go_through_the_fused_gelu_and_skip_layernorm(act):
    model = tiny(FFN.format(act=act), zero={"W1": np.s_[:, NEURONS], "B1": np.s_[NEURONS]})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (8, 11) and shapes(result.model)["W2"] == (11, 8)
    assert result.before.params - result.after.params == len(NEURONS) * PER_NEURON
    assert not result.barriers and not result.folds


@pytest.mark.parametrize("act", ["BiasGelu", "FastGelu"])
def test_a_neuron_with_its_bias_left_is_a_constant_folded_into_the_skip_layernorm_bias(act):
    model = tiny(FFN.format(act=act), zero={"W1": np.s_[:, NEURONS]})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (8, 11) and shapes(result.model)["B2"] == (8,)
    assert [(f.op, f.channels, f.into) for f in result.folds] == [("MatMul", 5, "bias")]
    assert result.after.params == result.before.params - len(NEURONS) * PER_NEURON  # no new Add
    assert [n.op_type for n in result.model.graph.node].count("Add") == 0


def test_skip_layernorm_without_a_bias_input_gets_one_for_the_fold():
    text = MS + """
    g (float[1, 4, 8] x, float[8, 16] W1, float[16] B1, float[16, 8] W2, float[8] G) => (float[1, 4, 8] y) {
      h = MatMul (x, W1)
      a = com.microsoft.FastGelu (h, B1)
      d = MatMul (a, W2)
      y = com.microsoft.SkipSimplifiedLayerNormalization <epsilon = 1e-5> (d, x, G)
    }"""
    result = shrink_checked(tiny(text, zero={"W1": np.s_[:, NEURONS]}))
    [sln] = [n for n in result.model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert len(sln.input) == 4 and sln.input[3]  # the folded constants became its bias
    assert result.after.params == result.before.params - len(NEURONS) * PER_NEURON + 8


@pytest.mark.parametrize(
    "node",
    [
        "a = com.microsoft.QuickGelu <alpha = 1.702> (h)",
        "a = com.microsoft.Gelu (h)",
        "a = com.microsoft.FastGelu (h)",
    ],
)
def test_other_fused_activations_are_elementwise(node):
    text = MS + f"""
    g (float[1, 4, 8] x, float[8, 16] W1, float[16] B1, float[16, 8] W2) => (float[1, 4, 8] y) {{
      h = MatMul (x, W1)
      {node}
      y = MatMul (a, W2)
    }}"""
    result = shrink_checked(tiny(text, zero={"W1": np.s_[:, NEURONS], "W2": np.s_[NEURONS]}))
    assert shapes(result.model)["W1"] == (8, 11) and shapes(result.model)["W2"] == (11, 8)
    assert not result.barriers


def test_bias_add_ties_its_operands():
    # onnxruntime has BiasAdd on CUDA only: the rule is checked on the analysis alone.
    from onnxshrink.testing import analyze_node

    bench = analyze_node(
        MS
        + """g (float[1, 4, 8] x, float[8, 16] W1, float[16] B1, float[8, 16] W2) => (float[1, 4, 16] y) {
          h = MatMul (x, W1)
          s = MatMul (x, W2)
          y = com.microsoft.BiasAdd (h, B1, s)
        }""",
        needs={"y": {2: [0, 5]}},
    )
    assert bench.kept("W1", 1) == bench.kept("B1", 0) == bench.kept("W2", 1) == [0, 5]
    assert bench.barriers == []


def test_simplified_layernorm_and_embed_layernorm_keep_the_hidden_axis_and_pass_the_rest():
    text = MS + """
    g (int32[1, 4] ids, float[20, 8] Tok, float[16, 8] Pos, float[8] G, float[8] Beta, float[8, 16] W1, float[16, 8] W2, float[8] S) => (float[1, 4, 8] y) {
      e, mask = com.microsoft.EmbedLayerNormalization <epsilon = 1e-5> (ids, , Tok, Pos, , G, Beta)
      h = MatMul (e, W1)
      r = Relu (h)
      d = MatMul (r, W2)
      y = com.microsoft.SimplifiedLayerNormalization <axis = -1, epsilon = 1e-5> (d, S)
    }"""
    model = tiny(text, zero={"W1": np.s_[:, NEURONS]})
    # onnxruntime's optimizer writes it in the ONNX domain (which onnx's checker refuses)
    [node] = [n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization"]
    node.domain = ""
    # the ids index the tables: keep them in range for the independent check
    result = shrink_checked(model, input_shapes={"ids": [1, 4]})
    assert shapes(result.model)["W1"] == (8, 11) and shapes(result.model)["Tok"] == (20, 8)
    assert not result.barriers


# ------------------------------------------------------------------ fused attention, tiny
ATTN = MS + """
g (float[1, 5, 8] x, float[8, 24] W, float[24] B, float[8, 8] Wo) => (float[1, 5, 8] y) {
  a = com.microsoft.Attention <num_heads = 4> (x, W, B)
  y = MatMul (a, Wo)
}"""


def head_cols(heads, d=2, hidden=8):
    return [s * hidden + h * d + j for s in range(3) for h in heads for j in range(d)]


def test_contrib_attention_heads_whose_output_columns_are_masked_go():
    model = tiny(ATTN, zero={"Wo": np.s_[[2, 3, 6, 7]]})  # heads 1 and 3 (head_dim 2)
    result = shrink_checked(model)
    assert shapes(result.model)["W"] == (8, 12) and shapes(result.model)["Wo"] == (4, 8)
    [attn] = [n for n in result.model.graph.node if n.op_type == "Attention"]
    assert onnx.helper.get_attribute_value(attn.attribute[0]) == 2


def test_contrib_attention_a_head_with_zero_values_is_zero_and_goes():
    v = [16 + 2, 16 + 3]  # head 1's V columns
    result = shrink_checked(tiny(ATTN, zero={"W": np.s_[:, v], "B": np.s_[v]}))
    assert shapes(result.model)["W"] == (8, 18) and shapes(result.model)["Wo"] == (6, 8)


def test_contrib_attention_a_head_masked_in_q_only_stays():
    q = [2, 3]
    result = shrink_checked(tiny(ATTN, zero={"W": np.s_[:, q], "B": np.s_[q]}))
    assert result.after.params == result.before.params
    assert not result.barriers


def test_contrib_attention_with_a_past_input_keeps_every_head():
    text = MS + """
    g (float[1, 5, 8] x, float[2, 1, 4, 3, 2] past, float[8, 24] W, float[24] B, float[8, 8] Wo) => (float[1, 5, 8] y, float[2, 1, 4, 8, 2] present) {
      a, present = com.microsoft.Attention <num_heads = 4> (x, W, B, , past)
      y = MatMul (a, Wo)
    }"""
    result = shrink_checked(tiny(text, zero={"Wo": np.s_[[2, 3]]}))
    assert shapes(result.model)["W"] == (8, 24)
    assert not result.barriers


MHA = MS + """
g (float[1, 5, 8] x, float[8, 8] Wq, float[8, 8] Wk, float[8, 8] Wv, float[24] B, float[8, 8] Wo) => (float[1, 5, 8] y) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  a = com.microsoft.MultiHeadAttention <num_heads = 4> (q, k, v, B)
  y = MatMul (a, Wo)
}"""


def test_multihead_attention_heads_go_with_their_projections_and_bias():
    result = shrink_checked(tiny(MHA, zero={"Wo": np.s_[[0, 1, 6, 7]]}))  # heads 0 and 3
    s = shapes(result.model)
    assert s["Wq"] == s["Wk"] == s["Wv"] == (8, 4) and s["B"] == (12,) and s["Wo"] == (4, 8)
    [mha] = [n for n in result.model.graph.node if n.op_type == "MultiHeadAttention"]
    assert onnx.helper.get_attribute_value(mha.attribute[0]) == 2


GQA = MS + """
g (float[1, 5, 16] x, float[16, 32] Wq, float[16, 16] Wk, float[16, 16] Wv, float[32, 16] Wo, int32[1] seqlens, int32 total) => (float[1, 5, 16] y) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  a, pk, pv = com.microsoft.GroupQueryAttention <num_heads = 4, kv_num_heads = 2> (q, k, v, , , seqlens, total)
  y = MatMul (a, Wo)
}"""


def gqa_feeds():
    return {"seqlens": np.array([4], np.int32), "total": np.array(5, np.int32)}


def test_group_query_attention_a_kv_head_goes_with_its_query_heads():
    from conftest import run

    from onnxshrink import shrink

    # K/V head 1 serves query heads 2 and 3 (rep 2, head_dim 8): their output rows masked.
    model = tiny(GQA, zero={"Wo": np.s_[16:32]})
    result = shrink(model, validate=False)
    s = shapes(result.model)
    assert s["Wq"] == (16, 16) and s["Wk"] == s["Wv"] == (16, 8) and s["Wo"] == (16, 16)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 5, 16)).astype(np.float32), **gqa_feeds()}
    [a], [b] = run(model, feeds), run(result.model, feeds)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    [node] = [n for n in result.model.graph.node if n.op_type == "GroupQueryAttention"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["num_heads"] == 2 and attrs["kv_num_heads"] == 1


def test_group_query_attention_query_heads_go_by_rank_in_every_group():
    from conftest import run

    from onnxshrink import shrink

    # Query rank 1 of both groups (heads 1 and 3) masked: each K/V head keeps one query head.
    model = tiny(GQA, zero={"Wo": np.s_[[*range(8, 16), *range(24, 32)]]})
    result = shrink(model, validate=False)
    s = shapes(result.model)
    assert s["Wq"] == (16, 16) and s["Wk"] == s["Wv"] == (16, 16)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 5, 16)).astype(np.float32), **gqa_feeds()}
    [a], [b] = run(model, feeds), run(result.model, feeds)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    # Only query head 1 masked: head 3 shares its rank with a live head, so both ranks stay.
    model = tiny(GQA, zero={"Wo": np.s_[8:16]})
    assert shapes(shrink(model, validate=False).model)["Wq"] == (16, 32)


ONNX_ATTN = """<ir_version: 10, opset_import: ["" : 23]>
g (float[1, 5, 8] x, float[8, 8] Wq, float[8, 4] Wk, float[8, 4] Wv, float[8, 8] Wo) => (float[1, 5, 8] y) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  a = Attention <q_num_heads = 4, kv_num_heads = 2> (q, k, v)
  y = MatMul (a, Wo)
}"""


def test_onnx_attention_3d_form_rewrites_its_head_counts():
    result = shrink_checked(tiny(ONNX_ATTN, zero={"Wo": np.s_[[4, 5, 6, 7]]}))
    s = shapes(result.model)
    assert s["Wq"] == (8, 4) and s["Wk"] == s["Wv"] == (8, 2) and s["Wo"] == (4, 8)


ONNX_ATTN_4D = """<ir_version: 10, opset_import: ["" : 23]>
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


def test_onnx_attention_4d_form_heads_are_an_axis():
    # head 2's V masked (zero output, absorbed) and head 0's output columns masked
    model = tiny(ONNX_ATTN_4D, zero={"Wv": np.s_[:, [4, 5]], "Wo": np.s_[[0, 1]]})
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Wq"] == s["Wk"] == s["Wv"] == (8, 4) and s["Wo"] == (4, 8)
    assert not result.barriers


# ------------------------------------------------------------------ optimized zoo transformers
def optimized(zoo_dir, name: str, which: str, model_type: str):
    """The zoo transformer (half its heads and FFN neurons masked, or natively built with the
    rest), exported and passed through onnxruntime's transformer optimizer (its fusions only)."""
    from onnxruntime.transformers.optimizer import optimize_model

    build = half_masked(TRANSFORMERS[name], which)
    path = export_cached(zoo_dir, ("tf", name, which, ()), build)
    out = path.with_name(path.stem + "_ortopt.onnx")
    if not out.exists():
        opt = optimize_model(str(path), model_type=model_type, num_heads=4, hidden_size=32, opt_level=0)
        opt.save_model_to_file(str(out))
    return out


@pytest.mark.parametrize("name, model_type, fused", [
    ("bert", "bert", {"SkipLayerNormalization", "BiasGelu"}),
    ("gpt", "gpt2", {"SkipLayerNormalization", "BiasGelu"}),
    ("vit", "vit", {"SkipLayerNormalization", "BiasGelu", "Attention"}),
])  # fmt: skip
def test_optimized_zoo_transformers_reach_the_optimized_native_size(zoo_dir, name, model_type, fused):
    masked = optimized(zoo_dir, name, "masked", model_type)
    native = optimized(zoo_dir, name, "native", model_type)
    model = onnx.load(masked)
    assert fused <= {n.op_type for n in model.graph.node if n.domain == "com.microsoft"}
    result = shrink_checked(masked)
    assert params(result.model) == result.after.params == params(onnx.load(native))
    assert result.after.params < 0.7 * result.before.params
    assert not result.barriers and not result.kept_zeroed


ROTARY_MHA = MS + """
g (float[1, 5, 16] x, float[16, 32] Wq, float[16, 32] Wk, float[16, 32] Wv, float[32, 16] Wo, float[8, 4] Cos, float[8, 4] Sin, int64[1, 5] Pos) => (float[1, 5, 16] y) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  qr = com.microsoft.RotaryEmbedding <num_heads = 4> (q, Pos, Cos, Sin)
  kr = com.microsoft.RotaryEmbedding <num_heads = 4> (k, Pos, Cos, Sin)
  a = com.microsoft.MultiHeadAttention <num_heads = 4> (qr, kr, v)
  y = MatMul (a, Wo)
}"""


def test_rotary_embeddings_pass_whole_heads_and_rewrite_num_heads():
    angles = np.arange(8)[:, None] * (1.0 / 10000 ** (np.arange(4) / 4))[None, :]
    values = {"Cos": np.cos(angles), "Sin": np.sin(angles), "Pos": np.arange(5)}
    result = shrink_checked(tiny(ROTARY_MHA, zero={"Wo": np.s_[8:24]}, values=values))  # heads 1, 2
    s = shapes(result.model)
    assert s["Wq"] == s["Wk"] == s["Wv"] == (16, 16) and s["Wo"] == (16, 16)
    heads = [
        {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["num_heads"]
        for n in result.model.graph.node
        if n.op_type in ("RotaryEmbedding", "MultiHeadAttention")
    ]
    assert heads == [2, 2, 2] and not result.barriers


GQA_PAST = MS + """
g (float[1, 1, 16] x, float[1, 2, 4, 8] past_k, float[1, 2, 4, 8] past_v, float[16, 32] Wq, float[16, 16] Wk, float[16, 16] Wv, float[32, 16] Wo, int32[1] seqlens, int32 total) => (float[1, 1, 16] y, float[1, 2, 5, 8] pk, float[1, 2, 5, 8] pv) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  a, pk, pv = com.microsoft.GroupQueryAttention <num_heads = 4, kv_num_heads = 2> (q, k, v, past_k, past_v, seqlens, total)
  y = MatMul (a, Wo)
}"""


def test_group_query_attention_with_a_kv_cache_keeps_every_head_and_runs():
    from conftest import run

    from onnxshrink import shrink

    model = tiny(GQA_PAST, zero={"Wo": np.s_[16:32]})
    result = shrink(model, validate=False)
    assert shapes(result.model)["Wq"] == (16, 32) and not result.barriers
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((1, 1, 16)).astype(np.float32),
        "past_k": rng.standard_normal((1, 2, 4, 8)).astype(np.float32),
        "past_v": rng.standard_normal((1, 2, 4, 8)).astype(np.float32),
        "seqlens": np.array([4], np.int32),
        "total": np.array(5, np.int32),
    }
    for a, b in zip(run(model, feeds), run(result.model, feeds), strict=True):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def test_a_query_other_readers_keep_partly_keeps_whole_heads():
    # q is read by the attention (which needs heads 0 and 3) and by a MatMul reading only
    # dims 2 and 3 (head 1): head 1 stays whole, its layout intact.
    text = MS + """
    g (float[1, 5, 8] x, float[8, 8] Wq, float[8, 8] Wk, float[8, 8] Wv, float[24] B, float[8, 8] Wo, float[8, 3] U) => (float[1, 5, 8] y, float[1, 5, 3] z) {
      q = MatMul (x, Wq)
      k = MatMul (x, Wk)
      v = MatMul (x, Wv)
      a = com.microsoft.MultiHeadAttention <num_heads = 4> (q, k, v, B)
      y = MatMul (a, Wo)
      z = MatMul (q, U)
    }"""
    u_rows = [0, 1, 4, 5, 6, 7]  # U reads q's dims 2 and 3 only
    result = shrink_checked(tiny(text, zero={"Wo": np.s_[[2, 3, 4, 5]], "U": np.s_[u_rows]}))
    s = shapes(result.model)
    assert s["Wq"] == (8, 6) and s["Wk"] == s["Wv"] == (8, 6) and s["Wo"] == (6, 8)


@pytest.mark.parametrize("heads_axis, mask", [(1, (1, 1, 5, 5)), (4, (1, 2, 5, 5))])
def test_onnx_attention_a_mask_with_a_head_axis_loses_the_removed_heads_slices(heads_axis, mask):
    text = ONNX_ATTN_4D.replace("float[8, 8] Wo)", f"float[8, 8] Wo, float[1, {heads_axis}, 5, 5] M)")
    text = text.replace("Attention <is_causal = 1> (qt, kt, vt)", "Attention (qt, kt, vt, M)")
    result = shrink_checked(tiny(text, zero={"Wv": np.s_[:, [4, 5]], "Wo": np.s_[[0, 1]]}))
    assert shapes(result.model)["Wq"] == (8, 4) and shapes(result.model)["M"] == mask
    assert not result.barriers

"""KV-cache decoders (analyze/cache.py): a cache input and the output that extends it lose the heads
that go, as one state; the report lists every input and output whose shape changed; the runtimes'
configs beside the input are written again beside the output (runtime_config.py).

Each shrunk model is checked here with validation off, in onnxruntime, against the model as given
(its zeros are the masks): the reference is fed the whole cache (random values in the removed
heads too), the shrunk model the kept heads, and their outputs compared on the kept heads."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import tiny
from onnx import helper

from onnxshrink import shrink
from onnxshrink.report import interface_changes
from onnxshrink.runtime_config import count

# One attention over 3 heads of 4 (hidden 12) with a key cache: present = Concat(past, k) along
# the sequence; the cache is both keys and values. x[b, s, 12], past[b, 3, p, 4].
ATTENTION = """
  {p}q0 = MatMul({x}, Wq{w})
  {p}q1 = Reshape({p}q0, shape4)
  {p}q = Transpose<perm=[0,2,1,3]>({p}q1)
  {p}k0 = MatMul({x}, Wk{w})
  {p}k1 = Reshape({p}k0, shape4)
  {p}k = Transpose<perm=[0,2,1,3]>({p}k1)
  {present} = Concat<axis=2>({past}, {p}k)
  {p}kt = Transpose<perm=[0,1,3,2]>({present})
  {p}s = MatMul({p}q, {p}kt)
  {p}sm = Softmax<axis=-1>({p}s)
  {p}a = MatMul({p}sm, {present})
  {p}a1 = Transpose<perm=[0,2,1,3]>({p}a)
  {p}a2 = Reshape({p}a1, shape3)
  {y} = MatMul({p}a2, Wo{w})
"""


def attention(present: str, past: str, y: str, p: str = "", x: str = "x", w: str = "") -> str:
    """The attention's nodes, its tensors named with prefix `p`, its weights with suffix `w`."""
    return ATTENTION.format(present=present, past=past, y=y, p=p, x=x, w=w)


SHAPES = """
  shape4 = Constant<value=int64[4] {0, 0, 3, 4}>()
  shape3 = Constant<value=int64[3] {0, 0, 12}>()
"""
CACHE = (
    "g (float[B,S,12] x, float[B,3,P,4] past, float[12,12] Wq, float[12,12] Wk, float[12,12] Wo)"
    " => (float[B,S,12] y, float[B,3,T,4] present) {"
    + SHAPES
    + attention("present", "past", "y")
    + "}"
)
# Head 1 goes: its query and key columns, and its rows of the output projection.
HEAD1 = {"Wq": np.s_[:, 4:8], "Wk": np.s_[:, 4:8], "Wo": np.s_[4:8, :]}


def run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {k: v for k, v in feed.items() if k in names})


def dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in vi.type.tensor_type.shape.dim]


def check_kept_head(
    model: onnx.ModelProto, shrunk: onnx.ModelProto, extra: dict | None = None, reads_past: bool = True
) -> None:
    """Outputs of the shrunk model fed heads 0 and 2 of a random cache = the model's fed the
    whole one."""
    rng = np.random.default_rng(7)
    for past_len in (0, 3):
        x = rng.standard_normal((2, 5, 12)).astype(np.float32)
        past = rng.standard_normal((2, 3, past_len, 4)).astype(np.float32)
        ref = run(model, {"x": x, "past": past, **(extra or {})})
        got = run(shrunk, {"x": x, "past": past[:, [0, 2]], **(extra or {})})
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], ref[1][:, [0, 2]], rtol=1e-5, atol=1e-6)
        assert got[1].shape == (2, 2, past_len * reads_past + 5, 4)


def test_cache_loses_the_heads_that_go():
    model = tiny(CACHE, zero=HEAD1)
    result = shrink(model, validate=False)
    shrunk = result.model
    assert dims(shrunk.graph.input[1]) == ["B", 2, "P", 4]
    assert dims(shrunk.graph.output[1]) == ["B", 2, "T", 4]
    sizes = {t.name: list(t.dims) for t in shrunk.graph.initializer}
    assert sizes["Wq"] == [12, 8] and sizes["Wk"] == [12, 8] and sizes["Wo"] == [8, 12]
    check_kept_head(model, shrunk)
    assert [c.text() for c in result.interface_changes] == [
        "input past [B,3,P,4] -> [B,2,P,4]",
        "output present [B,3,T,4] -> [B,2,T,4]",
    ]
    report = result.to_dict()["interface_changes"]
    assert report == [
        {"name": "past", "kind": "input", "before": ["B", 3, "P", 4], "after": ["B", 2, "P", 4]},
        {"name": "present", "kind": "output", "before": ["B", 3, "T", 4], "after": ["B", 2, "T", 4]},
    ]


def test_the_proof_feeds_the_kept_heads():
    """With validation on, the proof runs the reference on the whole cache and compares it with
    the shrunk model on the kept heads (and passes)."""
    result = shrink(tiny(CACHE, zero=HEAD1, seed=3), input_shapes={"x": [2, 5, 12], "past": [2, 3, 3, 4]})
    assert result.passed and result.validation is not None
    assert {o.name for o in result.validation.outputs} == {"y", "present"}
    assert dims(result.model.graph.input[1]) == ["B", 2, "P", 4]


def test_merged_decoder_if_branches():
    """optimum's merged decoder: an If choosing the with-cache branch (present = Concat(past, k))
    or the first-token branch (present = k, past not read)."""
    no_past = attention("c2", "past", "y2", p="e").replace("c2 = Concat<axis=2>(past, ek)", "c2 = Identity(ek)")
    text = (
        "g (bool use_cache, float[B,S,12] x, float[B,3,P,4] past, float[12,12] Wq, float[12,12] Wk,"
        " float[12,12] Wo) => (float[B,S,12] y, float[B,3,T,4] present) {"
        + SHAPES
        + "  y, present = If(use_cache) <then_branch = g1 () => (float[B,S,12] y1, float[B,3,T,4] c1) {"
        + attention("c1", "past", "y1", p="t")
        + "}, else_branch = g2 () => (float[B,S,12] y2, float[B,3,T,4] c2) {"
        + no_past
        + "}>\n}"
    )
    model = tiny(text, zero=HEAD1)
    result = shrink(model, validate=False)
    shrunk = result.model
    assert dims(shrunk.graph.input[2]) == ["B", 2, "P", 4]
    assert dims(shrunk.graph.output[1]) == ["B", 2, "T", 4]
    for use_cache in (True, False):
        check_kept_head(model, shrunk, {"use_cache": np.array(use_cache)}, reads_past=use_cache)
    assert [c.name for c in result.interface_changes] == ["past", "present"]


def test_an_output_not_extending_an_input_keeps_its_heads():
    """present = Concat(k, past): not the input extended (the input is not first), so no state
    pair: the interface keeps every head (the zeroed ones stay), and nothing changes shape."""
    text = CACHE.replace("present = Concat<axis=2>(past, k)", "present = Concat<axis=2>(k, past)")
    result = shrink(tiny(text, zero=HEAD1), validate=False)
    assert dims(result.model.graph.input[1]) == ["B", 3, "P", 4]
    assert result.interface_changes == []
    sizes = {t.name: list(t.dims) for t in result.model.graph.initializer}
    assert sizes["Wk"] == [12, 12]


def test_interface_changes_of_a_shrink_without_states_is_empty():
    model = tiny(
        "g (float[1,4] x, float[4,6] W, float[6,3] V) => (float[1,3] y) { h = MatMul(x, W) y = MatMul(h, V) }",
        zero={"W": np.s_[:, :2]},
    )
    result = shrink(model, validate=False)
    assert result.after.params == 4 * 4 + 4 * 3
    assert interface_changes(model, result.model) == []
    assert result.to_dict()["interface_changes"] == []


# ---------------------------------------------------------------------- runtime configs
def save(model: onnx.ModelProto, folder, configs: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder.parent / "out").mkdir(exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(model, path)
    for name, content in configs.items():
        (folder / name).write_text(json.dumps(content))
    return str(path)


HF_CONFIG = {"model_type": "llama", "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 4, "hidden_size": 12}
GENAI_CONFIG = {
    "model": {
        "decoder": {"num_attention_heads": 3, "num_key_value_heads": 3, "head_size": 4, "hidden_size": 12},
        "type": "llama",
    },
    "search": {"max_length": 32},
}


def test_counted_in_the_graph():
    """Heads, KV heads and head size counted in the graph, before and after."""
    model = tiny(CACHE, zero=HEAD1)
    before = count(model)
    assert before.values["heads"] == 3 and before.values["kv_heads"] == 3 and before.values["head_dim"] == 4
    after = count(shrink(model, validate=False).model)
    assert after.values["heads"] == 2 and after.values["kv_heads"] == 2 and after.values["head_dim"] == 4
    assert "hidden" not in after.values  # no embedding: x is a graph input


def test_configs_written_beside_the_output(tmp_path):
    path = save(tiny(CACHE, zero=HEAD1), tmp_path / "in", {"config.json": HF_CONFIG, "genai_config.json": GENAI_CONFIG})
    before_in = {p.name: p.read_bytes() for p in (tmp_path / "in").iterdir()}
    result = shrink(path, output=tmp_path / "out" / "model.onnx", validate=False)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf == {**HF_CONFIG, "num_attention_heads": 2, "num_key_value_heads": 2}
    genai = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert genai["model"]["decoder"] == {"num_attention_heads": 2, "num_key_value_heads": 2, "head_size": 4, "hidden_size": 12}
    assert genai["search"] == {"max_length": 32}
    assert {p.name: p.read_bytes() for p in (tmp_path / "in").iterdir()} == before_in  # never overwritten
    notes = {n["file"]: n for n in result.to_dict()["runtime_configs"]}
    assert notes["config.json"]["written"] and notes["config.json"]["changed"] == {
        "num_attention_heads": [3, 2],
        "num_key_value_heads": [3, 2],
    }
    assert str(tmp_path / "out" / "config.json") in result.written


def test_head_dim_written_when_the_config_derives_it(tmp_path):
    """A config without head_dim: transformers would take hidden_size // num_attention_heads (6),
    so the head size counted in the graph (4) is written."""
    config = {k: v for k, v in HF_CONFIG.items() if k != "head_dim"}
    path = save(tiny(CACHE, zero=HEAD1), tmp_path / "in", {"config.json": config})
    shrink(path, output=tmp_path / "out" / "model.onnx", validate=False)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["head_dim"] == 4 and hf["num_attention_heads"] == 2


def test_config_that_does_not_match_the_graph_is_not_written(tmp_path):
    """The config says 4 heads, the graph holds 3: its field is not what was counted."""
    path = save(tiny(CACHE, zero=HEAD1), tmp_path / "in", {"config.json": {**HF_CONFIG, "num_attention_heads": 4}})
    result = shrink(path, output=tmp_path / "out" / "model.onnx", validate=False)
    assert not (tmp_path / "out" / "config.json").exists()
    (note,) = result.runtime_configs
    assert not note["written"]
    assert "num_attention_heads: the config says 4, the input's graph holds 3" in note["text"]


def test_config_not_written_over_the_input(tmp_path):
    path = save(tiny(CACHE, zero=HEAD1), tmp_path / "in", {"config.json": HF_CONFIG})
    result = shrink(path, output=tmp_path / "in" / "small.onnx", validate=False)
    assert json.loads((tmp_path / "in" / "config.json").read_text()) == HF_CONFIG
    (note,) = result.runtime_configs
    assert not note["written"] and "same folder" in note["text"]


def test_uneven_layers_not_written(tmp_path):
    """Two attentions, one losing a head: a config holds one head count."""
    second = attention("present2", "past2", "y2", p="b", x="y", w="2")
    text = (
        "g (float[B,S,12] x, float[B,3,P,4] past, float[B,3,P,4] past2, float[12,12] Wq, float[12,12] Wk,"
        " float[12,12] Wo, float[12,12] Wq2, float[12,12] Wk2, float[12,12] Wo2)"
        " => (float[B,S,12] y2, float[B,3,T,4] present, float[B,3,T,4] present2) {"
        + SHAPES
        + attention("present", "past", "y")
        + second
        + "}"
    )
    path = save(tiny(text, zero=HEAD1), tmp_path / "in", {"config.json": HF_CONFIG})
    result = shrink(path, output=tmp_path / "out" / "model.onnx", validate=False)
    assert [c.name for c in result.interface_changes] == ["past", "present"]
    assert not (tmp_path / "out" / "config.json").exists()
    (note,) = result.runtime_configs
    assert "differs between layers in the shrunk model (2, 3)" in note["text"] or "(3, 2)" in note["text"]


@pytest.mark.parametrize("op", ["GroupQueryAttention"])
def test_fused_attention_heads_from_attributes(op):
    """A fused attention node's head counts are its attributes."""
    node = helper.make_node(op, ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=6, kv_num_heads=2)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 3, 24]) for n in "qkv"],
        [helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, [1, 3, 24])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    counts = count(model)
    assert counts.values == {"heads": 6, "kv_heads": 2}
    # a prune passes the groups it found: the fused node's attributes still count the heads
    assert count(model, groups=object()).values == {"heads": 6, "kv_heads": 2}


def test_onnx_attention_heads_from_attributes():
    """ONNX Attention's 3-D form counts its heads in q_num_heads and kv_num_heads."""
    node = helper.make_node("Attention", ["q", "k", "v"], ["o"], q_num_heads=6, kv_num_heads=2)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 3, w]) for n, w in zip("qkv", (24, 8, 8), strict=True)],
        [helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, [1, 3, 24])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    assert count(model).values == {"heads": 6, "kv_heads": 2}


def test_prune_removes_a_cached_head(tmp_path):
    """--prune on the cache model (random weights): one of 3 heads goes, from the weights and the
    cache; checked against the model with that head's slices zeroed here."""
    from onnxshrink.prune import prune

    model = tiny(CACHE, seed=5)
    result = prune(model, 0.3, units=["head"], validate=False, price=False)
    (removed,) = [result.groups.groups[i] for p in result.plans for i in p.removed]
    assert removed.unit.kind == "head"
    k_cols = next(m.indices for m in removed.members if m.initializer == "Wk")
    head = int(k_cols[0]) // 4
    assert sorted(int(i) for i in k_cols) == list(range(4 * head, 4 * head + 4))
    zeroed = onnx.ModelProto()
    zeroed.CopyFrom(model)
    for t in zeroed.graph.initializer:
        a = onnx.numpy_helper.to_array(t).copy()
        if t.name in ("Wq", "Wk"):
            a[:, 4 * head : 4 * head + 4] = 0
        elif t.name == "Wo":
            a[4 * head : 4 * head + 4, :] = 0
        t.CopyFrom(onnx.numpy_helper.from_array(a, t.name))
    kept = [h for h in range(3) if h != head]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 4, 12)).astype(np.float32)
    past = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    ref = run(zeroed, {"x": x, "past": past})
    got = run(result.model, {"x": x, "past": past[:, kept]})
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], ref[1][:, kept], rtol=1e-5, atol=1e-6)
    changes = result.to_dict()["shrink"]["interface_changes"]
    assert [(c["name"], c["before"][1], c["after"][1]) for c in changes] == [("past", 3, 2), ("present", 3, 2)]


def test_command_line_prints_and_reports_the_changes(tmp_path):
    from conftest import cli

    path = save(tiny(CACHE, zero=HEAD1), tmp_path / "in", {"config.json": HF_CONFIG})
    done = cli(path, "-o", tmp_path / "out" / "model.onnx", "--no-validate", "--report", tmp_path / "r.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = done.stdout + done.stderr
    assert "[W]     input past [B,3,P,4] -> [B,2,P,4]" in text
    assert "[W]     output present [B,3,T,4] -> [B,2,T,4]" in text
    assert f"[I] wrote {tmp_path / 'out' / 'config.json'}: num_attention_heads 3 -> 2, num_key_value_heads 3 -> 2" in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert [(c["name"], c["after"]) for c in report["interface_changes"]] == [
        ("past", ["B", 2, "P", 4]),
        ("present", ["B", 2, "T", 4]),
    ]
    assert report["runtime_configs"][0]["changed"] == {"num_attention_heads": [3, 2], "num_key_value_heads": [3, 2]}


# Grouped-query attention with the exporters' repeat_kv: 4 query heads over 2 KV heads of 4
# (hidden 16); the cached keys are repeated by Expand and a Reshape whose head count is computed
# from the cache's shape (Shape(present)[1] * 2), as torch's exports write it.
GQA = """
g (float[B,S,16] x, float[B,2,P,4] past, float[16,16] Wq, float[16,8] Wk, float[16,16] Wo)
  => (float[B,S,16] y, float[B,2,T,4] present) {
  shape_q = Constant<value=int64[4] {0, 0, 4, 4}>()
  shape_k = Constant<value=int64[4] {0, 0, 2, 4}>()
  shape_y = Constant<value=int64[3] {0, 0, 16}>()
  i0 = Constant<value=int64[1] {0}>()
  i1 = Constant<value=int64[1] {1}>()
  i2 = Constant<value=int64[1] {2}>()
  i3 = Constant<value=int64[1] {3}>()
  i4 = Constant<value=int64[1] {4}>()
  rep = Constant<value=int64[1] {2}>()
  q0 = MatMul(x, Wq)
  q1 = Reshape(q0, shape_q)
  q = Transpose<perm=[0,2,1,3]>(q1)
  k0 = MatMul(x, Wk)
  k1 = Reshape(k0, shape_k)
  k = Transpose<perm=[0,2,1,3]>(k1)
  present = Concat<axis=2>(past, k)
  sh = Shape(present)
  b = Slice(sh, i0, i1)
  h = Slice(sh, i1, i2)
  t = Slice(sh, i2, i3)
  d = Slice(sh, i3, i4)
  u = Unsqueeze(present, i2)
  target = Concat<axis=0>(b, h, rep, t, d)
  e = Expand(u, target)
  hq = Mul(h, rep)
  flat = Concat<axis=0>(b, hq, t, d)
  r = Reshape(e, flat)
  rt = Transpose<perm=[0,1,3,2]>(r)
  s = MatMul(q, rt)
  sm = Softmax<axis=-1>(s)
  a = MatMul(sm, r)
  a1 = Transpose<perm=[0,2,1,3]>(a)
  a2 = Reshape(a1, shape_y)
  y = MatMul(a2, Wo)
}
"""
# KV group 1: its key columns, its query heads 2 and 3, and their output-projection rows.
GROUP1 = {"Wk": np.s_[:, 4:8], "Wq": np.s_[:, 8:16], "Wo": np.s_[8:16, :]}


def test_gqa_repeat_kv_with_a_computed_head_count():
    model = tiny(GQA, zero=GROUP1)
    result = shrink(model, validate=False)
    shrunk = result.model
    sizes = {t.name: list(t.dims) for t in shrunk.graph.initializer if t.name.startswith("W")}
    assert sizes == {"Wq": [16, 8], "Wk": [16, 4], "Wo": [8, 16]}
    assert dims(shrunk.graph.input[1]) == ["B", 1, "P", 4]
    assert dims(shrunk.graph.output[1]) == ["B", 1, "T", 4]
    rng = np.random.default_rng(2)
    for past_len in (0, 4):
        x = rng.standard_normal((2, 3, 16)).astype(np.float32)
        past = rng.standard_normal((2, 2, past_len, 4)).astype(np.float32)
        ref = run(model, {"x": x, "past": past})
        got = run(shrunk, {"x": x, "past": past[:, [0]]})
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], ref[1][:, [0]], rtol=1e-5, atol=1e-6)
    before, after = count(model), count(shrunk)
    assert (before.values["heads"], before.values["kv_heads"]) == (4, 2)
    # one KV head left: its axis is no unit, the 2 query heads read it shared: not counted
    assert after.values["heads"] == 2 and "kv_heads" in after.unknown


def test_kv_heads_not_countable_not_written(tmp_path):
    """The shrunk GQA model's one KV head is no unit: num_key_value_heads cannot be counted, so
    the config is not written, and the note says why."""
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "hidden_size": 16}
    path = save(tiny(GQA, zero=GROUP1), tmp_path / "in", {"config.json": config})
    result = shrink(path, output=tmp_path / "out" / "model.onnx", validate=False)
    assert not (tmp_path / "out" / "config.json").exists()
    (note,) = result.runtime_configs
    assert "num_key_value_heads: not countable in the shrunk model" in note["text"]


# onnxruntime-genai's builder form: Q, K and V packed in one projection read by a
# GroupQueryAttention with a cache whose head size is a dim symbol, as the builder declares it
# ([batch, kv heads, past, kv_cache_dim]); the sequence lengths computed from the attention mask.
# 4 query heads over 2 K/V heads of 32 (onnxruntime's CPU kernel takes no head size under 16).
GENAI = """<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (float[batch,seq,16] x, int64[batch,total] mask, float[batch,2,past,kv_cache_dim] past_k,
   float[batch,2,past,kv_cache_dim] past_v, float[16,256] W, float[128,16] Wo)
  => (float[batch,seq,16] y, float[batch,2,total,kv_cache_dim] present_k, float[batch,2,total,kv_cache_dim] present_v) {
  one = Constant<value=int64[1] {1}>()
  one_ = Constant<value=int64 {1}>()
  summed = ReduceSum<keepdims=0>(mask, one)
  last = Sub(summed, one_)
  seqlens = Cast<to=6>(last)
  shape = Shape(mask)
  width = Gather<axis=0>(shape, one_)
  total_len = Cast<to=6>(width)
  qkv = MatMul(x, W)
  a, present_k, present_v = com.microsoft.GroupQueryAttention<num_heads=4, kv_num_heads=2>(qkv, , , past_k, past_v, seqlens, total_len)
  y = MatMul(a, Wo)
}
"""
# K/V group 1: query heads 2 and 3, K head 1, V head 1 of the packed projection; their rows of Wo.
GENAI_GROUP1 = {"W": np.s_[:, np.r_[64:128, 160:192, 224:256]], "Wo": np.s_[64:128, :]}


def test_a_packed_gqa_cache_of_a_symbolic_head_size_is_proven_at_its_head_size(tmp_path):
    """The proof draws the cache at the head size the query gives (32), not at the size chosen
    for other dynamic dims (16, which onnxruntime refuses): the shrink passes its proof, and
    runs as the input with the group zeroed, fed the whole cache, on the kept K/V head."""
    from onnxshrink.proof.inputs import resolve_shapes

    model = tiny(GENAI, zero=GENAI_GROUP1, seed=3)
    chosen = resolve_shapes(model, {})
    assert chosen["past_k"] == chosen["past_v"] == [2, 2, 16, 32]
    result = shrink(model, output=tmp_path / "small.onnx")
    assert result.validation is not None and result.validation.passed
    assert [(c.name, c.after) for c in result.interface_changes] == [
        ("past_k", ["batch", 1, "past", "kv_cache_dim"]),
        ("past_v", ["batch", 1, "past", "kv_cache_dim"]),
        ("present_k", ["batch", 1, "total", "kv_cache_dim"]),
        ("present_v", ["batch", 1, "total", "kv_cache_dim"]),
    ]
    shrunk = onnx.load(tmp_path / "small.onnx")
    assert {t.name: list(t.dims) for t in shrunk.graph.initializer if t.name.startswith("W")} == {
        "W": [16, 128],
        "Wo": [64, 16],
    }
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 3, 16)).astype(np.float32)
    past_k, past_v = (rng.standard_normal((1, 2, 5, 32)).astype(np.float32) for _ in range(2))
    mask = np.ones((1, 8), np.int64)
    ref = run(model, {"x": x, "mask": mask, "past_k": past_k, "past_v": past_v})
    got = run(shrunk, {"x": x, "mask": mask, "past_k": past_k[:, :1], "past_v": past_v[:, :1]})
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], ref[1][:, :1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], ref[2][:, :1], rtol=1e-5, atol=1e-6)


def test_the_past_of_a_multi_head_attention_takes_the_key_and_value_head_sizes():
    """MultiHeadAttention's past key and value: the query's head size (16 / 2 heads) and the
    value's (8 / 2), each its own dim symbol."""
    from onnxshrink.proof.inputs import resolve_shapes

    text = """<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
    g (float[batch,seq,16] x, float[batch,2,past,dk] past_k, float[batch,2,past,dv] past_v,
       float[16,16] Wq, float[16,16] Wk, float[16,8] Wv, float[8,16] Wo) => (float[batch,seq,16] y) {
      q = MatMul(x, Wq)
      k = MatMul(x, Wk)
      v = MatMul(x, Wv)
      a, pk, pv = com.microsoft.MultiHeadAttention<num_heads=2>(q, k, v, , , , past_k, past_v)
      y = MatMul(a, Wo)
    }
    """
    chosen = resolve_shapes(tiny(text), {})
    assert chosen["past_k"] == [2, 2, 16, 8]
    assert chosen["past_v"] == [2, 2, 16, 4]


def test_a_state_nothing_else_reads_keeps_one_head_of_its_output():
    """A second attention whose output nothing reads (a builder that wired the LM head to an
    earlier layer writes such): its cache is a state only its own present extends, so every
    index of its heads and head dims could go, but a graph output exists: it keeps one of each
    (index 0), the first proof passes, and the outputs are the model's (fed the whole cache) there."""
    text = (
        "g (float[B,S,12] x, float[B,3,P,4] past, float[B,3,P,4] past2, float[12,12] Wq, float[12,12] Wk,"
        " float[12,12] Wo, float[12,12] Wq2, float[12,12] Wk2, float[12,12] Wo2)"
        " => (float[B,S,12] y, float[B,3,T,4] present, float[B,3,T,4] present2) {"
        + SHAPES
        + attention("present", "past", "y")
        + attention("present2", "past2", "y2", p="b_", w="2")
        + "}"
    )
    model = tiny(text, seed=2)
    result = shrink(model)
    assert result.validation is not None and result.validation.passed
    assert not result.kept_after_failed_proof
    assert [(c.name, c.after) for c in result.interface_changes] == [
        ("past2", ["B", 1, "P", 1]),
        ("present2", ["B", 1, "T", 1]),
    ]
    sizes = {t.name: list(t.dims) for t in result.model.graph.initializer if t.name.startswith("W")}
    assert sizes == {"Wq": [12, 12], "Wk": [12, 12], "Wo": [12, 12], "Wk2": [12, 1]}
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    past, past2 = (rng.standard_normal((2, 3, 4, 4)).astype(np.float32) for _ in range(2))
    ref = run(model, {"x": x, "past": past, "past2": past2})
    got = run(result.model, {"x": x, "past": past, "past2": past2[:, :1, :, :1]})
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], ref[2][:, :1, :, :1], rtol=1e-5, atol=1e-6)

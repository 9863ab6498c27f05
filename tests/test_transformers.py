"""Transformers: attention heads and FFN neurons, exactly, through the exporters' reshapes.

Four architectures (models/transformers.py): BERT-like (post-LN, GELU, attention-mask input),
ViT-like (patch conv, pre-LN), GPT-like (causal, fused QKV split in three) and LLaMA-like
(RMSNorm, rotary embeddings, grouped-query attention, SwiGLU). Half of every layer's heads and
FFN neurons are masked as a head-pruning method masks them; the shrunk model must have exactly
the parameter count of the same architecture built with fewer heads and neurons.
"""

import numpy as np
import onnx
import pytest
import torch
from conftest import error_against, export_cached, params, shapes, shrink_checked, tiny

from models.transformers import TRANSFORMERS, BagOfEmbeddings
from models.zoo import choose_kept, native_widths, randomize, zero_groups

DYNAMIC = {0: "batch", 1: "seq"}


def masked_and_native(zoo_dir, name, **export):
    entry = TRANSFORMERS[name]
    key = tuple(sorted((k, str(v)) for k, v in export.items()))

    def masked():
        model = randomize(entry.build(), seed=1)
        zero_groups(model, choose_kept(model, 0.5, seed=2))
        return model, entry.inputs(), export

    def native():
        kept = choose_kept(randomize(entry.build(), seed=1), 0.5, seed=2)
        return randomize(entry.build(native_widths(kept)), seed=3), entry.inputs(), export

    return (
        export_cached(zoo_dir, ("tf", name, "masked", key), masked),
        export_cached(zoo_dir, ("tf", name, "native", key), native),
    )


def check(result, native_path):
    assert result.independent_error <= 1e-5  # shrink_checked: against the masked export
    assert params(result.model) == result.after.params == params(onnx.load(native_path))
    assert result.after.params < 0.7 * result.before.params
    assert not result.barriers
    assert not result.kept_zeroed


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_half_the_heads_and_neurons_reach_the_native_size(zoo_dir, name):
    masked, native = masked_and_native(zoo_dir, name)
    check(shrink_checked(masked), native)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_legacy_exporter(zoo_dir, name):
    masked, native = masked_and_native(zoo_dir, name, dynamo=False)
    check(shrink_checked(masked), native)


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_dynamic_batch_and_sequence(zoo_dir, name):
    masked, native = masked_and_native(zoo_dir, name, dynamic=DYNAMIC)
    inputs = [i.name for i in onnx.load(masked, load_external_data=False).graph.input]
    result = shrink_checked(masked, input_shapes={n: [2, 12] for n in inputs})
    check(result, native)
    dims = result.model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and dims[1].dim_param  # still dynamic


HEAD = 8  # head_dim of the zoo transformers (d_model 32, 4 heads)


@pytest.fixture(scope="module")
def one_head_masked(zoo_dir):
    """BERT with head 1 of layer 0 masked in one projection only: q, k, v (rows and bias) or o
    (columns)."""
    entry = TRANSFORMERS["bert"]

    def build(which):
        model = randomize(entry.build(), seed=5)
        attn = model.blocks[0].attn
        with torch.no_grad():
            if which == "o":
                attn.o.weight[:, HEAD : 2 * HEAD] = 0
            else:
                lin = getattr(attn, which)
                lin.weight[HEAD : 2 * HEAD] = 0
                lin.bias[HEAD : 2 * HEAD] = 0
        return model, entry.inputs(), {}

    return lambda which: export_cached(zoo_dir, ("head", which), lambda: build(which))


@pytest.mark.parametrize("which", ["v", "o"])
def test_a_head_masked_in_v_or_o_is_dead_and_goes(one_head_masked, which):
    result = shrink_checked(one_head_masked(which))
    d_model = 32
    one_head = (
        3 * (d_model * HEAD + HEAD) + HEAD * d_model
    )  # its q, k, v rows and biases, o columns
    assert result.before.params - result.after.params == one_head


@pytest.mark.parametrize("which", ["q", "k"])
def test_a_head_masked_in_q_or_k_alone_is_not_dead_and_stays(one_head_masked, which):
    # Zero queries (or keys) give uniform attention: the head outputs the mean of V.
    result = shrink_checked(one_head_masked(which))
    assert result.after.params == result.before.params
    [kept] = result.kept_zeroed
    assert kept.count == HEAD and kept.axis == 1  # the head's rows, stored transposed for MatMul
    assert kept.module == f"blocks.0.attn.{which}"  # named for --explain by the module reading it
    assert "4 x 8" in kept.reason and kept.kind == "structure"  # the heads x head-dims view


def test_ffn_neuron_with_a_bias_becomes_a_constant_folded_into_the_down_projection(zoo_dir):
    entry = TRANSFORMERS["gpt"]

    def build():
        model = randomize(entry.build(), seed=6)
        with torch.no_grad():
            model.blocks[0].mlp.up.weight[[3, 7, 11]] = 0  # rows masked, biases left: gelu(b)
        return model, entry.inputs(), {}

    result = shrink_checked(export_cached(zoo_dir, ("ffn-const",), build))
    assert result.before.params - result.after.params == 3 * (32 + 1 + 32)  # row, bias, down column
    assert [f.into for f in result.folds] == ["bias"]


def test_hidden_size_masked_is_kept_because_layernorm_sees_it(zoo_dir):
    entry = TRANSFORMERS["vit"]

    def build():
        model = randomize(entry.build(), seed=7)
        with torch.no_grad():
            model.blocks[0].mlp.down.weight[[2, 5]] = 0  # two hidden units written by the FFN
            model.blocks[0].mlp.down.bias[[2, 5]] = 0
        return model, entry.inputs(), {}

    result = shrink_checked(export_cached(zoo_dir, ("hidden",), build))
    assert result.after.params == result.before.params
    [kept] = result.kept_zeroed
    assert kept.count == 2 and kept.kind in ("normalization", "meets-live")


def test_embedding_columns_go_and_masked_rows_are_kept_and_reported(zoo_dir):
    def build():
        model = randomize(BagOfEmbeddings(vocab=50, dim=16, classes=4), seed=8)
        with torch.no_grad():
            model.tok.weight[:, [1, 5, 9]] = 0  # three features, masked for every token
            model.tok.weight[[3, 4]] = 0  # two tokens
        ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
        return model, (ids,), {}

    result = shrink_checked(export_cached(zoo_dir, ("bag",), build))
    assert result.independent_error == 0
    assert result.before.params - result.after.params == 3 * (50 + 4)  # table and head columns
    [rows] = result.kept_zeroed
    assert (rows.tensor, rows.axis, rows.count) == ("tok.weight", 0, 2)
    assert "run-time indices" in rows.reason


FUSED_ATTENTION = """
agraph (float[1, 5, 16] x, float[16, 16] Wq, float[16, 16] Wk, float[16, 16] Wv, float[16, 16] Wo) => (float[1, 5, 16] y)
{
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  a = Attention <q_num_heads = 4, kv_num_heads = 4> (q, k, v)
  y = MatMul (a, Wo)
}
"""


def test_fused_attention_op_heads_go_as_units():
    # Opset 23's Attention (3-D form): head 1 is dead (V columns and O rows masked); it goes
    # with its Q, K and V columns, and q_num_heads/kv_num_heads are rewritten (ops/attention.py).
    model = tiny(FUSED_ATTENTION, zero={"Wv": np.s_[:, 4:8], "Wo": np.s_[4:8]}, opset=23)
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Wq"] == s["Wk"] == s["Wv"] == (16, 12) and s["Wo"] == (12, 16)
    assert not result.barriers
    [node] = [n for n in result.model.graph.node if n.op_type == "Attention"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["q_num_heads"] == attrs["kv_num_heads"] == 3


LLAMA_CONFIG = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "vocab_size": 50,
}


def _mlp_masks(rows: dict[int, int]) -> dict[str, np.ndarray]:
    """Masks (torch parameter names) of the first `rows[i]` SwiGLU neurons of layer i: their
    gate and up rows and down columns."""
    masks = {}
    for i, n in rows.items():
        gate, down = np.ones((64, 32), np.float32), np.ones((32, 64), np.float32)
        gate[:n], down[:, :n] = 0, 0
        masks |= {f"blocks.{i}.mlp.gate.weight": gate, f"blocks.{i}.mlp.up.weight": gate, f"blocks.{i}.mlp.down.weight": down}
    return masks


@pytest.mark.parametrize("rows, written", [({1: 64}, None), ({0: 32, 1: 32}, 32)], ids=["one-mlp-whole", "even"])
def test_a_config_is_right_for_every_layer_or_not_written(zoo_dir, tmp_path, capsys, rows, written):
    """A LLaMA-like model whose second layer loses its whole MLP: no config gives that layer no
    MLP (nor one of 64 neurons), so config.json is not written, and the run says why; the same
    neurons gone from both layers: intermediate_size 32 is right for both, and written."""
    import json

    from onnxshrink.cli import main

    entry = TRANSFORMERS["llama"]
    # the key and build of tests/test_groups.py's `exported`: one export per session
    src = export_cached(zoo_dir, ("groups", "llama", ()), lambda: (randomize(entry.build(), seed=1), entry.inputs(), {}))
    folder, out = tmp_path / "in", tmp_path / "out" / "small.onnx"
    folder.mkdir()
    out.parent.mkdir()
    onnx.save(onnx.load(src), folder / "model.onnx")
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    np.savez(tmp_path / "masks.npz", **_mlp_masks(rows))
    assert main([str(folder / "model.onnx"), str(tmp_path / "masks.npz"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    small = onnx.load(out)
    gates = {t.name: tuple(t.dims) for t in small.graph.initializer if len(t.dims) == 2 and 32 in t.dims}
    if written is None:
        assert not (out.parent / "config.json").exists()
        assert (
            "config.json not written: 1 of the shrunk model's 2 layers have an MLP (the rest lost it "
            "whole), and a config gives every layer the same sizes" in printed
        )
        # the MLP's three matrices, and its RMSNorm's scale, which nothing else reads
        assert params(small) == params(onnx.load(src)) - 3 * 64 * 32 - 32
    else:
        config = json.loads((out.parent / "config.json").read_text())
        assert config == {**LLAMA_CONFIG, "intermediate_size": written}
        assert params(small) == params(onnx.load(src)) - 2 * 3 * 32 * 32
    assert gates


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_validate_layers_proves_the_first_block_of_a_width_pruned_model(zoo_dir, name):
    """`--validate-layers 1` when the hidden width is pruned (the default --prune of a
    transformer can take it): the tensors after the first block are narrower in the shrunk model,
    and are compared with the reference's on the channels kept. It passes where the full proof
    passes; the shrunk model is checked here against the input with the removed groups zeroed."""
    from onnxshrink.prune import prune

    entry = TRANSFORMERS[name]
    path = export_cached(zoo_dir, ("groups", name, ()), lambda: (randomize(entry.build(), seed=1), entry.inputs(), {}))
    first = prune(str(path), 0.25, units=["width"], validate_layers=1, price=False, draws=1)
    full = prune(str(path), 0.25, units=["width"], price=False, draws=1)
    v = first.shrink.validation
    assert v.passed and full.shrink.validation.passed
    assert v.kind == "first 1 of 2 repeated blocks" and full.shrink.validation.kind == "full"
    assert "(on its kept 24 of 32 along axis 2)" in v.detail  # int(32 * 0.75) channels of the width
    assert all(o.max_rel_error <= 1e-5 for o in v.outputs)
    assert first.removed() == full.removed()
    widths = {tuple(t.dims) for t in first.model.graph.initializer if len(t.dims) == 2 and 50 in t.dims}
    assert (50, 24) in widths and widths <= {(50, 24), (24, 50)}  # the embedding lost 8 of 32 columns
    assert error_against(_zeroed(onnx.load(path), first), first.model) <= 1e-5


def _zeroed(model, result) -> onnx.ModelProto:
    """The input with every member slice of the removed groups zeroed, here with numpy."""
    from onnx import numpy_helper

    values = {t.name: numpy_helper.to_array(t).copy() for t in model.graph.initializer}
    for g in (result.groups.groups[i] for i in result.removed()):
        for m in g.members:
            index = [slice(None)] * values[m.initializer].ndim
            index[m.axis] = np.asarray(m.indices)
            values[m.initializer][tuple(index)] = 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    return out

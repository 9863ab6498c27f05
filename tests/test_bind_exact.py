"""Masks bound by what the graph says, checked against the masked export itself.

Models come as users export them: library-default initialization (zero biases, unit norms, square
attention projections, BatchNorm statistics at their defaults: the exporters merge these equal
parameters into shared initializers) as well as randomized, from the dynamo exporter with and
without its optimizer and from the legacy exporter. Each shrink runs with validation off and is
compared here, with onnxruntime, with the model exported from the masked PyTorch module: never
with onnxshrink's own reference.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import FLOAT_TYPES, error_against, export_cached, params, with_masks

from models.transformers import TRANSFORMERS
from models.zoo import (
    ZOO,
    choose_kept,
    default_init,
    native_widths,
    randomize,
    zero_groups,
)
from onnxshrink import shrink
from onnxshrink.cli import main
from onnxshrink.errors import ShrinkError

EXPORTERS = {"dynamo": {}, "noopt": {"optimize": False}, "legacy": {"dynamo": False}}
INIT = {"default": default_init, "random": randomize}


def masked_module(kind: str, name: str, init: str, masked: bool):
    entry = TRANSFORMERS[name] if kind == "tf" else ZOO[name]
    model = INIT[init](entry.build(), seed=1)
    kept = choose_kept(model, 0.5, seed=2)
    masks = zero_groups(model, kept) if masked else None
    return model, masks, kept, entry


def exports(zoo_dir, kind: str, name: str, init: str, exporter: str, dynamic=None):
    """(masked export, unmasked export, native export, masks by parameter name)."""
    extra = dict(EXPORTERS[exporter])
    if dynamic:
        extra["dynamic"] = dynamic
    key = (kind, name, init, exporter, str(dynamic))
    paths = []
    for variant in ("masked", "unmasked"):
        def build(v=variant):
            model, _, _, entry = masked_module(kind, name, init, v == "masked")
            return model, entry.inputs(), extra

        paths.append(export_cached(zoo_dir, (*key, variant), build))

    def native():
        _, _, kept, entry = masked_module(kind, name, init, True)
        return INIT[init](entry.build(native_widths(kept)), seed=3), entry.inputs(), extra

    paths.append(export_cached(zoo_dir, (*key, "native"), native))
    _, masks, _, _ = masked_module(kind, name, init, True)
    return (*paths, {k: v.numpy() for k, v in masks.items()})


def distinct(model) -> int:
    """Float parameters, initializers and Constant values alike, with equal tensors counted once:
    unlike the stored count, it does not depend on which equal tensors an exporter merged
    (default-initialized models have many: every zero bias, every unit scale), so a shrunk model
    and a natively built one compare. Scalars (an arange's start, a mask's fill value) are
    numbers, not weights: left out. Counted here, not by onnxshrink."""
    model = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    tensors = [*model.graph.initializer]
    tensors += [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    seen = set()
    for t in tensors:
        if t.data_type in FLOAT_TYPES and len(t.dims):
            a = onnx.numpy_helper.to_array(t)
            seen.add((a.dtype.str, a.shape, a.tobytes()))
    return sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in seen)


def ideal(native, static: bool = True) -> int:
    """The natively built model's parameters (`distinct`), less the rows of the position table a
    static sequence never reads: the exporter without its optimizer stores the whole table
    (`max_len` rows) and slices the sequence's rows from it at run time."""
    model = onnx.load(str(native))
    pos = [t for t in model.graph.initializer if t.name == "pos.weight"]
    unread = (pos[0].dims[0] - SEQ) * pos[0].dims[1] if pos and static else 0
    return distinct(model) - unread


SEQ = TRANSFORMERS["bert"].input_shape[1]  # every transformer's example: [1, 8]


# ------------------------------------------------------------------ transformers
@pytest.mark.parametrize("exporter", list(EXPORTERS))
@pytest.mark.parametrize("init", list(INIT))
def test_bert_heads_and_neurons_exact_against_the_masked_export(zoo_dir, init, exporter):
    """The review's case: square projections, the dynamo exporter's pre-transposed anonymous
    weights, merged zero biases and unit norms. Masks named after the state dict."""
    masked, unmasked, native, masks = exports(zoo_dir, "tf", "bert", init, exporter)
    for model, held in ((masked, True), (unmasked, False)):
        result = shrink(model, masks, validate=False)
        assert result.input_masked is held
        assert distinct(result.model) == ideal(native)
        assert error_against(masked, result.model) <= 1e-5


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_bert_dynamic_axes_exact_against_the_masked_export(zoo_dir, exporter):
    dynamic = {0: "batch", 1: "seq"}
    masked, unmasked, native, masks = exports(zoo_dir, "tf", "bert", "default", exporter, dynamic)
    names = [i.name for i in onnx.load(str(unmasked)).graph.input]
    shapes = {n: [2, 12] for n in names}
    result = shrink(unmasked, masks, validate=False, input_shapes=shapes)
    assert distinct(result.model) == ideal(native, static=False)
    assert error_against(masked, result.model, shapes) <= 1e-5


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fused_qkv_and_grouped_query_attention_with_default_init(zoo_dir, name):
    masked, unmasked, native, masks = exports(zoo_dir, "tf", name, "default", "dynamo")
    result = shrink(unmasked, masks, validate=False)
    assert distinct(result.model) == ideal(native)
    assert error_against(masked, result.model) <= 1e-5


def test_a_mask_transposed_by_mistake_is_refused_by_name(zoo_dir, tmp_path, capsys):
    masked, _, _, masks = exports(zoo_dir, "tf", "bert", "default", "dynamo")
    wrong = dict(masks)
    wrong["blocks.0.attn.q.weight"] = np.ascontiguousarray(masks["blocks.0.attn.q.weight"].T)
    with pytest.raises(ShrinkError) as info:
        shrink(masked, wrong)
    text = str(info.value)
    assert info.value.exit_code == 2
    assert "'blocks.0.attn.q.weight'" in text and "'blocks.0.attn.k.weight'" not in text
    assert "would change 512 of the 512 weights it masks" not in text  # half are zero already
    assert "would change 256 of the 512 weights" in text
    assert "already holds the zeros of 11 other mask(s)" in text

    path = tmp_path / "wrong.npz"
    np.savez(path, **wrong)
    out = tmp_path / "small.onnx"
    assert main([str(masked), str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "'blocks.0.attn.q.weight'" in err and "--unmasked-input" in err
    assert not out.exists()


def test_masks_the_masked_export_contradicts_can_be_applied_when_the_user_says_so(zoo_dir):
    masked, _, _, masks = exports(zoo_dir, "tf", "bert", "default", "dynamo")
    wrong = dict(masks)
    wrong["blocks.0.attn.q.weight"] = np.ascontiguousarray(masks["blocks.0.attn.q.weight"].T)
    result = shrink(masked, wrong, input_masked=False)  # a deliberate second round of masking
    assert result.input_masked is False and result.validation.passed
    assert params(result.model) == result.after.params < params(onnx.load(str(masked)))
    # checked here: the masked export with the transposed mask multiplied into the initializer
    # that holds q's weight (found by its values: stored as is, or transposed for a MatMul)
    module, _, _, _ = masked_module("tf", "bert", "default", True)
    q = module.state_dict()["blocks.0.attn.q.weight"].numpy()
    model = onnx.load(str(masked))
    stored = [
        (t.name, np.array_equal(a, q.T))
        for t in model.graph.initializer
        for a in [onnx.numpy_helper.to_array(t)]
        if a.shape == q.shape and (np.array_equal(a, q) or np.array_equal(a, q.T))
    ]
    [(name, transposed)] = stored
    mask = wrong["blocks.0.attn.q.weight"]
    reference = with_masks(model, {name: mask.T if transposed else mask})
    assert error_against(reference, result.model) <= 1e-5


def test_a_merged_initializer_is_untied_for_the_masked_parameter_only(zoo_dir):
    """Every LayerNorm scale is one in a fresh model: the exporter stores them all as one
    initializer. A mask on one of them applies to that LayerNorm alone."""
    entry = TRANSFORMERS["bert"]

    def build(masked):
        model = default_init(entry.build(), seed=1)
        if masked:
            with torch.no_grad():
                model.blocks[0].n1.weight[[3, 17]] = 0
        return model, entry.inputs(), {}

    masked = export_cached(zoo_dir, ("ln-masked",), lambda: build(True))
    unmasked = export_cached(zoo_dir, ("ln-unmasked",), lambda: build(False))
    shared = [t.name for t in onnx.load(str(unmasked)).graph.initializer if t.name == "emb_norm.weight"]
    assert shared  # the exporter merged the five unit scales into the first one's name
    mask = np.ones(32, np.float32)
    mask[[3, 17]] = 0
    result = shrink(unmasked, {"blocks.0.n1.weight": mask}, validate=False)
    assert result.input_masked is False
    assert result.shared_initializers == {"emb_norm.weight": ["blocks.0.n1.weight"]}
    assert error_against(masked, result.model) <= 1e-5


# ------------------------------------------------------------------ CNNs and BatchNorm
def tp_group_masks(masks: dict[str, np.ndarray], model) -> dict[str, np.ndarray]:
    """Torch-Pruning's groups as masks: a removed channel takes its BatchNorm's running_mean
    along (and nothing else changes: the channel's scale and shift are masked already)."""
    out = dict(masks)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.BatchNorm2d) and f"{name}.weight" in masks:
            out[f"{name}.running_mean"] = masks[f"{name}.weight"]
    return out


@pytest.mark.parametrize(
    "init, exporter", [("default", "dynamo"), ("random", "dynamo"), ("random", "legacy")]
)
def test_torch_pruning_groups_with_batchnorm_statistics(zoo_dir, init, exporter):
    masked, unmasked, native, masks = exports(zoo_dir, "cnn", "resnet_basic", init, exporter)
    model, _, _, _ = masked_module("cnn", "resnet_basic", init, False)
    weights = {k: v.numpy() for k, v in model.state_dict().items()} if exporter == "legacy" else None
    groups = tp_group_masks(masks, model)
    assert sum(k.endswith("running_mean") for k in groups) == 11
    result = shrink(unmasked, groups, weights=weights, validate=False)
    assert result.unbound_masks == []
    assert distinct(result.model) == ideal(native)
    assert error_against(masked, result.model) <= 1e-5


def test_batchnorms_a_legacy_export_folded_without_a_trace_are_refused_when_values_fit_several(zoo_dir):
    """Fresh BatchNorms all have the same parameters: their values cannot say which conv each was
    folded into, and the legacy exporter records nothing. Refused by name, never guessed."""
    _, unmasked, _, masks = exports(zoo_dir, "cnn", "resnet_basic", "default", "legacy")
    model, _, _, _ = masked_module("cnn", "resnet_basic", "default", False)
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    with pytest.raises(ShrinkError) as info:
        shrink(unmasked, tp_group_masks(masks, model), weights=weights)
    text = str(info.value)
    assert "'stem.1.weight'" in text and "fit the folded weights of 5 convs" in text
    assert "dynamo exporter" in text


def test_batchnorm_scale_masked_alone_folds_its_shift_with_the_weights(zoo_dir):
    """Network slimming masks BatchNorm scales only: such a channel is the constant shift.
    Folded into the conv, that needs the original weights, which --weights gives."""
    entry = ZOO["vgg"]

    def build(masked):
        model = randomize(entry.build(), seed=4)
        if masked:
            with torch.no_grad():
                model.features[0][1].weight[[0, 2, 5]] = 0
        return model, entry.input_shape, {}

    masked = export_cached(zoo_dir, ("slim", "masked"), lambda: build(True))
    unmasked = export_cached(zoo_dir, ("slim", "unmasked"), lambda: build(False))
    original = build(False)[0]
    bn = next(n for n, m in original.named_modules() if isinstance(m, torch.nn.BatchNorm2d))
    mask = np.ones(original.get_submodule(bn).weight.shape[0], np.float32)
    mask[[0, 2, 5]] = 0
    with pytest.raises(ShrinkError, match="mask its weight and bias together"):
        shrink(unmasked, {f"{bn}.weight": mask})
    weights = {k: v.numpy() for k, v in original.state_dict().items()}
    result = shrink(unmasked, {f"{bn}.weight": mask}, weights=weights, validate=False)
    assert error_against(masked, result.model) <= 1e-5
    assert result.after.params < result.before.params
    # The masked export already holds the fold: nothing to apply, the same result.
    again = shrink(masked, {f"{bn}.weight": mask}, weights=weights, validate=False)
    assert again.input_masked is True
    assert again.after.params == result.after.params


@pytest.mark.parametrize("source", ["flat", "nni", "torch-prune", "state-dict"])
def test_every_mask_format_on_the_masked_and_the_unmasked_export(zoo_dir, tmp_path, source):
    from test_mask_sources import write_source

    masked, unmasked, native, _ = exports(zoo_dir, "cnn", "resnet_basic", "random", "dynamo")
    path = write_source(source, "resnet_basic", tmp_path)
    for model in (masked, unmasked):
        result = shrink(model, path, validate=False)
        assert distinct(result.model) == ideal(native)
        assert error_against(masked, result.model) <= 1e-5

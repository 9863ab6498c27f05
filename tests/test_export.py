"""export_and_shrink: a masked PyTorch module in, a smaller ONNX model proven against it out."""

import numpy as np
import onnx
import pytest
import torch
from conftest import output_error, params, run
from torch import nn
from torch.nn.utils import prune

from models.zoo import ZOO, choose_kept, export, native_widths, randomize, zero_groups
from onnxshrink import ShrinkError, export_and_shrink

X = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def torch_error(module: nn.Module | np.ndarray, x: torch.Tensor, model: onnx.ModelProto) -> float:
    """The shrunk model against the masked module's own output (or that output, computed
    before), both run here (not the tool's proofs): `output_error`, so NaN, shapes and dtypes
    count."""
    if isinstance(module, nn.Module):
        with torch.no_grad():
            module = module(x).numpy()
    return output_error(module, run(model, {model.graph.input[0].name: x.numpy()})[0])


def test_module_pruned_in_place_with_torch_nn_utils_prune(tmp_path):
    model = randomize(ZOO["resnet_basic"].build(), seed=3)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            prune.ln_structured(m, "weight", amount=0.5, n=1, dim=0)
    out = tmp_path / "small.onnx"
    result = export_and_shrink(model, (X,), output=out)
    assert result.validation.passed and result.torch_validation.passed
    assert result.torch_validation.outputs[0].max_rel_error <= 1e-5
    assert result.after.params < 0.6 * result.before.params
    # the written model computes what the pruned module computes
    assert torch_error(model, X, onnx.load(out)) <= 1e-5
    # the module itself is left pruned as it was
    assert all(hasattr(m, "weight_mask") for m in model.modules() if isinstance(m, nn.Conv2d))


def test_module_with_torch_ao_parametrizations_and_the_legacy_exporter():
    from torch.ao.pruning import WeightNormSparsifier

    model = randomize(ZOO["vgg"].build(), seed=3)
    sparsifier = WeightNormSparsifier(sparsity_level=0.5, sparse_block_shape=(1, 384), zeros_per_block=384)
    sparsifier.prepare(model, config=[{"tensor_fqn": "fc1.weight"}])
    sparsifier.step()  # half of fc1's neurons (whole rows) zeroed
    with torch.no_grad():
        want = model(X).numpy()
    result = export_and_shrink(model, (X,), exporter="legacy")
    assert result.torch_validation.passed
    shapes = {t.name: tuple(t.dims) for t in result.model.graph.initializer}
    assert shapes["fc1.weight"] == (16, 384)
    assert shapes["fc2.weight"] == (32, 16)
    assert torch_error(want, X, result.model) <= 1e-5  # the parametrization masks fc1
    # the user's module is left as it was: still parametrized, computing what it computed (its
    # parametrized class, shared by the copy the export made, once lost its `weight`)
    with torch.no_grad():
        assert np.array_equal(model(X).numpy(), want)
    sparsifier.squash_mask()
    with torch.no_grad():
        assert np.array_equal(model(X).numpy(), want)


def test_masks_given_as_a_dict_reach_the_native_size(tmp_path):
    entry = ZOO["mobilenetv2"]
    model = randomize(entry.build(), seed=1)
    probe = randomize(entry.build(), seed=1)
    kept = choose_kept(probe, 0.5, seed=2)
    masks = zero_groups(probe, kept)
    result = export_and_shrink(model, (X,), masks)
    native = randomize(entry.build(native_widths(kept)), seed=3)
    export(native, tmp_path / "native.onnx", entry.input_shape)
    assert params(result.model) == result.after.params == params(onnx.load(tmp_path / "native.onnx"))
    assert result.torch_validation.passed
    assert result.masks_bound == len(masks)
    assert torch_error(probe, X, result.model) <= 1e-5  # the module with the masks applied


def test_dynamic_batch_export():
    model = randomize(ZOO["resnet_bottleneck"].build(), seed=3)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            prune.ln_structured(m, "weight", amount=0.4, n=2, dim=0)
    x = torch.randn(2, 3, 32, 32)
    result = export_and_shrink(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},),
                               input_shapes={"x": [3, 3, 32, 32]})
    assert result.validation.input_shapes["x"] == [3, 3, 32, 32]
    assert result.torch_validation.passed
    batch = result.model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param and not batch.HasField("dim_value")
    assert torch_error(model, torch.randn(3, 3, 32, 32), result.model) <= 1e-5


def test_unknown_mask_names_are_refused():
    model = randomize(ZOO["vgg"].build(), seed=3)
    with pytest.raises(ShrinkError, match="'conv9.weight'"):
        export_and_shrink(model, (X,), {"conv9.weight": np.ones(3)})


@pytest.mark.parametrize("shape", [(5,), (3, 3), (1, 3, 3, 3)])
def test_mask_of_another_shape_is_refused_not_broadcast(shape):
    """A mask that does not fit its parameter raised torch's RuntimeError ((5,)) or was broadcast
    over it ((3, 3), (1, 3, 3, 3)): a guess from shapes. Only the parameter's shape, or one flag
    per output channel, is a mask."""
    model = randomize(ZOO["vgg"].build(), seed=4)
    name, weight = next((n, p) for n, p in model.named_parameters() if p.dim() == 4)
    with pytest.raises(ShrinkError, match=rf"mask '{name}' has shape \[{', '.join(map(str, shape))}\]"):
        export_and_shrink(model, (X,), {name: np.ones(shape, np.float32)}, exporter="legacy")
    assert weight.shape[1:] == (3, 3, 3)  # the shapes above fit its trailing axes


@pytest.mark.parametrize("module", ["model.pt", None])
def test_something_other_than_a_module_is_refused(module):
    with pytest.raises(ShrinkError, match="expected a torch.nn.Module"):
        export_and_shrink(module, (X,), exporter="legacy")


def test_bad_tolerance_is_refused_before_the_export():
    with pytest.raises(ShrinkError, match="rtol=-1"):
        export_and_shrink(object(), (X,), rtol=-1.0)  # checked before the module, too

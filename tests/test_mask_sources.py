"""Masks from every pruner's format, bound to every torch exporter's naming, give one result.

The same whole-group masks travel as a flat dict, NNI's nested dict, a torch.nn.utils.prune
state dict, a torch.ao.pruning sparsifier state and parametrized state dict, DPU-style channel
masks and a masked state dict; the model comes from the dynamo exporter (BatchNorm folded,
names kept), dynamo with optimize=False (BatchNorm kept) or the legacy exporter (folded weights
renamed onnx::Conv_N). Each combination must bind every mask, validate, and reach exactly the
parameter count of the natively built smaller model exported the same way.
"""

import numpy as np
import onnx
import pytest
import torch
from conftest import error_against, output_error, params, run, with_masks
from safetensors.numpy import save_file
from torch import nn
from torch.nn.utils import prune

from models.zoo import ZOO, choose_kept, randomize, zero_groups
from onnxshrink import shrink

EXPORTERS = {"dynamo": {}, "noopt": {"optimize": False}, "legacy": {"dynamo": False}}
MODELS = ["resnet_basic", "vgg"]


def group_masks(name):
    probe = randomize(ZOO[name].build(), seed=1)
    kept = choose_kept(probe, 0.5, seed=2)
    return {k: v for k, v in zero_groups(probe, kept).items()}, kept


def original(name):
    return randomize(ZOO[name].build(), seed=1)


@pytest.fixture(scope="module")
def exported(zoo_dir):
    """(unmasked export, native parameter count, masked export) per (model, exporter): the model
    exported before and after its masks were applied in PyTorch (test_bind_exact's exports)."""
    from test_bind_exact import exports

    def get(name, exporter):
        masked, unmasked, native, _ = exports(zoo_dir, "cnn", name, "random", exporter)
        return unmasked, params(onnx.load(native)), masked

    return get


def write_source(kind: str, name: str, directory):
    """The masks of `name` written as `kind` would write them; returns (path, format given)."""
    masks, _ = group_masks(name)
    path = directory / f"{kind}.pt"
    if kind == "flat":
        torch.save(masks, path)
    elif kind == "npz":
        path = directory / "m.npz"
        np.savez(path, **{k: v.numpy() for k, v in masks.items()})
    elif kind == "safetensors":
        path = directory / "m.safetensors"
        save_file({k: v.numpy().astype(np.float32) for k, v in masks.items()}, str(path))
    elif kind == "nni":  # {module: {"weight": mask, "bias": mask}}
        nested: dict = {}
        for k, v in masks.items():
            module, _, param = k.rpartition(".")
            nested.setdefault(module, {})[param] = v
        torch.save(nested, path)
    elif kind == "torch-prune":
        model = original(name)
        for k, v in masks.items():
            module, _, param = k.rpartition(".")
            prune.custom_from_mask(model.get_submodule(module), param, v)
        torch.save(model.state_dict(), path)
    elif kind == "torch-ao":
        from torch.ao.pruning import WeightNormSparsifier

        model = original(name)
        sparsifier = WeightNormSparsifier(sparsity_level=0.0)
        sparsifier.prepare(model, config=[{"tensor_fqn": k} for k in masks])
        for k, v in masks.items():  # the masks a pruning step would have set
            module, _, param = k.rpartition(".")
            model.get_submodule(module).parametrizations[param][0].mask.copy_(v)
        torch.save(sparsifier.state_dict(), path)
    elif kind == "dpu":  # one output-channel mask per layer
        layers = {k.rpartition(".")[0]: v.reshape(v.shape[0], -1)[:, 0].clone() for k, v in masks.items()}
        torch.save({layer: {"mask": m} for layer, m in layers.items()}, path)
    elif kind == "state-dict":  # the masked model's weights: their zeros are the masks
        model = original(name)
        zero_groups(model, group_masks(name)[1])
        torch.save(model.state_dict(), path)
    return path


SOURCES = ["flat", "npz", "safetensors", "nni", "torch-prune", "torch-ao", "dpu", "state-dict"]
EXPECTED_FORMAT = {"flat": "flat", "npz": "flat", "safetensors": "flat", "nni": "nni", "torch-prune": "torch-prune",
                   "torch-ao": "torch-ao", "dpu": "dpu", "state-dict": "state-dict"}


@pytest.mark.parametrize("exporter", list(EXPORTERS))
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", MODELS)
def test_every_source_and_exporter_reaches_the_native_size(exported, tmp_path, name, exporter, source):
    path, native_params, masked = exported(name, exporter)
    masks_path = write_source(source, name, tmp_path)
    # The legacy exporter folds BatchNorm and renames the conv: its masks bind by value.
    weights = {k: v.detach() for k, v in original(name).state_dict().items()} if exporter == "legacy" else None
    logs = []
    result = shrink(path, masks_path, weights=weights, log=logs.append)
    assert result.unbound_masks == []
    assert logs[0].startswith(f"{EXPECTED_FORMAT[source]} masks:")
    assert params(result.model) == result.after.params == native_params
    assert result.validation.passed
    # checked here too: against the module masked in PyTorch and exported the same way
    assert error_against(masked, result.model, draws=1) <= 1e-5


def test_legacy_batchnorm_masks_without_weights_are_refused_with_a_hint(exported, tmp_path):
    path, _, _ = exported("resnet_basic", "legacy")
    from onnxshrink.errors import ShrinkError

    with pytest.raises(ShrinkError) as info:
        shrink(path, write_source("flat", "resnet_basic", tmp_path))
    text = str(info.value)
    assert "'stem.1.weight'" in text and "--weights" in text


def test_batchnorm_scale_masked_without_its_shift_cannot_bind_to_a_folded_conv(exported):
    path, _, _ = exported("resnet_basic", "dynamo")
    from onnxshrink.errors import ShrinkError

    mask = torch.ones(8)
    mask[1] = 0
    with pytest.raises(ShrinkError, match="mask its weight and bias together"):
        shrink(path, {"stem.1.weight": mask})


def test_two_of_four_masks_are_accepted_and_reported(exported):
    path, _, _ = exported("vgg", "dynamo")
    model = original("vgg")
    masks = {}
    for k, p in model.named_parameters():
        if p.dim() == 4 and p[0].numel() % 4 == 0:  # 2:4 along each filter, as sparsity toolkits make
            w = p.detach().abs().reshape(p.shape[0], -1)
            groups = w.reshape(w.shape[0], -1, 4)
            top = groups.argsort(dim=-1, descending=True)[..., :2]
            m = torch.zeros_like(groups).scatter_(-1, top, 1.0)
            masks[k] = m.reshape(p.shape)
    result = shrink(path, masks)
    assert result.validation.passed
    assert params(result.model) == result.after.params == result.before.params  # no whole channel
    # checked here: the export with the masks multiplied into its conv weights (which the
    # exporter stored under their parameter names, BatchNorm folded in: zeros stay zeros)
    exported_model = onnx.load(str(path))
    stored = {t.name for t in exported_model.graph.initializer}
    assert set(masks) <= stored
    assert error_against(with_masks(exported_model, {k: v.numpy() for k, v in masks.items()}), result.model) <= 1e-5
    conv = [s for s in result.sparsity if s.tensor in masks]
    assert len(conv) == len(masks) == 3
    assert all(s.zeros == pytest.approx(0.5, abs=0.01) for s in conv)


def test_embedding_columns_masked_by_a_data_sparsifier_bind_by_value(tmp_path):
    """A data sparsifier names its data ("emb"), not a parameter: the masks file carries the
    original table, which finds the initializer by value."""
    from torch.ao.pruning._experimental.data_sparsifier import DataNormSparsifier

    torch.manual_seed(0)

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.fc = nn.Linear(8, 3)

        def forward(self, ids):
            return self.fc(self.emb(ids).mean(1))

    model = Bag().eval()
    sparsifier = DataNormSparsifier(sparsity_level=0.0)
    sparsifier.add_data("table", model.emb.weight)
    mask = torch.ones(20, 8, dtype=torch.int8)
    mask[:, [2, 5]] = 0  # two embedding columns pruned
    sparsifier.get_mask("table").copy_(mask)
    path = tmp_path / "ds.pt"
    torch.save(sparsifier.state_dict(), path)
    onnx_path = tmp_path / "bag.onnx"
    torch.onnx.export(model, (torch.randint(0, 20, (2, 5)),), str(onnx_path), input_names=["ids"], dynamo=False)
    ids = np.random.default_rng(0).integers(0, 20, size=(2, 5))
    logs = []
    result = shrink(onnx_path, path, inputs=[{"ids": ids}], log=logs.append)
    assert logs[0].startswith("ao-data masks: 1 of 1 bound (value)")
    shapes = {t.name: tuple(t.dims) for t in result.model.graph.initializer}
    assert shapes["emb.weight"] == (20, 6)
    assert result.validation.passed
    # checked here: the module with its table masked, on ids of every token
    with torch.no_grad():
        model.emb.weight.mul_(mask)
        for ids in torch.arange(20).reshape(2, 2, 5):
            want = model(ids).numpy()
            assert output_error(want, run(result.model, {"ids": ids.numpy()})[0]) <= 1e-5

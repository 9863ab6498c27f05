"""The everyday PyTorch flow: prune with torch.nn.utils.prune, export with the hooks still attached.

The exporter computes each pruned weight as weight_orig * weight_mask and folds it into one
initializer named after the product (`mul`, `mul_1`); the dynamo exporter also folds each
BatchNorm into the conv before it, and the fused conv then records only the BatchNorm's scope.
The masks file the pruner's user saves ({name: weight_mask}) and the pruner's state dict
(weight_orig and weight_mask) must bind to those weights, each result checked here in
onnxruntime against the masked export and sized like the model built natively with the kept
channels.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import error_against
from torch import nn
from torch.nn.utils import prune

from models.zoo import default_init, distinct_params, export, randomize
from onnxshrink import ShrinkError, shrink
from onnxshrink.cli import main

WIDTHS = (8, 16)
SHAPE = (1, 3, 12, 12)


class SmallCNN(nn.Module):
    """conv -> BN -> ReLU (padded), conv -> BN -> ReLU (unpadded: a removed channel's BN shift
    folds into the next conv's bias exactly), mean, Linear: 3.4 K parameters."""

    def __init__(self, widths: tuple[int, int] = WIDTHS):
        super().__init__()
        a, b = widths
        self.conv1, self.bn1 = nn.Conv2d(3, a, 3, padding=1), nn.BatchNorm2d(a)
        self.conv2, self.bn2 = nn.Conv2d(a, b, 3), nn.BatchNorm2d(b)
        self.fc = nn.Linear(b, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


PRUNERS = {
    "ln_structured": lambda m: prune.ln_structured(m, "weight", amount=0.5, n=1, dim=0),
    "random_structured": lambda m: prune.random_structured(m, "weight", amount=0.5, dim=0),
    "l1_unstructured": lambda m: prune.l1_unstructured(m, "weight", amount=0.5),
}
INITS = {"random": randomize, "default": default_init}
EXPORTERS = {"dynamo": {}, "legacy": {"dynamo": False}, "noopt": {"optimize": False}}


def pruned(pruner: str, init: str) -> SmallCNN:
    torch.manual_seed(0)  # random_structured draws from torch's generator
    model = INITS[init](SmallCNN(), seed=1)
    for conv in (model.conv1, model.conv2):
        PRUNERS[pruner](conv)
    return model


def native(pruner: str, init: str) -> SmallCNN:
    """The model built with the kept channels, initialized alike (the exporters drop zero
    biases), its convs carrying (identity) pruning hooks so that every exporter writes it as it
    writes the pruned one (the legacy exporter folds a BatchNorm only into a conv without)."""
    widths = WIDTHS if pruner == "l1_unstructured" else tuple(w // 2 for w in WIDTHS)
    model = INITS[init](SmallCNN(widths), seed=3)
    for conv in (model.conv1, model.conv2):
        prune.identity(conv, "weight")
    return model


_CACHE: dict[tuple, object] = {}


def deployed_params(path) -> int:
    """The distinct parameters of an export as deployed: a weight its hooks compute in the graph
    (weight_orig * weight_mask, when the exporter left the product to the runtime) counted once,
    as the product onnxruntime folds it into."""
    from onnxshrink.io.model import load_external
    from onnxshrink.stages.read import read_model

    source = read_model(path)
    load_external(source.proto, path.parent)
    return distinct_params(source.proto)


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    """(pruner, init, exporter) -> (masked export, flat masks file, state dict file, native
    parameter count), each exported once."""
    root = tmp_path_factory.mktemp("prune_flow")

    def get(pruner: str, init: str, exporter: str):
        key = (pruner, init, exporter)
        if key not in _CACHE:
            d = root / "_".join(key)
            d.mkdir()
            model = pruned(pruner, init)
            export(model, d / "model.onnx", SHAPE, **EXPORTERS[exporter])
            state = model.state_dict()
            torch.save(state, d / "state_dict.pt")
            torch.save({k[: -len("_mask")]: v for k, v in state.items() if k.endswith("_mask")}, d / "masks.pt")
            export(native(pruner, init), d / "native.onnx", SHAPE, **EXPORTERS[exporter])
            _CACHE[key] = (d / "model.onnx", d / "masks.pt", d / "state_dict.pt", deployed_params(d / "native.onnx"))
        return _CACHE[key]

    return get


def shrunk_and_checked(path, masks, **kwargs):
    """Shrink without the proof, then check against the masked export in onnxruntime."""
    result = shrink(path, masks, validate=False, **kwargs)
    assert result.unbound_masks == []
    assert error_against(path, result.model) <= 1e-5
    return result


@pytest.mark.parametrize("exporter", list(EXPORTERS))
@pytest.mark.parametrize("init", list(INITS))
def test_the_pruners_state_dict_binds_by_value_and_reaches_the_native_size(flow, init, exporter):
    path, _, state_dict, native_params = flow("ln_structured", init, exporter)
    result = shrunk_and_checked(path, state_dict)
    # optimize=False keeps the hooks' Mul: its product is the weight, which holds the masks
    assert result.masks_bound == 2 and result.input_masked is True
    assert distinct_params(result.model) == native_params
    assert distinct_params(result.model) < 0.45 * distinct_params(onnx.load(path))


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_the_flat_masks_file_binds_through_the_graph(flow, exporter):
    """Legacy: the conv's node name gives its module. Dynamo: the fused conv records only its
    BatchNorm's scope, but reads its own bias as `conv1.bias`, so its weight is conv1's."""
    path, masks, _, native_params = flow("ln_structured", "random", exporter)
    logs: list[str] = []
    result = shrunk_and_checked(path, masks, log=logs.append)
    how = "its op, by a sibling parameter" if exporter == "dynamo" else "scope"
    assert logs[0] == f"flat masks: 2 of 2 bound ({how}) to 2 initializer(s)"
    assert distinct_params(result.model) == native_params


def test_flat_masks_of_convs_fused_without_a_bias_say_what_works(flow, tmp_path, capsys):
    """Zero conv biases and fresh BatchNorms fuse into a zero bias, which the exporter drops:
    nothing in the graph names the conv. The refusal says what works, and each way does."""
    path, masks, state_dict, native_params = flow("ln_structured", "default", "dynamo")
    with pytest.raises(ShrinkError) as refused:
        shrink(path, masks, validate=False)
    text = str(refused.value)
    assert "'conv1.weight', 'conv2.weight'" in text
    assert "omit the masks file: the zeros in the model are the masks" in text
    assert "its weights 'mul', 'mul_1' hold zeroed output channels" in text
    assert "give the pruner's state dict" in text and "--weights" in text
    # the CLI: exit 2, one paragraph, nothing written
    out = tmp_path / "small.onnx"
    assert main([str(path), str(masks), "-o", str(out)]) == 2
    assert "omit the masks file" in capsys.readouterr().err and not out.exists()
    # what it says works: no masks file, or the masks with the pruner's state dict as --weights
    for result in (shrunk_and_checked(path, None), shrunk_and_checked(path, masks, weights=state_dict)):
        assert distinct_params(result.model) == native_params
    assert shrink(path, masks, weights=state_dict).validation.passed


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_random_structured_binds_both_ways(flow, exporter):
    path, masks, state_dict, native_params = flow("random_structured", "random", exporter)
    for source in (masks, state_dict):
        assert distinct_params(shrunk_and_checked(path, source).model) == native_params


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_unstructured_masks_bind_and_are_reported_as_sparsity(flow, exporter):
    path, masks, state_dict, native_params = flow("l1_unstructured", "random", exporter)
    for source in (masks, state_dict):
        result = shrunk_and_checked(path, source)
        assert distinct_params(result.model) == native_params == distinct_params(onnx.load(path))
        convs = {t.name for t in result.model.graph.initializer if len(t.dims) == 4}
        zeros = sorted(s.zeros for s in result.sparsity if s.tensor in convs)
        assert zeros == [pytest.approx(0.5, abs=0.02)] * 2


def test_weights_computed_in_the_graph_shrink_without_masks_and_with_either_masks_file(flow):
    """optimize=False keeps the hooks' Mul (weight_orig * weight_mask) as a node: the product
    is the weight the convs read (stored as one, as onnxruntime folds it), whose removed constant
    channels still fold into the next bias. The masks of either file bind to it by the conv's
    scope, and the model already holds them."""
    path, masks, state_dict, native_params = flow("ln_structured", "random", "noopt")
    for source in (None, state_dict, masks):
        result = shrunk_and_checked(path, source)
        assert distinct_params(result.model) == native_params
        assert sum(f.channels for f in result.folds) == 12  # every removed channel's BN shift
        assert "Mul" not in {n.op_type for n in result.model.graph.node}
        assert source is None or result.input_masked is True


def test_masks_of_a_model_exported_before_pruning_bind_by_value_and_are_applied(tmp_path):
    """The model exported unpruned (BatchNorm folded), then pruned: the state dict's
    weight_orig is the conv's weight scaled per channel by the fold; the masks are applied."""
    model = randomize(SmallCNN(), seed=1)
    path = tmp_path / "unpruned.onnx"
    export(model, path, SHAPE)
    for conv in (model.conv1, model.conv2):
        PRUNERS["ln_structured"](conv)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    result = shrink(path, tmp_path / "sd.pt", validate=False)
    assert result.input_masked is False
    x = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(x).numpy()  # the pruned module (its hooks apply the masks)
    from conftest import run

    got = run(result.model, {"x": x.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert distinct_params(result.model) == distinct_params(onnx.load(export_native(tmp_path)))


def export_native(directory):
    path = directory / "native_plain.onnx"
    export(randomize(SmallCNN(tuple(w // 2 for w in WIDTHS)), seed=3), path, SHAPE)
    return path


def test_a_bias_mask_on_a_conv_fused_with_its_batchnorm_is_refused(tmp_path):
    """The fused conv reads `conv1.bias` under its own name, but it holds (b - mean) * s + beta:
    masking it would zero the BatchNorm's shift too. Before, the mask was applied and the
    result proven against that wrong reference."""
    model = randomize(SmallCNN(), seed=1)
    path = tmp_path / "model.onnx"
    export(model, path, SHAPE)
    flags = torch.tensor([1, 0, 1, 0, 1, 1, 0, 1.0])
    with pytest.raises(ShrinkError) as refused:
        shrink(path, {"conv1.weight": flags, "conv1.bias": flags}, validate=False)
    text = str(refused.value)
    assert "'conv1.bias'" in text and "fused shift (b - mean) * s + beta" in text
    # the weight alone binds (the fold scales it per channel), and is exact against PyTorch
    result = shrink(path, {"conv1.weight": flags}, validate=False)
    with torch.no_grad():
        model.conv1.weight.mul_(flags.reshape(-1, 1, 1, 1))
        x = torch.randn(*SHAPE)
        want = model(x).numpy()
    from conftest import run

    got = run(result.model, {"x": x.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_bias_mask_on_a_fused_conv_binds_when_its_batchnorms_weight_and_bias_are_masked_too(tmp_path):
    """As --masks-out writes them (conv bias, BatchNorm weight and bias zeroed together): the
    fused shift (b - mean) * s + beta is zero there whether b is masked or not, so masking the
    fused bias is masking b; checked against the PyTorch module with all four masked."""
    model = randomize(SmallCNN(), seed=1)
    path = tmp_path / "model.onnx"
    export(model, path, SHAPE)
    flags = torch.tensor([1, 0, 1, 0, 1, 1, 0, 1.0])
    masks = {"conv1.weight": flags, "conv1.bias": flags, "bn1.weight": flags, "bn1.bias": flags}
    result = shrink(path, masks, validate=False)
    assert result.unbound_masks == []
    with torch.no_grad():
        model.conv1.weight.mul_(flags.reshape(-1, 1, 1, 1))
        for p in (model.conv1.bias, model.bn1.weight, model.bn1.bias):
            p.mul_(flags)
        x = torch.randn(*SHAPE)
        want = model(x).numpy()
    from conftest import run

    got = run(result.model, {"x": x.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # the three zeroed channels are gone: conv1's filters and biases, conv2's input columns
    assert distinct_params(result.model) == distinct_params(onnx.load(path)) - 3 * (27 + 1 + 16 * 9)
    # the BatchNorm's bias alone is not enough: refused as before
    with pytest.raises(ShrinkError, match="fused shift"):
        shrink(path, {"conv1.bias": flags, "bn1.weight": flags}, validate=False)

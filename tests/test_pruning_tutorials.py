"""The pruners' tutorials as their users leave them: exported with the pruning still attached.

PyTorch's pruning tutorial (LeNet; `prune.l1_unstructured` and `prune.ln_structured`, hooks
kept), torch.ao's sparsifier with its parametrizations attached, and NNI 3's wrapper (its
exported form built here by hand: NNI does not install beside the pinned torch) each export
the weight as a product the graph computes (`weight_orig * weight_mask`, `original * mask`).
That product is the weight: with no masks file, or with the pruner's own file, the shrink
reaches the same model as the `prune.remove` / `squash_mask` flow, and counts the parameters
the deployed model holds. Each result is checked here in onnxruntime against the masked export
as given, with the proof off.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from conftest import error_against, tiny
from torch import nn
from torch.nn.utils import prune

from models.zoo import export
from onnxshrink import shrink
from onnxshrink.cli import main
from onnxshrink.prepare.computed import fold_computed_weights

SHAPE = (1, 1, 32, 32)
EXPORTERS = {"dynamo": {}, "legacy": {"dynamo": False}}


class LeNet(nn.Module):
    """The tutorial's LeNet (its fc1 sized for a 32 x 32 input)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3)
        self.conv2 = nn.Conv2d(6, 16, 3)
        self.fc1 = nn.Linear(16 * 6 * 6, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), (2, 2))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.view(-1, int(x.nelement() / x.shape[0]))
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


LENET_PARAMS = 6 * 9 + 6 + 16 * 54 + 16 + 120 * 576 + 120 + 84 * 120 + 84 + 10 * 84 + 10


def params(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """The tutorial's pruning, exported hooks attached (each exporter), its state_dict(), and
    the `prune.remove` flow's export: {exporter: (hooked, state dict, removed)}."""
    root = tmp_path_factory.mktemp("tutorial")
    torch.manual_seed(0)
    model = LeNet().eval()
    prune.l1_unstructured(model.conv1, name="weight", amount=0.3)
    prune.ln_structured(model.conv1, name="weight", amount=0.5, n=2, dim=0)
    prune.l1_unstructured(model.conv1, name="bias", amount=3)
    prune.ln_structured(model.conv2, name="weight", amount=0.5, n=1, dim=0)
    prune.l1_unstructured(model.fc1, name="weight", amount=0.2)
    prune.ln_structured(model.fc2, name="weight", amount=0.25, n=1, dim=0)
    torch.save(model.state_dict(), root / "state_dict.pt")
    out = {}
    for name, kwargs in EXPORTERS.items():
        export(model, root / f"hooked_{name}.onnx", SHAPE, **kwargs)
    for module, param in [(model.conv1, "weight"), (model.conv1, "bias"), (model.conv2, "weight"),
                          (model.fc1, "weight"), (model.fc2, "weight")]:  # fmt: skip
        prune.remove(module, param)
    assert sum(p.numel() for p in model.parameters()) == LENET_PARAMS
    for name, kwargs in EXPORTERS.items():
        export(model, root / f"removed_{name}.onnx", SHAPE, **kwargs)
        out[name] = (root / f"hooked_{name}.onnx", root / "state_dict.pt", root / f"removed_{name}.onnx")
    return out


@pytest.mark.parametrize("exporter", list(EXPORTERS))
def test_the_pytorch_pruning_tutorial_with_its_hooks_attached(tutorial, exporter):
    hooked, state_dict, removed = tutorial[exporter]
    plain = shrink(removed, validate=False)  # the prune.remove flow
    assert plain.before.params == LENET_PARAMS
    for masks in (None, state_dict):
        result = shrink(hooked, masks, validate=False)
        assert error_against(hooked, result.model) <= 1e-5
        # the table counts the deployed model's parameters, not weight_orig and weight_mask
        assert result.before.params == LENET_PARAMS
        assert result.after.params == plain.after.params == params(result.model)
        assert params(result.model) == params(plain.model)
        assert "Mul" not in {n.op_type for n in result.model.graph.node}
        if masks is not None:
            assert result.input_masked is True and result.masks_bound == 5
        # the same weights as the prune.remove flow's shrunk model, in the same order of nodes
        ours = sorted(tuple(t.dims) for t in result.model.graph.initializer)
        assert ours == sorted(tuple(t.dims) for t in plain.model.graph.initializer)
    # conv1 keeps 3 of 6 filters, conv2 8 of 16 (and fc1's input columns with them), fc2 63 of 84
    assert plain.after.params == (3 * 9 + 3) + (8 * 27 + 8) + (120 * 288 + 120) + (63 * 120 + 63) + (10 * 63 + 10)


def test_the_tutorial_export_on_the_command_line(tutorial, tmp_path, capsys):
    hooked, state_dict, _ = tutorial["dynamo"]
    out = tmp_path / "small.onnx"
    assert main([str(hooked), str(state_dict), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "torch-prune masks: 5 of 5 bound (scope) to 5 initializer(s)" in text
    assert "| Parameters |      81.19 K |      43.20 K |       -46.8% |" in text
    assert error_against(hooked, onnx.load(str(out))) <= 1e-5


def test_torch_ao_parametrizations_attached(tmp_path):
    """A torch.ao sparsifier's masks, parametrizations attached (`parametrizations.weight.original`
    times the mask, computed in the graph): the same model as after `squash_mask()`."""
    from torch.ao.pruning import WeightNormSparsifier

    torch.manual_seed(1)
    model = LeNet().eval()
    sparsifier = WeightNormSparsifier(sparsity_level=0.5)
    sparsifier.prepare(model, [
        {"tensor_fqn": "fc1.weight", "sparse_block_shape": (1, 576), "zeros_per_block": 576},
        {"tensor_fqn": "fc2.weight", "sparse_block_shape": (1, 120), "zeros_per_block": 120},
    ])  # fmt: skip
    sparsifier.step()  # whole rows: half of fc1's and fc2's neurons
    torch.save(sparsifier.state_dict(), tmp_path / "sparsifier.pt")
    for name, kwargs in EXPORTERS.items():
        export(model, tmp_path / f"{name}.onnx", SHAPE, **kwargs)
    sparsifier.squash_mask()
    export(model, tmp_path / "squashed.onnx", SHAPE)
    plain = shrink(tmp_path / "squashed.onnx", validate=False)
    for name in EXPORTERS:
        for masks in (None, tmp_path / "sparsifier.pt"):
            result = shrink(tmp_path / f"{name}.onnx", masks, validate=False)
            assert error_against(tmp_path / f"{name}.onnx", result.model) <= 1e-5
            assert result.before.params == LENET_PARAMS
            assert result.after.params == plain.after.params
    assert plain.after.params == LENET_PARAMS - 60 * 577 - (84 * 120 - 42 * 60) - 42 - 42 * 10


def nni_wrap(module: nn.Module, mask: torch.Tensor) -> None:
    """Leave `module` as NNI 3's pruner does (its `ModuleWrapper`): the parameter and its mask
    under `_nni_wrapper`, the weight computed as their product at every call."""
    wrapper = nn.Module()
    wrapper.weight = nn.Parameter(module.weight.detach().clone())
    wrapper.register_buffer("weight_mask", mask)
    module._nni_wrapper = wrapper
    del module.weight
    forward = type(module).forward

    def masked(x):
        module.weight = wrapper.weight * wrapper.weight_mask
        return forward(module, x)

    module.forward = masked


def test_nni_wrapped_modules(tmp_path):
    torch.manual_seed(2)
    model = LeNet().eval()
    rows = torch.ones(120, 1)
    rows[::3] = 0
    cols = torch.ones(16, 1, 1, 1)
    cols[1::2] = 0
    nni_wrap(model.fc1, rows.expand(120, 576).clone())
    nni_wrap(model.conv2, cols.expand(16, 6, 3, 3).clone())
    assert "fc1._nni_wrapper.weight_mask" in model.state_dict()
    torch.save(model.state_dict(), tmp_path / "wrapped_state.pt")
    nested = {"fc1": {"weight": rows.expand(120, 576)}, "conv2": {"weight": cols.expand(16, 6, 3, 3)}}
    torch.save(nested, tmp_path / "nni_masks.pt")  # what pruner.compress() returns
    for name, kwargs in EXPORTERS.items():
        path = tmp_path / f"{name}.onnx"
        export(model, path, SHAPE, **kwargs)
        for masks in (None, tmp_path / "wrapped_state.pt", tmp_path / "nni_masks.pt"):
            logs: list[str] = []
            result = shrink(path, masks, validate=False, log=logs.append)
            assert error_against(path, result.model) <= 1e-5
            assert result.before.params == LENET_PARAMS
            # 40 of fc1's neurons and 8 of conv2's filters (with fc1's columns) go
            assert result.after.params == LENET_PARAMS - 40 * 577 - 8 * 55 - 80 * 8 * 36 - 40 * 84
            if masks is not None:
                fmt = "nni-wrapped" if "state" in masks.name else "nni"
                assert any(line.startswith(f"{fmt} masks: 2 of 2 bound") for line in logs)
            computed = [line for line in logs if "computes from constants" in line]
            assert len(computed) == (1 if name == "dynamo" else 0)  # fc1's product (legacy folds it)


# ------------------------------------------------------------------ what is a computed weight
def test_a_product_of_constants_is_stored_as_the_weight_it_is():
    model = tiny(
        """g (float[1, 4] x, float[3, 4] W, float[3, 4] M, float[4, 3] V, float[3] B) => (float[1, 3] y, float[1, 3] z) {
             w = Mul (W, M)
             y = Gemm <transB = 1> (x, w)
             t = Transpose (V)
             u = Add (t, B)
             z = MatMul (x, V)
           }""",
        zero={"M": np.s_[1]},
    )
    before = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert fold_computed_weights(model) == ["w"]
    after = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert sorted(after) == ["B", "V", "w"]  # W and M gone; V, read elsewhere too, stays
    assert np.array_equal(after["w"], before["W"] * before["M"])
    assert [n.op_type for n in model.graph.node] == ["Gemm", "Transpose", "Add", "MatMul"]


@pytest.mark.parametrize(
    "body",
    [
        # a conversion: how the model stores a weight (int8 with its scale) is its choice
        "w = DequantizeLinear (Q, S)\n y = MatMul (x, w)",
        # one stored tensor, viewed: nothing to combine
        "w = Transpose (V)\n y = MatMul (x, w)",
        # larger than what it is computed from
        "w = Expand (R, Shp)\n y = MatMul (x, w)",
    ],
)
def test_what_is_left_as_written(body):
    model = tiny(
        f"""g (float[1, 4] x, int8[4, 3] Q, float S, float[3, 4] V, float[1, 3] R, int64[2] Shp) => (float[1, 3] y) {{
             {body}
           }}""",
        values={"S": 0.5, "Shp": [4, 3], "Q": np.arange(12, dtype=np.int8).reshape(4, 3)},
    )
    assert fold_computed_weights(model) == []


def test_an_initializer_the_user_can_feed_is_not_a_constant():
    model = tiny(
        """g (float[1, 4] x, float[4, 3] W, float[4, 3] M) => (float[1, 3] y) {
             w = Mul (W, M)
             y = MatMul (x, w)
           }"""
    )
    model.graph.input.append(onnx.helper.make_tensor_value_info("M", onnx.TensorProto.FLOAT, [4, 3]))
    assert fold_computed_weights(model) == []

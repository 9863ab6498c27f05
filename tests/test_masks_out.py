"""`--masks-out` is a framework state dict: the framework's names only, each of its parameter's
shape, so that it loads strictly into the module it came from; a tensor the framework has no
name for goes under `onnx/NAME`, apart; applied back to the unpruned ONNX model it gives the
prune's model exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from conftest import error_against, export_cached, params, run
from torch import nn
from torch.nn.utils import prune as torch_prune

from models.zoo import ZOO, export, randomize
from onnxshrink import shrink
from onnxshrink.cli import main


def strict_check(module: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """load_state_dict's strict check of what is there: every name one of the module's, of its
    shape (a masks file holds no running statistics and no unmasked parameters)."""
    own = module.state_dict()
    unexpected = sorted(set(masks) - set(own))
    assert unexpected == []
    wrong = [k for k in masks if tuple(masks[k].shape) != tuple(own[k].shape)]
    assert wrong == []


def masked_in_torch(module: nn.Module, masks: dict[str, torch.Tensor]) -> nn.Module:
    """The masks applied in the framework, as a pruner's user does: torch.nn.utils.prune."""
    for name, mask in masks.items():
        owner, _, param = name.rpartition(".")
        torch_prune.custom_from_mask(module.get_submodule(owner), param, mask)
    return module


@pytest.mark.parametrize("suffix", [".pt", ".npz", ".safetensors"])
def test_masks_out_of_a_resnet_loads_strictly_into_the_module(zoo_dir, tmp_path, suffix):
    entry = ZOO["resnet_basic"]
    path = export_cached(zoo_dir, ("masks-out", "resnet_basic"), lambda: (randomize(entry.build(), seed=1), entry.input_shape, {}))
    out, masks_path = tmp_path / "small.onnx", tmp_path / f"masks{suffix}"
    assert main([str(path), "--prune", "0.3", "-o", str(out), "--masks-out", str(masks_path), "-q"]) == 0
    if suffix == ".pt":
        masks = torch.load(masks_path, weights_only=True)
    elif suffix == ".npz":
        masks = {k: torch.from_numpy(v) for k, v in np.load(masks_path).items()}
    else:
        from safetensors.torch import load_file

        masks = load_file(str(masks_path))
    module = randomize(entry.build(), seed=1)
    strict_check(module, masks)
    # conv filters, the BatchNorms folded into them, the next convs' input columns, fc's columns
    assert {k.rpartition(".")[2] for k in masks} == {"weight", "bias"}
    assert sum(int((m == 0).any()) for m in masks.values()) == len(masks)
    # the masks applied in PyTorch give the pruned model's function
    x = torch.randn(*entry.input_shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = masked_in_torch(module, masks)(x).numpy()
    got = run(onnx.load(out), {"x": x.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # and applied to the unpruned export, the same parameters as the prune
    again = shrink(path, masks_path, validate=False, input_masked=False)
    assert again.after.params == params(onnx.load(out))
    assert error_against(onnx.load(out), again.model) <= 1e-5


class STFT(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("forward_basis_buffer", torch.randn(12, 1, 8))

    def forward(self, x):
        return F.conv1d(x[:, None], self.forward_basis_buffer, stride=4)


class Framed(nn.Module):
    """Silero VAD's front end, small: a framing conv over a buffer (`stft.forward_basis_buffer`,
    read by F.conv1d: its module has no `weight`), a conv encoder and an LSTM, whose ONNX weights
    (gates packed and reordered) have no framework name."""

    def __init__(self):
        super().__init__()
        self.stft = STFT()
        self.encoder = nn.Conv1d(12, 10, 3)
        self.lstm = nn.LSTM(10, 6, batch_first=True)
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        h = torch.relu(self.encoder(self.stft(x)))
        y, _ = self.lstm(h.transpose(1, 2))
        return self.out(y[:, -1])


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_buffers_keep_their_names_and_graph_only_tensors_go_apart(tmp_path, exporter):
    torch.manual_seed(3)
    module = Framed().eval()
    path = tmp_path / "framed.onnx"
    export(module, path, (1, 64), **({"dynamo": False} if exporter == "legacy" else {}))
    masks_path = tmp_path / "masks.npz"
    assert main([str(path), "--prune", "0.5", "-o", str(tmp_path / "small.onnx"),
                 "--masks-out", str(masks_path), "-q"]) == 0  # fmt: skip
    masks = dict(np.load(masks_path))
    framework = {k: v for k, v in masks.items() if not k.startswith("onnx/")}
    # the LSTM's weights (packed gates, `onnx::LSTM_125` or `val_47`): apart; its hidden units
    # are prune units too, so the Linear after it loses columns
    assert sorted(framework) == ["encoder.bias", "encoder.weight", "out.weight", "stft.forward_basis_buffer"]
    lstm = set(masks) - set(framework)
    assert sorted(masks[k].shape for k in lstm) == [(1, 4 * 6, 6), (1, 4 * 6, 10), (1, 8 * 6)]
    # the framing conv's filters are the buffer's rows: under its own name, not `stft.weight`
    assert "stft.forward_basis_buffer" in framework and "stft.weight" not in masks
    strict_check(module, {k: torch.from_numpy(v) for k, v in framework.items()})
    assert (framework["stft.forward_basis_buffer"].reshape(12, -1).all(axis=1) == 0).sum() == 6
    # the round trip: the same parameter count as the prune
    small = onnx.load(tmp_path / "small.onnx")
    again = shrink(path, masks_path, validate=False, input_masked=False)
    assert again.after.params == params(small)
    assert error_against(small, again.model) <= 1e-5


def test_a_prune_that_removes_nothing_writes_no_masks_file(tmp_path, capsys):
    entry = ZOO["resnet_basic"]
    path = tmp_path / "m.onnx"
    export(randomize(entry.build(), seed=1), path, entry.input_shape)
    masks = tmp_path / "masks.npz"
    argv = [str(path), "--prune", "0.5", "--ignore", "*", "-o", str(tmp_path / "out.onnx"), "--masks-out", str(masks)]
    assert main(argv) == 0
    assert f"[W] no masks written to {masks}: nothing was pruned" in capsys.readouterr().out
    assert not masks.exists()



def _pruned_with_masks_out(model: onnx.ModelProto, path: Path) -> tuple[dict, dict, Path, Path]:
    """`model` saved at `path` and pruned by the CLI (`--prune 0.5 --masks-out masks.pt`): the
    masks as torch loads them (weights_only), those under framework names, the output, the file."""
    out, masks_path = path.with_name("small.onnx"), path.with_name("masks.pt")
    onnx.save(model, path)
    assert main([str(path), "--prune", "0.5", "-o", str(out), "--masks-out", str(masks_path), "-q"]) == 0
    masks = torch.load(masks_path, weights_only=True)
    return masks, {k: v for k, v in masks.items() if not k.startswith("onnx/")}, out, masks_path


def bare_torch_export(seed: int = 5) -> tuple[onnx.ModelProto, dict[str, torch.Tensor]]:
    """Two Linear layers as torch's dynamo exporter writes them for a rank-3 input (MatMul by
    the transposed weight it made, `val_N`; Add of the bias under its state_dict name), its
    nodes' module scopes dropped (as a later tool drops node metadata); and the state dict."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    state = {"fc1.weight": (16, 8), "fc1.bias": (16,), "fc2.weight": (4, 16), "fc2.bias": (4,)}
    state = {k: rng.standard_normal(s).astype(np.float32) for k, s in state.items()}
    inits = [
        numpy_helper.from_array(state["fc1.weight"].T.copy(), "val_0"),
        numpy_helper.from_array(state["fc1.bias"], "fc1.bias"),
        numpy_helper.from_array(state["fc2.weight"].T.copy(), "val_1"),
        numpy_helper.from_array(state["fc2.bias"], "fc2.bias"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "val_0"], ["m1"], name="node_MatMul_1"),
        helper.make_node("Add", ["m1", "fc1.bias"], ["a1"], name="node_Add_2"),
        helper.make_node("Relu", ["a1"], ["r"], name="node_Relu_3"),
        helper.make_node("MatMul", ["r", "val_1"], ["m2"], name="node_MatMul_4"),
        helper.make_node("Add", ["m2", "fc2.bias"], ["y"], name="node_Add_5"),
    ]
    graph = helper.make_graph(
        nodes, "main_graph", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, producer_name="pytorch", opset_imports=[helper.make_opsetid("", 18)])
    return model, {k: torch.from_numpy(v) for k, v in state.items()}


def test_a_torch_export_without_module_scopes_keeps_onnx_names_apart(tmp_path):
    """No module scopes on the nodes: the tensors named as the framework names them
    (`fc1.bias`) stay framework names, and those the exporter made (the transposed Linear
    weights, `val_N`) go under onnx/; the .pt loads with weights_only and, reapplied, gives the
    prune's model."""
    model, state = bare_torch_export()
    module = nn.Sequential()
    module.fc1, module.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
    module.load_state_dict(state)
    bare = tmp_path / "bare.onnx"
    masks, framework, out, masks_path = _pruned_with_masks_out(model, bare)
    assert sorted(framework) == ["fc1.bias"] and sorted(set(masks) - set(framework)) == ["onnx/val_0", "onnx/val_1"]
    strict_check(module, framework)
    dropped = framework["fc1.bias"] == 0
    assert int(dropped.sum()) == 8  # half of fc1's 16 neurons: its columns of val_0, rows of val_1
    assert (masks["onnx/val_0"][:, dropped] == 0).all() and (masks["onnx/val_0"][:, ~dropped] == 1).all()
    assert (masks["onnx/val_1"][dropped] == 0).all() and (masks["onnx/val_1"][~dropped] == 1).all()
    small = onnx.load(out)
    again = shrink(bare, masks_path, validate=False, input_masked=False)
    assert again.after.params == params(small) == 8 * 8 + 8 + 8 * 4 + 4
    assert error_against(small, again.model) <= 1e-5


def torch_prelu_export(slope: np.ndarray, seed: int = 3) -> tuple[onnx.ModelProto, dict[str, torch.Tensor]]:
    """Conv -> PReLU(8) -> Conv as torch's TorchScript exporter writes it (node scopes /conv,
    /act, /head): the PReLU slope, [8] in the state dict, is stored unsqueezed to [8, 1, 1] under
    a name the exporter made (`onnx::PRelu_11`). And the state dict."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    state = {
        "conv.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "conv.bias": rng.standard_normal(8).astype(np.float32),
        "act.weight": slope.astype(np.float32),
        "head.weight": rng.standard_normal((4, 8, 1, 1)).astype(np.float32),
        "head.bias": rng.standard_normal(4).astype(np.float32),
    }
    inits = [numpy_helper.from_array(v, k) for k, v in state.items() if k != "act.weight"]
    inits.append(numpy_helper.from_array(state["act.weight"].reshape(8, 1, 1), "onnx::PRelu_11"))
    nodes = [
        helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"], name="/conv/Conv", pads=[1, 1, 1, 1]),
        helper.make_node("PRelu", ["c", "onnx::PRelu_11"], ["p"], name="/act/PRelu"),
        helper.make_node("Conv", ["p", "head.weight", "head.bias"], ["y"], name="/head/Conv"),
    ]
    graph = helper.make_graph(
        nodes, "main_graph", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, producer_name="pytorch", opset_imports=[helper.make_opsetid("", 18)])
    return model, {k: torch.from_numpy(v) for k, v in state.items()}


@pytest.mark.parametrize("init", ["random", "default"])
def test_a_prelu_slope_the_exporter_reshaped_goes_under_its_onnx_name(tmp_path, init):
    """A PReLU slope torch keeps as [8] and the exporter stores as [8, 1, 1] under a name of its
    own: named `act.weight` with the stored shape, the masks file did not load into the module
    and onnxshrink could not bind it back (exit 2). It goes under onnx/ by the stored name; the
    rest loads strictly, and the file reapplied gives the prune's model."""
    slope = np.random.default_rng(1).uniform(0.05, 0.5, 8) if init == "random" else np.full(8, 0.25)
    model, state = torch_prelu_export(slope)
    module = nn.Sequential()
    module.conv, module.act, module.head = nn.Conv2d(3, 8, 3, padding=1), nn.PReLU(8), nn.Conv2d(8, 4, 1)
    module.load_state_dict(state)
    path = tmp_path / "m.onnx"
    masks, framework, out, masks_path = _pruned_with_masks_out(model, path)
    assert sorted(masks) == ["conv.bias", "conv.weight", "head.weight", "onnx/onnx::PRelu_11"]
    strict_check(module, framework)
    dropped = masks["conv.bias"] == 0
    assert int(dropped.sum()) == 4  # half of the 8 filters, with their slopes and head columns
    assert (masks["onnx/onnx::PRelu_11"].reshape(8) == ~dropped).all()
    assert (masks["head.weight"][:, dropped] == 0).all() and (masks["head.weight"][:, ~dropped] == 1).all()
    small = onnx.load(out)
    assert params(small) == 4 * 27 + 4 + 4 + 4 * 4 + 4
    again = shrink(path, masks_path, validate=False, input_masked=False)
    assert again.after.params == params(small)
    assert error_against(small, again.model) <= 1e-5
    # the masks applied in PyTorch (the slope's by hand, as its flags) give the prune's function
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        masked_in_torch(module, framework)
        module.act.weight.mul_(masks["onnx/onnx::PRelu_11"].reshape(8))
        want = module(x).numpy()
    got = run(small, {"x": x.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()

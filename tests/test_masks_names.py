"""`--masks-out` names each mask by the parameter it really is, as the model records it: a
module called several times (an LSTMCell stepped over time, a block applied to three inputs)
has one parameter per name, whatever call scope (`cell_2`, `mlp.0_1`) the exporter gave its
nodes; a Gemm reading `weight_hh` is masked as `weight_hh`, not as an invented `weight`; a
wrapper's attribute (`m.`) the scopes leave out is taken from the recorded names. The .pt loads
with weights_only into the module's state dict, and the masks applied back to the unpruned
export give the prune's parameter count and outputs."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from conftest import error_against, params, with_masks
from torch import nn

from onnxshrink import shrink
from onnxshrink.bind.graph import framework_modules
from onnxshrink.cli import main


class Stepped(nn.Module):
    """An LSTMCell run over 3 steps: every step's two Gemms read `cell.weight_ih` [24, 8] and
    `cell.weight_hh` [24, 6] under scopes `cell`, `cell_1`, `cell_2`."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(8, 6)
        self.up = nn.Linear(6, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 6)
        c = torch.zeros(x.shape[0], 6)
        for t in range(3):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(torch.relu(self.up(h)))


class Thrice(nn.Module):
    """One block applied to three inputs: its Linear weights are read by MatMuls (3-D inputs)
    as transposed constants the exporter names `onnx::MatMul_N`, under scopes `mlp.0`,
    `mlp.0_1`, `mlp.0_2`."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, a, b, c):
        return self.mlp(a) + self.mlp(b) + self.mlp(c)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.combine = nn.Linear(16, 4)


class Wrapped(nn.Module):
    """A wrapper calling its inner model's layers itself: the scopes say `up`, `combine`; the
    parameters are `m.up.bias`, `m.combine.bias`."""

    def __init__(self):
        super().__init__()
        self.m = Inner()

    def forward(self, x):
        return self.m.combine(torch.relu(self.m.up(x)))


def exported(module: nn.Module, shapes: list[tuple[int, ...]], path) -> dict[str, np.ndarray]:
    torch.onnx.export(module, tuple(torch.randn(*s) for s in shapes), str(path), dynamo=False)
    return {f"x{i}": np.random.default_rng(i).standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}


def round_trip(module: nn.Module, shapes: list[tuple[int, ...]], tmp_path, same: bool = True) -> dict[str, torch.Tensor]:
    """Prune with --masks-out, check the written masks against the module's state dict, apply them
    back to the unpruned export (`same`: it gives the prune's model); the masks."""
    path, out, masks_path = tmp_path / "m.onnx", tmp_path / "small.onnx", tmp_path / "masks.pt"
    exported(module, shapes, path)
    assert main([str(path), "--prune", "0.5", "-o", str(out), "--masks-out", str(masks_path)]) == 0
    masks = torch.load(masks_path, weights_only=True)
    own = module.state_dict()
    framework = {k: v for k, v in masks.items() if not k.startswith("onnx/")}
    assert sorted(set(framework) - set(own)) == []
    assert [k for k in framework if tuple(framework[k].shape) != tuple(own[k].shape)] == []
    small, original = onnx.load(out), onnx.load(path)
    again = shrink(path, masks_path, validate=False, input_masked=False)
    if not same:  # the masks, multiplied into the initializers of their names here, are what it computes
        inits = {t.name for t in original.graph.initializer}
        by_name = {k.removeprefix("onnx/"): v.numpy() for k, v in masks.items()}
        assert error_against(with_masks(original, {k: v for k, v in by_name.items() if k in inits}), again.model) <= 1e-5
    else:
        assert again.after.params == params(small) < params(original)
        assert error_against(small, again.model) <= 1e-5
    return masks


def test_an_lstm_cell_stepped_over_time_masks_weight_ih_and_weight_hh(tmp_path, capsys):
    torch.manual_seed(0)
    module = Stepped().eval()
    masks = round_trip(module, [(2, 3, 8)], tmp_path)
    # every step reads the one weight_ih and weight_hh: a hidden unit goes from every step, so
    # each has one mask, and the masks applied back give the prune's model (round_trip)
    said = capsys.readouterr()
    assert "zeroed differently" not in said.out + said.err
    assert {"cell.weight_ih", "cell.weight_hh", "cell.bias_ih", "cell.bias_hh"} <= set(masks)
    assert not any("cell_" in k for k in masks)
    gone = masks["cell.weight_hh"].reshape(4, 6, 6).sum(axis=(0, 2)) == 0  # a unit: its 4 gate rows
    assert gone.any() and (masks["cell.weight_hh"][:, gone] == 0).all()
    # the hidden neurons of `up` go: its rows and bias, head's columns
    assert {"up.weight", "up.bias", "head.weight"} <= set(masks)
    assert int((masks["up.bias"] == 0).sum()) == 6
    assert (masks["head.weight"][:, masks["up.bias"] == 0] == 0).all()


def test_a_block_called_three_times_is_masked_as_its_one_parameter(tmp_path):
    torch.manual_seed(1)
    module = Thrice().eval()
    masks = round_trip(module, [(2, 5, 8)] * 3, tmp_path)
    framework = sorted(k for k in masks if not k.startswith("onnx/"))
    assert framework and all(k.split(".")[1] in ("0", "2") for k in framework)
    assert not any("_1" in k or "_2" in k for k in framework)


def test_a_wrapped_module_keeps_its_wrapper_prefix(tmp_path):
    torch.manual_seed(2)
    module = Wrapped().eval()
    masks = round_trip(module, [(2, 5, 8)], tmp_path)
    framework = sorted(k for k in masks if not k.startswith("onnx/"))
    assert framework == ["m.combine.weight", "m.up.bias", "m.up.weight"]
    dropped = masks["m.up.bias"] == 0
    assert int(dropped.sum()) == 8
    assert (masks["m.up.weight"][dropped] == 0).all() and (masks["m.up.weight"][~dropped] == 1).all()
    assert (masks["m.combine.weight"][:, dropped] == 0).all()


def test_framework_modules_read_scopes_against_the_recorded_names():
    names = ["m.combine.bias", "cell.weight_ih", "mlp.0.bias", "block_1.weight", "onnx::MatMul_3"]
    scopes = ["combine", "cell_2", "cell", "mlp.0_1", "block_1", "other_1", None, "combine_1"]
    assert framework_modules(scopes, names) == [
        "m.combine", "cell", "cell", "mlp.0", "block_1", "other_1", None, "m.combine",
    ]  # fmt: skip
    # a scope's first part recorded under two prefixes: left as it is
    assert framework_modules(["up"], ["a.up.weight", "b.up.weight"]) == ["up"]


def test_the_paths_a_module_is_recorded_under_are_indexed_by_its_last_part():
    """What framework_modules looks a scope's first part up in (it searched every owner)."""
    from onnxshrink.bind.graph import _owners, _under

    owners = _owners(["m.combine.bias", "a.up.weight", "b.up.weight", "cell.weight_ih", "onnx::MatMul_3"])
    assert owners == {"m", "m.combine", "a", "a.up", "b", "b.up", "cell"}
    assert _under(owners) == {"combine": {"m."}, "up": {"a.", "b."}}


def test_one_name_for_two_tensors_of_different_shapes_names_neither():
    """Two tensors given one parameter name (as the scopes once named an LSTMCell's weight_ih
    and weight_hh `cell_1.weight`): each goes under onnx/ by its own name, with a note."""
    from onnx import helper, numpy_helper

    from onnxshrink.prune.groups import Member, ParamRef
    from onnxshrink.prune.masks_out import mask_slices

    inits = [numpy_helper.from_array(np.ones(s, np.float32), n) for n, s in (("a", (4, 3)), ("b", (4, 5)))]
    model = helper.make_model(helper.make_graph([], "g", [], [], inits))

    def member(name: str, shape: tuple[int, int], index: int) -> Member:
        ref = ParamRef("cell_1.weight", 0, shape)
        return Member(name, 0, np.array([index]), name, "Gemm", "weight", "out", [ref], name)

    slices = mask_slices(model, [member("a", (4, 3), 1), member("b", (4, 5), 2)])
    masks = slices.masks()
    assert sorted(masks) == ["onnx/a", "onnx/b"]
    assert masks["onnx/a"].shape == (4, 3) and masks["onnx/b"].shape == (4, 5)
    assert [int(i) for i in np.flatnonzero(~masks["onnx/a"].all(axis=1))] == [1]
    assert [int(i) for i in np.flatnonzero(~masks["onnx/b"].all(axis=1))] == [2]
    assert slices.notes == ["'cell_1.weight' names tensors of different shapes (a, b): no mask under it"]

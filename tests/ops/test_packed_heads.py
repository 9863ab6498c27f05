"""torch.nn.MultiheadAttention's heads as prune units (analyze/coupling.py, prune/groups.py): its
packed in_proj ([3E, E], its output viewed as [.., 3, E] whose q, k, v slots constant Gathers pick
out) is cut by heads, not into its q/k/v thirds, and the heads survive torch's merge of batch
with heads ([T, B, E] -> [T, B*H, hd]) and the later split B*H -> [B, H]. A head is one `head`
group: its rows in each of q, k, v's slices of the weight and bias, and its out_proj columns.
`prune(units=head)` removes heads exactly against the module with those heads zeroed here
(torch's default init, zero biases, and random biases).
"""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import params

from onnxshrink.prune import find_groups, prune

E, HEADS, T, B = 16, 4, 5, 2
HD = E // HEADS


class Attention(torch.nn.Module):
    def __init__(self, batch_first: bool, biases: bool) -> None:
        super().__init__()
        self.a = torch.nn.MultiheadAttention(E, HEADS, batch_first=batch_first)
        if biases:  # torch's default init zeroes both biases
            with torch.no_grad():
                self.a.in_proj_bias.normal_()
                self.a.out_proj.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x, x, x, need_weights=False)[0]


_EXPORTS: dict[tuple[bool, bool], tuple[dict, bytes, np.ndarray]] = {}


def exported(batch_first: bool, biases: bool) -> tuple[Attention, onnx.ModelProto, np.ndarray]:
    """The module (fresh), its legacy export (once per session) and an input. The dynamo
    exporter's graph has the same Reshape/Unsqueeze/Transpose/Squeeze/Gather structure (checked
    by hand: `--groups` lists 4 heads, 4 exact), but takes 13 s to export here."""
    key = (batch_first, biases)
    if key not in _EXPORTS:
        torch.manual_seed(3)
        module = Attention(batch_first, biases).eval()
        x = torch.randn(B, T, E) if batch_first else torch.randn(T, B, E)
        buf = io.BytesIO()
        torch.onnx.export(module, (x,), buf, dynamo=False, input_names=["x"], output_names=["y"])
        _EXPORTS[key] = ({k: v.clone() for k, v in module.state_dict().items()}, buf.getvalue(), x.numpy())
    state, data, x = _EXPORTS[key]
    module = Attention(batch_first, biases).eval()
    module.load_state_dict(state)
    return module, onnx.load_from_string(data), x


def head_rows(h: int) -> list[int]:
    """Head h's rows of the packed projection: in each of the q, k, v slices."""
    return [s * E + h * HD + d for s in range(3) for d in range(HD)]


def heads_of(members) -> list[int]:
    """The heads a group's members hold, by their out_proj columns (`params` names the parameter)."""
    cols = {int(i) for m in members for p in m.params if p.name.endswith("out_proj.weight") for i in m.indices}
    return sorted({c // HD for c in cols})


CASES = [(False, True), (True, False)]


@pytest.mark.parametrize("batch_first, biases", CASES)
def test_each_head_of_a_packed_projection_is_one_exact_head_group(batch_first, biases):
    _, model, _ = exported(batch_first, biases)
    gset = find_groups(model)
    [lay] = [la for la in gset.layers if la.kind == "head"]
    assert len(lay.groups) == HEADS and all(gset.groups[i].exact for i in lay.groups)
    assert not any(la.kind == "head" for la in gset.layers if la is not lay)
    for h, gid in enumerate(sorted(lay.groups, key=lambda g: heads_of(gset.groups[g].members))):
        group = gset.groups[gid]
        assert heads_of(group.members) == [h]
        assert group.unit.head_dim == HD and group.unit.channels == 3 * HD
        got = {tuple(int(i) for i in m.indices) for m in group.members}
        assert got == {tuple(head_rows(h)), tuple(range(h * HD, (h + 1) * HD))}
        assert group.params == 3 * HD * E + 3 * HD + E * HD


@pytest.mark.parametrize("batch_first, biases", CASES)
def test_prune_removes_heads_exactly_against_them_zeroed_here(batch_first, biases):
    module, model, x = exported(batch_first, biases)
    result = prune(model, 0.5, units=["head"], draws=1, price=False)
    assert result.shrink.validation.passed
    gone = sorted(h for gid in result.removed() for h in heads_of(result.groups.groups[gid].members))
    assert len(gone) == HEADS // 2
    assert params(model) - params(result.model) == len(gone) * (3 * HD * E + 3 * HD + E * HD)
    rows = [r for h in gone for r in head_rows(h)]
    cols = [h * HD + d for h in gone for d in range(HD)]
    with torch.no_grad():
        module.a.in_proj_weight[rows] = 0
        module.a.in_proj_bias[rows] = 0
        module.a.out_proj.weight[:, cols] = 0
        want = module(torch.from_numpy(x)).numpy()
    sess = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    [got] = sess.run(None, {"x": x})
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the removal changed the output: the zeroed heads counted
    sess0 = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.abs(sess0.run(None, {"x": x})[0] - want).max() > 1e-3

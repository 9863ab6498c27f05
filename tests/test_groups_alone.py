"""`--groups` says of each group whether it is removable on its own: each group listed exact is
zeroed alone (here, with numpy) and shrinks with all of it removed, the shrunk model equal to the
zeroed input in onnxruntime; a group the shrink keeps when it is zeroed alone is listed not
exact, with the reason. Zeroed together with half of every layer (the check before), a group
inside a residual branch passed whenever its branch's block group, zeroed with it, emptied the
branch: alone, it is the last live channel the branch's Conv reads, or the last of a Split's part."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import ort_run, tiny
from onnx import numpy_helper

from onnxshrink import shrink
from onnxshrink.cli import main

HEAD = (
    "g (float[1,2,4,4] x, float[4,2,1,1] Ws, float[4] Bs, float[{n},4,1,1] W1, float[{n}] B1, "
    "float[4,{n},1,1] W2, float[4] B2, float[4,3] Wf, float[3] Bf) => (float[1,3] y) {{\n"
)
TAIL = """
  c = Conv(q, W2, B2)
  t = Add(r, c)
  p = GlobalAveragePool(t)
  f = Flatten(p)
  y = Gemm(f, Wf, Bf)
}
"""
# a stem, a residual block whose branch has 3 inner channels, a head; W1's rows 1 and 2 (and
# their biases) zero: channel 0 is the last one the branch's second Conv reads
LAST_LIVE = (
    HEAD.format(n=3)
    + "  s = Conv(x, Ws, Bs)\n  r = Relu(s)\n  a = Conv(r, W1, B1)\n  q = Relu(a)"
    + TAIL
)
# the branch's 4 inner channels split in two parts; W1's row 1 zero: row 0 is its part's last
SPLIT = (
    HEAD.format(n=4)
    + "  s = Conv(x, Ws, Bs)\n  r = Relu(s)\n  a = Conv(r, W1, B1)\n"
    + "  p1, p2 = Split <axis = 1, num_outputs = 2> (a)\n  q1 = Relu(p1)\n  q2 = Tanh(p2)\n"
    + "  q = Concat <axis = 1> (q2, q1)"
    + TAIL
)
BIASES = ("Bs", "B1", "B2", "Bf")


def listed(tmp_path, model: onnx.ModelProto, capsys) -> tuple[dict, str]:
    """The groups `--groups` writes, and what it prints."""
    path, out = tmp_path / "m.onnx", tmp_path / "g.json"
    onnx.save(model, path)
    capsys.readouterr()
    assert main([str(path), "--groups", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def zeroed_alone(model: onnx.ModelProto, group: dict) -> onnx.ModelProto:
    """`model` with the group's member slices set to zero here (each initializer read once)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name: t for t in out.graph.initializer}
    for m in group["members"]:
        arr = numpy_helper.to_array(inits[m["initializer"]]).copy()
        index = [slice(None)] * arr.ndim
        index[m["axis"]] = m["indices"]
        arr[tuple(index)] = 0
        inits[m["initializer"]].CopyFrom(numpy_helper.from_array(arr, m["initializer"]))
    return out


def dims(model: onnx.ModelProto) -> dict[str, list[int]]:
    return {t.name: list(t.dims) for t in model.graph.initializer}


def live(model: onnx.ModelProto, group: dict) -> bool:
    """Every weight slice of the group (a bias may be zero) holds a non-zero value in `model`:
    the shrink of it keeps them."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return all(
        np.abs(np.take(inits[m["initializer"]], i, axis=m["axis"])).sum() > 0
        for m in group["members"]
        if inits[m["initializer"]].ndim > 1
        for i in m["indices"]
    )


def check_listing(tmp_path, model: onnx.ModelProto, capsys, row: int, why: str | None) -> None:
    """The group of W1's `row` is listed not exact for `why` (None: exact); every group listed
    exact, zeroed alone here, shrinks with all of it removed, equal to the zeroed input."""
    groups, printed = listed(tmp_path, model, capsys)
    assert groups["checked"] == "alone"
    assert "each exact group was zeroed alone" in printed
    [group] = [g for g in groups["groups"] if _rows(g, "W1") == [row]]
    if why is None:
        assert group["exact"] and live(model, group), group["reason"]
    else:
        assert not group["exact"], "the last live channel is listed exact"
        assert why in group["reason"], group["reason"]
        assert f"not exact: {group['reason']}" in printed  # the layer's line says why
    base = dims(shrink(model, validate=False, progress=False).model)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 2, 4, 4)).astype(np.float32)}
    exact = [g for g in groups["groups"] if g["exact"]]
    assert len(exact) >= 5
    for g in exact:
        reference = zeroed_alone(model, g)
        result = shrink(reference, validate=False, progress=False).model
        after = dims(result)
        if live(model, g):  # all of it goes: each member axis is its indices shorter
            for m in g["members"]:
                name, axis = m["initializer"], m["axis"]
                assert after.get(name, [0] * 4)[axis] == base[name][axis] - len(m["indices"]), (
                    g["id"],
                    name,
                )
        np.testing.assert_allclose(
            ort_run(result, feeds)[0], ort_run(reference, feeds)[0], rtol=1e-5, atol=1e-5
        )


def _rows(group: dict, name: str) -> list[int] | None:
    """The indices of the group's member `name` on axis 0 (its rows), None when it has none."""
    rows = [m["indices"] for m in group["members"] if m["initializer"] == name and m["axis"] == 0]
    return rows[0] if len(rows) == 1 else None


@pytest.mark.parametrize("init", ["random", "zero_biases"])
def test_the_last_live_channel_a_conv_reads_is_not_exact_alone(tmp_path, capsys, init):
    """Random biases: the branch's second Conv adds its bias whatever it reads, so it keeps one
    input channel, the last live one. Zero biases (a default init): with that channel gone the
    branch is zero, and goes whole: the channel is exact (no rule of shapes says otherwise)."""
    values = (
        {b: np.zeros(n) for b, n in zip(BIASES, (4, 3, 4, 3), strict=True)}
        if init == "zero_biases"
        else None
    )
    model = tiny(LAST_LIVE, zero={"W1": np.s_[1:], "B1": np.s_[1:]}, values=values, seed=3)
    why = "an input needs at least one channel" if values is None else None
    check_listing(tmp_path, model, capsys, 0, why)


def test_the_last_live_channel_before_a_sigmoid_is_not_exact_alone_with_zero_biases(
    tmp_path, capsys
):
    """Zero biases, and the branch's output through a Sigmoid (0 -> 0.5): the branch stays."""
    text = LAST_LIVE.replace("t = Add(r, c)", "c2 = Sigmoid(c)\n  t = Add(r, c2)")
    values = {b: np.zeros(n) for b, n in zip(BIASES, (4, 3, 4, 3), strict=True)}
    model = tiny(text, zero={"W1": np.s_[1:], "B1": np.s_[1:]}, values=values, seed=3)
    check_listing(tmp_path, model, capsys, 0, "an input needs at least one channel")


def test_the_last_channel_of_a_split_part_is_not_exact_alone(tmp_path, capsys):
    model = tiny(SPLIT, zero={"W1": np.s_[1:2], "B1": np.s_[1:2]}, opset=18, seed=4)
    check_listing(tmp_path, model, capsys, 0, "each part of a Split keeps at least one index")


# 1,200 exact channel groups x 5 nodes: over the 5,000 node analyses checking each alone costs
WIDE_1x1 = """
g (float[1,2,1,1] x, float[600,2,1,1] W1, float[600] B1, float[600,600,1,1] W2, float[600] B2,
   float[3,600,1,1] W3, float[3] B3) => (float[1,3,1,1] y) {
  a = Conv(x, W1, B1)
  r = Relu(a)
  b = Conv(r, W2, B2)
  s = Relu(b)
  y = Conv(s, W3, B3)
}
"""


def test_a_large_model_is_checked_half_of_each_layer_at_a_time_and_the_listing_says_so(tmp_path, capsys):
    model = tiny(WIDE_1x1, seed=5)
    groups, printed = listed(tmp_path, model, capsys)
    assert groups["checked"] == "halves"
    exact = sum(g["exact"] for g in groups["groups"])
    assert exact == 1200  # W1's and W2's output channels; W3's are the output's
    line = f"not each alone: {exact} groups x {len(model.graph.node)} nodes is over 5,000 node analyses"
    assert line in printed


def test_groups_of_a_model_with_external_data_are_those_of_the_same_model_inline(tmp_path, capsys):
    """The weights stay on disk (mapped): the same groups, members and labels."""
    model = tiny(SPLIT, zero={"W1": np.s_[1:2], "B1": np.s_[1:2]}, opset=18, seed=4)
    inline, _ = listed(tmp_path, model, capsys)
    outside = tmp_path / "ext"
    outside.mkdir()
    onnx.save(model, outside / "m.onnx", save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    capsys.readouterr()
    assert main([str(outside / "m.onnx"), "--groups", str(outside / "g.json"), "-q"]) == 0
    external = json.loads((outside / "g.json").read_text())
    assert external["groups"] == inline["groups"] and external["checked"] == inline["checked"] == "alone"
    assert sum(not g["exact"] for g in external["groups"]) > 0

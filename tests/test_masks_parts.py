"""`--masks-out` for a weight read in parts: an LSTM whose packed W and R an exporter built at
run time from one stored tensor each, read by three Slices (PyTorch's gate order i, f, g, o
reordered to ONNX's i, o, f, c), as the OpenVINO-converted silero VAD ships. Each Slice is a
place of the tensor that zeroes its own gate's rows of a removed unit; one mask zeroing all of
them changes no place (no Slice reads another's rows), so it is written. Where a reader reads
the whole tensor, the union would zero rows it reads unzeroed: no mask, the tensor skipped.
"""

from __future__ import annotations

import numpy as np
import onnx
from conftest import ort_run
from onnx import TensorProto, helper, numpy_helper

from onnxshrink.prune import prune
from onnxshrink.prune.groups import Member
from onnxshrink.prune.masks_out import mask_slices

H, F = 5, 3
# PyTorch's blocks i, f, g, o of a [4H, .] weight -> ONNX's i, o, f, c: three Slices
PARTS = [(0, H), (3 * H, 4 * H), (H, 3 * H)]


def packed_lstm(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = {"w_ih": rng.normal(size=(4 * H, F)) * 0.6, "w_hh": rng.normal(size=(4 * H, H)) * 0.4,
         "B": rng.normal(size=(1, 8 * H)) * 0.3, "V": rng.normal(size=(H, 2))}  # fmt: skip
    nodes, inits = [], []
    for name in ("w_ih", "w_hh"):
        parts = []
        for k, (a, b) in enumerate(PARTS):
            for p, v in (("s", a), ("e", b)):
                inits.append(numpy_helper.from_array(np.array([v], np.int64), f"{name}_{p}{k}"))
            nodes.append(helper.make_node("Slice", [name, f"{name}_s{k}", f"{name}_e{k}", "ax0"], [f"{name}_{k}"], name=f"{name}_slice{k}"))
            parts.append(f"{name}_{k}")
        nodes.append(helper.make_node("Concat", parts, [f"{name}_cat"], axis=0))
        nodes.append(helper.make_node("Unsqueeze", [f"{name}_cat", "ax0"], [f"{name}_3d"]))
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "ax0"))
    nodes += [
        helper.make_node("LSTM", ["x", "w_ih_3d", "w_hh_3d", "B", "", "h0", "c0"], ["y", "yh", "yc"], hidden_size=H),
        helper.make_node("Squeeze", ["y", "ax1"], ["y3"]),
        helper.make_node("MatMul", ["y3", "V"], ["out"]),
    ]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "ax1"))
    inits += [numpy_helper.from_array(v.astype(np.float32), k) for k, v in w.items()]
    state = [1, 2, H]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [7, 2, F]),
         helper.make_tensor_value_info("h0", TensorProto.FLOAT, state),
         helper.make_tensor_value_info("c0", TensorProto.FLOAT, state)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [7, 2, 2]),
         helper.make_tensor_value_info("yh", TensorProto.FLOAT, state),
         helper.make_tensor_value_info("yc", TensorProto.FLOAT, state)],
        inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def masked_by_hand(m: onnx.ModelProto, masks: dict[str, np.ndarray]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    for t in out.graph.initializer:
        if t.name in masks:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * (masks[t.name] != 0), t.name))
    return out


def test_a_weight_read_in_parts_gets_one_mask_that_gives_the_pruned_model():
    m = packed_lstm()
    result = prune(m, 0.4, draws=1)
    assert result.shrink.validation.passed and result.skipped_masks == []
    masks = {k: np.asarray(v) for k, v in result.masks.items()}
    assert {"w_ih", "w_hh"} <= set(masks)
    gone = sorted({int(i) % H for i in np.flatnonzero((masks["w_ih"] == 0).all(axis=1))})
    assert len(gone) >= 1  # a unit's four gate rows, each zeroed through its own Slice
    assert set(np.flatnonzero((masks["w_ih"] == 0).all(axis=1))) == {g * H + u for g in range(4) for u in gone}
    hand = masked_by_hand(m, masks)
    rng = np.random.default_rng(3)
    for _ in range(3):
        feed = {"x": rng.normal(size=(7, 2, F)).astype(np.float32),
                "h0": rng.normal(size=(1, 2, H)).astype(np.float32) * 5,
                "c0": rng.normal(size=(1, 2, H)).astype(np.float32) * 5}  # fmt: skip
        for a, b in zip(ort_run(hand, feed), ort_run(result.model, feed), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_reader_of_the_whole_weight_leaves_it_without_a_mask():
    """Two places zero different rows of `w`; a third node reads all of it: no one mask."""
    w = np.arange(12, dtype=np.float32).reshape(6, 2)
    nodes = [helper.make_node("Slice", ["w", "s0", "e0", "ax"], ["a"], name="sa"),
             helper.make_node("Slice", ["w", "s1", "e1", "ax"], ["b"], name="sb")]  # fmt: skip
    inits = [numpy_helper.from_array(w, "w")] + [
        numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("s0", 0), ("e0", 3), ("s1", 3), ("e1", 6), ("ax", 0))
    ]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "ab"], inits)
    model = helper.make_model(graph)

    def member(node: str, idx: list[int]) -> Member:
        return Member("w", 0, np.array(idx, np.int64), node, "Slice", None, "", [], f"w_{node}")

    untied = {"w_sa": "w", "w_sb": "w"}
    got = mask_slices(model, [member("sa", [1]), member("sb", [4])], False, untied)
    assert got.skipped == [] and list(np.flatnonzero(got.masks()["w"][:, 0] == 0)) == [1, 4]
    model.graph.node.append(helper.make_node("Identity", ["w"], ["c"], name="whole"))
    got = mask_slices(model, [member("sa", [1]), member("sb", [4])], False, untied)
    assert got.skipped == ["w"] and "w" not in got.masks()
    # a Slice reading the other place's rows: rows 0:5 hold 4, which only sb zeroed
    model.graph.node.pop()
    model.graph.initializer.append(numpy_helper.from_array(np.array([5], np.int64), "e0x"))
    model.graph.node[0].input[2] = "e0x"
    got = mask_slices(model, [member("sa", [1]), member("sb", [4])], False, untied)
    assert got.skipped == ["w"]

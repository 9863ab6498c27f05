"""The float64 judge's twin of a large reference (past TWIN_BYTES of weights) is streamed: the
reference widened into a float64 data file, shrunk as a large model is (weights mapped, the
shrunk ones written to a file), compared and computed a tensor and a piece at a time. It decides
as the twin in memory does: a correct prune is rounding, a prune written wrong another model. The
sizes that decide are lowered here, so that a tiny LLaMA takes the large model's path (its prune
streamed, its twin too)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import onnxshrink.stages.attempt as attempt
from models.llama import LlamaConfig, build
from onnxshrink.errors import ValidationFailed
from onnxshrink.io.weights import tensor_values
from onnxshrink.proof import judge, widen
from onnxshrink.prune import prune, spill
from onnxshrink.prune import run as prune_run
from onnxshrink.stages import twin as twin_stage

DOWN = "model.layers.1.mlp.down_proj.weight_t"  # [ffn, hidden]: a row is one FFN neuron's output
FEED = {"input_ids": np.random.default_rng(0).integers(0, 128, (1, 16)).astype(np.int64)}


def _large(monkeypatch, tmp_path) -> list[tuple[Path, list[str]]]:
    """The large model's path for the prune, its shrink and its twin (the float64 runs in pieces
    of 8 KiB of weights), temporary files under `tmp_path`; each twin's scratch directory, with
    what it held when the twin was handed to the judge, listed as the twin is made."""
    monkeypatch.setattr(prune_run, "in_memory", lambda size: False)
    monkeypatch.setattr(spill, "SPILL_BYTES", 0)
    for stage in ("assemble", "save", "growth", "masking"):
        monkeypatch.setattr(f"onnxshrink.stages.{stage}.in_memory", lambda size: False)
    monkeypatch.setattr(judge, "TWIN_BYTES", 0)
    monkeypatch.setattr(widen, "PIECE_BYTES", 8192)
    monkeypatch.setattr(twin_stage.tempfile, "tempdir", str(tmp_path))
    made: list[tuple[Path, list[str]]] = []
    real = attempt.float64_twin

    def listed(reference, base_dir, shrink, near, streamed):
        assert streamed
        twin = real(reference, base_dir, shrink, near, streamed)
        assert twin.base_dir is not None
        made.append((twin.base_dir, sorted(os.listdir(twin.base_dir))))
        return twin

    monkeypatch.setattr(attempt, "float64_twin", listed)
    return made


def _written_wrong(monkeypatch, change, twin_too: bool) -> None:
    """The rewrite writes DOWN changed by `change` (its float64 values -> the wrong ones), in its
    file, in the shrink of the float32 reference, and with `twin_too` in its float64 twin's too (a
    bug of the rewrite: both shrinks wrong alike), else only there (a wrong value stored)."""
    apply = attempt.apply

    def wrong(analysis, reference, *streaming):
        result = apply(analysis, reference, *streaming)
        t = next(t for t in result.model.graph.initializer if t.name == DOWN)
        if twin_too or t.data_type == onnx.TensorProto.FLOAT:
            base = streaming[0].path.parent
            values = tensor_values(t, base)
            new = change(values.astype(np.float64)).astype(values.dtype)
            info = {e.key: e.value for e in t.external_data}
            with open(base / info["location"], "r+b") as f:
                os.pwrite(f.fileno(), new.tobytes(), int(info["offset"]))
        return result

    monkeypatch.setattr(attempt, "apply", wrong)


def _judged(path: Path, tmp_path: Path) -> ValidationFailed:
    """The prune of `path` proven at --rtol 0 on FEED alone: the proof fails its float32 tolerance
    whatever the model, and the judge decides."""
    with pytest.raises(ValidationFailed) as info:
        prune(path, 0.25, tmp_path / "out.onnx", rtol=0.0, recover=False, price=False, inputs=[FEED], draws=0)
    return info.value


def _in_memory(model: onnx.ModelProto, base_dir: Path | None) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            t.CopyFrom(numpy_helper.from_array(tensor_values(t, base_dir), t.name))
    return out


def _float32_difference(result, base: Path) -> float:
    """max |shrunk - reference| / max |reference| on FEED, run here in onnxruntime (float32)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    ref, new = (
        ort.InferenceSession(_in_memory(m, d).SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, FEED)[0]
        for m, d in ((result.reference, base), (result.model, result.data_file.parent))
    )
    return float(np.abs(new - ref).max() / np.abs(ref).max())


def _gone(made: list[tuple[Path, list[str]]], tmp_path: Path) -> None:
    """The twin was streamed (its scratch directory held its float64 data file when the judge
    had it, and the widened reference the judge computes in float64) and its scratch is gone."""
    assert len(made) == 1 and made[0][1] == ["reference.float64.data", "twin.float64.data"]
    assert not made[0][0].exists()
    assert not list(tmp_path.rglob(".onnxshrink-twin-*"))


def test_a_correct_prune_past_its_float32_tolerance_is_rounding_by_its_streamed_twin(tmp_path, monkeypatch):
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=3), path)
    made = _large(monkeypatch, tmp_path)
    failed = _judged(path, tmp_path)
    (o,) = failed.result.validation.outputs
    # float32 differs (a pruned width rounds otherwise), float64 finds the same function
    assert o.max_rel_error > 1e-8 and o.rounding is True
    assert o.float64 is not None and o.float64 < 1e-12
    assert "between the reference and its float64 twin;" in o.judged
    _gone(made, tmp_path)


@pytest.mark.parametrize(
    "what, change",
    [
        ("a weight off by 1e-4", lambda w: w * (1 + 1e-4)),
        ("a live channel dropped", lambda w: np.where(np.arange(len(w))[:, None] == 3, 0.0, w)),
    ],
)
def test_a_prune_written_wrong_is_another_function_by_its_streamed_twin(tmp_path, monkeypatch, what, change):
    """Both shrinks wrong alike (the rewrite's bug): the twin has the shrunk model's graph and
    constants, and in float64 it is another function, by the figure float32 shows (the error is
    far past float32's rounding, 2.7e-7 of the output here)."""
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=3), path)
    made = _large(monkeypatch, tmp_path)
    _written_wrong(monkeypatch, change, twin_too=True)
    failed = _judged(path, tmp_path)
    (o,) = failed.result.validation.outputs
    assert o.rounding is False and "its float64 twin: another function" in o.judged
    measured = _float32_difference(failed.result, path.parent)
    assert measured > 1e-5  # (far past rounding)
    assert o.float64 == pytest.approx(measured, rel=0.05)
    _gone(made, tmp_path)


def test_a_weight_stored_1e4_off_is_another_model_by_its_streamed_twin(tmp_path, monkeypatch):
    """Only the shrunk model's weight wrong: it is not its twin's rounded."""
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=3), path)
    made = _large(monkeypatch, tmp_path)
    _written_wrong(monkeypatch, lambda w: w * (1 + 1e-4), twin_too=False)
    failed = _judged(path, tmp_path)
    (o,) = failed.result.validation.outputs
    assert o.rounding is False and o.float64 is None
    assert o.judged == f"constant {DOWN} is not its float64 value rounded: another model"
    _gone(made, tmp_path)


def test_a_streamed_twin_that_fails_leaves_no_scratch_and_the_judge_goes_on_without_it(tmp_path, monkeypatch):
    """The shrink of the widened reference fails once its float64 copy is written: the scratch
    is deleted, and the shrunk model is judged with its new constants moved."""
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=3), path)
    _large(monkeypatch, tmp_path)
    held: list[list[str]] = []

    def failing(reference, base_dir, shrink, near, streamed):
        def broken(wide, data_dir, store, writer):
            held.append(sorted(os.listdir(data_dir)))
            raise RuntimeError("the float64 shrink failed")

        return twin_stage.float64_twin(reference, base_dir, broken, near, streamed)

    monkeypatch.setattr(attempt, "float64_twin", failing)
    failed = _judged(path, tmp_path)
    (o,) = failed.result.validation.outputs
    assert held == [["reference.float64.data", "twin.float64.data"]]
    assert not list(tmp_path.rglob(".onnxshrink-twin-*"))
    assert o.rounding is True and "its stored constants' rounding reaching" in o.judged
    assert o.judged.endswith("; no float64 twin (the float64 shrink failed)")

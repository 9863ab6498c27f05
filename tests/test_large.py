"""Large-model paths on a small LLaMA-shaped model (models/llama.py): external data read lazily
(mapped), fp16 and bf16 weights, slices streamed into the output's data file, proofs run one
session at a time (in segments, or the first blocks only). tools/bench_llm.py runs the same paths
on multi-GB models."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import cli_on_terminal, error_against, params

from models.llama import LlamaConfig, build
from onnxshrink import result as results
from onnxshrink import shrink
from onnxshrink.cli import main
from onnxshrink.proof import inputs, sessions
from onnxshrink.stages import attempt as api

TINY = LlamaConfig.preset("tiny", layers=2).half_masked()
FP16_RTOL = 10 * 2.0**-10  # the proof's default for float16 arithmetic


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """name -> (path, ideal parameter count), built once."""
    d = tmp_path_factory.mktemp("llama")
    out = {}
    for name, changes in {
        "fp32": {},
        "fp16": {"compute": "fp16"},
        "bf16": {"storage": "bf16"},  # bf16 weights cast to fp32 where read
        "fp16-islands": {"storage": "fp16"},
    }.items():
        built = build(LlamaConfig(**{**TINY.__dict__, **changes}), d / f"{name}.onnx")
        out[name] = (built.path, built.ideal_params)
    return out


def _types(model: onnx.ModelProto) -> set[int]:
    return {t.data_type for t in model.graph.initializer if len(t.dims) == 2}


@pytest.mark.parametrize(
    "name, weight_type, rtol",
    [
        ("fp32", onnx.TensorProto.FLOAT, 1e-5),
        ("fp16", onnx.TensorProto.FLOAT16, 2.0**-10 * 10),
        ("bf16", onnx.TensorProto.BFLOAT16, 1e-5),  # computed in fp32
        ("fp16-islands", onnx.TensorProto.FLOAT16, 1e-5),
    ],
)
def test_shrinks_to_the_ideal_size_in_its_own_dtype(models, tmp_path, name, weight_type, rtol):
    path, ideal = models[name]
    out = tmp_path / "small.onnx"
    result = shrink(path, output=out, validate=False)
    assert result.after.params == ideal
    assert result.before.params - ideal == TINY.removed_params() == 30720
    saved = onnx.load(out)
    assert params(saved) == ideal  # counted here too
    assert _types(saved) == {weight_type}
    # zero terms only removed: at most the dtype's rounding of sums in another order
    assert error_against(path, saved, {"input_ids": [1, 12]}) <= rtol
    proven = shrink(path, validate=True, input_shapes={"input_ids": [1, 12]})
    assert proven.validation.passed and proven.validation.kind == "full"
    assert proven.validation.rtol == pytest.approx(rtol)
    assert max(o.max_rel_error for o in proven.validation.outputs) <= rtol


def test_weights_are_mapped_not_read(models):
    """The analysis sees each external weight as a read-only view of the mapped data file."""
    import mmap

    from onnxshrink.io.weights import WeightStore
    from onnxshrink.prepare import prepare

    path, _ = models["fp32"]
    model = onnx.load(path, load_external_data=False)
    graph, _ = prepare(model, path.parent, WeightStore())
    name = "model.layers.1.mlp.down_proj.weight_t"
    w = graph.tensors()[name].values
    assert w.shape == (96, 64) and not w.flags.writeable
    base = w
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)
    proto = next(t for t in model.graph.initializer if t.name == name)
    offset = int(next(e.value for e in proto.external_data if e.key == "offset"))
    on_disk = np.fromfile(str(path) + ".data", np.float32, count=96 * 64, offset=offset)
    assert np.array_equal(w.reshape(-1), on_disk)
    assert not w[1::2].any()  # masked neurons: the builder zeroed every other down row


def test_streamed_result_refers_to_its_data_file(models, tmp_path, monkeypatch):
    """Past IN_MEMORY_BYTES the result keeps its weights in the file they were streamed to."""
    monkeypatch.setattr(results, "IN_MEMORY_BYTES", 0)
    path, ideal = models["fp16"]
    out = tmp_path / "small.onnx"
    result = shrink(path, output=out, validate=False)
    assert result.written == [str(out), str(out) + ".data"]
    assert result.data_file == Path(str(out) + ".data")
    big = [t for t in result.model.graph.initializer if len(t.dims) == 2]
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in big)
    assert not list(tmp_path.glob(".onnxshrink-*"))  # the streamed file was moved into place
    assert error_against(path, onnx.load(out), {"input_ids": [1, 12]}) <= FP16_RTOL
    # without an output, the data live in a temporary file for as long as the result
    unsaved = shrink(path, validate=False)
    copy = tmp_path / "copy.onnx"
    unsaved.save(copy)
    assert error_against(path, onnx.load(copy), {"input_ids": [1, 12]}) <= FP16_RTOL
    assert onnx.load(copy).graph.initializer and copy.with_name("copy.onnx.data").exists()


def test_proof_in_segments_and_of_the_first_blocks(models, monkeypatch):
    path, ideal = models["fp32"]
    monkeypatch.setattr(sessions, "SEGMENT_BYTES", 20_000)  # the model's weights are ~300 KB
    result = shrink(path, input_shapes={"input_ids": [1, 10]})
    v = result.validation
    assert v.passed and v.kind == "full" and result.after.params == ideal
    assert "segments" in v.detail
    assert max(o.max_rel_error for o in v.outputs) <= 1e-5
    # checked here, not by the proof: the shrunk model against the input (masked as built)
    assert error_against(path, result.model, {"input_ids": [1, 10]}) <= 1e-5
    # the segments compute exactly what the whole model computes
    model = onnx.load(path)
    feeds = inputs.make_inputs(model, {"input_ids": [1, 10]}, 2, seed=5)
    whole = sessions.run_model(model, feeds, ["logits"], "cpu")
    parts = sessions.run_model(onnx.load(path, load_external_data=False), feeds, ["logits"], "cpu", path.parent)
    for a, b in zip(whole, parts, strict=True):
        assert np.array_equal(a[0], b[0])
    first = shrink(path, input_shapes={"input_ids": [1, 10]}, validate_layers=1)
    assert first.validation.passed and first.validation.kind == "first 1 of 2 repeated blocks"
    assert first.after.params == ideal
    assert error_against(path, first.model, {"input_ids": [1, 10]}) <= 1e-5
    # compared after block 1: the residual stream, and the rotary tables and mask every block reads
    compared = sorted(o.name.rsplit("_", 1)[0] for o in first.validation.outputs)
    assert compared == ["causal", "cos", "residual", "sin"]


def test_cli_validate_layers(models, tmp_path, capsys):
    path, _ = models["fp16"]
    out = tmp_path / "small.onnx"
    assert main([str(path), "-o", str(out), "--validate-layers", "1", "--input-shapes", "input_ids:1,8"]) == 0
    text = capsys.readouterr().out
    assert "[W]     Proof: first 1 of 2 repeated blocks" in text
    assert "rtol 0.00976562 for float16 arithmetic" in text
    assert main([str(path), "--validate-layers", "0"]) == 2


def test_progress_bars_stay_out_of_the_way(monkeypatch):
    """--help does not import tqdm; without a terminal no bar is drawn (stderr is made a
    non-terminal here, whatever runs the tests)."""
    code = "import sys; from onnxshrink.cli import build_parser; build_parser(); print('tqdm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    from onnxshrink.progress import bar

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with bar(10, "x", show=True) as b:
        assert type(b).__name__ == "_Silent"
    assert sys.stderr.getvalue() == ""


def test_progress_bars_on_a_terminal_and_none_with_q(models, tmp_path):
    """On a terminal each long phase shows a bar on stderr; with -q nothing at all is shown."""
    path, ideal = models["fp32"]
    out = tmp_path / "small.onnx"
    code, printed, shown = cli_on_terminal(path, "-o", out, "--input-shapes", "input_ids:1,8", cwd=tmp_path)
    assert code == 0, shown
    # each bar starts at 0 of its total (and is cleared when done: leave=False): the model's
    # 144 nodes, the 3 runs of each model in the proof (the reference twice: its own noise)
    for phase in ("analysis: reading weights:   0%", "slicing and writing weights:   0%",
                  "proof: reference:   0%", "proof: reference's noise:   0%", "proof: shrunk:   0%"):
        assert phase in shown and phase not in printed
    assert "| 0/144 [" in shown and shown.count("| 0/3 [") == 3
    assert "PASSED" in printed and params(onnx.load(out)) == ideal
    out.unlink()
    code, printed, shown = cli_on_terminal(path, "-o", out, "--input-shapes", "input_ids:1,8", "-q", cwd=tmp_path)
    assert (code, printed, shown) == (0, "", "")
    assert params(onnx.load(out)) == ideal


def test_a_failed_streamed_proof_leaves_nothing(models, tmp_path, monkeypatch):
    """A rewrite that changes the function fails the proof: no output, no hidden data file."""
    from onnxshrink.errors import ValidationFailed

    real = api.apply

    def wrong(analysis, reference, *streaming):
        result = real(analysis, reference, *streaming)
        for t in result.model.graph.initializer:
            if t.name == "model.norm.weight":  # 64 floats: kept in the model, not streamed
                t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) + 1, t.name))
        return result

    monkeypatch.setattr(api, "apply", wrong)
    path, _ = models["fp32"]
    out = tmp_path / "small.onnx"
    with pytest.raises(ValidationFailed) as failed:
        shrink(path, output=out, input_shapes={"input_ids": [1, 8]})
    assert failed.value.result is not None and not failed.value.result.passed
    del failed
    import gc

    gc.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("segment_bytes", [20_000, 1 << 30])  # in segments, and whole
def test_masks_applied_to_a_large_model_are_spilled(models, tmp_path, monkeypatch, segment_bytes):
    """A masks file on the unmasked export: the masked weights of the reference go to a file
    (absolute paths onnxshrink maps; onnxruntime gets them inline), not to memory."""
    from onnxshrink.io.weights import absolute

    masked_path, ideal = models["fp32"]
    unmasked = build(LlamaConfig(**{**TINY.__dict__, "masked_kv": (), "masked_ffn": ()}), tmp_path / "u.onnx")
    masked = onnx.load(masked_path)
    masks = {
        t.name: (onnx.numpy_helper.to_array(t) != 0).astype(np.uint8)
        for t in masked.graph.initializer
        if len(t.dims) == 2 and not onnx.numpy_helper.to_array(t).all()
    }
    assert len(masks) == 2 * 7  # Q, K, V, O, gate, up and down of each of the 2 layers
    monkeypatch.setattr(results, "IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(sessions, "SEGMENT_BYTES", segment_bytes)
    out = tmp_path / "small.onnx"
    result = shrink(unmasked.path, masks, output=out, input_shapes={"input_ids": [1, 8]})
    assert result.input_masked is False and result.validation.passed
    assert result.after.params == ideal
    spilled = [t for t in result.reference.graph.initializer if absolute(t) is not None]
    assert {t.name for t in spilled} == set(masks) and absolute(spilled[0]).exists()
    assert error_against(masked_path, onnx.load(out), {"input_ids": [1, 8]}) <= 1e-5


def test_a_weight_two_readers_slice_alike_is_written_once(tmp_path):
    """A tied embedding (read by a Gather and, transposed, by the LM head's Gemm) whose hidden
    columns go is sliced alike for both readers: the copies are one initializer again, and the
    output's data file holds its bytes once (the second copy was written, then merged away,
    its 90 MB on SmolLM2-135M read by nothing). Outputs equal the input's in onnxruntime."""
    import onnxruntime as ort
    from onnx import external_data_helper, numpy_helper

    from onnxshrink import shrink

    rng = np.random.default_rng(21)
    emb = rng.standard_normal((64, 32)).astype(np.float32)
    emb[:, [2, 5, 9, 30]] = 0.0  # the zeros are the masks
    model = onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 17]>
        g (int64[5] ids) => (float[5, 64] y) {
            h = Gather(E, ids)
            g2 = Relu(h)
            y = Gemm<transB: int = 1>(g2, E)
        }"""
    )
    model.graph.initializer.append(numpy_helper.from_array(emb, "E"))
    external_data_helper.convert_model_to_external_data(model, location="m.onnx.data", size_threshold=0)
    onnx.save(model, str(tmp_path / "m.onnx"))
    out = tmp_path / "s.onnx"
    r = shrink(tmp_path / "m.onnx", output=out, validate=False)
    assert r.data_file is not None or (tmp_path / "s.onnx.data").exists()
    shrunk = onnx.load(str(out), load_external_data=False)
    lengths = [
        int(next(e.value for e in t.external_data if e.key == "length"))
        for t in shrunk.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    ]
    assert [t.name for t in shrunk.graph.initializer] == ["E"] and lengths == [64 * 28 * 4]
    assert (tmp_path / "s.onnx.data").stat().st_size == sum(lengths)
    ids = rng.integers(0, 64, 5).astype(np.int64)
    want = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"ids": ids})[0]
    got = ort.InferenceSession(str(out)).run(None, {"ids": ids})[0]
    assert np.array_equal(want, got) or np.allclose(want, got, rtol=1e-6, atol=1e-6)

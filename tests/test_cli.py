"""The command line: happy paths, reports, external data, every user error, validation failure.

A few tests run the real process (`python -m onnxshrink.cli`); the rest call `main([...])`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import (
    CONV2,
    WIDE,
    WIDE_BEFORE,
    WIDE_PER_CHANNEL,
    cli,
    error_against,
    export_cached,
    init,
    params,
    run,
    snapshot,
    tiny,
)

from onnxshrink import ShrinkError, ValidationFailed, __version__, shrink
from onnxshrink.cli import main

# Conv(3->6, 3x3) -> Relu -> Conv(6->4, 1x1). Parameters: 162 + 6 + 24 + 4 = 196.
DROP = [1, 3]
KEEP = [0, 2, 4, 5]
BEFORE = 196
REMOVED = len(DROP) * (3 * 3 * 3 + 1 + 4)  # W1 filters, B1 entries, W2 input columns
AFTER = BEFORE - REMOVED  # 132

# Same graph, dynamic batch.
CONV2_DYN = CONV2.replace("float[1,3,8,8] x", "float[N,3,8,8] x").replace(
    "float[1,4,8,8] y", "float[N,4,8,8] y"
)


def save_external(model: onnx.ModelProto, path: Path, **kwargs) -> None:
    """Save with external data (onnx.save_model rewrites the proto it is given: save a copy)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, path, save_as_external_data=True, location=path.name + ".data", **kwargs)


def temp_dirs(directory: Path) -> list[str]:
    return [p.name for p in directory.rglob(".onnxshrink-*")]


def channel_masks() -> dict[str, torch.Tensor]:
    w = torch.ones(6, 3, 3, 3)
    b = torch.ones(6)
    w[DROP] = 0
    b[DROP] = 0
    return {"W1": w, "B1": b}


def masked_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """The input model with channels DROP of W1/B1 zeroed, built independently of onnxshrink."""
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    for t in ref.graph.initializer:
        if t.name in ("W1", "B1"):
            a = onnx.numpy_helper.to_array(t).copy()
            a[DROP] = 0
            t.CopyFrom(onnx.numpy_helper.from_array(a, t.name))
    return ref


@pytest.fixture
def conv2(tmp_path) -> tuple[Path, onnx.ModelProto]:
    model = tiny(CONV2, seed=11)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return path, model


@pytest.fixture
def conv2_pt(tmp_path) -> Path:
    path = tmp_path / "masks.pt"
    torch.save(channel_masks(), path)
    return path


def wide_folding(seed: int = 5) -> tuple[onnx.ModelProto, int]:
    """WIDE with the filters of 20 positive-bias channels zeroed: each becomes the constant
    relu(bias) > 0, which is folded into B2, so the shrunk model sums B2 in another order."""
    base = tiny(WIDE, seed=seed)
    positive = np.flatnonzero(init(base, "B1") > 0)[:20]
    assert len(positive) == 20
    return tiny(WIDE, seed=seed, zero={"W1": np.s_[list(positive)]}), len(positive)


# ------------------------------------------------------------------ happy paths (subprocess)
def test_cli_shrinks_with_pt_masks_prints_table_and_writes_report(tmp_path, conv2, conv2_pt):
    path, model = conv2
    out, report = tmp_path / "small.onnx", tmp_path / "r.json"
    p = cli(path.name, conv2_pt.name, "-o", out.name, "--report", report.name, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""

    small = onnx.load(out)
    assert params(model) == BEFORE
    assert params(small) == AFTER
    assert init(small, "W1").shape == (4, 3, 3, 3)
    assert init(small, "W2").shape == (4, 4, 1, 1)
    np.testing.assert_array_equal(init(small, "W1"), init(model, "W1")[KEEP])
    np.testing.assert_array_equal(init(small, "B1"), init(model, "B1")[KEEP])
    np.testing.assert_array_equal(init(small, "W2"), init(model, "W2")[:, KEEP])
    np.testing.assert_array_equal(init(small, "B2"), init(model, "B2"))

    # the shrunk file computes what the masked input computes
    x = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
    (want,) = run(masked_reference(model), {"x": x})
    (got,) = run(small, {"x": x})
    assert got.shape == (1, 4, 8, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    lines = p.stdout.splitlines()
    assert f"[I] onnxshrink 0.1.0 | model {path.name} | masks {conv2_pt.name}" in lines
    assert "[I] flat masks: 2 of 2 bound (name) to 2 initializer(s)" in lines
    assert "[I]     Comparing Output: 'y' (shape=(1, 4, 8, 8))" in lines
    assert any("PASSED | Output: 'y'" in line for line in lines)
    assert "[I]     PASSED | All outputs matched | Outputs: ['y']" in lines
    table = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    cells = {k: [c.strip() for c in v.split("|")[2:5]] for k, v in table.items()}
    assert cells["Parameters"] == [str(BEFORE), str(AFTER), "-32.7%"]
    assert cells["Conv"] == ["2", "2", ""]
    assert cells["Relu"] == ["1", "1", ""]
    assert cells["Nodes"] == ["3", "3", ""]
    assert cells["MACs"][2] == "-33.3%"  # 64 pixels x (6x27 + 4x6) -> 64 x (4x27 + 4x4)
    out = tmp_path.resolve() / out.name  # the CLI prints absolute paths
    assert f"[I] saved {out} " in p.stdout

    r = json.loads(report.read_text())
    assert r["passed"] is True
    assert r["before"]["params"] == BEFORE
    assert r["after"]["params"] == AFTER
    assert r["before"]["ops"] == {"Conv": 2, "Relu": 1}
    assert r["before"]["file_bytes"] == path.stat().st_size
    assert r["after"]["file_bytes"] == out.stat().st_size
    assert r["masks_bound"] == 2
    assert r["unbound_masks"] == []
    assert r["written"] == [str(out)]
    v = r["validation"]
    assert v["passed"] is True
    assert (v["rtol"], v["atol"], v["draws"], v["provider"]) == (1e-5, 0.0, 3, "cpu")
    assert v["input_shapes"] == {"x": [1, 3, 8, 8]}
    assert [o["name"] for o in v["outputs"]] == ["y"]
    assert v["outputs"][0]["shape"] == [1, 4, 8, 8]
    assert v["outputs"][0]["passed"] is True
    assert 0.0 <= v["outputs"][0]["max_rel_error"] <= 1e-5


def test_cli_quiet_prints_nothing_on_success(tmp_path, conv2):
    path, _ = conv2
    np.savez(tmp_path / "masks.npz", **{k: v.numpy() for k, v in channel_masks().items()})
    p = cli(path.name, "masks.npz", "-o", "q.onnx", "-q", cwd=tmp_path)
    assert p.returncode == 0
    assert p.stdout == ""
    assert p.stderr == ""
    assert params(onnx.load(tmp_path / "q.onnx")) == AFTER


def test_cli_external_data_input_gives_external_data_output(tmp_path):
    model = tiny(WIDE, seed=2, zero={"W1": np.s_[[3, 9, 40]], "B1": np.s_[[3, 9, 40]]})
    src = tmp_path / "in"
    src.mkdir()
    save_external(model, src / "m.onnx", size_threshold=0)
    before = snapshot(src)
    (tmp_path / "out").mkdir()

    p = cli("in/m.onnx", "-o", "out/small.onnx", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert snapshot(src) == before
    assert sorted(os.listdir(tmp_path / "out")) == ["small.onnx", "small.onnx.data"]

    out = tmp_path / "out" / "small.onnx"
    skeleton = onnx.load(out, load_external_data=False)
    w1 = next(t for t in skeleton.graph.initializer if t.name == "W1")
    assert w1.data_location == onnx.TensorProto.EXTERNAL
    assert {e.key: e.value for e in w1.external_data}["location"] == "small.onnx.data"
    small = onnx.load(out)
    assert params(small) == WIDE_BEFORE - 3 * WIDE_PER_CHANNEL
    assert init(small, "W1").shape == (61, 16, 3, 3)

    x = np.random.default_rng(0).standard_normal((1, 16, 8, 8)).astype(np.float32)
    (want,) = run(model, {"x": x})
    (got,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_cli_refuses_output_equal_to_input_and_leaves_it_untouched(tmp_path):
    model = tiny(WIDE, seed=2, zero={"W1": np.s_[[3]], "B1": np.s_[[3]]})
    save_external(model, tmp_path / "m.onnx")
    before = snapshot(tmp_path)
    assert set(before) == {"m.onnx", "m.onnx.data"}

    p = cli("m.onnx", "-o", "m.onnx", cwd=tmp_path)
    assert p.returncode == 2
    assert "refusing to overwrite the input model or its data" in p.stderr
    assert "m.onnx" in p.stderr
    assert "Traceback" not in p.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: None, "absent.onnx: no such file"),
        (
            lambda d: (d / "absent.onnx").write_bytes(np.random.default_rng(0).bytes(256)),
            "absent.onnx: not a valid ONNX model",
        ),
    ],
    ids=["missing", "random-bytes"],
)
def test_cli_bad_model_file_exits_2_without_traceback(tmp_path, make, expected):
    make(tmp_path)
    before = snapshot(tmp_path)
    p = cli("absent.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.startswith("[E] ")
    assert expected in p.stderr
    assert p.stderr.strip().count("\n") == 0
    assert "Traceback" not in p.stderr
    assert snapshot(tmp_path) == before


class Payload:
    """Unpickling this runs open(marker, "w"): it creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickled_code_in_pt_masks_is_refused_and_never_run(tmp_path, conv2, capsys):
    path, _ = conv2
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"W1": torch.ones(6, 3, 3, 3), "extra": {"x": Payload(marker)}}, evil)
    before = snapshot(tmp_path)

    assert main([str(path), str(evil), "-o", str(tmp_path / "out.onnx")]) == 2
    err = capsys.readouterr().err
    assert f"{evil}: holds objects other than tensors" in err
    assert "weights_only=True" in err
    assert "Traceback" not in err
    assert not marker.exists()
    assert snapshot(tmp_path) == before

    # the file really is a payload: an unsafe load runs it
    torch.load(evil, weights_only=False)
    assert marker.exists()


# ------------------------------------------------------------------ validation failure
@pytest.fixture
def folding(tmp_path) -> Path:
    model, _ = wide_folding()
    path = tmp_path / "f.onnx"
    onnx.save(model, path)
    return path


def test_cli_validation_failure_exits_1_and_writes_nothing(tmp_path, folding):
    """At zero tolerance the folded bias differs in its last bits: rounding (the float64 judge
    says the two compute the same function), which no kept channel is a fix for: exit 1 at
    once, the smallest tolerance that would have passed named, nothing written."""
    before = snapshot(tmp_path)
    p = cli(folding.name, "--rtol", "0", "--atol", "0", "-o", "out.onnx", cwd=tmp_path)
    assert p.returncode == 1
    assert snapshot(tmp_path) == before
    assert "[E]     FAILED | Mismatched outputs: ['y']" in p.stdout
    assert "[I]         Float64 judge: rounding (float64: " in p.stdout
    assert "[E] out.onnx not written: validation failed" in p.stdout
    assert "finding the removals responsible" not in p.stdout  # rounding: nothing kept back
    err = p.stderr.strip()
    assert err.startswith(
        "[E] the shrunk model does not match the reference on output(s) ['y']; nothing was written."
        " The error (relative 1.09e-07 on 'y') is rounding, not a wrong model: in float64 the two"
        " compute the same function"
    )
    assert err.endswith(
        "The smallest tolerance that would have passed: --rtol 1.1e-07; without --rtol the "
        "tolerance follows the reference's own noise."
    )
    # and that tolerance does pass
    q = cli(folding.name, "--rtol", "1.1e-07", "-o", "out.onnx", cwd=tmp_path)
    assert q.returncode == 0 and params(onnx.load(tmp_path / "out.onnx")) == WIDE_BEFORE - 20 * WIDE_PER_CHANNEL


def test_cli_validation_failure_keep_failed_writes_output(tmp_path, folding):
    p = cli(
        folding.name, "--rtol", "0", "--atol", "0", "-o", "out.onnx", "--keep-failed",
        "--no-recover", cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 1
    assert "it was written anyway (--keep-failed)" in p.stderr
    out = tmp_path.resolve() / "out.onnx"
    assert params(onnx.load(out)) == WIDE_BEFORE - 20 * WIDE_PER_CHANNEL
    assert f"[I] saved {out} " in p.stdout
    assert temp_dirs(tmp_path) == []


def test_validation_failure_report_and_api(tmp_path, folding, capsys):
    # default tolerance: the folded model passes, and the fold is reported
    assert main([str(folding), "-o", str(tmp_path / "ok.onnx")]) == 0
    assert "[I] folded 20 constant channel(s) into 1 consumer(s)" in capsys.readouterr().out
    assert params(onnx.load(tmp_path / "ok.onnx")) == WIDE_BEFORE - 20 * WIDE_PER_CHANNEL

    # zero tolerance: exit 1, a report that says why, nothing written
    report = tmp_path / "r.json"
    out = tmp_path / "out.onnx"
    argv = [str(folding), "--rtol", "0", "--atol", "0", "-o", str(out), "--report", str(report)]
    assert main([*argv, "--no-recover"]) == 1
    assert not out.exists()
    r = json.loads(report.read_text())
    assert r["passed"] is False
    assert r["written"] == []
    (o,) = r["validation"]["outputs"]
    assert o["name"] == "y" and o["passed"] is False and o["rounding"] is True
    assert o["max_abs_error"] > 0 and o["float64"] < 1e-12
    assert r["after"]["params"] == WIDE_BEFORE - 20 * WIDE_PER_CHANNEL
    assert r["first_failure"] is None and r["kept_after_failed_proof"] == []

    # the API raises ValidationFailed carrying the result
    with pytest.raises(ValidationFailed) as info:
        shrink(folding, output=out, rtol=0.0, atol=0.0)
    assert info.value.exit_code == 1
    assert info.value.result.passed is False
    assert info.value.result.written == []
    assert info.value.result.validation.rounding()
    assert info.value.result.validation.needed_rtol() == pytest.approx(1.09e-7, rel=0.01)
    assert not out.exists()
    with pytest.raises(ValidationFailed, match="written anyway") as info:
        shrink(folding, output=out, rtol=0.0, atol=0.0, keep_failed=True, recover=False)
    assert info.value.result.written == [str(out.absolute())]
    assert params(onnx.load(out)) == WIDE_BEFORE - 20 * WIDE_PER_CHANNEL
    assert temp_dirs(tmp_path) == []


def _wrong_fold(monkeypatch, relative: float, bias: str = "B2") -> None:
    """The rewrite folds constant channels into `bias` with a wrong value (monkeypatched: each
    folded value off by `relative` of what was folded)."""
    import onnxshrink.stages.attempt as api

    real = api.apply

    def wrong(analysis, reference, *streaming):
        result = real(analysis, reference, *streaming)
        before = {t.name: onnx.numpy_helper.to_array(t) for t in reference.graph.initializer}
        for t in result.model.graph.initializer:
            if t.name == bias and result.folds:
                b = onnx.numpy_helper.to_array(t)
                wrong = b.astype(np.float64) + relative * (b - before[bias])
                t.CopyFrom(onnx.numpy_helper.from_array(wrong.astype(b.dtype), bias))  # (float64 in the twin)
        return result

    monkeypatch.setattr(api, "apply", wrong)


def test_a_failed_proof_keeps_the_removals_responsible_and_writes_the_proven_rest(
    tmp_path, folding, conv2, conv2_pt, capsys, monkeypatch
):
    """A fold with a wrong value fails the proof (the float64 judge: another function). The run
    finds the removals responsible (the folded channels), keeps them and writes the proven rest,
    saying so; here that rest is the whole input: no smaller, so nothing is written (exit 1)."""
    _wrong_fold(monkeypatch, 1e-3)
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    argv = [str(folding), "-o", str(out), "--report", str(report)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "finding the removals responsible" in captured.out
    assert not out.exists()
    assert captured.err.strip().startswith(
        "[E] the proof failed (the shrunk model differs from the reference (max relative error "
    )
    assert "; in float64 too: another function)" in captured.err
    assert (
        f"and keeping the removals responsible leaves a model no smaller than the input "
        f"({WIDE_BEFORE} parameters, the input {WIDE_BEFORE}): nothing was written."
    ) in captured.err
    assert json.loads(report.read_text())["passed"] is False


def _folded_convs():
    """Filters of the first conv zeroed with their biases, of the second zeroed alone (their
    constant channels folded into B3)."""
    rng = np.random.default_rng(3)
    b2 = rng.uniform(0.1, 1.0, 16).astype(np.float32)  # positive: relu(b2) folded into B3
    return tiny(
        """g (float[1,8,8,8] x, float[16,8,3,3] W1, float[16] B1, float[16,16,1,1] W2, float[16] B2,
             float[8,16,1,1] W3, float[8] B3) => (float[1,8,8,8] y) {
             h = Conv<pads=[1,1,1,1]>(x, W1, B1)
             r = Relu(h)
             h2 = Conv(r, W2, B2)
             r2 = Relu(h2)
             y = Conv(r2, W3, B3)
           }""",
        seed=3,
        values={"B2": b2},
        zero={"W1": np.s_[:4], "B1": np.s_[:4], "W2": np.s_[:6]},
    )


def test_recovery_runs_the_reference_once_for_all_its_tries(monkeypatch):
    # the reference and the inputs are the same in every try: its outputs and noise are reused
    import onnxshrink.proof.comparison as comparison

    calls = {"reference": 0, "proofs": 0}
    run_reference, compare = comparison._reference_outputs, comparison.compare

    def counted(*args):
        calls["reference"] += 1
        return run_reference(*args)

    def proof(*args):
        calls["proofs"] += 1
        return compare(*args)

    monkeypatch.setattr(comparison, "_reference_outputs", counted)
    monkeypatch.setattr("onnxshrink.stages.attempt.compare", proof)
    _wrong_fold(monkeypatch, 1e-3, "B3")
    r = shrink(_folded_convs())
    assert r.passed and {k["indices"] for k in r.kept_after_failed_proof} == {6}
    assert calls["proofs"] >= 2 and calls["reference"] == 1


def test_recovery_keeps_back_only_the_wrong_removals_and_is_deterministic(monkeypatch):
    """Filters of the first conv zeroed with their biases (removable) and of the second zeroed
    alone (constant channels folded into B3, with a wrong value here): recovery keeps the folded
    channels back, removes the others, and gives the same model, byte for byte, on every run."""
    rng = np.random.default_rng(3)
    model = _folded_convs()
    _wrong_fold(monkeypatch, 1e-3, "B3")
    runs = [shrink(model) for _ in range(2)]
    layer1 = 8 * 9 + 1 + 16  # a W1 filter, its bias, a W2 column
    for r in runs:
        assert r.passed and r.first_failure.endswith("; in float64 too: another function)")
        assert r.first_failure_bug  # only a float64 verdict calls it a bug
        assert params(r.model) == params(model) - 4 * layer1  # the folded channels kept back
        assert {k["indices"] for k in r.kept_after_failed_proof} == {6}
    assert runs[0].kept_after_failed_proof == runs[1].kept_after_failed_proof
    assert runs[0].model.SerializeToString() == runs[1].model.SerializeToString()
    # independently: the kept-back model computes what the input computes
    x = rng.standard_normal((1, 8, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(runs[0].model, {"x": x})[0], run(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_a_rewrite_that_breaks_the_model_is_recovered_from(tmp_path, conv2, conv2_pt, monkeypatch, capsys):
    """A handler bug (monkeypatched: Relu's rewrite drops a channel from W2 it should not) gives a
    model onnxruntime cannot run: a failed proof like any other, never an internal error."""
    import onnxshrink.ops.elementwise as elementwise

    def broken(self, node, rw):  # when channels are removed, removes one too many from W2
        kept = rw.kept(node.outputs[0], 1)
        if kept is None or kept.all():
            return
        for c in node.outputs[0].outputs:
            w = c.inputs[1]
            if getattr(w, "name", "") == "W2":
                w.values = np.asarray(w.values)[:, 1:]

    monkeypatch.setattr(elementwise.Elementwise, "rewrite", broken, raising=False)
    path, model = conv2
    out = tmp_path / "out.onnx"
    # keeping the removed channels back passes, and leaves nothing removed: exit 1, said so
    assert main([str(path), str(conv2_pt), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("[E] the proof failed (the shrunk model does not run (fails to run in onnxruntime")
    assert "leaves a model no smaller than the input (196 parameters, the input 196)" in err
    assert not out.exists()
    with pytest.raises(ValidationFailed, match="no smaller than the input"):
        shrink(path, conv2_pt)


def test_cli_failure_from_a_wrong_rewrite(tmp_path, conv2, conv2_pt, monkeypatch, capsys):
    """A rewrite that changes the function (monkeypatched) fails validation at any tolerance."""
    import onnxshrink.stages.attempt as api

    real = api.apply

    def wrong(analysis, reference, *streaming):
        result = real(analysis, reference, *streaming)
        for t in result.model.graph.initializer:
            if t.name == "B2":
                t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) + 1, "B2"))
        return result

    monkeypatch.setattr(api, "apply", wrong)
    path, _ = conv2
    out = tmp_path / "out.onnx"
    assert main([str(path), str(conv2_pt), "-o", str(out), "--rtol", "1e-3"]) == 1
    cap = capsys.readouterr()
    assert not out.exists()
    assert "[E]         FAILED | Output: 'y' | Difference is NOT within tolerance" in cap.out
    assert "nothing was written" in cap.err
    assert main([str(path), str(conv2_pt), "-o", str(out), "--keep-failed"]) == 1
    assert np.array_equal(init(onnx.load(out), "B2"), init(onnx.load(path), "B2") + 1)


# ------------------------------------------------------------------ in-process options
def test_no_masks_file_uses_zeros_in_weights(tmp_path, capsys):
    model = tiny(CONV2, seed=11, zero={"W1": np.s_[DROP], "B1": np.s_[DROP]})
    path = tmp_path / "z.onnx"
    onnx.save(model, path)
    assert main([str(path), "-o", str(tmp_path / "out.onnx")]) == 0
    out = capsys.readouterr().out
    assert "[I] no masks file: the zeros in the weights are the masks" in out
    assert "[I]     PASSED | All outputs matched | Outputs: ['y']" in out
    small = onnx.load(tmp_path / "out.onnx")
    assert params(small) == AFTER
    np.testing.assert_array_equal(init(small, "W1"), init(model, "W1")[KEEP])


def test_no_output_writes_nothing(tmp_path, conv2, conv2_pt, capsys):
    path, _ = conv2
    before = snapshot(tmp_path)
    assert main([str(path), str(conv2_pt)]) == 0
    assert snapshot(tmp_path) == before
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "[W] no -o given: nothing written"
    assert "[I]     PASSED | All outputs matched | Outputs: ['y']" in out


def test_explain_lists_kept_zeroed_slices(tmp_path, capsys):
    # channel 2 of the model output is zeroed: it cannot go, the output keeps its shape
    model = tiny(CONV2, seed=11, zero={"W1": np.s_[DROP], "B1": np.s_[DROP], "W2": np.s_[[2]]})
    path = tmp_path / "e.onnx"
    onnx.save(model, path)

    assert main([str(path)]) == 0
    plain = capsys.readouterr().out
    # W2's row 2 (4 weights) is the kept zero slice: not counted as unstructured sparsity
    assert "[I] 1 zeroed slice(s) had to be kept (4 zero weights); --explain says why" in plain
    assert "unstructured" not in plain
    assert "(axis 0)" not in plain

    assert main([str(path), "--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "[I] 1 zeroed slice(s) had to be kept (4 zero weights)" in lines
    assert "[I]     W2 (axis 0): 1 kept: it is part of a graph input or output" in lines
    # W2 after shrinking is [4, 4, 1, 1] with one row of zeros: a whole slice, not sparsity
    assert not any(line.startswith("[I]     W2:") for line in lines)


def test_report_lists_unbound_masks_with_allow_unbound(tmp_path, conv2, capsys):
    path, _ = conv2
    masks = tmp_path / "m.npz"
    np.savez(masks, W1=channel_masks()["W1"].numpy(), **{"head.weight": np.ones(3)})
    report = tmp_path / "r.json"
    argv = [str(path), str(masks), "--allow-unbound", "-o", str(tmp_path / "o.onnx")]
    assert main([*argv, "--report", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["unbound_masks"] == ["head.weight"]
    assert r["masks_bound"] == 1
    # W1 filters 1 and 3 are zero but B1 is not: relu(B1) is folded into B2 (or dropped)
    assert r["after"]["params"] == BEFORE - REMOVED
    out = capsys.readouterr().out
    assert "[I] flat masks: 1 of 2 bound (name) to 1 initializer(s)" in out
    assert "[W] 1 mask(s) matched no initializer and were ignored (--allow-unbound): 'head.weight'" in out


def test_input_shapes_sets_the_validation_shapes(tmp_path, capsys):
    path = tmp_path / "d.onnx"
    onnx.save(tiny(CONV2_DYN, seed=4, zero={"W1": np.s_[DROP], "B1": np.s_[DROP]}), path)
    report = tmp_path / "r.json"
    assert main([str(path), "--input-shapes", "x:5,3,8,8", "--report", str(report)]) == 0
    assert "[I]     Comparing Output: 'y' (shape=(5, 4, 8, 8))" in capsys.readouterr().out
    r = json.loads(report.read_text())
    assert r["validation"]["input_shapes"] == {"x": [5, 3, 8, 8]}
    assert r["after"]["params"] == AFTER
    # MACs: 5 images x 8 x 8 pixels x (4 x 27 + 4 x 4)
    assert r["after"]["macs"] == 5 * 64 * (4 * 27 + 4 * 4)


@pytest.mark.parametrize(
    "order",
    [
        ["--input-shapes", "x:5,3,8,8", "{model}", "-o", "{out}"],
        ["--input-shapes", "x:5,3,8,8", "--draws", "2", "{model}", "{masks}", "-o", "{out}"],
        ["{model}", "--input-shapes", "x:5,3,8,8", "{masks}", "-o", "{out}"],
        ["-o", "{out}", "--input-shapes=x:5,3,8,8", "{model}"],
    ],
)
def test_options_go_in_any_order(tmp_path, capsys, order):
    """--input-shapes takes several values: before, it took the model (and masks) after it too."""
    path, out = tmp_path / "d.onnx", tmp_path / "out.onnx"
    model = tiny(CONV2_DYN, seed=4, zero={"W1": np.s_[DROP], "B1": np.s_[DROP]})
    onnx.save(model, path)
    mask = np.ones(6, np.float32)
    mask[DROP] = 0
    np.savez(tmp_path / "m.npz", W1=mask)
    argv = [w.format(model=path, masks=tmp_path / "m.npz", out=out) for w in order]
    assert main(argv) == 0, capsys.readouterr().err
    assert "[I]     Comparing Output: 'y' (shape=(5, 4, 8, 8))" in capsys.readouterr().out
    assert params(onnx.load(out)) == AFTER
    assert error_against(path, onnx.load(out), {"x": [5, 3, 8, 8]}) <= 1e-5


@pytest.mark.parametrize(
    ("option", "error"),
    [
        (["--input-shapes", "x:1,3,8"], "--input-shapes 'x' has 3 dims; the model's input has 4."),
        (["--input-shapes", "x:1,4,8,8"], "--input-shapes 'x': dim 4 differs from the model's static 3."),
        (["--input-shapes", "y:1,3,8,8"], "--input-shapes names 'y', which is not a model input"),
    ],
)
@pytest.mark.parametrize("prune", [[], ["--prune", "0.5"]])
def test_options_the_model_contradicts_are_refused_before_any_analysis(tmp_path, capsys, option, error, prune):
    path = tmp_path / "d.onnx"
    onnx.save(tiny(CONV2_DYN, seed=4), path)
    assert main([*option, str(path), *prune, "-o", str(tmp_path / "out.onnx")]) == 2
    captured = capsys.readouterr()
    assert error in captured.err
    assert captured.out.splitlines() == [f"[I] onnxshrink {__version__} | model {path}"]
    assert not (tmp_path / "out.onnx").exists()


def test_external_data_flag_writes_data_file(tmp_path, capsys):
    path = tmp_path / "w.onnx"
    onnx.save(tiny(WIDE, seed=1, zero={"W1": np.s_[:8], "B1": np.s_[:8]}), path)
    out = tmp_path / "o.onnx"
    assert main([str(path), "-o", str(out), "--external-data", "-q"]) == 0
    assert capsys.readouterr() == ("", "")
    assert sorted(os.listdir(tmp_path)) == ["o.onnx", "o.onnx.data", "w.onnx"]
    assert params(onnx.load(out)) == WIDE_BEFORE - 8 * WIDE_PER_CHANNEL


def test_verbose_prints_traceback_for_errors(tmp_path, capsys):
    assert main([str(tmp_path / "nope.onnx"), "-v"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"[E] {tmp_path / 'nope.onnx'}: no such file")
    assert "Traceback" in err
    assert "ShrinkError" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == "onnxshrink 0.1.0"


# ------------------------------------------------------------------ errors (in-process)
def _write(d: Path, name: str, data: bytes, *args: str) -> list[str]:
    (d / name).write_bytes(data)
    return [name, *args]


def _mkdir(d: Path, name: str) -> list[str]:
    (d / name).mkdir()
    return [name]


def _external_without_data(d: Path) -> list[str]:
    (d / "x").mkdir()
    save_external(tiny(WIDE, seed=1), d / "x" / "m.onnx")
    (d / "x" / "m.onnx.data").unlink()
    return ["x/m.onnx"]


def _masks(d: Path, name: str, masks) -> list[str]:
    torch.save(masks, d / name)
    return ["m.onnx", name]


def _npz(d: Path, name: str, **arrays) -> list[str]:
    np.savez(d / name, **arrays)
    return ["m.onnx", name]


def _write_npz(d: Path, name: str, **arrays) -> list[str]:
    np.savez(d / name, **arrays)
    return [name]


ERRORS = {
    "missing-model": (lambda d: ["nope.onnx"], ["nope.onnx: no such file"]),
    "model-is-directory": (lambda d: _mkdir(d, "dir.onnx"), ["dir.onnx: is a directory"]),
    "random-bytes": (
        lambda d: _write(d, "r.onnx", np.random.default_rng(1).bytes(512)),
        ["r.onnx: not a valid ONNX model"],
    ),
    "truncated": (
        lambda d: _write(d, "t.onnx", (d / "m.onnx").read_bytes()[:500]),
        ["t.onnx: not a valid ONNX model"],
    ),
    "empty-file": (
        lambda d: _write(d, "e.onnx", b""),
        ["e.onnx: not a valid ONNX model (it has no nodes or no outputs)"],
    ),
    "missing-external-data": (
        _external_without_data,
        ["x/m.onnx: its weights are stored in 'm.onnx.data', which is not next to the model"],
    ),
    "masks-missing": (lambda d: ["m.onnx", "none.pt"], ["none.pt: no such masks file"]),
    "masks-unknown-suffix": (
        lambda d: ["m.onnx", *_write(d, "m.txt", b"W1 1 1 1")],
        ["m.txt: unknown masks format '.txt'"],
    ),
    "masks-not-a-dict": (
        lambda d: _masks(d, "t.pt", torch.ones(6, 3, 3, 3)),
        ["t.pt: expected a non-empty dict of mask tensors, found Tensor"],
    ),
    "masks-entry-not-a-tensor": (
        lambda d: _masks(d, "s.pt", {"W1": torch.ones(6, 3, 3, 3), "conv": {"note": "hi"}}),
        ["s.pt: entry 'conv.note' is a str, not a tensor or array"],
    ),
    "mask-matches-nothing": (
        lambda d: _masks(d, "u.pt", {"W1": torch.ones(6, 3, 3, 3), "conv9.weight": torch.ones(2)}),
        ["u.pt: 1 mask(s) match no initializer", "'conv9.weight'", "--allow-unbound"],
    ),
    "mask-wrong-shape": (
        lambda d: _masks(d, "w.pt", {"W1": torch.ones(6, 3, 3)}),
        ["w.pt: mask 'W1' has shape [6, 3, 3] but initializer 'W1' has shape [6, 3, 3, 3]"],
    ),
    "mask-wrong-channel-count": (
        lambda d: _npz(d, "c.npz", W1=np.ones(5)),
        ["c.npz: mask 'W1' has shape [5] but initializer 'W1' has shape [6, 3, 3, 3]"],
    ),
    "mask-not-binary": (
        lambda d: _masks(d, "h.pt", {"B1": torch.full((6,), 0.5)}),
        ["h.pt: mask 'B1' holds", "0.5", "masks must be 0/1"],
    ),
    "masks-pickled-object": (
        lambda d: _masks(d, "p.pt", {"W1": Payload(d / "pwned")}),
        ["p.pt: holds objects other than tensors and plain containers"],
    ),
    "input-shapes-syntax": (
        lambda d: ["m.onnx", "--input-shapes", "x=1,3,8,8"],
        ["--input-shapes 'x=1,3,8,8': expected name:d0,d1,..."],
    ),
    "input-shapes-not-integers": (
        lambda d: ["m.onnx", "--input-shapes", "x:1,3,eight,8"],
        ["--input-shapes 'x:1,3,eight,8': expected name:d0,d1,..."],
    ),
    "input-shapes-unknown-input": (
        lambda d: ["m.onnx", "--input-shapes", "image:1,3,8,8"],
        ["--input-shapes names 'image', which is not a model input; inputs are ['x']"],
    ),
    "input-shapes-wrong-rank": (
        lambda d: ["m.onnx", "--input-shapes", "x:1,3"],
        ["--input-shapes 'x' has 2 dims; the model's input has 4"],
    ),
    "inputs-file-missing": (
        lambda d: ["m.onnx", "--inputs", "feeds.npz"],
        ["feeds.npz: no such inputs file"],
    ),
    "weights-missing": (
        lambda d: ["m.onnx", "--weights", "orig.pt"],
        ["orig.pt: no such weights file", "--weights", "state dict"],
    ),
    "inputs-file-wrong-name": (
        lambda d: ["m.onnx", "--inputs", *_write_npz(d, "feeds.npz", image=np.zeros((1, 3, 8, 8), np.float32))],
        ["feeds.npz: holds 'image', which is not a model input; the model's inputs are ['x']"],
    ),
    "inputs-file-missing-input": (
        lambda d: ["m.onnx", "--inputs", *_write_npz(d, "feeds.npz")],
        ["feeds.npz: has no array for model input 'x'"],
    ),
    "inputs-file-wrong-dtype": (
        lambda d: ["m.onnx", "--inputs", *_write_npz(d, "feeds.npz", x=np.zeros((1, 3, 8, 8)))],
        ["feeds.npz: array 'x' is float64; the model's input 'x' is float32"],
    ),
    "inputs-file-wrong-shape": (
        lambda d: ["m.onnx", "--inputs", *_write_npz(d, "feeds.npz", x=np.zeros((1, 3, 9, 8), np.float32))],
        ["feeds.npz: array 'x' has shape [1, 3, 9, 8]; the model's input 'x' has shape [1, 3, 8, 8]"],
    ),
    "output-dir-missing": (
        lambda d: ["m.onnx", "-o", "nodir/out.onnx"],
        ["nodir: the output directory does not exist"],
    ),
    "output-is-input": (
        lambda d: ["m.onnx", "-o", "sub/../m.onnx"],
        ["m.onnx: refusing to overwrite the input model"],
    ),
}


@pytest.mark.parametrize("case", list(ERRORS), ids=list(ERRORS))
def test_bad_input_exits_2_with_one_paragraph_and_writes_nothing(
    tmp_path, case, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    onnx.save(tiny(CONV2, seed=11), tmp_path / "m.onnx")
    (tmp_path / "sub").mkdir()
    make, expected = ERRORS[case]
    argv = make(tmp_path)
    if "-o" not in argv:
        argv = [*argv, "-o", "out.onnx"]
    before = snapshot(tmp_path)

    assert main([*argv, "--report", "r.json"]) == 2
    cap = capsys.readouterr()
    assert cap.err.startswith("[E] ")
    assert cap.err.strip().count("\n") == 0, cap.err
    assert "Traceback" not in cap.err
    for text in expected:
        assert text in cap.err
    assert snapshot(tmp_path) == before  # no output, no report, no temp dirs, input untouched


def test_allow_unbound_goes_on(tmp_path, conv2, capsys):
    path, _ = conv2
    masks = {**channel_masks(), "conv9.weight": torch.ones(2)}
    torch.save(masks, tmp_path / "u.pt")
    out = tmp_path / "out.onnx"
    assert main([str(path), str(tmp_path / "u.pt"), "-o", str(out)]) == 2
    assert not out.exists()
    assert main([str(path), str(tmp_path / "u.pt"), "-o", str(out), "--allow-unbound"]) == 0
    assert "[I] flat masks: 2 of 3 bound (name) to 2 initializer(s)" in capsys.readouterr().out
    assert params(onnx.load(out)) == AFTER


def test_api_raises_shrink_error_for_bad_masks(conv2):
    _, model = conv2
    with pytest.raises(ShrinkError, match=r"masks: mask 'W1' holds") as info:
        shrink(model, {"W1": np.full((6, 3, 3, 3), 2.0, np.float32)})
    assert info.value.exit_code == 2


# ------------------------------------------------------------------ a real exporter's model
def _resnet(native: bool):
    from models.zoo import ZOO, choose_kept, native_widths, randomize, zero_groups

    entry = ZOO["resnet_basic"]
    model = randomize(entry.build(), seed=7)
    kept = choose_kept(model, 0.5, seed=7)
    if native:
        return randomize(entry.build(native_widths(kept)), seed=7), entry.input_shape, {}
    zero_groups(model, kept)
    return model, entry.input_shape, {}


def test_cli_on_exported_resnet_with_external_data(tmp_path, zoo_dir, capsys):
    masked = export_cached(zoo_dir, ("cli", "resnet_basic", "masked"), lambda: _resnet(False))
    native = export_cached(zoo_dir, ("cli", "resnet_basic", "native"), lambda: _resnet(True))
    assert Path(str(masked) + ".data").exists()  # the exporter wrote external data

    out, report = tmp_path / "r.onnx", tmp_path / "r.json"
    assert main([str(masked), "-o", str(out), "--report", str(report)]) == 0
    assert "[I]     PASSED | All outputs matched" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.onnx", "r.onnx.data"]
    r = json.loads(report.read_text())
    assert r["before"]["params"] == params(onnx.load(masked))
    # exactly the parameters of the same network built natively with the kept widths
    assert r["after"]["params"] == params(onnx.load(native))
    assert r["after"]["params"] < r["before"]["params"] / 2
    assert r["written"] == [str(out), str(out) + ".data"]
    assert r["after"]["file_bytes"] == out.stat().st_size + Path(str(out) + ".data").stat().st_size

    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x})
    (want,) = run(onnx.load(masked), {sess.get_inputs()[0].name: x})
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---------------------------------------------------------------- regressions
def test_report_into_a_missing_directory_is_refused_before_any_work(conv2, tmp_path, capsys):
    path, _ = conv2
    code = main([str(path), "-o", str(tmp_path / "o.onnx"), "--report", str(tmp_path / "nodir" / "r.json")])
    assert code == 2
    assert not (tmp_path / "o.onnx").exists()
    assert "--report" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["model", "output"])
def test_report_never_overwrites_the_model_or_the_output(conv2, tmp_path, capsys, target):
    path, _ = conv2
    before = path.read_bytes()
    out = tmp_path / "o.onnx"
    report = path if target == "model" else out
    code = main([str(path), "-o", str(out), "--report", str(report), "-q"])
    assert code == 2
    assert path.read_bytes() == before
    assert not out.exists()


def test_zero_draws_and_no_inputs_is_refused(conv2, tmp_path, capsys):
    path, _ = conv2
    assert main([str(path), "--draws", "0", "-o", str(tmp_path / "o.onnx")]) == 2
    assert "nothing to validate" in capsys.readouterr().err
    assert not (tmp_path / "o.onnx").exists()


def test_a_model_cut_before_its_opset_is_refused(conv2, tmp_path, capsys):
    path, model = conv2
    cut = tmp_path / "cut.onnx"
    data = model.SerializeToString()
    # The opset_import field is serialized last; drop it whole.
    tail = model.opset_import[0].SerializeToString()
    cut.write_bytes(data[: data.rindex(tail) - 2])
    assert main([str(cut)]) == 2
    err = capsys.readouterr().err
    assert "cut.onnx" in err and "Traceback" not in err


def test_an_empty_or_corrupt_pt_file_is_a_read_error_not_a_code_warning(conv2, tmp_path, capsys):
    path, _ = conv2
    empty, corrupt = tmp_path / "e.pt", tmp_path / "r.pt"
    empty.write_bytes(b"")
    corrupt.write_bytes(np.random.default_rng(0).bytes(300))
    for masks in (empty, corrupt):
        assert main([str(path), str(masks)]) == 2
        err = capsys.readouterr().err
        assert masks.name in err and "cannot be read" in err and "run code" not in err


def test_output_naming_a_directory_is_refused(conv2, tmp_path, capsys):
    path, _ = conv2
    (tmp_path / "odir").mkdir()
    assert main([str(path), "-o", str(tmp_path / "odir")]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_table_shows_no_size_change_when_nothing_is_written(conv2, capsys):
    path, _ = conv2
    assert main([str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| File size"))
    assert line.split("|")[3].strip() == "-" and line.split("|")[4].strip() == ""

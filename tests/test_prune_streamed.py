"""A large model's prune streams its weights (external data mapped, the zeroed ones spilled to
disk, calibration in the proof's segments): the same groups, scores and output as the prune
that reads the model into memory. The sizes that decide it are lowered, so that a tiny LLaMA
takes the large model's path."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from models.llama import LlamaConfig, build
from onnxshrink.core.zeroed import ZeroedWeight
from onnxshrink.io import weights
from onnxshrink.io.model import Scratch
from onnxshrink.io.weights import absolute
from onnxshrink.proof import segment
from onnxshrink.prune import prune, spill
from onnxshrink.prune import run as prune_run


def _tensors(path) -> dict[str, bytes]:
    m = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}


def _streamed(monkeypatch) -> dict[str, int]:
    """Take the large model's path however small the model; count the spill files made and
    the calibration models cut into segments."""
    counts = {"spills": 0, "cut": 0}
    spill_file, cut = Scratch.spill, segment.pieces

    def counted_spill(self):
        counts["spills"] += 1
        return spill_file(self)

    def counted_pieces(model, budget):
        parts = cut(model, budget)
        counts["cut"] += bool(parts)
        return parts

    monkeypatch.setattr(prune_run, "in_memory", lambda size: False)
    monkeypatch.setattr(spill, "SPILL_BYTES", 0)
    monkeypatch.setattr("onnxshrink.proof.sessions.SEGMENT_BYTES", 64 * 1024)
    monkeypatch.setattr(Scratch, "spill", counted_spill)
    monkeypatch.setattr(segment, "pieces", counted_pieces)
    return counts


def test_a_streamed_prune_writes_what_the_prune_in_memory_writes(tmp_path, monkeypatch):
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=3), path)
    rng = np.random.default_rng(0)
    feeds = [{"input_ids": rng.integers(0, 128, (1, 16)).astype(np.int64)} for _ in range(3)]
    kw = dict(criterion="wanda", data=feeds, validate=False, price=False)
    held = prune(path, 0.25, tmp_path / "held.onnx", **kw)
    assert not any(absolute(t) for t in held.shrink.reference.graph.initializer)
    counts = _streamed(monkeypatch)
    written = _deferred_writes(monkeypatch)
    streamed = prune(path, 0.25, tmp_path / "streamed.onnx", **kw)
    # the reference zeroed on disk (the groups are checked on its analysis); it refers to its
    # spill, where a zeroed weight is written only if something reads it whole: a MatMul's
    # weight is read through its pattern and kept slices, never made
    assert counts["spills"] == 1
    deferred = [t.name for t in streamed.shrink.reference.graph.initializer if absolute(t)]
    matmul_weights = {n.input[1] for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "MatMul"}
    assert len(deferred) > 10 and matmul_weights & set(deferred)
    assert not matmul_weights & set(written), written
    assert counts["cut"] == 1  # the calibration run in segments
    assert [p.removed for p in streamed.plans] == [p.removed for p in held.plans]
    assert streamed.removed()  # (it pruned something)
    assert _tensors(tmp_path / "streamed.onnx") == _tensors(tmp_path / "held.onnx")
    # not only the prune in memory's: the input with the chosen slices zeroed here, in onnxruntime
    want, got = _by_hand(path, streamed, feeds[0]), _outputs(tmp_path / "streamed.onnx", feeds[0])
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    assert streamed.shrink.after.params == held.shrink.after.params < held.original.params


def _outputs(model, feed: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    m = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _by_hand(path, result, feed: dict[str, np.ndarray]) -> np.ndarray:
    """The input's output with every chosen group's slices zeroed by this test (numpy)."""
    model = onnx.load(str(path))
    values = {t.name: numpy_helper.to_array(t).copy() for t in model.graph.initializer}
    chosen = {i for p in result.plans for i in p.removed}
    for g in result.groups.groups:
        for m in g.members if g.id in chosen else ():
            assert m.tensor == m.initializer  # (no weight of this model is read twice)
            index = [slice(None)] * values[m.initializer].ndim
            index[m.axis] = m.indices
            values[m.initializer][tuple(index)] = 0
    del model.graph.initializer[:]
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in values.items())
    return _outputs(model, feed)


def _deferred_writes(monkeypatch) -> list[str]:
    """The names of the deferred (reserved) weights written, as they are written."""
    names: list[str] = []
    write = weights.Pending.write

    def counted(self):
        names.append(self.name)
        return write(self)

    monkeypatch.setattr(weights.Pending, "write", counted)
    return names


def test_a_streamed_prune_with_its_proof_writes_its_reference_for_onnxruntime(tmp_path, monkeypatch):
    """With validation on, the reference's deferred weights are written before onnxruntime
    reads its files: the proof passes on its first try, and the output is the in-memory prune's."""
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=5), path)
    held = prune(path, 0.25, tmp_path / "held.onnx", validate=False, price=False)
    assert held.removed()
    _streamed(monkeypatch)
    for stage in ("assemble", "save", "growth", "masking"):  # the shrink's stages alike
        monkeypatch.setattr(f"onnxshrink.stages.{stage}.in_memory", lambda size: False)
    written = _deferred_writes(monkeypatch)
    streamed = prune(path, 0.25, tmp_path / "streamed.onnx", price=False)
    deferred = [t.name for t in streamed.shrink.reference.graph.initializer if absolute(t)]
    assert deferred and sorted(written) == sorted(deferred)
    assert streamed.shrink.validation is not None and streamed.shrink.validation.passed
    assert streamed.shrink.first_failure is None
    assert _tensors(tmp_path / "streamed.onnx") == _tensors(tmp_path / "held.onnx")


def test_a_streamed_global_prune_counts_its_candidates_with_their_weights(tmp_path, monkeypatch):
    """`--allocation global` turns the ratio into a parameter target met on shrunk candidates:
    a streamed input's candidates are made from the model with its weights (they were made from
    its weightless copy), and the result is the in-memory prune's."""
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=4), path)
    kw = dict(allocation="global", validate=False, price=False)
    held = prune(path, 0.3, tmp_path / "held.onnx", **kw)
    _streamed(monkeypatch)
    streamed = prune(path, 0.3, tmp_path / "streamed.onnx", **kw)
    assert [p.removed for p in streamed.plans] == [p.removed for p in held.plans]
    assert streamed.removed()
    assert _tensors(tmp_path / "streamed.onnx") == _tensors(tmp_path / "held.onnx")


def _pattern_of(w: np.ndarray):
    from onnxshrink.core import nonzero

    return nonzero._scan(np.array(w))


def test_a_spilled_weight_is_zeroed_bit_for_bit(tmp_path):
    # Zeroed through a spill file (row blocks, the other axes' slices cleared with a bit
    # mask) it holds the bytes numpy's own assignment of 0 gives: +0.0 over -0.0, NaN and inf
    # too; a quantized weight's slices set to its zero point.
    from onnxshrink.io.weights import WeightStore

    store = WeightStore()
    rng = np.random.default_rng(5)
    cases = []
    for shape, dtype in [((37, 11), np.float32), ((9, 4, 3), np.float16), ((20, 6), np.int8), ((5, 7), np.float64)]:
        w = (rng.standard_normal(shape) * 4).astype(dtype)
        if w.dtype.kind == "f":
            w.reshape(-1)[rng.random(w.size) < 0.3] = -0.0
            w.reshape(-1)[:2] = [np.nan, np.inf]
        slices = [(a, np.sort(rng.choice(shape[a], max(1, shape[a] // 3), replace=False))) for a in range(len(shape))]
        zero = np.int8(3) if w.dtype == np.int8 else None
        w.tofile(tmp_path / f"w{len(cases)}.bin")
        cases.append((w, slices, zero))
    writer = store.writer(tmp_path / "spill.data")
    for k, (w, slices, zero) in enumerate(cases):
        mapped = np.memmap(tmp_path / f"w{k}.bin", w.dtype, "r", shape=w.shape)
        expected = np.array(w)
        for axis, idx in slices:
            index = [slice(None)] * w.ndim
            index[axis] = idx
            expected[tuple(index)] = 0 if zero is None else zero
        zeroed = ZeroedWeight(np.asarray(mapped), slices, zero)
        assert b"".join(b.tobytes() for b in zeroed.blocks()) == expected.tobytes()
        made = writer.write(f"w{k}", zeroed.blocks(), w.shape, w.dtype)
        assert made.tobytes() == expected.tobytes()
        # what the shrink reads of it without making it: kept slices (a zeroed one kept is 0,
        # or the zero point), rows, the non-zero pattern
        index = {a: np.sort(rng.choice(n, max(1, n - n // 4), replace=False)) for a, n in enumerate(w.shape) if a != 1}
        sliced = expected
        for a, idx in index.items():
            sliced = np.take(sliced, idx, axis=a)
        assert zeroed.kept(index).tobytes() == sliced.tobytes()
        used = rng.random(w.shape[0]) < 0.5
        assert zeroed.rows(used).tobytes() == expected[used].tobytes()
        if w.ndim == 2 and zero is None:
            got, want = zeroed.pattern(), _pattern_of(expected)
            assert got is not None and want.zeros is not None and got.zeros is not None
            assert np.array_equal(got.rows, want.rows) and np.array_equal(got.cols, want.cols)
            assert got.count == want.count == int(np.count_nonzero(expected))
            assert sorted(zip(*got.zeros, strict=True)) == sorted(zip(*want.zeros, strict=True))
    writer.close()


def _default_init(path, out) -> None:
    """The LLaMA at `path` as a default-initialized model exports: every RMSNorm gain 1, and
    the equal gains merged into one initializer every norm reads (exporters merge equal
    constants), its weights again in external data."""
    model = onnx.load(str(path))
    gains = [t.name for t in model.graph.initializer if t.name.endswith("norm.weight")]
    width = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == gains[0])).shape
    keep = [t for t in model.graph.initializer if t.name not in gains]
    del model.graph.initializer[:]
    model.graph.initializer.extend([*keep, numpy_helper.from_array(np.ones(width, np.float32), "norm_ones")])
    for n in model.graph.node:
        n.input[:] = ["norm_ones" if i in gains else i for i in n.input]
    onnx.save(model, str(out), save_as_external_data=True, location=out.name + ".data", size_threshold=0)


def test_a_streamed_prune_of_a_default_initialized_llama_is_the_input_zeroed(tmp_path, monkeypatch):
    """Unit norm gains shared by every norm (one initializer read 2L + 1 times): the streamed
    prune, validation off, equals the in-memory prune and, in onnxruntime, the input with the
    chosen slices of every weight (the shared gain's too) zeroed by this test."""
    built = tmp_path / "random.onnx"
    build(LlamaConfig.preset("tiny", seed=6), built)
    path = tmp_path / "llama.onnx"
    _default_init(built, path)
    rng = np.random.default_rng(1)
    feeds = [{"input_ids": rng.integers(0, 128, (1, 12)).astype(np.int64)} for _ in range(2)]
    kw = dict(validate=False, price=False)
    held = prune(path, 0.25, tmp_path / "held.onnx", **kw)
    _streamed(monkeypatch)
    # its data file hard-linked (a deduplicated cache), which onnx's own loader refuses: read
    # as the weights are, mapped
    os.link(tmp_path / "llama.onnx.data", tmp_path / "linked.data")
    streamed = prune(path, 0.25, tmp_path / "streamed.onnx", **kw)
    os.unlink(tmp_path / "linked.data")
    assert [p.removed for p in streamed.plans] == [p.removed for p in held.plans]
    assert _tensors(tmp_path / "streamed.onnx") == _tensors(tmp_path / "held.onnx")
    model = onnx.load(str(path))
    values = {t.name: numpy_helper.to_array(t).copy() for t in model.graph.initializer}
    chosen = {i for p in streamed.plans for i in p.removed}
    kinds = {g.unit.kind for g in streamed.groups.groups if g.id in chosen}
    assert "width" in kinds, kinds  # the hidden width goes: the shared gain is sliced
    for g in streamed.groups.groups:
        for m in g.members if g.id in chosen else ():
            index = [slice(None)] * values[m.initializer].ndim
            index[m.axis] = m.indices
            values[m.initializer][tuple(index)] = 0
    del model.graph.initializer[:]
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in values.items())
    for feed in feeds:
        want, got = _outputs(model, feed), _outputs(tmp_path / "streamed.onnx", feed)
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    out = onnx.load(str(tmp_path / "streamed.onnx")).graph.initializer
    after = sum(int(np.prod(t.dims)) for t in out if t.data_type == onnx.TensorProto.FLOAT)
    assert after == streamed.shrink.after.params < held.original.params


def test_a_streamed_parameter_target_counts_its_candidates_on_disk(tmp_path, monkeypatch):
    """`--prune-to-params` on a streamed input: each candidate is zeroed on disk and shrunk from
    there, as the chosen one is; the model is never read into memory (it was, with a copy per
    candidate: 4.6 GiB for SmolLM2-135M's 0.54 GB). The count each candidate gets is the
    output's own, and the result is the in-memory prune's."""
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=6), path)
    kw = dict(params=0.7, validate=False, price=False)
    held = prune(path, None, tmp_path / "held.onnx", **kw)
    counts = _streamed(monkeypatch)

    def refused(self):
        raise AssertionError("the streamed input read into memory")

    monkeypatch.setattr(prune_run.Input, "full", refused)
    said: list[str] = []
    streamed = prune(path, None, tmp_path / "streamed.onnx", **kw, log=said.append)
    counted = [line for line in said if line.startswith("params: ")]
    assert counted and counts["spills"] == len(counted) + 1  # a spill per candidate, one for the output
    assert [p.removed for p in streamed.plans] == [p.removed for p in held.plans]
    after = onnx.load(str(tmp_path / "streamed.onnx"))
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    assert not any(n.op_type == "Constant" for n in after.graph.node)
    params = sum(int(np.prod(t.dims)) for t in after.graph.initializer if t.data_type in floats)  # weights, not shapes
    assert params == streamed.shrink.after.params < streamed.original.params
    assert streamed.reached == params / streamed.original.params
    assert abs(streamed.reached - 0.7) <= 0.005
    assert _tensors(tmp_path / "streamed.onnx") == _tensors(tmp_path / "held.onnx")


def _resident_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                mine = len(head) >= 6 and head[-1] == str(path)
            elif mine and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_a_streamed_prune_gives_its_mapped_weights_back_before_the_price(tmp_path, monkeypatch):
    """The weight pages the prune read through its maps are given back before the price runs the
    models in onnxruntime (which maps and reads their files again): the two added up at the
    prune's peak (SmolLM2-135M with external data, --prune 0.2 --no-validate: 1.14 GiB)."""
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=7), path)
    _streamed(monkeypatch)
    data = (tmp_path / "llama.onnx.data").resolve()
    seen: list[int] = []
    measure = prune_run.measure

    def measured(*args, **kwargs):
        seen.append(_resident_kib(data))
        return measure(*args, **kwargs)

    monkeypatch.setattr(prune_run, "measure", measured)
    result = prune(path, 0.25, tmp_path / "out.onnx", validate=False)
    assert result.price is not None and result.price.outputs  # (it measured a price)
    assert seen == [0]


def _refuse_full(monkeypatch) -> None:
    def refused(self):
        raise AssertionError("the streamed input read into memory")

    monkeypatch.setattr(prune_run.Input, "full", refused)


@pytest.mark.parametrize("mode", ["bias", "refit"])
def test_a_streamed_compensated_prune_writes_what_the_prune_in_memory_writes(tmp_path, monkeypatch, mode):
    """`--compensate bias|refit` on a streamed input: the calibration runs in segments (the
    refit's samples too), the compensation reads its consumers' weights mapped, and the
    reference is zeroed and compensated on disk (a refit weight written to the spill file as
    it is made), the model never read into memory (it was, with two copies more: > 12 GiB for
    the 4.1 GB TinyLlama). The output is the in-memory prune's, and in onnxruntime not the
    input merely zeroed."""
    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=8), path)
    rng = np.random.default_rng(2)
    feeds = [{"input_ids": rng.integers(0, 128, (1, 16)).astype(np.int64)} for _ in range(3)]
    kw = dict(criterion="fluctuation", compensate=mode, data=feeds, validate=False, price=False)
    held = prune(path, 0.25, tmp_path / "held.onnx", **kw)
    counts = _streamed(monkeypatch)
    _refuse_full(monkeypatch)
    calibrated: list = []
    collect = prune_run.collect
    monkeypatch.setattr(prune_run, "collect", lambda *a, **k: calibrated.append(collect(*a, **k)) or calibrated[-1])
    streamed = prune(path, 0.25, tmp_path / "streamed.onnx", **kw)
    # zeroed on disk (one spill file), the refit's samples mapped from another; calibrated in segments
    assert counts["spills"] == 1 + (mode == "refit") and counts["cut"] == 1
    samples = [s.samples for s in calibrated[0].stats.values() if s.samples is not None]
    assert len(samples) == (0 if mode == "bias" else len(calibrated[0].stats)) and all(weights.owner(s) is not None for s in samples)
    assert [p.removed for p in streamed.plans] == [p.removed for p in held.plans]
    assert streamed.removed()
    assert _tensors(tmp_path / "streamed.onnx") == _tensors(tmp_path / "held.onnx")
    assert sorted(streamed.weights) == sorted(held.weights)
    changed = {n for n in held.weights if not n.endswith(".compensation")}  # the refit weights
    assert len(held.weights) - len(changed) > 4 and (len(changed) > 4) == (mode == "refit")
    for name, v in held.weights.items():
        assert np.array_equal(streamed.weights[name], v), name
    spilled = {t.name for t in streamed.shrink.reference.graph.initializer if absolute(t)}
    matmul_weights = {n.input[1] for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "MatMul"}
    assert len(spilled & matmul_weights) > 10
    for feed in feeds:
        want, got = _outputs(tmp_path / "held.onnx", feed), _outputs(tmp_path / "streamed.onnx", feed)
        assert np.array_equal(got, want)
    # the compensation is there: not the input merely zeroed
    zeroed_only = _by_hand(path, streamed, feeds[0])
    assert np.max(np.abs(_outputs(tmp_path / "streamed.onnx", feeds[0]) - zeroed_only)) > 1e-4
    assert streamed.shrink.after.params == held.shrink.after.params < held.original.params


@pytest.mark.parametrize("most", [4096, 20, 10])
def test_the_refit_samples_calibrated_in_segments_are_the_whole_runs(tmp_path, monkeypatch, most):
    """The refit's samples of a streamed model, calibrated in segments (a segment's activations
    for every feed, then the next segment's), are the whole run's: every position in feed
    order when all fit (4096), drawn in the order the whole run meets the activations when
    the feeds together hold more (20: 48 positions), and, when one feed holds more (10: its
    16 positions, drawn as they come), from the whole run itself."""
    from onnxshrink.prune import calibrate

    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=9), path)
    rng = np.random.default_rng(3)
    feeds = [{"input_ids": rng.integers(0, 128, (1, 16)).astype(np.int64)} for _ in range(3)]
    skeleton = onnx.load(str(path), load_external_data=False)
    # every weight MatMul's input ([1, 16, channels]), last first: not the order a run in
    # segments meets them in
    weights = {t.name for t in skeleton.graph.initializer}
    acts = {n.input[0]: 2 for n in reversed(skeleton.graph.node) if n.op_type == "MatMul" and n.input[1] in weights}
    monkeypatch.setattr(calibrate, "MAX_SAMPLES", most)
    whole = calibrate.collect(onnx.load(str(path)), acts, feeds, samples=True, seed=4)
    counts = _streamed(monkeypatch)
    cut = calibrate.collect(skeleton, acts, feeds, samples=True, seed=4, data_dir=str(tmp_path))
    assert counts["cut"] == 1  # (run in segments, or tried to)
    assert list(cut.stats) and sorted(cut.stats) == sorted(whole.stats) == sorted(acts)
    for name, s in whole.stats.items():
        assert s.samples is not None and len(s.samples) == min(48, most)
        assert s.samples.dtype == np.float32  # as onnxruntime gave them (float64 holds them exactly)
        assert np.array_equal(cut.stats[name].samples, s.samples), name
        assert np.array_equal(cut.stats[name].total, s.total), name
    for got, want in zip(cut.outputs, whole.outputs, strict=True):
        assert np.array_equal(got["logits"], want["logits"])


def test_settling_reserved_weights_gives_the_pages_read_back_after_each(tmp_path, monkeypatch):
    """The zeroed weights a prune's reference reserved are written at the proof's start, each
    read from the mapped input: the pages read go back to the page cache after each one (they
    all stayed resident: TinyLlama's shape, 4 GiB, the default prune's peak 6.1 GiB)."""
    store = weights.WeightStore()
    writer = store.writer(tmp_path / "spill.data")

    class Rows:
        def __init__(self, k: int):
            self.k = k

        def blocks(self):
            yield np.full((2, 4), self.k, np.float32)
            yield np.full((1, 4), -self.k, np.float32)

    where = [writer.reserve(f"w{k}", (3, 4), np.dtype(np.float32), Rows(k + 1)) for k in range(3)]
    writer.close()
    left: list[int] = []  # the ranges still to write, at each trim
    monkeypatch.setattr(weights, "trim", lambda *a: left.append(len(store._pending)))
    store.settle()
    assert left == [2, 1, 0]
    data = np.fromfile(tmp_path / "spill.data", np.uint8)
    for k, w in enumerate(where):
        got = data[w.offset : w.offset + w.length].view(np.float32).reshape(3, 4)
        assert np.array_equal(got, np.array([[k + 1] * 4, [k + 1] * 4, [-(k + 1)] * 4], np.float32))


def test_a_segments_spilled_weights_are_handed_to_onnxruntime_mapped_not_inlined(tmp_path, monkeypatch):
    """A reference's spilled weights (stored by absolute path, which onnxruntime refuses) are
    handed to each segment's session as they lie in the spill file, not read into the segment
    and copied twice more (TinyLlama's default prune: proof 75 -> 47 s, peak 2.4 -> 1.7 GiB):
    the outputs are the model's, run whole from memory, bit for bit."""
    import onnxruntime as ort

    from onnxshrink.proof import sessions

    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=12), path)
    model = onnx.load(str(path), load_external_data=False)
    whole = onnx.load(str(path))
    values = {t.name: numpy_helper.to_array(t) for t in whole.graph.initializer}
    spill_file = tmp_path / "spill.data"  # every large weight moved to a file named by absolute path
    moved = []
    with open(spill_file, "wb") as f:
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL and values[t.name].ndim == 2:
                offset = f.tell()
                f.write(values[t.name].tobytes())
                del t.external_data[:]
                for key, value in (("location", str(spill_file)), ("offset", str(offset)), ("length", str(values[t.name].nbytes))):
                    e = t.external_data.add()
                    e.key, e.value = key, value
                moved.append(t.name)
    assert len(moved) > 8
    inlined: list[str] = []
    real_inline = weights.inline
    monkeypatch.setattr(weights, "inline", lambda t, *a: inlined.append(t.name) or real_inline(t, *a))
    parts = segment.pieces(model, 16 * 1024)
    assert len(parts) > 2
    rng = np.random.default_rng(1)
    feeds = [{"input_ids": rng.integers(0, 128, (1, 9)).astype(np.int64)} for _ in range(2)]
    got = sessions.run_model(model, [dict(f) for f in feeds], ["logits"], "cpu", str(tmp_path), parts=parts)
    assert inlined == []
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    ref = ort.InferenceSession(whole.SerializeToString(), so, providers=["CPUExecutionProvider"])
    for feed, out in zip(feeds, got, strict=True):
        assert np.array_equal(out[0], ref.run(["logits"], feed)[0])

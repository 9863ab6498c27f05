"""The float64 judge with its streamed twin on a large model's prune: time, memory and disk.

Prunes MODEL (`--ratio`, the l1 criterion) with its proof at `--rtol 1e-12` on one random
token sequence (`--tokens`), no recovery and no price: the float32 proof then fails whatever the
model, and the float64 judge decides (for a reference past TWIN_BYTES of weights, with its
streamed twin). Prints the judge's verdict and float64 figure, the judge's wall time and peak
RSS (VmHWM reset as it starts), the twin's share of it and the disk its scratch held at most,
and the whole process's peak.

`--corrupt stored`: the shrunk model's weight `--weight` is written 1e-4 (relative) off, its
twin's right (a wrong value stored); `--corrupt rewrite`: both written off alike (a bug of the
rewrite: the twin has it too); `--element`: only the weight's element of largest magnitude. `--no-twin`: judged without a twin
(the shrunk model with its new constants moved), as a reference past TWIN_BYTES was before its
twin was streamed. Everything is written under `--workdir` (deleted at the end
unless `--keep`); nothing is written beside the model.

    python tools/judge_big.py /tmp/llm/tinyllama-L22-fp32.onnx --workdir /tmp/tb-judge
    python tools/judge_big.py /tmp/llm/tinyllama-L22-fp32.onnx --workdir /tmp/tb-judge --corrupt stored
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30


def _hwm() -> int:
    """This process's peak RSS since the last reset (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _rss(kind: str = "VmRSS") -> int:
    """This process's resident memory now (`kind`: VmRSS, RssAnon, RssFile), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(kind + ":"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _corrupted(weight: str, twin_too: bool, element: bool) -> None:
    """The rewrite writes `weight` 1e-4 (relative) off in the float32 shrink (and with `twin_too`
    in the float64 twin's), in its file; with `element`, only its element of largest magnitude."""
    import numpy as np
    import onnx

    import onnxshrink.stages.attempt as attempt
    from onnxshrink.io.weights import tensor_values

    apply = attempt.apply

    def wrong(analysis, reference, *streaming):  # type: ignore[no-untyped-def]
        result = apply(analysis, reference, *streaming)
        t = next(t for t in result.model.graph.initializer if t.name == weight)
        if twin_too or t.data_type == onnx.TensorProto.FLOAT:
            base = streaming[0].path.parent if streaming and streaming[0] is not None else None
            values = tensor_values(t, base)
            wide = values.astype(np.float64)
            if element:
                wide.flat[int(np.argmax(np.abs(wide)))] *= 1 + 1e-4
            else:
                wide *= 1 + 1e-4
            new = wide.astype(values.dtype)
            if base is None or t.data_location != onnx.TensorProto.EXTERNAL:
                t.CopyFrom(onnx.numpy_helper.from_array(new, t.name))
            else:
                info = {e.key: e.value for e in t.external_data}
                with open(base / info["location"], "r+b") as f:
                    os.pwrite(f.fileno(), new.tobytes(), int(info["offset"]))
            what = "its largest element" if element else "every element"
            print(f"  {weight} ({onnx.TensorProto.DataType.Name(t.data_type)}, {list(t.dims)}): {what} written 1e-4 off", flush=True)
        return result

    attempt.apply = wrong  # type: ignore[assignment]


def _traced(name: str, f):  # type: ignore[no-untyped-def]
    def traced(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            print(f"  (judge: {name} {time.perf_counter() - t0:.1f} s, peak RSS so far {_hwm() / GIB:.2f} GiB)", flush=True)

    return traced


def _measured() -> dict[str, float]:
    """Wrap the judge and the twin's making: their wall time, the judge's peak RSS, and the disk
    the twin's scratch held (both float64 files, as its shrink ends)."""
    import onnxshrink.proof.comparison  # noqa: F401 (imports the judge where the proof reads it)
    import onnxshrink.proof.judge as judge
    import onnxshrink.stages.attempt as attempt

    got: dict[str, float] = {}
    real_judge, real_twin = judge.judge, attempt.float64_twin

    def timed_judge(*args, **kwargs):  # type: ignore[no-untyped-def]
        got["before_peak"] = _hwm()  # (the reset below resets ru_maxrss too)
        print(f"  (judge starts: peak RSS of the run before it {got['before_peak'] / GIB:.2f} GiB, RSS now {_rss() / GIB:.2f} GiB, {_rss('RssFile') / GIB:.2f} of it mapped files)", flush=True)
        from onnxshrink.io.weights import release_all

        release_all()  # what the judge does first: the peak below is the judge's own
        print(f"  (judge: its pages of mapped weights released, RSS {_rss() / GIB:.2f} GiB)", flush=True)
        _reset_hwm()
        t0 = time.perf_counter()
        try:
            return real_judge(*args, **kwargs)
        finally:
            got["judge_s"], got["judge_peak"] = time.perf_counter() - t0, _hwm()

    def timed_twin(reference, base_dir, shrink, near, streamed):  # type: ignore[no-untyped-def]
        def sized(wide, data_dir, store, writer):  # type: ignore[no-untyped-def]
            made = shrink(wide, data_dir, store, writer)
            if data_dir is not None:
                got["disk"] = sum(p.stat().st_size for p in Path(data_dir).iterdir())
            return made

        t0 = time.perf_counter()
        twin = real_twin(reference, base_dir, sized, near, streamed)
        got["twin_s"], got["streamed"] = time.perf_counter() - t0, streamed
        print(f"  (judge: twin made {got['twin_s']:.1f} s, peak RSS so far {_hwm() / GIB:.2f} GiB)", flush=True)
        return twin

    for name in ("same_form", "float64_outputs", "_shrunk_float64"):  # each step's peak, as it ends
        setattr(judge, name, _traced(name, getattr(judge, name)))
    judge.judge = timed_judge  # type: ignore[assignment]
    attempt.float64_twin = timed_twin  # type: ignore[assignment]
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--workdir", required=True)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--corrupt", choices=["none", "stored", "rewrite"], default="none")
    p.add_argument("--weight", default="model.layers.10.mlp.down_proj.weight_t")
    p.add_argument("--element", action="store_true", help="corrupt only the weight's element of largest magnitude")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--twin-mib", type=float, help="the judge's TWIN_BYTES in MiB (a smaller model's twin streamed)")
    p.add_argument("--no-twin", action="store_true", help="judge without the twin (its new constants moved), as before it was streamed")
    a = p.parse_args(argv)
    import numpy as np
    import onnx

    from onnxshrink.errors import ValidationFailed
    from onnxshrink.prune import prune

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(work)  # every scratch file of the run under the workdir
    vocab = next(
        int(t.dims[0]) for t in onnx.load(a.model, load_external_data=False).graph.initializer if "embed_tokens" in t.name
    )
    feed = {"input_ids": np.random.default_rng(0).integers(0, vocab, (1, a.tokens)).astype(np.int64)}
    got = _measured()
    if a.twin_mib is not None:
        import onnxshrink.proof.judge as judge

        judge.TWIN_BYTES = int(a.twin_mib * 2**20)
    if a.no_twin:
        import onnxshrink.stages.attempt as attempt

        def no_twin(*args):  # type: ignore[no-untyped-def]
            raise OSError("not made (--no-twin)")

        attempt.float64_twin = no_twin  # type: ignore[assignment]
    if a.corrupt != "none":
        _corrupted(a.weight, a.corrupt == "rewrite", a.element)
    t0 = time.perf_counter()
    try:
        result = prune(a.model, a.ratio, work / "pruned.onnx", rtol=1e-12, recover=False, price=False,
                       inputs=[feed], draws=0, progress=False)  # fmt: skip
        report = result.shrink.validation
    except ValidationFailed as exc:
        report = exc.result.validation
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - t0
    for o in report.outputs:
        verdict = {True: "rounding", False: "another model", None: "not judged"}[o.rounding]
        print(f"output {o.name}: float32 {o.max_rel_error:.3g} of the output; judged {verdict}; float64 "
              f"{o.float64 if o.float64 is None else f'{o.float64:.3g}'}\n  {o.judged}")  # fmt: skip
    if "judge_s" in got:
        twin = (
            f"twin ({'streamed' if got['streamed'] else 'in memory'}) {got['twin_s']:.1f} s" if "twin_s" in got else "no twin"
        )
        print(f"judge: {got['judge_s']:.1f} s ({twin}), peak RSS {got['judge_peak'] / GIB:.2f} GiB; "
              f"twin scratch at most {got.get('disk', 0) / GIB:.2f} GiB on disk")  # fmt: skip
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, got.get("before_peak", 0)) / GIB
    print(f"whole run (prune, proof, judge): {total:.1f} s, peak RSS {peak:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

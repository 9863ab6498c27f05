"""Large models: shrink a LLaMA-shaped model of several GB and measure time, memory and size.

The model is built by `models.llama.build` (random weights written straight to external data,
never held whole in memory), with half of the K/V heads (and the query heads they serve) and
half of the FFN neurons masked, as a head/neuron pruner leaves them. The shrink runs in a fresh
child process, which prints:

* the time of each phase of the shrink (`ShrinkResult.timings`) and of the whole call;
* the read+write floor, measured in the same child: reading the input files once (16 MiB
  chunks into one buffer, before the shrink) and writing as many bytes as the shrink wrote
  (after it, beside the output, then deleted);
* peak RSS of the child (VmHWM, reset just before the shrink) and its ratio to the model's files;
* parameters before / after / ideal (the model built natively without the masked heads and
  neurons), and the proof: which kind, its tolerance and relative error.

    python tools/bench_llm.py --preset tinyllama                      # fp32, 4.4 GB, full proof
    python tools/bench_llm.py --preset llama7b --validate-layers 2    # fp16, first blocks proven
    python tools/bench_llm.py --preset tiny --layers 4 --compute fp16 # quick

Models are built in --workdir (default: a directory under /tmp) and reused by later runs with
the same configuration; `--clean` deletes the model and the shrunk copy at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _proc import proc_status, reset_peak  # tools/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 2**20
GIB = 2**30


def _files(path: Path) -> list[Path]:
    data = path.with_name(path.name + ".data")
    return [path, data] if data.exists() else [path]


def _read_all(paths: list[Path]) -> tuple[int, float]:
    buf = bytearray(16 * MIB)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def _write_bytes(path: Path, size: int) -> float:
    chunk = b"\1" * (16 * MIB)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


class _Sampler:
    """Samples VmRSS every 20 ms, by the phase the shrink's log lines name: the peak of each."""

    def __init__(self) -> None:
        import threading

        self.phase = "load"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def log(self, line: str) -> None:
        for word, phase in (("analyzing", "analyze"), ("rewriting", "rewrite"), ("validating", "validate")):
            if line.startswith(word) or f"; {word}" in line:
                self.phase = phase

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            rss = proc_status()["VmRSS"]
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def child(src: str, out: str, options: str) -> None:
    import onnxshrink
    from onnxshrink.report import to_jsonable

    opts = json.loads(options)
    rss_imports = proc_status()["VmRSS"]
    src_path = Path(src)
    read_bytes, read_s = _read_all(_files(src_path))
    from onnxshrink.analyze import nonzero

    scan = nonzero._scan
    scanned = {"seconds": 0.0, "bytes": 0}

    def timed_scan(w):  # the analysis' passes over the weights, timed apart
        t = time.perf_counter()
        try:
            return scan(w)
        finally:
            scanned["seconds"] += time.perf_counter() - t
            scanned["bytes"] += w.nbytes

    nonzero._scan = timed_scan
    reset_peak()
    sampler = _Sampler()
    t0 = time.perf_counter()
    result = onnxshrink.shrink(src_path, output=out, log=sampler.log, **opts)
    wall = time.perf_counter() - t0
    sampler.phase = "after"
    peak = proc_status()["VmHWM"]
    phase_peaks = sampler.stop()
    written = sum(Path(p).stat().st_size for p in result.written)
    write_s = _write_bytes(Path(out).with_name(".bench-floor"), written)
    v = result.validation
    record = {
        "wall": wall,
        "timings": dict(result.timings),
        "rss_after_imports": rss_imports,
        "rss_peak": peak,
        "rss_peak_by_phase": phase_peaks,
        "scan_seconds": scanned["seconds"],
        "scan_bytes": scanned["bytes"],
        "read_bytes": read_bytes,
        "read_s": read_s,
        "written_bytes": written,
        "write_s": write_s,
        "params_before": result.before.params,
        "params_after": result.after.params,
        "validation": to_jsonable(v) if v is not None else None,
    }
    print("BENCH-LLM " + json.dumps(record), flush=True)


def run_child(src: Path, out: Path, options: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(src), str(out), json.dumps(options)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH-LLM ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the shrink failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("BENCH-LLM ") :])


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return 0
    from models.llama import LlamaConfig, build

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tinyllama", choices=sorted(LlamaConfig.PRESETS))
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--compute", choices=["fp32", "fp16"], help="override the compute dtype")
    p.add_argument("--storage", choices=["fp32", "fp16", "bf16"], help="weights' dtype (Cast)")
    p.add_argument("--validate-layers", type=int, help="prove the first N blocks only")
    p.add_argument("--no-validate", action="store_true")
    p.add_argument("--seq", type=int, default=16, help="validation sequence length")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/onnxshrink-bench-llm"))
    p.add_argument("--clean", action="store_true", help="delete the model and its shrunk copy")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)

    changes = {k: v for k, v in (("layers", args.layers), ("compute", args.compute), ("storage", args.storage)) if v}
    cfg = LlamaConfig.preset(args.preset, **changes).half_masked()
    tag = f"{args.preset}-L{cfg.layers}-{cfg.compute}" + (f"-{cfg.storage}" if cfg.storage else "")
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.workdir / f"{tag}.onnx"
    meta = args.workdir / f"{tag}.json"
    print(f"load average {os.getloadavg()[0]:.2f}; {tag}: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, {cfg.kv_heads} K/V heads ({len(cfg.masked_kv)} masked), FFN {cfg.ffn} ({len(cfg.masked_ffn)} masked), vocab {cfg.vocab}", flush=True)
    if not (model.exists() and meta.exists()):
        print(f"building {model} ...", flush=True)
        built = build(cfg, model)
        meta.write_text(json.dumps({"params": built.params, "ideal": built.ideal_params, "bytes": built.bytes, "seconds": built.seconds}))
        print(f"built in {built.seconds:.1f} s: {gib(built.bytes)}", flush=True)
    info = json.loads(meta.read_text())
    out = args.workdir / f"{tag}.shrunk.onnx"
    options: dict = {"input_shapes": {"input_ids": [1, args.seq]}}
    if args.no_validate:
        options["validate"] = False
    elif args.validate_layers is not None:
        options["validate_layers"] = args.validate_layers
    rec = run_child(model, out, options)
    rec.update(model=tag, model_bytes=info["bytes"], params_ideal=info["ideal"], load_average=os.getloadavg()[0])
    floor = rec["read_s"] + rec["write_s"]
    shrink_s = sum(v for k, v in rec["timings"].items() if k != "validate")
    lines = [
        f"model {tag}: {gib(info['bytes'])} on disk, {info['params']:,} parameters",
        "phases: " + " | ".join(f"{k} {v:.2f} s" for k, v in rec["timings"].items()) + f" | call {rec['wall']:.2f} s",
        f"analysis: {rec['timings']['analyze'] - rec['scan_seconds']:.2f} s on the graph, "
        f"{rec['scan_seconds']:.2f} s reading {gib(rec['scan_bytes'])} of weights (one pass each)",
        f"shrink without validation: {shrink_s:.2f} s; read+write floor {floor:.2f} s "
        f"(read {gib(rec['read_bytes'])} in {rec['read_s']:.2f} s, write {gib(rec['written_bytes'])} in {rec['write_s']:.2f} s); "
        f"ratio {shrink_s / floor:.2f}",
        f"peak RSS {gib(rec['rss_peak'])} (after imports {gib(rec['rss_after_imports'])}); "
        f"peak RSS / model file {rec['rss_peak'] / info['bytes']:.3f}; by phase (sampled every 20 ms): "
        + ", ".join(f"{k} {gib(v)}" for k, v in rec["rss_peak_by_phase"].items()),
        f"parameters before {rec['params_before']:,} after {rec['params_after']:,} ideal {info['ideal']:,} "
        f"({'at' if rec['params_after'] == info['ideal'] else 'NOT at'} the ideal count)",
    ]
    v = rec["validation"]
    if v is None:
        lines.append("proof: none (--no-validate)")
    else:
        worst = max((o["max_rel_error"] for o in v["outputs"]), default=0.0)
        lines.append(
            f"proof: {v.get('kind', 'full')}, {'PASSED' if v['passed'] else 'FAILED'}, rtol {v['rtol']:g}, "
            f"max relative error {float(worst):.3g}, {v['seconds']:.1f} s"
        )
    lines.append(f"load average {rec['load_average']:.2f}")
    print("\n".join(lines), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rec, indent=2))
    if args.clean:
        for f in [*_files(model), *_files(out), meta]:
            f.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

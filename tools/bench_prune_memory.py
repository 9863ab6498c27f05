"""The prune's memory and time on a LLaMA-shaped model, against the masks shrink of the same model.

Builds the model with `models.llama.build` (random weights written straight to external data;
reused when it exists), then runs, each in a fresh child process, one after the other:

* the masks shrink of the model (the zeros its weights hold are the masks), `--no-validate`;
* `prune(model, RATIO, validate=False)` (the CLI's `--prune RATIO --no-validate`), with
  `--criterion` and, for a data-driven one, `--calib N` random token sequences of `--seq` tokens
  as N calibration feeds (the model's batch is 1).

For each it prints the wall time of the child and its peak RSS (ru_maxrss of that child alone),
then the prune's time over the shrink's and its peak against the model's files:

    python tools/bench_prune_memory.py --preset tinyllama                     # 1.1 B, fp32, 4.1 GB
    python tools/bench_prune_memory.py --preset tinyllama --criterion wanda   # 8 x 128 tokens
    python tools/bench_prune_memory.py --preset tinyllama --criterion fluctuation --compensate bias
    python tools/bench_prune_memory.py --preset smollm135m
    python tools/bench_prune_memory.py --preset tinyllama --layers 2          # quick
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30

PRUNE = """
import sys
import numpy as np
from onnxshrink.prune import prune
model, out, ratio, criterion, calib, seq, vocab, compensate = sys.argv[1:9]
rng = np.random.default_rng(0)
feeds = [{"input_ids": rng.integers(0, int(vocab), (1, int(seq))).astype(np.int64)} for _ in range(int(calib))]
data = feeds if criterion in ("activation", "wanda", "fluctuation") or compensate != "none" else None
r = prune(model, float(ratio), out, criterion=criterion, compensate=compensate, data=data, validate=False, progress=False)
print("  prune phases: " + " | ".join(f"{k} {v:.1f} s" for k, v in r.timings.items() if not k.startswith("shrink.")))
print(f"  parameters {r.original.params:,} -> {r.shrink.after.params:,}")
"""


def run(cmd: list[str]) -> tuple[float, float, int, float]:
    """Wall seconds, peak RSS (GiB) of the child alone, its exit code, and its CPU seconds (user
    and system, its threads' included: on a loaded machine, a figure the others' load moves
    less than the wall time)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter() - t0, usage.ru_maxrss * 1024 / GIB, p.returncode, cpu


def main(argv: list[str] | None = None) -> int:
    from models.llama import LlamaConfig, build

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tinyllama", choices=sorted(LlamaConfig.PRESETS))
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--criterion", default="l1")
    p.add_argument("--compensate", default="none", choices=("none", "bias", "refit"))
    p.add_argument("--calib", type=int, default=8, help="calibration sequences (data-driven criteria, compensation)")
    p.add_argument("--seq", type=int, default=128, help="tokens per calibration sequence")
    p.add_argument("--workdir", default="/tmp/onnxshrink-bench-prune")
    p.add_argument("--no-shrink", action="store_true", help="skip the masks shrink (its figure is then not printed)")
    a = p.parse_args(argv)
    cfg = LlamaConfig.preset(a.preset, **({"layers": a.layers} if a.layers else {})).half_masked()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"{a.preset}-L{cfg.layers}-fp32.onnx"
    if not model.exists():
        print(f"building {model} ...", flush=True)
        build(cfg, model)
    size = sum(f.stat().st_size for f in (model, model.with_name(model.name + ".data")) if f.exists())
    print(f"model {model.name}: {size / GIB:.2f} GiB on disk", flush=True)
    shrink_s = shrink_cpu = None
    if not a.no_shrink:
        out = work / "shrunk.onnx"
        wall, peak, rc, cpu = run([sys.executable, "-m", "onnxshrink", str(model), "-o", str(out), "--no-validate", "-q"])
        print(f"masks shrink --no-validate: exit {rc}; wall {wall:.1f} s (cpu {cpu:.1f} s); peak RSS {peak:.2f} GiB", flush=True)
        shrink_s, shrink_cpu = wall, cpu
    out = work / "pruned.onnx"
    cmd = [sys.executable, "-c", PRUNE, str(model), str(out), str(a.ratio), a.criterion, str(a.calib), str(a.seq), str(cfg.vocab), a.compensate]
    wall, peak, rc, cpu = run(cmd)
    data = a.criterion != "l1" or a.compensate != "none"
    what = f"--prune {a.ratio} --criterion {a.criterion}" + (f" --compensate {a.compensate}" if a.compensate != "none" else "")
    what += f" ({a.calib} x {a.seq} tokens)" if data else ""
    print(
        f"{what} --no-validate: exit {rc}; wall {wall:.1f} s (cpu {cpu:.1f} s); peak RSS {peak:.2f} GiB "
        f"({peak * GIB / size:.2f} x the model's files)"
    )
    if shrink_s and shrink_cpu:
        print(f"prune / masks shrink wall time: {wall / shrink_s:.2f} (cpu time: {cpu / shrink_cpu:.2f})")
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""ResNet-50 `--prune 0.5`, the whole process as a user runs it (start-up, the proof and the
price included), against onnxsim 0.8's `apply_structured_pruning` at the same sparsity (issue 32:
at most 1.5x).

    python tools/bench_peer_prune.py --onnxsim /tmp/onnxsim-site --repeat 5

ResNet-50 is `models.zoo.BENCH["resnet50"]` (torchvision's layout in plain torch, 25.5 M
parameters, random weights, `randomize(seed)`), exported as tools/bench_prune.py does. onnxsim
is not the project's dependency: `--onnxsim` is a folder holding it (`pip install --target DIR
onnxsim==0.8.1`), put on the path of its own process only. Each run is a fresh process, the
kinds taken in turns (onnxsim, onnxshrink, onnxshrink --no-price, ...) so that a change in the
machine's load hits all alike, after one untimed round (it compiles the bytecode, kept in the
workdir as an installed package keeps it, and reads the model into the page cache):

* ``onnxsim``: `python -c "import onnx, onnxsim.pruning; m = onnx.load(src);
  onnx.save(apply_structured_pruning(m, sparsity), out)"` (L2 importance, its default), nothing
  checked;
* ``onnxshrink``: `onnxshrink src --prune RATIO -o out.onnx -q` with the defaults: L1
  importance, the proof against the input with the chosen groups zeroed, and the price;
* ``no price``: the same with `--no-price`;
* ``no proof, no price``: with `--no-validate --no-price`.

Printed: the median wall clock and CPU time (user + system, of the process and its threads)
of each, and the ratio of each onnxshrink kind to onnxsim; the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIM = (
    "import sys, onnx\n"
    "from onnxsim.pruning import apply_structured_pruning\n"
    "model = onnx.load(sys.argv[1])  # its external data with it\n"
    "onnx.save(apply_structured_pruning(model, sparsity=float(sys.argv[3])), sys.argv[2])\n"
)


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one fresh process, run in `cwd` (the workdir): `python -m` puts its
    working directory first on the path, before PYTHONPATH, so that a checkout the bench ran in
    would be the onnxshrink of every kind, --also's too."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ...: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onnxsim", type=Path, required=True, help="a folder holding onnxsim 0.8 (pip install --target)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", type=Path, help="keep (and reuse) the exported model here")
    ap.add_argument("--kinds", default="onnxsim,onnxshrink,no price,no proof no price")
    ap.add_argument(
        "--also", action="append", default=[], metavar="NAME=DIR",
        help="one more kind: onnxshrink's defaults with the onnxshrink package in DIR first on the path (e.g. another checkout)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from models.zoo import BENCH
    from tools.bench_prune import export_model

    tmp = None if args.workdir else tempfile.TemporaryDirectory()
    work = (args.workdir or Path(tmp.name)).absolute()  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    src = export_model("resnet50", BENCH["resnet50"], work, args.seed)
    # as installed packages run: from compiled bytecode (kept in the workdir, made by the
    # untimed first round), whatever PYTHONDONTWRITEBYTECODE this shell has
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    # this checkout's onnxshrink (each run's working directory is the workdir: see timed)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    sim_env = {**env, "PYTHONPATH": os.pathsep.join([str(args.onnxsim), env.get("PYTHONPATH", "")])}
    ours = [sys.executable, "-m", "onnxshrink.cli", str(src), "--prune", str(args.ratio), "-o", str(work / "ours.onnx"), "-q"]
    commands = {
        "onnxsim": ([sys.executable, "-c", SIM, str(src), str(work / "sim.onnx"), str(args.ratio)], sim_env),
        "onnxshrink": (ours, env),
        "no price": ([*ours, "--no-price"], env),
        "no proof no price": ([*ours, "--no-price", "--no-validate"], env),
    }
    for also in args.also:
        name, _, folder = also.partition("=")
        commands[name] = (ours, {**env, "PYTHONPATH": os.pathsep.join([folder, env.get("PYTHONPATH", "")])})
    kinds = [k for k in args.kinds.split(",") if k in commands] + [a.partition("=")[0] for a in args.also]
    load = [os.getloadavg()[0]]
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    try:
        for k in range(args.repeat + 1):
            for kind in kinds:
                figures = timed(*commands[kind], work)
                if k:  # the first round compiles the bytecode and reads the model into the page cache
                    runs[kind].append(figures)
    finally:
        if tmp is not None:
            tmp.cleanup()
    load.append(os.getloadavg()[0])
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    print(f"ResNet-50 --prune {args.ratio:g}, whole process, median of {args.repeat} fresh processes in turns")
    base = med.get("onnxsim")
    for kind, (wall, cpu) in med.items():
        ratio = f"  {wall / base[0]:.2f}x wall, {cpu / base[1]:.2f}x CPU" if base and kind != "onnxsim" else ""
        print(f"  {kind:<20} wall {wall:6.2f} s  CPU {cpu:6.2f} s{ratio}")
        print(f"  {'':<20} runs (wall/CPU s): " + ", ".join(f"{w:.1f}/{c:.1f}" for w, c in runs[kind]))
    print(f"  load average before {load[0]:.2f} / after {load[1]:.2f} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

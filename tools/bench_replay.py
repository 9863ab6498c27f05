"""The replay's cost: `--analysis replay` against the rules, and what each replayed op costs.

For ResNet-50 (models.zoo.BENCH, torchvision's layout), a few small zoo models (half of each
group's channels zeroed, exported as tools/bench.py does) and an int4 MLP (two MatMulNBits,
onnxruntime's MatMulNBitsQuantizer, block 32: ops with no rule, replayed in onnxruntime), each
shrink runs in a fresh child process (`shrink(model, validate=False)`), with `--analysis rules`
and with `--analysis replay`. Printed per model: the analysis phase and the whole shrink, in
seconds (the median of `--repeat` runs), and replay / rules of each; per op type: the nodes
replayed, the probes per node (onnxruntime runs, or copies of the node in one run) and the
seconds per node (the replay itself, and for ops with no rule the check that slicing commutes
with them).

`--baseline REF` also runs the code of git revision REF (extracted with `git archive` into a
temporary directory, first on PYTHONPATH of its children), interleaved with the working tree's
runs (baseline, current, baseline, ...), so that both see the same machine: the figures are
printed side by side. Children run with one thread (OMP/MKL) and onnxruntime's sessions with
one thread, as the shrink's own are.

    python tools/bench_replay.py                                   # all models, this tree
    python tools/bench_replay.py --baseline main --repeat 3        # before / after
    python tools/bench_replay.py --models resnet50 --workdir /tmp/br   # keep the exports
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ("resnet_basic", "mobilenetv2", "densenet", "inception")
NBITS = "mlp_int4"
MODELS = ("resnet50", *SMALL, NBITS)
ANALYSES = ("rules", "replay")


# ------------------------------------------------------------------ the child
def child(src: str, analysis: str) -> None:
    """Shrink `src` once with `analysis`; print the timings and the per-op replay costs."""
    import onnxshrink
    from onnxshrink.analyze import fallback as replayed_mod
    from onnxshrink.analyze import keep as keep_mod
    from onnxshrink.analyze import replay as replay_mod

    costs: dict[str, list[float]] = {}  # op -> [nodes, seconds, runs]
    nodes: dict[str, set[str]] = {}
    runs = [0]
    run = replay_mod.NodeRunner.run

    def counted(self, inputs):  # type: ignore[no-untyped-def]
        runs[0] += 1
        return run(self, inputs)

    replay_mod.NodeRunner.run = counted  # type: ignore[method-assign]
    many = getattr(replay_mod.NodeRunner, "run_many", None)
    if many is not None:  # probes run as copies of the node in one call (else it calls run)

        def counted_many(self, probes):  # type: ignore[no-untyped-def]
            if self.copies >= 2:  # full groups of copies; the rest through run
                runs[0] += len(probes) - len(probes) % self.copies
            return many(self, probes)

        replay_mod.NodeRunner.run_many = counted_many  # type: ignore[method-assign]

    def timed(fn):  # type: ignore[no-untyped-def]
        def wrapper(node, *args, **kwargs):  # type: ignore[no-untyped-def]
            t0, r0 = time.perf_counter(), runs[0]
            try:
                return fn(node, *args, **kwargs)
            finally:
                cost = costs.setdefault(node.op, [0, 0.0, 0])
                nodes.setdefault(node.op, set()).add(node.outputs[0].name if node.outputs else node.name)
                cost[1] += time.perf_counter() - t0
                cost[2] += runs[0] - r0

        return wrapper

    keep_mod.replay = timed(keep_mod.replay)  # type: ignore[attr-defined]
    replayed_mod.replay = timed(replayed_mod.replay)  # type: ignore[attr-defined]
    replayed_mod.commutes = timed(replayed_mod.commutes)  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        t0 = time.perf_counter()
        result = onnxshrink.shrink(
            src, validate=False, output=str(Path(tmp) / "out.onnx"), analysis=analysis
        )
        wall = time.perf_counter() - t0
    for op, cost in costs.items():
        cost[0] = len(nodes[op])
    record = {
        "code": str(Path(onnxshrink.__file__).parents[1]),
        "wall": wall,
        "analyze": result.timings.get("analyze", 0.0),
        "ops": costs,
    }
    print("BENCH-REPLAY " + json.dumps(record))


def run_child(code: Path | None, src: Path, analysis: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(src), analysis],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH-REPLAY ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{src.name} ({analysis}) failed:\n{proc.stderr[-3000:]}")
    record = json.loads(lines[-1][len("BENCH-REPLAY ") :])
    if code is not None and Path(record["code"]).resolve() != code.resolve():
        raise RuntimeError(f"the baseline child ran the code in {record['code']}, not {code}")
    return record


# ------------------------------------------------------------------ the models
def int4_mlp(path: Path, hidden: int = 256, ffn: int = 1024, tokens: int = 16) -> None:
    """x[batch, tokens, hidden] -> MatMulNBits -> Relu -> MatMulNBits, half of the FFN neurons'
    weights zero before quantization (block 32, symmetric)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((hidden, ffn)).astype(np.float32)
    w1[:, ::2] = 0
    w2 = rng.standard_normal((ffn, hidden)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    shape = ["batch", tokens, hidden]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True)
    quantizer.process()
    onnx.save(quantizer.model.model, str(path))


def build(name: str, workdir: Path) -> Path:
    if name == NBITS:
        path = workdir / f"{NBITS}.onnx"
        if not path.exists():
            import logging

            logging.disable(logging.INFO)  # the quantizer's progress lines
            int4_mlp(path)
        return path
    sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
    import bench  # tools/bench.py: the same exports as the benchmark's

    from models.zoo import BENCH, ZOO

    bench.quiet_torch()
    return bench.export_models(name, {**ZOO, **BENCH}[name], ("groups",), workdir, 0, 0.5)[
        "groups"
    ]


def extract(ref: str, into: Path) -> Path:
    """The tree of git revision `ref` of this repository, under `into`."""
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True
    )
    if rev.returncode:
        raise SystemExit(f"bench_replay: --baseline {ref!r} is no git revision here")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "onnxshrink"], capture_output=True, check=True
    )
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


# ------------------------------------------------------------------ the report
def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def render(results: dict, versions: list[str], names: list[str]) -> list[str]:
    lines = ["Shrink (validate=False), seconds, median of the runs; x: replay / rules"]
    head = f"{'model':14s}"
    for v in versions:
        head += f" | {v + ': analyze rules':>22s} {'replay':>8s} {'x':>6s} | {'total rules':>11s} {'replay':>8s} {'x':>6s}"
    lines.append(head)
    for name in names:
        row = f"{name:14s}"
        for v in versions:
            got = {a: results[(name, v, a)] for a in ANALYSES}
            an = {a: median([r["analyze"] for r in got[a]]) for a in ANALYSES}
            wall = {a: median([r["wall"] for r in got[a]]) for a in ANALYSES}
            row += (
                f" | {an['rules']:22.2f} {an['replay']:8.2f} {an['replay'] / an['rules']:6.1f}"
                f" | {wall['rules']:11.2f} {wall['replay']:8.2f} {wall['replay'] / wall['rules']:6.1f}"
            )
        lines.append(row)
    lines += ["", "Replay cost per op type (--analysis replay; for mlp_int4 also rules, whose "
              "MatMulNBits have no rule): nodes, probes per node, seconds per node"]  # fmt: skip
    for name in names:
        for analysis in ANALYSES if name == NBITS else ("replay",):
            for v in versions:
                runs = results[(name, v, analysis)]
                ops: dict[str, list[list[float]]] = {}
                for r in runs:
                    for op, cost in r["ops"].items():
                        ops.setdefault(op, []).append(cost)
                parts = []
                for op, costs in sorted(ops.items(), key=lambda kv: -median([c[1] for c in kv[1]])):
                    n = costs[0][0]
                    parts.append(
                        f"{op} {n:g} x {median([c[2] for c in costs]) / n:.0f} probes, "
                        f"{median([c[1] for c in costs]) / n:.3f} s"
                    )
                lines.append(f"  {name} ({analysis}, {v}): " + ("; ".join(parts) or "nothing replayed"))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    ap.add_argument("--baseline", metavar="REF", help="also run git revision REF's code")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each (median)")
    ap.add_argument("--workdir", type=Path, help="keep (and reuse) the exported models here")
    ap.add_argument("--child", nargs=2, metavar=("SRC", "ANALYSIS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if not names or any(n not in MODELS for n in names):
        ap.error(f"--models: choose from {MODELS}")
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        codes: dict[str, Path | None] = {}
        if args.baseline:
            codes[f"before ({args.baseline})"] = extract(args.baseline, Path(tmp) / "baseline")
        codes["after" if args.baseline else "this tree"] = None
        results: dict[tuple[str, str, str], list[dict]] = {}
        for name in names:
            src = build(name, workdir)
            for _ in range(args.repeat):
                for v, code in codes.items():
                    for analysis in ANALYSES:
                        t0 = time.perf_counter()
                        rec = run_child(code, src, analysis)
                        results.setdefault((name, v, analysis), []).append(rec)
                        print(f"[{time.perf_counter() - t0:6.1f} s] {name} {v} {analysis}: "
                              f"analyze {rec['analyze']:.2f} s, total {rec['wall']:.2f} s",
                              file=sys.stderr, flush=True)  # fmt: skip
    print("\n".join(render(results, list(codes), names)))
    load_end = os.getloadavg()
    print(f"\nLoad average (1, 5, 15 min) at start {' '.join(f'{x:.2f}' for x in load_start)}, "
          f"at end {' '.join(f'{x:.2f}' for x in load_end)}; {os.cpu_count()} CPUs")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

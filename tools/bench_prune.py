"""How long `--prune` takes, per phase, against the plain shrink of the same removals.

For ResNet-50 (`models.zoo.BENCH`, torchvision's layout, 25.5 M parameters) and the transformer
zoo (`models.transformers.TRANSFORMERS`: BERT-, ViT-, GPT-, LLaMA-like), each exported with
`torch.onnx.export` defaults and random weights (`randomize(seed)`):

* ``prune``: `onnxshrink.prune(model, ratio)` (L1, per layer, validated as the command line
  does), its phases from `PruneResult.timings`: load (read the model and its statistics),
  groups (the coupled groups: one analysis with the coupling log, and the check that every
  exact group leaves when zeroed), importance, select, zero (the reference with the chosen
  groups zeroed, and the masks), then the shrink of that reference (shrink = its load, bind,
  analyze, rewrite and save; validate = the proof with onnxruntime);
* ``plain``: the floor, `onnxshrink.shrink(reference)` of the same reference written to disk
  (the same removals given as a masked model, as any pruner's output reaches onnxshrink),
  validated the same way;
* ``cli``: the wall clock of `onnxshrink model.onnx --prune RATIO -o out.onnx -q` and of
  `onnxshrink reference.onnx -o out.onnx -q`, as a user sees them (start-up included).

Every figure is the median of `--repeat` runs, each in a fresh process (`--child`), taken in
turns (prune, plain, prune, ...) so that a change in the machine's load hits both alike; the
load average before and after is printed (the machine may be shared). The ratio prune / plain
compares the in-process totals, validation included in both.

    python tools/bench_prune.py                        # resnet50 and the transformer zoo
    python tools/bench_prune.py --models resnet50 --repeat 5 --json prune.json
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
PHASES = ("load", "groups", "importance", "select", "zero", "shrink", "validate")
MARK = "BENCH-PRUNE "


def child(kind: str, src: str, out: str, ratio: float, reference: str | None) -> None:
    """One prune or plain shrink in this fresh process; its figures as one JSON line."""
    import onnxshrink
    from onnxshrink.prune import prune

    t0 = time.perf_counter()
    if kind == "prune":
        result = prune(src, ratio, out)
        wall = time.perf_counter() - t0
        timings = getattr(result, "timings", {})  # none before they were recorded: the total only
        phases = {k: v for k, v in timings.items() if not k.startswith("shrink.")}
        shrink_timings = result.shrink.timings
        shrunk = result.shrink
        if reference:
            import onnx

            onnx.save(
                result.shrink.reference,
                reference,
                save_as_external_data=True,
                location=Path(reference).name + ".data",
            )
    else:
        shrunk = onnxshrink.shrink(src, output=out)
        wall = time.perf_counter() - t0
        phases, shrink_timings = {}, shrunk.timings
    phases["validate"] = shrink_timings.get("validate", 0.0)
    phases["shrink"] = sum(v for k, v in shrink_timings.items() if k != "validate")
    record = {
        "wall": wall,
        "phases": phases,
        "params": shrunk.after.params,
        "passed": bool(shrunk.validation and shrunk.validation.passed),
    }
    print(MARK + json.dumps(record), flush=True)


def run_child(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{args[0]} of {args[1]} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(MARK) :])


def cli_wall(*args: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "onnxshrink.cli", *args, "-q"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"onnxshrink {' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
        )
    return time.perf_counter() - t0


def export_model(name: str, entry, workdir: Path, seed: int) -> Path:
    path = workdir / f"{name}-s{seed}.onnx"
    if not path.exists():
        import logging
        import warnings

        import torch

        from models.zoo import export, randomize

        torch.set_num_threads(1)
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        export(randomize(entry.build(), seed), path, entry.inputs())
    return path


def bench(name: str, path: Path, args, workdir: Path) -> dict:
    reference = workdir / f"{name}-s{args.seed}-r{args.ratio:g}-reference.onnx"
    out = workdir / f"{name}-out.onnx"
    runs: dict[str, list[dict]] = {"prune": [], "plain": []}
    walls: dict[str, list[float]] = {"prune": [], "plain": []}
    for k in range(args.repeat):
        runs["prune"].append(
            run_child("prune", str(path), str(out), str(args.ratio), str(reference))
        )
        runs["plain"].append(run_child("plain", str(reference), str(out), str(args.ratio), ""))
        if k < args.cli_repeat:
            walls["prune"].append(cli_wall(str(path), "--prune", str(args.ratio), "-o", str(out)))
            walls["plain"].append(cli_wall(str(reference), "-o", str(out)))

    def median(kind: str, key: str) -> float:
        return statistics.median(
            r["phases"].get(key, 0.0) if key in PHASES else r[key] for r in runs[kind]
        )

    record = {
        "model": name,
        "params": runs["prune"][0]["params"],
        "passed": all(r["passed"] for rs in runs.values() for r in rs),
        "same_params": runs["prune"][0]["params"] == runs["plain"][0]["params"],
        "prune": {"wall": median("prune", "wall"), **{p: median("prune", p) for p in PHASES}},
        "plain": {
            "wall": median("plain", "wall"),
            **{p: median("plain", p) for p in ("shrink", "validate")},
        },
        "cli": {k: statistics.median(v) for k, v in walls.items() if v},
    }
    record["ratio"] = record["prune"]["wall"] / record["plain"]["wall"]
    return record


def render(records: list[dict]) -> list[str]:
    header = ["model", "params after", *PHASES, "prune", "plain", "ratio", "cli prune", "cli plain"]
    rows = []
    for r in records:
        p = r["prune"]
        rows.append(
            [
                r["model"],
                f"{r['params']:,}",
                *(f"{p[k]:.2f}" for k in PHASES),
                f"{p['wall']:.2f}",
                f"{r['plain']['wall']:.2f}",
                f"{r['ratio']:.1f}x",
                f"{r['cli'].get('prune', float('nan')):.2f}",
                f"{r['cli'].get('plain', float('nan')):.2f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models", help="comma-separated: resnet50, bert, vit, gpt, llama (default: all)"
    )
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3, help="fresh-process runs per figure (median)")
    ap.add_argument(
        "--cli-repeat", type=int, default=1, help="of those, how many also time the CLI"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", type=Path, help="keep (and reuse) the exported models here")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument(
        "--child", nargs=5, metavar=("KIND", "SRC", "OUT", "RATIO", "REF"), help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    if args.child:
        kind, src, out, ratio, ref = args.child
        child(kind, src, out, float(ratio), ref or None)
        return 0
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ONNXSHRINK_THREADS"):
        os.environ.setdefault(var, "1")  # the children inherit it: figures comparable run to run
    sys.path.insert(0, str(ROOT))
    from models.transformers import TRANSFORMERS
    from models.zoo import BENCH

    entries = {"resnet50": BENCH["resnet50"], **TRANSFORMERS}
    names = args.models.split(",") if args.models else list(entries)
    unknown = [n for n in names if n not in entries]
    if unknown:
        print(
            f"--models: unknown {', '.join(unknown)}; choose from {', '.join(entries)}",
            file=sys.stderr,
        )
        return 2
    tmp = None if args.workdir else tempfile.TemporaryDirectory()
    workdir = args.workdir or Path(tmp.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        load_before = os.getloadavg()
        records = []
        for name in names:
            path = export_model(name, entries[name], workdir, args.seed)
            records.append(bench(name, path, args, workdir))
            print(f"  {name}: done", file=sys.stderr, flush=True)
        load_after = os.getloadavg()
    finally:
        if tmp is not None:
            tmp.cleanup()
    lines = [
        f"onnxshrink --prune {args.ratio:g} (L1, per layer), median of {args.repeat} fresh processes; "
        "seconds per phase, in-process totals (validation included) and the command line's wall clock",
        *render(records),
        f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f} ({os.cpu_count()} CPUs)",
    ]
    print("\n".join(lines))
    for r in records:
        if not (r["passed"] and r["same_params"]):
            print(f"{r['model']}: validation failed or plain shrink differs", file=sys.stderr)
    if args.json:
        args.json.write_text(
            json.dumps({"records": records, "load": [load_before, load_after]}, indent=1)
        )
    return 0 if all(r["passed"] and r["same_params"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

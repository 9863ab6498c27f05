"""onnxshrink benchmark: how much smaller, how fast, how much memory, how exact, how quick to run.

For every model of `models.zoo.ZOO`, `models.transformers.TRANSFORMERS` (BERT-, ViT-, GPT- and
LLaMA-like: heads and FFN neurons are the groups) and `BENCH` (ResNet-50 sized), and two kinds
of masks (transformers have no BatchNorm, so only the first):

* ``groups``: `choose_kept(model, fraction)` then `zero_groups`, i.e. each dropped channel has
  its conv filter *and* its BatchNorm scale/shift zeroed, so it is exactly 0 after the BN. The
  natively narrow model `entry.build(native_widths(kept))` is exported next to it.
* ``conv-only``: the same dropped channels, but only the producing layer's weight rows (and
  bias) are zeroed -- Conv2d and Linear, never BatchNorm -- as NNI's L1NormPruner or
  `torch.nn.utils.prune.ln_structured` leave them. After BN folding such a channel is a
  non-zero constant, which onnxshrink has to fold into the consumers. Linear layers are masked
  too (as in the ``groups`` variant) so that the ``groups`` native model stays the right
  comparison; there is no separate native model for this variant.

Both masked models carry the same random weights (`randomize(seed)`); the native model has its
own random weights (only its size and speed are compared, not its outputs). All models are
exported with `torch.onnx.export` defaults (the dynamo exporter, external .data file).

Measured per (model, variant):

* params / MACs / file size of the masked input, the shrunk output and the native model
  (`onnxshrink.report.model_stats`, on the model's static input shape);
* the shrink itself, `onnxshrink.shrink(masked.onnx, validate=False, output=shrunk.onnx)`, run
  in a fresh child process (``--child``): the phases of `ShrinkResult.timings` (load, bind,
  analyze, rewrite, save -- "save" also covers the statistics computed before saving) and the
  wall clock around the whole call; and its peak memory, i.e. the peak resident set size during
  the call (VmHWM, reset just before the call through /proc/self/clear_refs) minus the resident
  set size just before it (VmRSS, once every library the shrink uses -- onnx, onnx.reference,
  onnxruntime, onnx_graphsurgeon, onnxshrink's op handlers -- is imported; the input files are
  read once beforehand in small chunks only to warm the OS page cache, which does not count in
  RSS). It includes reading and parsing the model, which the call does itself, and whatever
  onnxruntime allocates for constant evaluation. Also given as a multiple of the input's size
  on disk (.onnx + .data); for the tiny zoo models that ratio is dominated by fixed costs;
* exactness: `onnxshrink.proof.compare(masked, shrunk)` on the files as written (3 random
  draws with onnxruntime), reporting the largest max |shrunk - masked| / max |masked| over the
  outputs;
* onnxruntime CPU latency with 1 intra-op and 1 inter-op thread, default graph optimizations,
  all sessions fed the same input: the masked models of both variants, their shrunk models and
  the native model of one zoo entry are run in rounds, each session once per round in a shuffled
  order (so drifts in machine speed and cache state hit all of them alike), after 5 warm-up runs
  each, until every session has at least 20 runs and the loop has taken about
  `--latency-seconds` per session (default 2 s for resnet50, 1 s for the small models, which
  then still get thousands of runs). The median is reported, and shrunk / native of the medians
  and of the 10th percentiles (the latter is less sensitive to other processes competing for
  the CPU; the load average before and after the run is printed to judge that).

Run from the repository root (after `pip install -e .`):

    python tools/bench.py --quick                  # the small zoo models, both variants
    python tools/bench.py                          # also resnet50 (~25.5 M params)
    python tools/bench.py --models vgg,resnet50 --variants conv-only --json bench.json

Exports go to a temporary directory deleted at the end, unless `--workdir DIR` is given: then
they are kept there and reused by later runs with the same seed and fraction.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _proc import proc_status, reset_peak  # tools/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("groups", "conv-only")
PHASES = ("load", "bind", "analyze", "rewrite", "validate", "save")
MIB = 2**20


# ------------------------------------------------------------------ child: one measured shrink
def _files(path: Path) -> list[Path]:
    data = path.with_name(path.name + ".data")
    return [path, data] if data.exists() else [path]


def file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in _files(path))


def child(src: str, out: str, analysis: str = "rules") -> None:
    """Shrink `src` into `out` once and print the measurements as one JSON line."""
    import importlib

    rss_start = proc_status()["VmRSS"]
    # Everything a shrink imports, some of it lazily (op handlers, onnx.reference, onnxruntime
    # for constant evaluation), is imported first: the baseline is "after imports", so the
    # figure is the memory the model's data costs, not the libraries' fixed footprint (which
    # is reported apart, as rss_imports).
    for mod in (
        "numpy",
        "onnx",
        "onnx.reference",
        "onnx_graphsurgeon",
        "onnxruntime",
        "onnxshrink",
        "onnxshrink.ops",
        "onnxshrink.report",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(mod)
    import onnxshrink
    from onnxshrink.report import to_jsonable

    rss_imports = proc_status()["VmRSS"] - rss_start
    src_path = Path(src)
    for p in _files(src_path):  # warm the page cache; 16 MiB chunks keep RSS flat
        with open(p, "rb") as f:
            while f.read(16 * MIB):
                pass
    gc.collect()
    reset = reset_peak()
    base = proc_status()["VmRSS"]  # after imports; before the model is read
    t0 = time.perf_counter()
    result = onnxshrink.shrink(src_path, validate=False, output=out, analysis=analysis)
    wall = time.perf_counter() - t0
    peak = proc_status()["VmHWM"]  # since the reset: the peak of the call
    record = {
        "wall": wall,
        "timings": dict(result.timings),
        "rss_imports": rss_imports,
        "rss_before": base,
        "rss_peak": peak,
        "peak_increase": peak - base,
        "hwm_reset": reset,
        "before": to_jsonable(result.before),
        "after": to_jsonable(result.after),
        "written": result.written,
    }
    print("BENCH-CHILD " + json.dumps(record))


def run_child(src: Path, out: Path, analysis: str = "rules") -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            str(src),
            str(out),
            "--analysis",
            analysis,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH-CHILD ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"shrink of {src.name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len("BENCH-CHILD ") :])


# ------------------------------------------------------------------ building the models
def quiet_torch() -> None:
    """Silence the exporter's warnings (call after torch is imported: it sets its loggers)."""
    import logging
    import warnings

    import torch.onnx  # noqa: F401

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def export_models(name: str, entry, variants, workdir: Path, seed: int, fraction: float) -> dict:
    """Export the masked models of `variants` and the native model; {kind: path}."""
    import torch
    from torch import nn

    from models.zoo import choose_kept, export, native_widths, randomize, zero_groups

    stem = f"{name}-s{seed}-f{fraction:g}"
    paths = {k: workdir / f"{stem}-{k}.onnx" for k in (*variants, "native")}
    if all(p.exists() for p in paths.values()):
        return paths

    masked = randomize(entry.build(), seed)
    kept = choose_kept(masked, fraction, seed)
    masks = zero_groups(masked, kept)
    if "groups" in paths and not paths["groups"].exists():
        export(masked, paths["groups"], entry.inputs())
    if "conv-only" in paths and not paths["conv-only"].exists():
        conv = randomize(entry.build(), seed)
        params = dict(conv.named_parameters())
        applied = 0
        with torch.no_grad():
            for pname, mask in masks.items():
                owner = conv.get_submodule(pname.rsplit(".", 1)[0])
                if isinstance(owner, nn.Conv2d | nn.Linear):  # never BatchNorm
                    params[pname].mul_(mask)
                    applied += 1
        if not applied:
            raise RuntimeError(f"{name}: no Conv2d/Linear masks to apply")
        export(conv, paths["conv-only"], entry.inputs())
    if not paths["native"].exists():
        native = randomize(entry.build(native_widths(kept)), seed)
        export(native, paths["native"], entry.inputs())
    return paths


# ------------------------------------------------------------------ latency
def latency(
    paths: dict[str, Path], example: tuple, seconds: float, min_runs: int = 20, warmup: int = 5
) -> dict[str, dict]:
    """Median onnxruntime latency (ms) of each model, 1 thread, run round-robin on one input
    (`example`: the entry's torch example inputs, in the models' input order)."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    arrays = [np.asarray(t.numpy()) for t in example]
    sessions = {}
    for key, p in paths.items():
        s = ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
        sessions[key] = (s, {i.name: a for i, a in zip(s.get_inputs(), arrays, strict=True)})
    for s, feed in sessions.values():
        for _ in range(warmup):
            s.run(None, feed)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    budget = seconds * len(sessions)
    order = list(sessions)
    rng = random.Random(0)
    t_start = time.perf_counter()
    while True:
        rng.shuffle(order)  # no session always follows the same one (cache state)
        for key in order:
            s, feed = sessions[key]
            t0 = time.perf_counter()
            s.run(None, feed)
            times[key].append(time.perf_counter() - t0)
        done = min(len(v) for v in times.values()) >= min_runs
        if done and time.perf_counter() - t_start >= budget:
            break
    out = {}
    for key, v in times.items():
        q = statistics.quantiles(v, n=10)
        out[key] = {
            "median_ms": statistics.median(v) * 1e3,
            "p10_ms": q[0] * 1e3,
            "p90_ms": q[-1] * 1e3,
            "runs": len(v),
        }
    return out


# ------------------------------------------------------------------ one zoo entry
def bench_model(name: str, entry, args, workdir: Path, latency_seconds: float) -> list[dict]:
    import onnx

    from onnxshrink.options import ShrinkOptions
    from onnxshrink.proof.comparison import compare
    from onnxshrink.proof.inputs import resolve_shapes
    from onnxshrink.report import model_stats

    t0 = time.perf_counter()
    from models.transformers import TRANSFORMERS

    variants = list(args.variants)
    if name in TRANSFORMERS:  # no BatchNorm: conv-only masks would be the groups masks again
        variants = [v for v in variants if v != "conv-only"]
    if not variants:
        return []
    paths = export_models(name, entry, variants, workdir, args.seed, args.fraction)
    log(f"{name}: exported in {time.perf_counter() - t0:.1f} s")

    native_proto = onnx.load(str(paths["native"]))
    native = model_stats(
        native_proto, resolve_shapes(native_proto, {}), file_bytes(paths["native"])
    )
    del native_proto

    records = []
    lat_paths = {"native": paths["native"]}
    for variant in variants:
        src = paths[variant]
        out = workdir / f"{src.stem}-shrunk.onnx"
        for stale in _files(out):  # from an earlier run in the same --workdir
            stale.unlink(missing_ok=True)
        m = run_child(src, out, args.analysis)
        total = sum(m["timings"].values())
        log(
            f"{name} [{variant}]: shrink {m['wall']:.2f} s (phases {total:.2f} s), "
            f"peak +{m['peak_increase'] / MIB:.1f} MiB"
        )
        masked_proto, shrunk_proto = onnx.load(str(src)), onnx.load(str(out))
        report = compare(
            masked_proto, shrunk_proto, ShrinkOptions(draws=args.draws, seed=args.seed)
        )
        del masked_proto, shrunk_proto
        worst = max(report.outputs, key=lambda o: o.max_rel_error)
        in_bytes = file_bytes(src)
        records.append(
            {
                "model": name,
                "variant": variant,
                "input_shape": list(entry.input_shape),
                "params": {
                    "masked": m["before"]["params"],
                    "shrunk": m["after"]["params"],
                    "native": native.params,
                },
                "macs": {
                    "masked": m["before"]["macs"],
                    "shrunk": m["after"]["macs"],
                    "native": native.macs,
                },
                "nodes": {
                    "masked": m["before"]["nodes"],
                    "shrunk": m["after"]["nodes"],
                    "native": native.nodes,
                },
                "file_bytes": {
                    "masked": in_bytes,
                    "shrunk": file_bytes(out),
                    "native": native.file_bytes,
                },
                "shrink": {
                    "wall_s": m["wall"],
                    "phases_s": m["timings"],
                    "phases_total_s": total,
                },
                "memory": {
                    "rss_imports": m["rss_imports"],
                    "rss_before": m["rss_before"],
                    "rss_peak": m["rss_peak"],
                    "peak_increase": m["peak_increase"],
                    "ratio_to_file": m["peak_increase"] / in_bytes,
                    "hwm_reset": m["hwm_reset"],
                },
                "validation": {
                    "max_rel_error": worst.max_rel_error,
                    "max_abs_error": max(o.max_abs_error for o in report.outputs),
                    "passed": report.passed,
                    "rtol": report.rtol,
                    "draws": report.draws,
                },
            }
        )
        lat_paths[f"{variant}/masked"] = src
        lat_paths[f"{variant}/shrunk"] = out

    t0 = time.perf_counter()
    lat = latency(lat_paths, entry.inputs(), latency_seconds)
    log(f"{name}: latency measured in {time.perf_counter() - t0:.1f} s")
    for r in records:
        v = r["variant"]
        r["latency"] = {
            "masked": lat[f"{v}/masked"],
            "shrunk": lat[f"{v}/shrunk"],
            "native": lat["native"],
        }
        r["latency_ratio_shrunk_native"] = (
            lat[f"{v}/shrunk"]["median_ms"] / lat["native"]["median_ms"]
        )
        r["latency_ratio_shrunk_native_p10"] = (
            lat[f"{v}/shrunk"]["p10_ms"] / lat["native"]["p10_ms"]
        )
    return records


# ------------------------------------------------------------------ output
def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def human(n: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def mib(n: float) -> str:
    return f"{n / MIB:.2f}" if n < 10 * MIB else f"{n / MIB:.1f}"


def table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells: list[str]) -> str:
        parts = [
            f" {c:<{w}} " if i < 2 else f" {c:>{w}} "
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "|" + "|".join(parts) + "|"

    return [title, sep, line(header), sep, *(line(r) for r in rows), sep]


def render(records: list[dict]) -> list[str]:
    out: list[str] = []
    rows = []
    for r in records:
        p, m, f = r["params"], r["macs"], r["file_bytes"]
        rows.append(
            [
                r["model"],
                r["variant"],
                human(p["masked"]),
                human(p["shrunk"]),
                human(p["native"]),
                f"{p['shrunk'] / p['native']:.3f}",
                human(m["masked"]),
                human(m["shrunk"]),
                human(m["native"]),
                f"{m['shrunk'] / m['native']:.3f}",
                mib(f["masked"]),
                mib(f["shrunk"]),
                mib(f["native"]),
            ]
        )
    out += table(
        "Size (params, MACs per inference, files in MiB; ratio = shrunk / native)",
        [
            "model",
            "variant",
            "params in",
            "shrunk",
            "native",
            "ratio",
            "MACs in",
            "shrunk",
            "native",
            "ratio",
            "MiB in",
            "shrunk",
            "native",
        ],
        rows,
    )
    out.append("")

    rows = []
    for r in records:
        ph = r["shrink"]["phases_s"]
        mem = r["memory"]
        rows.append(
            [
                r["model"],
                r["variant"],
                *(f"{ph[k]:.3f}" if k in ph else "-" for k in PHASES if k != "validate"),
                f"{r['shrink']['phases_total_s']:.3f}",
                f"{r['shrink']['wall_s']:.3f}",
                mib(mem["peak_increase"]),
                f"{mem['ratio_to_file']:.2f}x",
            ]
        )
    out += table(
        "Shrink, validate=False, fresh process (seconds; peak RSS increase over RSS before "
        "the call, MiB, and as a multiple of the input file size)",
        [
            "model",
            "variant",
            "load",
            "bind",
            "analyze",
            "rewrite",
            "save",
            "phases",
            "wall",
            "peak MiB",
            "x file",
        ],
        rows,
    )
    out.append("")

    rows = []
    for r in records:
        lat, val = r["latency"], r["validation"]
        rows.append(
            [
                r["model"],
                r["variant"],
                f"{val['max_rel_error']:.2e}",
                "yes" if val["passed"] else "NO",
                f"{lat['masked']['median_ms']:.3f}",
                f"{lat['shrunk']['median_ms']:.3f}",
                f"{lat['native']['median_ms']:.3f}",
                f"{lat['masked']['median_ms'] / lat['shrunk']['median_ms']:.2f}x",
                f"{r['latency_ratio_shrunk_native']:.3f}",
                f"{r['latency_ratio_shrunk_native_p10']:.3f}",
                str(lat["shrunk"]["runs"]),
            ]
        )
    out += table(
        "Exactness (shrunk vs masked, onnxruntime) and latency (onnxruntime CPU, 1 thread, "
        "median ms)",
        [
            "model",
            "variant",
            "max rel err",
            "passed",
            "masked ms",
            "shrunk ms",
            "native ms",
            "masked/shrunk",
            "shrunk/native",
            "(p10)",
            "runs",
        ],
        rows,
    )
    flags = []
    for r in records:
        tag = f"{r['model']} [{r['variant']}]"
        if r["latency_ratio_shrunk_native"] > 1.05:
            flags.append(f"{tag}: shrunk/native latency {r['latency_ratio_shrunk_native']:.3f}")
        if r["memory"]["ratio_to_file"] > 3 and r["file_bytes"]["masked"] >= 10 * MIB:
            flags.append(f"{tag}: shrink peak memory {r['memory']['ratio_to_file']:.2f}x file")
        if not r["validation"]["passed"]:
            flags.append(f"{tag}: validation FAILED ({r['validation']['max_rel_error']:.2e})")
        if r["params"]["shrunk"] > r["params"]["native"]:
            flags.append(f"{tag}: shrunk has more params than native")
    small = [r for r in records if r["file_bytes"]["masked"] < 10 * MIB]
    if small:
        fixed = min(r["memory"]["peak_increase"] for r in small)
        flags.append(
            f"models under 10 MiB: the peak memory (>= {mib(fixed)} MiB) is mostly a fixed cost"
            " (onnxruntime sessions for constant evaluation), so 'x file' means little there"
        )
    if flags:
        out += ["", "Notes:", *(f"  - {f}" for f in flags)]
    return out


def environment() -> dict:
    import numpy
    import onnx
    import onnxruntime
    import torch

    import onnxshrink

    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "onnxshrink"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "onnxshrink": f"{onnxshrink.__version__} ({commit})",
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cpu": f"{cpu}, {os.cpu_count()} cores",
    }


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated zoo names (default: all)")
    ap.add_argument("--quick", action="store_true", help="skip the BENCH models (resnet50)")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}"
    )
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--workdir", type=Path, help="keep (and reuse) exported models here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fraction", type=float, default=0.5, help="share of channels pruned")
    ap.add_argument("--draws", type=int, default=3, help="random inputs for validation")
    ap.add_argument(
        "--latency-seconds",
        type=float,
        help="latency loop time per session, each also getting >= 20 runs (default: 2 for "
        "the BENCH models, 1 for the small zoo models, which run in well under 1 ms)",
    )
    ap.add_argument(
        "--analysis",
        choices=("rules", "replay"),
        default="rules",
        help="the shrink's analysis: the handlers' rules (default) or onnxruntime's replay "
        "of every node",
    )
    ap.add_argument("--child", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        child(*args.child, analysis=args.analysis)
        return 0

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    quiet_torch()
    from models.transformers import TRANSFORMERS
    from models.zoo import BENCH, ZOO

    everything = {**ZOO, **TRANSFORMERS, **BENCH}
    if args.models:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in names if n not in everything]
        if unknown:
            ap.error(f"unknown models {unknown}; choose from {sorted(everything)}")
    else:
        names = list(everything)
    if args.quick:
        names = [n for n in names if n not in BENCH]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        ap.error(f"--variants: choose from {VARIANTS}")
    if not names:
        ap.error("no models to run")

    env = environment()
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="onnxshrink-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in names:
            seconds = args.latency_seconds or (2.0 if name in BENCH else 1.0)
            records.extend(bench_model(name, everything[name], args, workdir, seconds))
    elapsed = time.perf_counter() - t_start
    load_end = os.getloadavg()
    env["load_average_start"] = list(load_start)
    env["load_average_end"] = list(load_end)

    lines = [
        "onnxshrink benchmark: "
        + ", ".join(f"{k} {v}" for k, v in env.items() if not k.startswith("load_"))
        + f"; seed {args.seed}, {args.fraction:g} of each group's channels pruned"
        + f"; analysis {args.analysis}",
        "",
        *render(records),
        "",
        f"Total benchmark time {elapsed:.0f} s. Load average (1, 5, 15 min) at start "
        f"{' '.join(f'{x:.2f}' for x in load_start)}, at end "
        f"{' '.join(f'{x:.2f}' for x in load_end)} ({os.cpu_count()} cores; this benchmark "
        "itself keeps about 1 busy).",
    ]
    print("\n".join(lines))
    if args.json:
        payload = {"environment": env, "args": vars(args) | {"json": str(args.json)}}
        payload["args"]["workdir"] = str(args.workdir) if args.workdir else None
        payload["results"] = records
        payload["total_seconds"] = elapsed
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

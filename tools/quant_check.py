"""`--prune` on int8 models from `onnxruntime.quantization`, against the float model they come from.

For a ResNet-50 (`models.zoo.BENCH`, torchvision's layout) and a small BERT (`models.transformers`
Transformer, kind "bert"), each exported with `torch.onnx.export` defaults and random weights, the
float model and its quantized forms:

* ``dynamic``: `quantize_dynamic` (DynamicQuantizeLinear feeding ConvInteger / MatMulInteger);
* ``qdq``: `quantize_static`, QuantFormat.QDQ, per-tensor weights;
* ``qdq_pc``: the same, per-channel weights;
* ``qop``: `quantize_static`, QuantFormat.QOperator (QLinearConv, QLinearMatMul, ...);
* ``qop_pc``: the same, per-channel weights;

calibrated on random inputs. Each is run as a user runs it, in a fresh process:
`onnxshrink M --prune RATIO -o out.onnx --report r.json -q`, and the table prints per model, form
and ratio: the exit status, whether the first proof passed, the parameters before and after (and
what the float model at the same ratio removed: the quantized prune should remove as many, within
5%), and the wall time against the float model's (the median of `--repeat` runs, taken in turns
with the float model's so that the machine's load hits both alike).

    python tools/quant_check.py                            # resnet50 and bert, ratios 0.3 and 0.5
    python tools/quant_check.py --models bert --forms qdq,qop --ratios 0.5
    python tools/quant_check.py --workdir /tmp/q --json quant.json --repeat 3

Measured (`--repeat 3`, onnxruntime 1.32, on a shared 2-core machine with a load average of
10-11): every form of both models at 0.3 and 0.5 exits 0 with its first proof passed; the
pruned models hold 1.000x the float model's pruned parameters per tensor and 1.003-1.008x per
channel (the per-channel scales and zero points of the kept channels); they take 1.38-1.67x the
float model's time for ResNet-50 (float: 17.4 s at 0.3, 13.5 s at 0.5) and 1.06-2.00x for the
BERT (4 layers, hidden 256, 4 heads, FFN 1024; float 4.5 s and 4.8 s). The BERT's dynamic and
QOperator forms hold the embedding tables as integers a Gather reads, dequantized after it: the
tables are members of the hidden width's groups as the float ones are. With the width a default
unit (one run each, a load average of 6): every BERT form removes the float model's groups (1332
at 0.3, 2208 at 0.5) and 1.000x its parameters per tensor (1.004x per channel), first proof
passed; before, the dynamic and QOperator forms removed 0.633x at 0.5 (the width stayed whole).
ResNet-50's dynamic, qop and qop_pc forms: 1.000x (1.001x per channel) at 0.3 and 0.5, first
proof passed.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMS = ("float", "dynamic", "qdq", "qdq_pc", "qop", "qop_pc")
MODELS = ("resnet50", "bert")


def export_float(name: str, workdir: Path, seed: int) -> Path:
    """The float model, exported once (cached in `workdir`)."""
    path = workdir / f"{name}-s{seed}.onnx"
    if path.exists():
        return path
    import warnings

    import torch

    sys.path.insert(0, str(ROOT))
    from models.transformers import TRANSFORMERS, Transformer, _ids
    from models.zoo import BENCH, ZOO, export, randomize

    torch.set_num_threads(1)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if name == "resnet50":
        entry = BENCH["resnet50"]
        export(randomize(entry.build(), seed), path, entry.inputs())
    elif name == "bert":  # BERT-mini sized: 4 layers, 256 hidden, 4 heads, 1024 FFN
        model = Transformer(
            kind="bert", layers=4, d_model=256, heads=4, ffn=1024, vocab=1000, max_len=64
        )
        ids = _ids(batch=1, seq=16, vocab=1000)
        example = (*ids, torch.tensor([[1.0] * 12 + [0.0] * 4]))
        export(randomize(model, seed), path, example)
    elif name in ZOO or name in TRANSFORMERS:  # the zoo's small models, for a quick look
        entry = ZOO[name] if name in ZOO else TRANSFORMERS[name]
        export(randomize(entry.build(), seed), path, entry.inputs())
    else:
        raise SystemExit(f"unknown model {name}: choose from {', '.join(MODELS)} or the zoo's")
    return path


def quantized(src: Path, form: str, seed: int) -> Path:
    """`src` quantized by onnxruntime.quantization in `form` (cached beside it)."""
    if form == "float":
        return src
    out = src.with_name(f"{src.stem}-{form}.onnx")
    if out.exists():
        return out
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        quantize_dynamic,
        quantize_static,
    )

    from onnxshrink.proof.inputs import make_inputs, resolve_shapes

    logging.disable(logging.WARNING)
    try:
        if form == "dynamic":
            quantize_dynamic(src, out)
            return out
        model = onnx.load(src)
        feeds = iter(make_inputs(model, resolve_shapes(model, {}), 4, seed=seed))

        class Reader(CalibrationDataReader):
            def get_next(self):
                return next(feeds, None)

        fmt = QuantFormat.QDQ if form.startswith("qdq") else QuantFormat.QOperator
        quantize_static(src, out, Reader(), quant_format=fmt, per_channel=form.endswith("_pc"))
    finally:
        logging.disable(logging.NOTSET)
    return out


def run(path: Path, ratio: float, workdir: Path) -> dict:
    """`onnxshrink path --prune ratio` in a fresh process: exit, time, and the report's figures."""
    out = workdir / f"{path.stem}-p{ratio:g}-out.onnx"
    report = workdir / f"{path.stem}-p{ratio:g}-report.json"
    for p in (out, report):
        p.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "onnxshrink.cli", str(path), "--prune", str(ratio), "-o", str(out)]
        + ["--report", str(report), "-q"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    wall = time.perf_counter() - t0
    record: dict = {"exit": proc.returncode, "wall": wall, "written": out.exists()}
    if report.exists():
        data = json.loads(report.read_text())
        shrink = data.get("shrink", data)
        record |= {
            "before": (shrink.get("before") or {}).get("params"),
            "after": (shrink.get("after") or {}).get("params"),
            "first_failure": shrink.get("first_failure"),
            "kept_back": len(shrink.get("kept_after_failed_proof") or []),
            "removed_groups": sum(layer["removed"] for layer in data.get("layers", [])),
        }
    if proc.returncode != 0 or not report.exists():
        record["stderr"] = proc.stderr.strip().splitlines()[-3:]
    return record


def render(records: list[dict]) -> list[str]:
    header = ["model", "form", "ratio", "exit", "1st proof", "params", "after", "/ float's",
              "removed", "/ float's", "groups", "time s", "/ float's"]  # fmt: skip
    float_of = {(r["model"], r["ratio"]): r for r in records if r["form"] == "float"}
    rows = []
    for r in records:
        f = float_of.get((r["model"], r["ratio"]))
        removed = (r["before"] - r["after"]) if r.get("after") is not None else None
        f_removed = (f["before"] - f["after"]) if f and f.get("after") is not None else None
        vs = f"{removed / f_removed:.3f}" if removed is not None and f_removed else "-"
        vs_after = (
            f"{r['after'] / f['after']:.3f}" if f and r.get("after") and f.get("after") else "-"
        )
        rows.append([
            r["model"], r["form"], f"{r['ratio']:g}", str(r["exit"]),
            "-" if "first_failure" not in r else ("passed" if not r["first_failure"] else "FAILED"),
            f"{r['before']:,}" if r.get("before") is not None else "-",
            f"{r['after']:,}" if r.get("after") is not None else "-",
            vs_after,
            f"{removed:,}" if removed is not None else "-",
            vs,
            str(r.get("removed_groups", "-")),
            f"{r['wall']:.1f}",
            f"{r['wall'] / f['wall']:.2f}x" if f else "-",
        ])  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    for r in records:
        if r.get("first_failure") or r.get("stderr"):
            lines.append(f"{r['model']} {r['form']} {r['ratio']:g}: {r.get('first_failure') or ''} "
                         f"{' | '.join(r.get('stderr') or [])}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: resnet50, bert")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated: {', '.join(FORMS)}")
    ap.add_argument("--ratios", default="0.3,0.5")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs of each (median time), taken in turns"
    )
    ap.add_argument("--workdir", type=Path, help="keep (and reuse) the models here")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    if "float" not in forms:
        forms.insert(0, "float")  # the baseline every figure is compared with
    bad = [f for f in forms if f not in FORMS]
    if bad:
        ap.error(f"unknown form(s) {', '.join(bad)}: choose from {', '.join(FORMS)}")
    ratios = [float(r) for r in args.ratios.split(",") if r]
    with tempfile.TemporaryDirectory(prefix="quant_check-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        records = []
        for name in args.models.split(","):
            src = export_float(name, workdir, args.seed)
            paths = {form: quantized(src, form, args.seed) for form in forms}
            for ratio in ratios:
                runs: dict[str, list[dict]] = {form: [] for form in forms}
                for _ in range(
                    args.repeat
                ):  # in turns: a change in the machine's load hits all alike
                    for form in forms:
                        rec = {
                            "model": name,
                            "form": form,
                            "ratio": ratio,
                            **run(paths[form], ratio, workdir),
                        }
                        print(json.dumps(rec), file=sys.stderr, flush=True)
                        runs[form].append(rec)
                for form in forms:
                    rec = dict(runs[form][0])
                    rec["walls"] = [r["wall"] for r in runs[form]]
                    rec["wall"] = statistics.median(rec["walls"])
                    rec["exit"] = max(r["exit"] for r in runs[form])
                    records.append(rec)
        lines = render(records)
        print("\n".join(lines))
        if args.json:
            args.json.write_text(json.dumps(records, indent=2))
        ok = all(r["exit"] == 0 and not r.get("first_failure") for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

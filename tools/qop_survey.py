"""Which quantized ops stop channel propagation: zoo models quantized by onnxruntime.quantization,
and models as shipped, with the op types no handler claims and the groups onnxshrink finds.

Each zoo model (models.zoo, random weights, the legacy exporter) is quantized in each form:
``dynamic`` (`quantize_dynamic`: DynamicQuantizeLinear feeding ConvInteger / MatMulInteger,
DynamicQuantizeLSTM for LSTM), ``qop`` (`quantize_static`, QuantFormat.QOperator: QLinearConv,
QLinearConcat, QLinearAveragePool, ...) and ``qop_pc`` (the same, per-channel weights), calibrated
on random inputs; files given on the command line are read as they are. Per model it prints the
op types (domain.op: count) with no handler, the `--groups` count (exact/all) and the most
frequent reasons a group is not exact.

    python tools/qop_survey.py                                   # the zoo, every form
    python tools/qop_survey.py --models densenet,inception --forms qop
    python tools/qop_survey.py --models "" path/to/common_old.onnx

Measured (onnxruntime 1.32): before QLinearConcat, QLinearAveragePool, QLinearSigmoid,
QLinearLeakyRelu and DynamicQuantizeLSTM had rules, exact groups were densenet qop 0/323 (60/73
after), inception qop 44/161 (96/109), se_resnet qop 30/91 (54/67), ddddocr common.onnx dynamic
1752/10988 (1752/1754) and qop 0/23957 (1815/10027), ddddocr common_old.onnx 1755/11054
(1819/1820); every other zoo model and form was unchanged.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMS = ("dynamic", "qop", "qop_pc")
MODELS = ("resnet_basic", "se_resnet", "mobilenetv2", "densenet", "inception", "vgg", "resnext", "recurrent")


def export_float(name: str, workdir: Path) -> Path:
    path = workdir / f"{name}.onnx"
    if path.exists():
        return path
    import torch

    sys.path.insert(0, str(ROOT))
    from models.recurrent import RECURRENT
    from models.zoo import ZOO, export, randomize

    torch.set_num_threads(1)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    entry = RECURRENT if name == "recurrent" else ZOO[name]
    export(randomize(entry.build(), 0), path, entry.inputs(), dynamo=False)
    return path


def quantized(src: Path, form: str) -> Path:
    """`src` quantized by onnxruntime.quantization in `form`, as tools/quant_check.py does it."""
    sys.path.insert(0, str(ROOT / "tools"))
    from quant_check import quantized as quantize

    return quantize(src, form, seed=0)


def survey(path: Path) -> dict:
    import onnx

    from onnxshrink.core.registry import handler_for_op
    from onnxshrink.prepare.shapes import default_opset
    from onnxshrink.prune import find_groups

    model = onnx.load(path)
    opset = default_opset(model)
    missing = collections.Counter(
        f"{n.domain or 'ai.onnx'}.{n.op_type}"
        for n in model.graph.node
        if handler_for_op(n.op_type, n.domain, opset) is None
    )
    groups = find_groups(model, base_dir=path.parent, name=path.name)
    reasons = collections.Counter((g.reason or "")[:100] for g in groups.groups if not g.exact)
    return {
        "model": path.stem,
        "missing": dict(missing),
        "exact": len(groups.exact()),
        "all": len(groups.groups),
        "reasons": reasons.most_common(3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", type=Path, help="models as shipped, surveyed as they are")
    p.add_argument("--models", default=",".join(MODELS), help="zoo models, comma-separated")
    p.add_argument("--forms", default=",".join(FORMS), help=f"of {', '.join(FORMS)}")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/qop_survey"))
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    paths = [quantized(export_float(m, args.workdir), f) for m in filter(None, args.models.split(","))
             for f in filter(None, args.forms.split(","))] + list(args.paths)  # fmt: skip
    print("| model | ops without a handler | groups exact/all | most frequent reasons not exact |")
    print("|---|---|---|---|")
    for path in paths:
        row = survey(path)
        missing = ", ".join(f"{k}: {v}" for k, v in row["missing"].items()) or "-"
        reasons = "; ".join(f"{n}x {r}" for r, n in row["reasons"]) or "-"
        print(f"| {row['model']} | {missing} | {row['exact']}/{row['all']} | {reasons} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

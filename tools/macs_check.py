"""The MAC count the tool prints, against the same count at onnxruntime's own sizes, over the
corpus models (tools/corpus.py's list, read from its cache; fetch them with tools/corpus.py).

For each model: `count_macs` at the corpus input shapes (onnx's shape inference on the skeleton,
with the sizes it finds folded in); then every node output made a graph output, the model run
in onnxruntime (no graph optimization) on random inputs of those shapes, and each op's handler
count taken at the sizes onnxruntime gave. The two must be equal: the independent part is the
sizes. Models with control flow (If, Loop, Scan: counted per branch and iteration) and those a
random draw cannot run are listed as skipped, with the reason.

    python tools/macs_check.py [--only NAME ...] [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import onnx

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import corpus  # noqa: E402  (tools/corpus.py: the models and their shapes)

from onnxshrink.ops import facts  # noqa: E402
from onnxshrink.prepare import default_opset  # noqa: E402
from onnxshrink.report import count_macs  # noqa: E402

BODIES = {"If", "Loop", "Scan"}
FLOATS = {"float": np.float32, "float16": np.float16, "double": np.float64}  # onnxruntime's names


def feeds_for(session, model: corpus.Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs at the corpus shapes (a dynamic dim not given: 1), the model's fixed
    values where it has them."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in session.get_inputs():
        shape = model.input_shapes.get(i.name) or [d if isinstance(d, int) else 1 for d in i.shape]
        kind = i.type[len("tensor(") : -1]
        if kind == "bool":
            value = np.ones(shape, bool)
        elif kind in FLOATS:
            value = rng.standard_normal(shape).astype(FLOATS[kind])
        else:  # int64, int32, uint8, ...: numpy's names
            lo, hi = model.int_ranges.get(i.name, model.int_range)
            value = rng.integers(lo, hi, shape).astype(np.dtype(kind))
        fixed = model.values.get(i.name)
        if fixed is not None and np.asarray(fixed).size == value.size:
            value = np.asarray(fixed).astype(value.dtype).reshape(value.shape)
        out[i.name] = value
    return out


def at_runtime_sizes(model: onnx.ModelProto, entry: corpus.Model) -> int:
    """The handlers' MAC counts at the sizes onnxruntime gives every node output."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    for n in probe.graph.node:
        for o in n.output:
            if o and o not in have:
                probe.graph.output.append(onnx.ValueInfoProto(name=o))
                have.add(o)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = feeds_for(session, entry)
    outs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    shapes = {k: list(np.shape(v)) for k, v in outs.items()}
    shapes |= {k: list(v.shape) for k, v in feeds.items()}
    shapes |= {t.name: list(t.dims) for t in model.graph.initializer}
    opset = default_opset(model)
    total = 0
    for n in model.graph.node:
        handler, op = facts(n, opset)
        if handler is not None and n.output and n.output[0] in shapes:
            total += handler.macs(op, [shapes.get(i) for i in n.input], shapes[n.output[0]])
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "onnxshrink-corpus")
    p.add_argument("--only", nargs="*", default=None, help="models whose name contains any of these")
    args = p.parse_args(argv)
    equal = differ = skipped = 0
    for entry in corpus.MODELS:
        if args.only and not any(s in entry.name for s in args.only):
            continue
        path = args.cache / "models" / entry.package / entry.path
        if not path.exists():
            print(f"{entry.name:26} skipped: not in the cache (run tools/corpus.py)")
            skipped += 1
            continue
        model = onnx.load(str(path))
        if any(n.op_type in BODIES for n in model.graph.node):
            print(f"{entry.name:26} skipped: control flow (bodies counted per branch and iteration)")
            skipped += 1
            continue
        counted = count_macs(model, entry.input_shapes)
        try:
            truth = at_runtime_sizes(model, entry)
        except Exception as exc:
            print(f"{entry.name:26} skipped: onnxruntime does not run it on random inputs ({str(exc)[:80]})")
            skipped += 1
            continue
        same = counted == truth
        equal += same
        differ += not same
        print(f"{entry.name:26} count_macs {counted:>14,}  at onnxruntime's sizes {truth:>14,}  {'equal' if same else 'DIFFERENT'}")
    print(f"\n{equal} equal, {differ} different, {skipped} skipped")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

"""The exact forms of a LayerNorm whose input lost k of its d channels, timed in onnxruntime.

A LayerNorm over d channels of which k are zero is not a LayerNorm of the other d - k (its mean
divides their sum by d). Two forms compute it exactly: the fused op over the input padded with
k zeros, its output sliced back (`pad`); and the statistics written out with the divisor d,
mean = sum / d, var = (sum((x - mean)²) + k mean²) / d (`decomposed`). Printed with the
LayerNorm over all d channels (`original`, the model before) and over the d - k alone (`kept`,
not exact: what a pruner that ignores the statistics writes), in microseconds (onnxruntime,
one thread, the best of 7 x 100 runs), fp32.

    python tools/norm_forms.py
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = [((1, 128), 768, 192), ((1, 56, 56), 96, 48), ((1, 14, 14), 384, 192), ((1, 8), 64, 16)]


def model(form: str, rows: tuple[int, ...], d: int, k: int) -> onnx.ModelProto:
    n = d if form == "original" else d - k
    r = len(rows) + 1
    rng = np.random.default_rng(0)
    g, b = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
    inits = [numpy_helper.from_array(g, "g"), numpy_helper.from_array(b, "b")]
    mk = helper.make_node
    if form in ("original", "kept"):
        nodes = [mk("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    elif form == "pad":
        pads = np.zeros(2 * r, np.int64)
        pads[-1] = k
        vpads = np.asarray([0, k], np.int64)
        inits += [numpy_helper.from_array(a, name) for a, name in (
            (pads, "pads"), (vpads, "vpads"), (np.asarray([0], np.int64), "s0"),
            (np.asarray([n], np.int64), "s1"), (np.asarray([-1], np.int64), "ax"),
        )]  # fmt: skip
        nodes = [
            mk("Pad", ["x", "pads"], ["xp"]),
            mk("Pad", ["g", "vpads"], ["gp"]),
            mk("Pad", ["b", "vpads"], ["bp"]),
            mk("LayerNormalization", ["xp", "gp", "bp"], ["yp"], axis=-1, epsilon=1e-5),
            mk("Slice", ["yp", "s0", "s1", "ax"], ["y"]),
        ]
    else:
        inits += [numpy_helper.from_array(a, name) for a, name in (
            (np.asarray([-1], np.int64), "ax"), (np.asarray(1 / d, np.float32), "invd"),
            (np.asarray(k, np.float32), "kk"), (np.asarray(1e-5, np.float32), "eps"),
        )]  # fmt: skip
        nodes = [
            mk("ReduceSum", ["x", "ax"], ["s"], keepdims=1),
            mk("Mul", ["s", "invd"], ["m"]),
            mk("Sub", ["x", "m"], ["xc"]),
            mk("Mul", ["xc", "xc"], ["sq"]),
            mk("ReduceSum", ["sq", "ax"], ["ss"], keepdims=1),
            mk("Mul", ["m", "m"], ["m2"]),
            mk("Mul", ["m2", "kk"], ["km2"]),
            mk("Add", ["ss", "km2"], ["ss2"]),
            mk("Mul", ["ss2", "invd"], ["var"]),
            mk("Add", ["var", "eps"], ["ve"]),
            mk("Sqrt", ["ve"], ["sd"]),
            mk("Div", ["xc", "sd"], ["nz"]),
            mk("Mul", ["nz", "g"], ["ng"]),
            mk("Add", ["ng", "b"], ["y"]),
        ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [*rows, n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def micros(m: onnx.ModelProto, x: np.ndarray) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    for _ in range(20):
        sess.run(None, {"x": x})
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(100):
            sess.run(None, {"x": x})
        best = min(best, (time.perf_counter() - t) / 100)
    return best * 1e6


def main() -> None:
    rng = np.random.default_rng(1)
    print("| input | d -> d - k | original | kept (not exact) | pad | decomposed | pad vs decomposed: max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rows, d, k in SHAPES:
        full = rng.standard_normal((*rows, d)).astype(np.float32)
        full[..., d - k :] = 0  # the k zero channels: the kept ones first
        kept = np.ascontiguousarray(full[..., : d - k])
        t = {f: micros(model(f, rows, d, k), full if f == "original" else kept) for f in ("original", "kept", "pad", "decomposed")}
        outs = [ort.InferenceSession(model(f, rows, d, k).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": kept})[0] for f in ("pad", "decomposed")]
        print(
            f"| {rows} | {d} -> {d - k} | {t['original']:.1f} | {t['kept']:.1f} | {t['pad']:.1f} | "
            f"{t['decomposed']:.1f} | {np.abs(outs[0] - outs[1]).max():.1e} |"
        )


if __name__ == "__main__":
    main()

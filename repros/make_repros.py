"""Minimal reproductions of the failure classes tools/sweep.py found, one per class.

Each is a tiny graph in ONNX text (as tests/conftest.py `tiny()` writes them: capitalized
inputs are random initializers, `zero` sets slices of them to 0). For each, this script writes
repros/<class>.onnx and repros/<class>.txt (the whole model in onnx.parser text, with the
weights' values, parseable by `onnx.parser.parse_model`; the comment on top says what goes
wrong), then runs `shrink(model, validate=False)` on the model parsed back from the .txt and
checks it in onnxruntime as tests/test_random_graphs.py does (2 inputs, dynamic dims 2 and 3),
printing what happens. Exit status 0 when every repro still fails as described.

    python repros/make_repros.py
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))
from conftest import tiny  # noqa: E402

from models.randgraph import compare_outputs, float_params, ort_session  # noqa: E402

# name -> (text, zero, values, seed, expected failure, what goes wrong and where)
REPROS = {
    "gemm_symbolic_output": (
        """
g (float[1,2] x, float[2,2] W1, float[2] B1, float[2,2] W2, float[2] B2) => (float[1,K] y) {
  h = Gemm<transB=1>(x, W1, B1)
  y = Gemm<transB=1>(h, W2, B2)
}
""",
        {"W1": (0,), "W2": (0,)},
        {},
        0,
        "wrong outputs",
        """h[:, 0] is the constant B1[0] (W1 row 0 zeroed); y[:, 0] reads nothing (W2 row 0 zeroed).
The output's last dim is declared as a symbol K, so kept(y, 1) is None (all kept) in
ops/linear.py Gemm.rewrite, and `~ka & (b0[:, ky] != 0).any(axis=1)` indexes b0[:, None]: the
`removed` mask is 2-D. With a square B it broadcasts and is all False here, so h's constant
feature 0 is removed (its row of W1 and its column of W2 are sliced) but its contribution
B1[0] * W2[1, 0] is never folded into B2: y[:, 1] is off. The same model declared float[1,2] y
is shrunk correctly. With a non-square B the same line raises (see
gemm_symbolic_output_exception).""",
    ),
    "gemm_symbolic_output_exception": (
        """
g (float[1,4] x, float[3,4] W1, float[3] B1, float[2,3] W2, float[2] B2) => (float[1,K] y) {
  h = Gemm<transB=1>(x, W1, B1)
  y = Gemm<transB=1>(h, W2, B2)
}
""",
        {"W1": (0,)},
        {},
        0,
        "exception in shrink",
        """As gemm_symbolic_output, with a 2x3 B: ops/linear.py Gemm.rewrite line
`removed = ~ka & (b0[:, ky] != 0).any(axis=1)` with ky None raises "operands could not be
broadcast together with shapes (3,) (3,2)" (when the shapes happen to broadcast, the matmul two
lines below raises instead: "matmul: Input operand 1 has a mismatch in its core dimension").""",
    ),
    "scalar_gather_fold": (
        """
g (float[1,2,3,3] x, float[2,2,1,1] W1, float[2] B1, int64 K, int64[1] Ax, float[2,2,1,1] W3, float[2] B3, float[2,2] W2, float[2] B2) => (float[1,2] y) {
  c = Conv(x, W1, B1)
  s = Gather<axis=1>(c, K)
  u = Unsqueeze(s, Ax)
  d = Conv(c, W3, B3)
  m = Mul(d, u)
  g = GlobalMaxPool(m)
  f = Flatten(g)
  h = MatMul(f, W2)
  y = Add(h, B2)
}
""",
        {"W1": (), "W3": (0,)},
        {"K": 1, "Ax": [1]},
        2,
        "wrong outputs",
        """c is wholly constant (W1 zeroed), so every node after it is folded by
analyze/constants.py _fold -> analyze/evaluate.py evaluate_op, which feeds its inputs through
np.ascontiguousarray: a 0-d array becomes 1-d, so Gather with the scalar index K gives
[1,1,3,3] instead of [1,3,3], the Unsqueeze [1,1,1,3,3], the Mul [1,1,2,3,3], and GlobalMaxPool
of that rank-5 array takes the max over the channels too. d's channel 0 (W3 row 0 zeroed) is
removed and folded into B2 with that wrong value.""",
    ),
    "scalar_gather_fold_exception": (
        """
g (float[1,2,3,3] x, float[2,2,1,1] W1, float[2] B1, int64 K, int64[1] Ax, float[2,1,1,1] W2) => (float[1,2,3,3] y) {
  c = Conv(x, W1, B1)
  s = Gather<axis=1>(c, K)
  u = Unsqueeze(s, Ax)
  y = Conv(u, W2)
}
""",
        {"W1": ()},
        {"K": 0, "Ax": [1]},
        0,
        "exception in shrink",
        """As scalar_gather_fold: the folded Unsqueeze output has rank 5, and the Conv's constant
handler (ops/common.py channel_expand -> analyze/constants.py expand_to) raises "zip() argument 2
is shorter than argument 1".""",
    ),
    "fold_missing_input": (
        """
g (float[N,2,3,3] x, float[2,2,1,1] W1, float[2] B1, int64[4] R, float[2,4,1,1] W2) => (float[N,2,3,3] y) {
  c = Conv(x, W1, B1)
  t = Tile(c, R)
  y = Conv(t, W2)
}
""",
        {"W1": ()},
        {"R": [1, 2, 1, 1]},
        0,
        "exception in shrink",
        """c is wholly constant (W1 zeroed) but has a dynamic batch, so ConstContext.value(c) is None
(it cannot be materialized). analyze/constants.py propagate_constants still calls _fold for
Tile (every input is "full"), and _fold evaluates Tile with a missing data input: onnx's
reference evaluator runs np.tile(None, [1,2,1,1]) and returns a [1,2,1,1] object array, recorded
as the whole value of t. The next Conv's constant handler then raises "operands could not be
broadcast together with remapped shapes ... (1,2,1,1) and requested shape (1,4,3,3)" (in the
sweep also from ops/linear.py _full_k and ops/reshape.py reshape_constants).""",
    ),
    "gather_unknown_axis": (
        """
g (float[N,2,3,3] x, float[1,1,3,3] T, int64[3] R, float[3] S, float[3] B, float[3] M, float[3] V, int64[2] I) => (float[N,2,3,3] y) {
  n = Shape<end=1>(x)
  rep = Concat<axis=0>(n, R)
  t = Tile(T, rep)
  c = Concat<axis=1>(t, x)
  b = BatchNormalization(c, S, B, M, V)
  y = Gather<axis=1>(b, I)
}
""",
        {"S": 0},
        {"R": [1, 1, 1], "I": [0, 1], "V": [1, 1, 1]},
        0,
        "exception in shrink",
        """The tiled token's dims are not inferred (the repeats come from Shape), so c's channel
count is unknown; b's channel 0 is constant (BN scale 0). ops/concat.py Gather.constants does
`np.where(idx < 0, idx + n, idx)` with n = ir.static_dim(x, axis) = None: "TypeError:
unsupported operand type(s) for +: 'int' and 'NoneType'".""",
    ),
    "shape_value_times_data": (
        """
g (float[1,2,3,3] x, int64 I, float[2,2,1,1] W2) => (float[1,2,3,3] y) {
  s = Shape(x)
  k = Gather<axis=0>(s, I)
  f = Cast<to=1>(k)
  d = Mul(x, f)
  y = Conv(d, W2)
}
""",
        {"W2": (slice(None), 0)},
        {"I": 1},
        0,
        "does not load/run in onnxruntime",
        """d = x * C, with C = Shape(x)[1] as a float (a channel mean written by hand divides by it).
analyze/shapes.py propagate_shapes treats every Add/Sub/Mul/Div with one shape-valued operand as
a shape computation, so d (a float activation) gets an opaque SymValue, and
analyze/keep.py KeepState._visit then skips the Mul's handler ("a shape computation"): d's
channel axis is never coupled to x's. The Conv drops its zero input column 0 from d while x (a
graph input) keeps both channels: the shrunk Conv gets 2 channels for a 1-channel kernel. In the
sweep the same cause shows as Conv / Gemm / MatMul / BatchNormalization / Split / Reshape shape
errors in onnxruntime.""",
    ),
    "matmul_const_contracted": (
        """
g (float[N,2,3,3] x, float[2,2,1,1] W1, float[2] B1, int64[3] S, float[6,2] W2) => (float[N,2] y) {
  c = Conv(x, W1, B1)
  r = Reshape(c, S)
  t = Transpose<perm=[0,2,1]>(r)
  g = MatMul(r, t)
  f = Flatten(g)
  p = GlobalAveragePool(x)
  q = Flatten(p)
  z = Concat<axis=1>(q, f)
  y = MatMul(z, W2)
}
""",
        {"W1": ()},
        {"S": [0, 2, -1]},
        0,
        "wrong outputs",
        """A Gram matrix g = r @ r^T of a constant map (W1 zeroed: r[:, i, :] = B1[i] over the 9
positions). ops/linear.py MatMul.constants takes the contracted size as
`k = max(am.shape[-1], bm.shape[-2], av.shape[-1], bv.shape[-2])`, the sizes of the compressed
constant arrays (1 here, the values being uniform along HW), not the tensor's 9: g's constant is
B1 B1^T instead of 9 B1 B1^T. The constant features of z are removed and folded into a new Add
after y with that value.""",
    ),
    "layernorm_const_fold": (
        """
g (float[1,2,3,7] x, float[2,2,1,1] W1, float[2] B1, float[7] G, float[7] Bt, float[2,4,1,1] W2) => (float[1,2,3,7] y) {
  c = Conv(x, W1, B1)
  n = LayerNormalization<axis=-1>(c, G, Bt)
  z = Concat<axis=1>(x, n)
  y = Conv(z, W2)
}
""",
        {"W1": ()},
        {},
        8,
        "wrong outputs",
        """n is a LayerNorm of constant rows (W1 zeroed): exactly Bt, and onnxruntime computes exactly Bt.
onnxshrink folds it with analyze/evaluate.py evaluate_op, which runs LayerNormalization (not in
_ORT_OPS) with onnx's float32 reference evaluator: the mean of 7 equal float32 values is off by
an ulp, and (x - mean) / sqrt(var + 1e-5) amplifies it ~300x (up to 1e-4 of the scale). z's
constant channels are removed and folded into y with that value: relative error ~7e-5.""",
    ),
    "constant_map_params_grew": (
        """
g (float[1,1,4,4] x, float[2,1,1,1] W1, float[2] B1, float[1,2,1,1] W2, float[1] B2) => (float[1,1,5,5] y) {
  c = Conv(x, W1, B1)
  p = AveragePool<kernel_shape=[2,2], pads=[1,1,1,1], count_include_pad=1>(c)
  y = Conv(p, W2, B2)
}
""",
        {"W1": (0,)},
        {},
        0,
        "parameters grew",
        """c's channel 0 is the constant B1[0]; after the padded AveragePool it varies at the borders.
Removing it saves 3 parameters (W1[0], B1[0], W2[:, 0]); rewrite.py Rewriter.fold_into_bias ->
add_after folds its contribution as a [1, 1, 5, 5] constant map added after y (25 parameters):
7 parameters before, 29 after (onnxshrink's own result.after.params says so too). Nothing weighs
the fold's size against what the removal saves.""",
    ),
}


def input_shapes(model: onnx.ModelProto, n: int) -> dict[str, list[int]]:
    return {
        i.name: [d.dim_value if d.HasField("dim_value") else n for d in i.type.tensor_type.shape.dim]
        for i in model.graph.input
    }


def run(model: onnx.ModelProto) -> tuple[str | None, str]:
    """(failure class or None, detail), checked as tests/test_random_graphs.py does."""
    from onnxshrink import shrink

    rng = np.random.default_rng(0)
    draws = [
        {k: rng.standard_normal(s).astype(np.float32) for k, s in input_shapes(model, n).items()}
        for n in (2, 3)
    ]
    ref = [ort_session(model).run(None, f) for f in draws]
    try:
        result = shrink(model, validate=False, input_shapes=input_shapes(model, 2))
    except Exception as exc:
        where = [f for f in traceback.extract_tb(exc.__traceback__) if "/onnxshrink/" in f.filename][-1]
        at = f"onnxshrink/{where.filename.split('/onnxshrink/')[-1]}:{where.lineno} in {where.name}"
        return "exception in shrink", f"{type(exc).__name__}: {str(exc).splitlines()[0]} [at {at}]"
    try:
        sess = ort_session(result.model)
        got = [sess.run(None, f) for f in draws]
    except Exception as exc:
        return "does not load/run in onnxruntime", str(exc).splitlines()[0][:300]
    names = [o.name for o in model.graph.output]
    diffs = [d for r, g in zip(ref, got, strict=True) for d in compare_outputs(names, r, g)]
    worst = max(diffs, key=lambda d: d.rel_err)
    if not all(d.ok for d in diffs):
        return "wrong outputs", (
            f"output {worst.name}: max |shrunk - ref| = {worst.max_abs_err:.3g}, max |ref| = "
            f"{worst.max_ref:.3g}, relative error {worst.rel_err:.3g}"
        )
    before, after = float_params(model), float_params(result.model)
    if after > before:
        return "parameters grew", f"{before} -> {after} float parameters"
    return None, f"passes (max relative error {worst.rel_err:.2g})"


def main() -> int:
    still = 0
    for name, (text, zero, values, seed, expected, why) in REPROS.items():
        model = tiny(text, zero=zero, values=values, seed=seed)
        head = "\n".join(f"# {line}" if line else "#" for line in why.splitlines())
        what, detail = run(model)
        body = onnx.printer.to_text(model)
        (HERE / f"{name}.txt").write_text(
            f"# {name}: {expected}\n#\n{head}\n#\n# measured: {what}: {detail}\n"
            f"# (python repros/make_repros.py re-measures; onnx.parser.parse_model reads this file)\n{body}\n"
        )
        parsed = onnx.parser.parse_model((HERE / f"{name}.txt").read_text())
        onnx.save(parsed, HERE / f"{name}.onnx")
        what2, detail2 = run(onnx.load(HERE / f"{name}.onnx"))
        ok = what == expected and what2 == expected
        still += ok
        print(f"{name}: {what2}: {detail2}" + ("" if ok else f"   [expected {expected}]"))
    print(f"{still} of {len(REPROS)} reproductions fail as described")
    return 0 if still == len(REPROS) else 1


if __name__ == "__main__":
    sys.exit(main())

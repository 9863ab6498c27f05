"""fp16 and bf16 models (weights and activations) shrink and pass the proof with default options.

The default tolerance follows the dtype the model computes in (ten machine epsilons), and the
printed figures say which it was. onnxruntime runs fp16 on the CPU; bf16 it mostly cannot (no
Add, MatMul, Conv or Relu kernel, and no bf16 arrays in its Python API), so the proof emulates
bf16 arithmetic (onnxshrink/proof/emulate.py). Each result is checked here independently too: fp16 in
onnxruntime, bf16 with onnx's numpy reference evaluator (bf16 arithmetic through ml_dtypes).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import error_against, output_error, params, run, tiny
from onnx import helper
from torch import nn

from onnxshrink import export_and_shrink, shrink
from onnxshrink.cli import main
from onnxshrink.proof.verdict import OutputCheck, ValidationReport

EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}

# Two zeroed columns of W1 whose bias stays: constants relu(B1) folded into a new bias of y.
MLP = """g ({t}[2,8] x, {t}[8,6] W1, {t}[6] B1, {t}[6,4] W2) => ({t}[2,4] y) {{
  h = MatMul(x, W1)
  a = Add(h, B1)
  r = Relu(a)
  y = MatMul(r, W2)
}}"""
# Two zeroed filters whose bias stays: constants relu(B1) folded into the 1x1 conv's bias.
CNN = """g ({t}[1,3,8,8] x, {t}[6,3,3,3] W1, {t}[6] B1, {t}[4,6,1,1] W2, {t}[4] B2) => ({t}[1,4,8,8] y) {{
  h = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r = Relu(h)
  y = Conv(r, W2, B2)
}}"""
MODELS = {
    "mlp": (MLP, {"W1": np.s_[:, [1, 4]]}, (78, 56)),
    "cnn": (CNN, {"W1": np.s_[[1, 4]]}, (196, 132)),
}


def model(kind: str, dtype: str) -> onnx.ModelProto:
    text, zero, _ = MODELS[kind]
    return tiny(text.format(t=dtype), zero=zero, opset=22)  # Conv takes bfloat16 since opset 22


def reference_error(reference: onnx.ModelProto, shrunk: onnx.ModelProto) -> float:
    """Max error relative to each output's magnitude, both models run by onnx's reference
    evaluator in their own dtype (bfloat16 through ml_dtypes): independent of onnxruntime and of
    the proof's emulation."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(7)
    worst = 0.0
    for _ in range(3):
        feeds = {}
        for i in reference.graph.input:
            dtype = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
            shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
        for a, b in zip(ReferenceEvaluator(reference).run(None, feeds), ReferenceEvaluator(shrunk).run(None, feeds), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            worst = max(worst, output_error(a.astype(np.float64), b.astype(np.float64)))  # NaN counts
    return worst


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_shrinks_and_passes_the_proof_by_default(kind, dtype):
    m = model(kind, dtype)
    result = shrink(m)
    v = result.validation
    assert v.passed and v.rtol == 10 * EPS[dtype] and v.dtype == dtype
    assert f"rtol {10 * EPS[dtype]:g} for {dtype} arithmetic" in v.detail
    assert ("bfloat16 arithmetic emulated in float32" in v.detail) == (dtype == "bfloat16")
    # folding the constants into a bias rounds differently: an error (if any) at the dtype's
    # resolution
    assert 0 <= v.outputs[0].max_rel_error <= 4 * EPS[dtype]
    assert (result.before.params, result.after.params) == MODELS[kind][2]
    assert {t.data_type for t in result.model.graph.initializer} == {m.graph.initializer[0].data_type}
    # the shrunk model without the proof, checked independently
    shrunk = shrink(m, validate=False).model
    if dtype == "float16":
        assert error_against(m, shrunk) <= 4 * EPS[dtype]
    assert reference_error(m, shrunk) <= 4 * EPS[dtype]


def test_the_cli_prints_the_tolerance_and_names_the_rtol_for_an_error_at_the_resolution(tmp_path, capsys):
    path, out = tmp_path / "fp16.onnx", tmp_path / "small.onnx"
    onnx.save(model("cnn", "float16"), path)
    assert main([str(path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "and at least rtol 0.00976562 for float16 arithmetic" in text
    assert "Tolerance: [abs=0, rel=0.0097656] (the floor for float16" in text
    assert "PASSED | All outputs matched" in text
    out.unlink()
    # 1e-5 is below fp16's resolution: rounding (the float64 judge: the same function), which no
    # kept channel fixes: a failed proof at once (exit 1, nothing written) naming the rtol to give
    for recover in ([], ["--no-recover"]):
        assert main([str(path), "-o", str(out), "--rtol", "1e-5", *recover]) == 1
        captured = capsys.readouterr()
        assert "Float64 judge: rounding (float64: 0 between the reference and its float64 twin; the reference's own float16 error" in captured.out
        assert "finding the removals responsible" not in captured.out
        assert "is rounding, not a wrong model: in float64 the two compute the same function" in captured.err
        assert "The smallest tolerance that would have passed: --rtol 0.00057;" in captured.err
        assert not out.exists()
    assert main([str(path), "-o", str(out), "--rtol", "0.00057"]) == 0


def _report(errors: list[float], rtol: float, eps: float, rounding: list | None = None) -> ValidationReport:
    rounding = rounding or [None] * len(errors)
    checks = [OutputCheck(f"y{k}", [1], e, e, e <= rtol, rounding=r) for k, (e, r) in enumerate(zip(errors, rounding, strict=True))]
    return ValidationReport(
        all(c.passed for c in checks), rtol, 0.0, 3, "cpu", {}, checks, dtype="float16", eps=eps, rtol_given=True
    )


def test_a_failure_is_rounding_when_the_float64_judge_says_so_or_else_by_its_size():
    eps = 2.0**-10
    assert _report([3e-3, 1e-6], 1e-5, eps).rounding()  # not judged: within 16 epsilons
    assert not _report([0.5, 1e-6], 1e-5, eps).rounding()  # a wrong removal's size
    assert not _report([3e-3, 0.2], 1e-5, eps).rounding()  # every failed output must be
    assert not _report([1e-6], 1e-5, eps).rounding()  # passed
    assert _report([0.5], 1e-5, eps, [True]).rounding()  # judged: the same function
    assert not _report([3e-3], 1e-5, eps, [False]).rounding()  # judged: another function
    hint = _report([0.012], 10 * eps, eps).tolerance_hint()  # over the default, but rounding
    assert "The smallest tolerance that would have passed: --rtol 0.012;" in hint
    assert _report([0.0123], 0.0, eps).needed_rtol() == 0.0123


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_export_and_shrink_of_a_half_precision_module(dtype):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        module[0].weight[[2, 5]] = 0  # two filters whose biases stay: folded into the next conv
    module = module.to(dtype)
    result = export_and_shrink(module, (torch.randn(1, 3, 8, 8, dtype=dtype),))
    name = "float16" if dtype == torch.float16 else "bfloat16"
    for v in (result.validation, result.torch_validation):
        assert v.passed and v.dtype == name and v.rtol == 10 * EPS[name]
        assert f"rtol {10 * EPS[name]:g} for {name} arithmetic" in v.detail
    assert params(result.model) == result.after.params == result.before.params - 2 * (27 + 1) - 2 * 4
    if dtype == torch.float16:  # checked here too (onnxruntime has no bf16 kernels to run it)
        x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
        with torch.no_grad():
            want = module(x).numpy()
        got = run(result.model, {result.model.graph.input[0].name: x.numpy()})[0]
        assert output_error(want, got) <= 4 * EPS["float16"]

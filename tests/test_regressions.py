"""Minimal reproductions of the failure classes the random-graph sweep found (tools/sweep.py):
each, shrunk with validation off, must now compute what the input computes, with no more
parameters. tests/regressions/<class>.onnx.txt is the whole model in onnx.parser text; its
header comment says what went wrong and where (sweep_3000_before_fixes.txt: the sweep then)."""

from pathlib import Path

import onnx
import pytest
from conftest import error_against, params

from onnxshrink import shrink

CASES = sorted((Path(__file__).parent / "regressions").glob("*.onnx.txt"))


def test_every_failure_class_has_its_reproduction():
    assert len(CASES) == 10


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name.split(".")[0])
def test_reproduction_shrinks_exactly(path):
    text = "\n".join(line for line in path.read_text().splitlines() if not line.startswith("#"))
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    shapes = {i.name: [d.dim_value or 2 for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    result = shrink(model, validate=False, input_shapes=shapes)
    assert error_against(model, result.model, shapes) <= 1e-5
    assert params(result.model) <= params(model)

"""Models as other exporters write them: tf2onnx, Keras 3's own ONNX export, paddle2onnx, spox.

tools/exporter_fixtures.py built each fixture in its framework (a CNN, an MLP, an attention
model; random trained-like weights, some channels zeroed) and exported it with the exporter
itself; its sidecar JSON says which channels it zeroed and `native_params`, the parameter count
of the same architecture built natively with only the kept channels and exported the same way.
Each fixture is shrunk with validation off (the zeros in its weights are the masks), checked here
in onnxruntime against the fixture as given, and its parameter count against the native one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import ort_run
from onnx import numpy_helper

from onnxshrink import shrink

MODELS = Path(__file__).resolve().parents[1] / "models"
EXPORTERS = ("tf2onnx", "keras", "paddle2onnx", "spox")
FIXTURES = sorted(p for e in EXPORTERS for p in (MODELS / e).glob("*.onnx") if p.with_suffix(".json").is_file())

_PARAM_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT8, onnx.TensorProto.UINT8}


def count_params(graph: onnx.GraphProto) -> int:
    """Float and 8-bit elements of initializers and Constant nodes, in every graph: counted here
    as tools/exporter_fixtures.py counted the native model, independently of onnxshrink."""
    n = sum(int(np.prod(t.dims)) for t in graph.initializer if t.data_type in _PARAM_TYPES)
    for node in graph.node:
        for a in node.attribute:
            if node.op_type == "Constant" and a.name == "value" and a.t.data_type in _PARAM_TYPES:
                n += int(numpy_helper.to_array(a.t).size)
            if a.type == onnx.AttributeProto.GRAPH:
                n += count_params(a.g)
            n += sum(count_params(g) for g in a.graphs)
    return n


def draws(meta: dict, count: int = 3) -> list[dict[str, np.ndarray]]:
    spec = meta["input"]
    rng = np.random.default_rng(7)
    out = []
    for _ in range(count):
        if "range" in spec:
            x = rng.integers(*spec["range"], size=spec["shape"]).astype(spec["dtype"])
        else:
            x = rng.standard_normal(spec["shape"]).astype(spec["dtype"])
        out.append({spec["name"]: x})
    return out


def test_every_exporter_has_its_fixtures():
    assert sorted({p.parent.name for p in FIXTURES}) == sorted(EXPORTERS)
    assert all(p.stat().st_size < 200_000 for p in FIXTURES)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_fixture_shrinks_exactly_to_the_native_size(path: Path):
    meta = json.loads(path.with_suffix(".json").read_text())
    model = onnx.load(str(path))
    assert count_params(model.graph) == meta["params"]  # the fixture is the one described
    result = shrink(model, validate=False)
    for feed in draws(meta):
        want = ort_run(model, feed)
        got = ort_run(result.model, feed)
        for a, b in zip(want, got, strict=True):
            assert a.shape == b.shape
            assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    assert count_params(result.model.graph) == meta["native_params"] < meta["params"]
    assert result.after.params == meta["native_params"]

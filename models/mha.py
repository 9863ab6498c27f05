"""torch.nn.MultiheadAttention exported with dynamic axes: the module the tests and the fixture
writer share (tests/ops/test_packed_heads_dynamic.py, tools/mha_fixtures.py).

Self-attention `a(x, x, x)` of width E with HEADS heads, exported by torch's legacy exporter
(`dynamo=False`, `dynamic_axes`) or its dynamo exporter (`dynamic_shapes`), with a dynamic batch
and, when asked, a dynamic sequence axis. The dynamo export takes ~13 s, so its models are
stored (models/mha/, written by tools/mha_fixtures.py); the legacy one exports in a fraction of
a second. Needs torch (imported by the functions that use it).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import onnx

E, HEADS, T, B = 16, 4, 5, 2
HD = E // HEADS
DIR = Path(__file__).resolve().parent / "mha"


def module(batch_first: bool, biases: bool, seed: int = 3) -> Any:
    """The attention module (eval mode): torch's default init (zero biases), or with random
    normal biases."""
    import torch

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.MultiheadAttention(E, HEADS, batch_first=batch_first)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x, x, x, need_weights=False)[0]

    torch.manual_seed(seed)
    m = Attention().eval()
    if biases:
        with torch.no_grad():
            m.a.in_proj_bias.normal_()
            m.a.out_proj.bias.normal_()
    return m


def batch_axis(batch_first: bool) -> int:
    return 0 if batch_first else 1


def export(m: Any, batch_first: bool, dynamo: bool, seq: bool) -> onnx.ModelProto:
    """`m` exported with a dynamic batch (and sequence, when `seq`) axis."""
    import torch

    x = torch.randn(B, T, E) if batch_first else torch.randn(T, B, E)
    b, s = batch_axis(batch_first), 1 - batch_axis(batch_first)
    axes = {b: "batch", **({s: "seq"} if seq else {})}
    buf = io.BytesIO()
    if dynamo:
        shapes = {"x": {a: torch.export.Dim(n) for a, n in axes.items()}}
        prog = torch.onnx.export(m, (x,), dynamo=True, input_names=["x"], output_names=["y"], dynamic_shapes=shapes)
        model = prog.model_proto
    else:
        dyn = {"x": axes, "y": axes}
        torch.onnx.export(m, (x,), buf, dynamo=False, input_names=["x"], output_names=["y"], dynamic_axes=dyn)
        model = onnx.load_from_string(buf.getvalue())
    return model


def fixture_path(batch_first: bool) -> Path:
    return DIR / f"dynamo_{'batch_first' if batch_first else 'seq_first'}.onnx"


def draw(batch_first: bool, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (batch, seq, E) if batch_first else (seq, batch, E)
    return rng.standard_normal(shape).astype(np.float32)

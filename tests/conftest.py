"""Shared test helpers: tiny models in ONNX text syntax, and the zoo exported once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# One thread each for torch, onnxruntime and BLAS: on a busy 2-core machine, thread pools that
# spin-wait for each other made the suite take 84 minutes instead of a few. Set in the
# environment, so the processes the tests start (the command line) are pinned too: onnxruntime
# reads no OMP_NUM_THREADS, the tool's sessions follow ONNXSHRINK_THREADS.
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ONNXSHRINK_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402
from onnx import numpy_helper  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Conv(3->6, 3x3, padded) -> Relu -> Conv(6->4, 1x1): 196 parameters; the CLI and I/O tests' model.
CONV2 = """
g (float[1,3,8,8] x, float[6,3,3,3] W1, float[6] B1, float[4,6,1,1] W2, float[4] B2)
  => (float[1,4,8,8] y) {
  h = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r = Relu(h)
  y = Conv(r, W2, B2)
}
"""

# Conv(16->64) -> Relu -> Conv(64->32, 1x1), wide enough for external data (W1 is 36 KiB).
WIDE = """
g (float[1,16,8,8] x, float[64,16,3,3] W1, float[64] B1, float[32,64,1,1] W2, float[32] B2)
  => (float[1,32,8,8] y) {
  h = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r = Relu(h)
  y = Conv(r, W2, B2)
}
"""
WIDE_BEFORE = 64 * 16 * 9 + 64 + 32 * 64 + 32  # 11360
WIDE_PER_CHANNEL = 16 * 9 + 1 + 32  # one W1 filter, its bias, one W2 column


def tiny(text: str, zero: dict | None = None, seed: int = 0, opset: int = 17, values: dict | None = None) -> onnx.ModelProto:
    """A model from ONNX text (see onnxshrink.testing.model_from_text): capitalized graph inputs
    become random initializers, `values` gives some exactly, `zero` zeroes index expressions."""
    from onnxshrink.testing import model_from_text

    return model_from_text(text, opset=opset, values=values, zero=zero, seed=seed)


def cli(*args, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    """Run the command line in a fresh process (`kwargs`: for subprocess.run, e.g. preexec_fn)."""
    return subprocess.run(
        [sys.executable, "-m", "onnxshrink.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file (and directory) under `directory`, with its bytes."""
    out = {}
    for p in sorted(directory.rglob("*")):
        out[str(p.relative_to(directory))] = p.read_bytes() if p.is_file() else b"<dir>"
    return out


def init(model: onnx.ModelProto, name: str) -> np.ndarray:
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    raise KeyError(name)


def shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(t.dims) for t in model.graph.initializer}


def pytest_configure(config):
    import torch

    from onnxshrink import validate

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    validate.SESSION_THREADS = 1


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a model with onnxruntime (one thread, no spinning), independently of onnxshrink."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


run = ort_run


def params(model: onnx.ModelProto) -> int:
    from onnxshrink.report import model_stats

    return model_stats(model).params


def error_against(reference, shrunk: onnx.ModelProto, shapes: dict | None = None, draws: int = 3) -> float:
    """Max relative error (of each output's magnitude) of `shrunk` against `reference` (a
    model or a path: the user's own file), on random inputs, run here with onnxruntime:
    independent of onnxshrink's proof. Shapes and dtypes must agree."""
    from onnxshrink.validate import make_inputs, resolve_shapes

    ref = onnx.load(str(reference)) if not isinstance(reference, onnx.ModelProto) else reference
    worst = 0.0
    for feed in make_inputs(ref, resolve_shapes(ref, shapes or {}), draws, seed=123):
        for a, b in zip(run(ref, feed), run(shrunk, feed), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
    return worst


def shrink_checked(model, draws: int = 3, **kwargs):
    """Shrink with validation off (the analysis must be sound on its own), then check here that
    the shrunk model computes what the input computes (the zeros in its weights are the masks:
    it is its own reference). `model`: a ModelProto or an exported file."""
    from onnxshrink import shrink

    assert "masks" not in kwargs, "shrink_checked compares with the input model itself"
    result = shrink(model, validate=False, **kwargs)
    worst = error_against(model, result.model, kwargs.get("input_shapes"), draws)
    assert worst <= 1e-5, f"shrunk model differs from the input by {worst:.3g} (relative)"
    result.independent_error = worst
    return result


# ------------------------------------------------------------------ zoo exports (cached)
@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


_EXPORTS: dict[tuple, Path] = {}


def half_masked(entry, which: str, **export_kwargs):
    """For export_cached: a zoo entry with half of every channel group masked ("masked"), or
    built natively with the channels kept ("native")."""
    from models.zoo import choose_kept, native_widths, randomize, zero_groups

    def build():
        kept = choose_kept(randomize(entry.build(), seed=1), 0.5, seed=2)
        if which == "native":
            return randomize(entry.build(native_widths(kept)), seed=3), entry.inputs(), export_kwargs
        model = randomize(entry.build(), seed=1)
        zero_groups(model, kept)
        return model, entry.inputs(), export_kwargs

    return build


def export_cached(directory: Path, key: tuple, build) -> Path:
    """Export once per session per key; `build()` returns (module, input_shape, export kwargs)."""
    if key not in _EXPORTS:
        from models.zoo import export

        module, input_shape, kwargs = build()
        path = directory / ("_".join(str(k) for k in key) + ".onnx")
        export(module, path, input_shape, **kwargs)
        _EXPORTS[key] = path
    return _EXPORTS[key]

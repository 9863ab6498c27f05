"""Shared test helpers: tiny models in ONNX text syntax, and the zoo exported once per session."""

from __future__ import annotations

import math
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


def cli_on_terminal(*args, cwd: Path, env: dict | None = None) -> tuple[int, str, str]:
    """Run the command line in a fresh process whose stderr is a terminal (a pseudo-terminal
    made here, whatever the test runs under): (exit code, stdout, what the terminal showed)."""
    import fcntl
    import pty
    import struct
    import termios

    main_fd, term_fd = pty.openpty()
    # 24 rows of 100 columns (a new pseudo-terminal has 0 x 0: bars sized to it would be empty)
    fcntl.ioctl(term_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "onnxshrink.cli", *map(str, args)],
            cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=term_fd, text=True, env=env,
        )
        os.close(term_fd)
        shown = bytearray()
        while True:
            try:
                chunk = os.read(main_fd, 4096)
            except OSError:  # the last writer closed the terminal (EIO on Linux)
                break
            if not chunk:
                break
            shown += chunk
        out = proc.stdout.read() if proc.stdout else ""
        code = proc.wait(timeout=300)
    finally:
        os.close(main_fd)
    return code, out, shown.decode(errors="replace")


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

    from onnxshrink.proof import sessions

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    sessions.SESSION_THREADS = 1


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a model with onnxruntime (one thread, no spinning), independently of onnxshrink."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


run = ort_run


# What the README calls parameters: float weights and the integer ones of quantized models
# (8-, 4- and 16-bit weights, int32 biases), stored as initializers (in subgraphs too) or, for
# floats, as Constant nodes; int64 constants are shape arithmetic. Counted here, not by onnxshrink.
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
PARAM_TYPES = FLOAT_TYPES | {
    onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT4, onnx.TensorProto.UINT4,
    onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.INT32,
}


def _graphs(graph: onnx.GraphProto):
    yield graph
    for n in graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _graphs(g)


def params(model: onnx.ModelProto) -> int:
    """The model's parameters, counted here from the protobuf (independently of onnxshrink's
    `model_stats`, whose figures the tests check against this)."""
    total = 0
    for g in _graphs(model.graph):
        total += sum(int(np.prod(t.dims, dtype=np.int64)) for t in g.initializer if t.data_type in PARAM_TYPES)
        for n in g.node:
            if n.op_type != "Constant" or n.domain not in ("", "ai.onnx"):
                continue
            for a in n.attribute:
                if a.name == "value" and a.t.data_type in FLOAT_TYPES:
                    total += int(np.prod(a.t.dims, dtype=np.int64))
                elif a.name == "value_float":
                    total += 1
                elif a.name == "value_floats":
                    total += len(a.floats)
    return total


def with_masks(model: onnx.ModelProto, masks: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` with each mask (0/1, of its initializer's shape) multiplied into the
    initializer of that name, here with numpy: the reference a shrink with these masks must
    match, made without onnxshrink (masked entries exactly 0, even where inf or nan)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    left = dict(masks)
    for t in out.graph.initializer:
        if t.name in left:
            w = numpy_helper.to_array(t)
            m = np.asarray(left.pop(t.name))
            assert m.shape == w.shape, f"mask {t.name!r}: shape {m.shape}, its initializer's {w.shape}"
            t.CopyFrom(numpy_helper.from_array(np.where(m != 0, w, np.zeros((), w.dtype)).astype(w.dtype), t.name))
    assert not left, f"masks name no initializer: {sorted(left)}"
    return out


def _index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """Integer inputs read directly as indices into a stored table: their exclusive bound."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    # op -> [(index input, table input, table axis attribute or 0)]
    reads = {"Gather": [(1, 0)], "EmbedLayerNormalization": [(0, 2), (1, 3), (7, 4)]}
    bounds: dict[str, int] = {}
    for n in model.graph.node:
        for i, table in reads.get(n.op_type, []):
            if i < len(n.input) and table < len(n.input) and n.input[table] in dims:
                shape = dims[n.input[table]]
                axis = next((a.i for a in n.attribute if a.name == "axis"), 0) if n.op_type == "Gather" else 0
                size = shape[axis if axis >= 0 else axis + len(shape)]
                bounds[n.input[i]] = min(bounds.get(n.input[i], size), size)
    return bounds


def random_feeds(
    model: onnx.ModelProto, shapes: dict | None = None, draws: int = 3, seed: int = 123
) -> list[dict[str, np.ndarray]]:
    """Random inputs made here (not by onnxshrink): the shapes given, static dims, and for the
    other dynamic dims 2 (a leading axis) or 16, one value per dim name; integer indices into a
    stored table within it (else 0 or 1)."""
    from onnx import helper

    shapes = dict(shapes or {})
    stored = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in stored]
    symbols: dict[str, int] = {}
    for i in inputs:
        if i.name in shapes:
            for d, v in zip(i.type.tensor_type.shape.dim, shapes[i.name], strict=True):
                if d.dim_param:
                    symbols.setdefault(d.dim_param, v)
    for i in inputs:
        if i.name not in shapes:
            shapes[i.name] = [
                d.dim_value if d.HasField("dim_value") else symbols.setdefault(d.dim_param, 2 if k == 0 else 16)
                if d.dim_param else (2 if k == 0 else 16)
                for k, d in enumerate(i.type.tensor_type.shape.dim)
            ]
    bounds = _index_bounds(model)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        feed = {}
        for i in inputs:
            dtype = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
            shape = shapes[i.name]
            if dtype == np.bool_:
                feed[i.name] = np.asarray(rng.random(shape) < 0.5)
            elif np.issubdtype(dtype, np.integer):
                feed[i.name] = np.asarray(rng.integers(0, bounds.get(i.name, 2), size=shape), dtype)
            else:
                assert np.issubdtype(dtype, np.floating), f"input {i.name!r}: no random {dtype} here"
                feed[i.name] = np.asarray(rng.standard_normal(shape), dtype)
        out.append(feed)
    return out


def output_error(ref: np.ndarray, got: np.ndarray, name: str = "") -> float:
    """Max |got - ref| relative to max |ref|, strictly: shapes and dtypes must agree; an integer
    or bool output must be equal (else inf); a NaN or inf where the reference has another value
    is inf (a NaN never hides behind max()); where the reference is not finite, the same value."""
    assert got.dtype == ref.dtype, f"output {name!r}: dtype {got.dtype}, the reference's {ref.dtype}"
    assert got.shape == ref.shape, f"output {name!r}: shape {got.shape}, the reference's {ref.shape}"
    if not np.issubdtype(ref.dtype, np.floating):
        return 0.0 if np.array_equal(ref, got) else math.inf
    a, b = ref.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(a)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if not same[~finite].all() or not np.isfinite(b[finite]).all():
        return math.inf
    err = float(np.max(np.abs(a[finite] - b[finite]), initial=0.0))
    scale = float(np.max(np.abs(a[finite]), initial=0.0))
    return err / scale if scale > 0 else (0.0 if err == 0 else math.inf)


# Over this relative error, a float32 output is judged again in float64 (models/randgraph.py's
# `rounding_only`): two different float32 roundings of the same function (constants folded and
# summed in another order) can differ by many epsilons where an output is a small remainder of
# cancellation. Then its error is the float64 one: what the two functions differ by.
ROUNDING_SCREEN = 1e-6


def _float64_error(reference, shrunk, feed, names, ref32, got32, errors) -> list[float]:
    from models.randgraph import ROUNDING_FACTOR, _max_abs, float64_outputs

    r64, s64 = float64_outputs(reference, feed), float64_outputs(shrunk, feed)
    if r64 is None or s64 is None:
        return errors
    out = list(errors)
    for k, (a32, b32, a64, b64) in enumerate(zip(ref32, got32, r64, s64, strict=True)):
        if errors[k] <= ROUNDING_SCREEN or a32.dtype != np.float32 or not np.isfinite(errors[k]):
            continue
        if a64.shape != a32.shape or not (np.isfinite(a64).all() and np.isfinite(b64).all()):
            continue
        floor = _max_abs(a32, a64) + _max_abs(b32, b64)
        if max(_max_abs(a32, b32), _max_abs(a64, b64)) <= ROUNDING_FACTOR * floor:
            out[k] = output_error(np.asarray(a64), np.asarray(b64), names[k])
    return out


def error_against(reference, shrunk, shapes: dict | None = None, draws: int = 3) -> float:
    """The largest relative error (`output_error`: NaN, inf, shape and dtype mismatches are
    failures) of `shrunk` against `reference` over random inputs made here, both run here with
    onnxruntime: independent of onnxshrink's proof. `reference` is the user's model (a
    ModelProto or a path) with the masks applied by the test (`with_masks`), never onnxshrink's
    own reference. A float32 output off by float32 rounding only is measured in float64."""
    ref = reference if isinstance(reference, onnx.ModelProto) else onnx.load(str(reference))
    got = shrunk if isinstance(shrunk, onnx.ModelProto) else onnx.load(str(shrunk))
    names = [o.name for o in ref.graph.output]
    assert [o.name for o in got.graph.output] == names, "the outputs differ"
    worst = 0.0
    for feed in random_feeds(ref, shapes, draws, seed=123):
        a, b = run(ref, feed), run(got, feed)
        errors = [output_error(x, y, n) for x, y, n in zip(a, b, names, strict=True)]
        if any(ROUNDING_SCREEN < e < math.inf for e in errors):
            errors = _float64_error(ref, got, feed, names, a, b, errors)
        worst = max(worst, *errors)
    return worst


def shrink_checked(model, draws: int = 3, masks: dict[str, np.ndarray] | None = None, **kwargs):
    """Shrink with validation off (the analysis must be sound on its own), then check here that
    the shrunk model computes what the input computes (the zeros in its weights are the masks:
    it is its own reference; with `masks`, by initializer name, the input with them applied here).
    `model`: a ModelProto or an exported file."""
    from onnxshrink import shrink

    reference = model if masks is None else with_masks(model, masks)
    result = shrink(model, masks, validate=False, **kwargs)
    worst = error_against(reference, result.model, kwargs.get("input_shapes"), draws)
    assert worst <= 1e-5, f"shrunk model differs from the input by {worst:.3g} (relative)"
    # the report's parameter counts are the models' own, counted here
    given = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    assert (result.before.params, result.after.params) == (params(given), params(result.model))
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


def zero_slices(m: onnx.ModelProto, where: dict[str, list[tuple[int, list[int]]]]) -> onnx.ModelProto:
    """A copy of `m` whose initializers named in `where` have the given indices zeroed along
    each given axis (a masked export made by hand)."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    for t in out.graph.initializer:
        v = numpy_helper.to_array(t).copy()
        for axis, idx in where.get(t.name, []):
            v[(slice(None),) * axis + (idx,)] = 0
        t.CopyFrom(numpy_helper.from_array(v, t.name))
    return out


def node_attr(m: onnx.ModelProto, op: str, name: str):
    """Attribute `name` of the one `op` node of `m`'s main graph."""
    [node] = [n for n in m.graph.node if n.op_type == op]
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}[name]

"""Prove the shrunk model against the reference with onnxruntime, on random and given inputs."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from onnxshrink import ir
from onnxshrink.errors import ShrinkError, first_line
from onnxshrink.logs import onnxruntime_severity
from onnxshrink.options import ShrinkOptions

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# onnxruntime's threads per session (0: its default, one per core). Tests set 1; a process
# started by them (the command line) reads ONNXSHRINK_THREADS (see session_threads).
SESSION_THREADS = 0
THREADS_VARIABLE = "ONNXSHRINK_THREADS"


@dataclass
class OutputCheck:
    name: str
    shape: list[int]
    max_abs_error: float
    max_rel_error: float  # max |shrunk - reference| / max |reference|
    passed: bool
    rtol: float | None = None  # this output's tolerance (None: the report's rtol)
    tolerance: str = ""  # why that tolerance: "given", the dtype's floor, the reference's noise
    noise: float | None = None  # the reference's own noise: its outputs with onnxruntime's
    # optimizations on vs off, relative to max |reference| (None: not measured)
    rounding: bool | None = None  # the float64 judge's verdict on a failure (None: not judged)
    float64: float | None = None  # max |shrunk - reference| in float64, relative (when judged)
    judged: str = ""  # what the float64 judge found, or why it could not judge

    def needed_rtol(self, atol: float) -> float:
        """The smallest rtol this output passes with, at `atol` (inf: none, e.g. shapes differ)."""
        if not math.isfinite(self.max_abs_error):
            return math.inf
        if self.max_abs_error <= atol:
            return 0.0
        if self.max_rel_error == 0 or not math.isfinite(self.max_rel_error):
            return math.inf
        mag = self.max_abs_error / self.max_rel_error
        return (self.max_abs_error - atol) / mag


@dataclass
class ValidationReport:
    passed: bool
    rtol: float  # the tolerance given, or the dtype's floor (each output's own: OutputCheck.rtol)
    atol: float
    draws: int
    provider: str
    input_shapes: dict[str, list[int]]
    outputs: list[OutputCheck] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # the shrunk model did not load or run in onnxruntime
    # What was proven: "full" (the graph outputs), or "first N of M blocks" (their frontier)
    kind: str = "full"
    detail: str = ""  # how: sessions one after the other, segments, the dtype the tolerance follows
    # The least precise float type the model computes in, and its machine epsilon
    dtype: str = "float32"
    eps: float = 2.0**-23
    # onnxruntime's graph optimization level the models were compared at (its default, as users
    # run them; ORT_DISABLE_ALL when the reference itself does not load at the default)
    level: str = ""
    rtol_given: bool = False  # the tolerance was given (--rtol): it wins over the derived one

    def to_dict(self) -> dict:
        return asdict(self)

    def rounding(self) -> bool:
        """Did it fail by rounding only: every output that failed computes the reference's
        function (the float64 judge says so; where it could not judge, the error is within a
        few machine epsilons of the dtype), above a tolerance that was given?"""
        failed = [o for o in self.outputs if not o.passed]
        return (
            not self.passed
            and self.error is None
            and bool(failed)
            and all(
                o.rounding if o.rounding is not None else o.max_rel_error <= ROUNDING_STEPS * self.eps
                for o in failed
            )
        )

    def needed_rtol(self) -> float:
        """The smallest rtol every output passes with (at this atol); inf when none does."""
        return max((o.needed_rtol(self.atol) for o in self.outputs), default=0.0)

    def tolerance_hint(self) -> str:
        """What a failure by rounding means, and the smallest tolerance that would have passed."""
        failed = [o for o in self.outputs if not o.passed]
        worst = max(failed, key=lambda o: o.max_rel_error)
        judged = (
            f"in float64 the two compute the same function ({worst.judged})"
            if worst.rounding
            else f"it is within a few machine epsilons of {self.dtype} ({self.eps:.3g})"
        )
        needed = self.needed_rtol()
        passing = (
            f" The smallest tolerance that would have passed: --rtol {round_up(needed)}"
            + (f" (with --atol {self.atol:g})" if self.atol else "")
            + ("; without --rtol the tolerance follows the reference's own noise." if self.rtol_given else ".")
            if math.isfinite(needed)
            else ""
        )
        return (
            f"The error (relative {worst.max_rel_error:.3g} on '{worst.name}') is rounding, not a "
            f"wrong model: {judged}; {self.dtype} arithmetic rounds differently when zero terms "
            f"are removed and constants folded.{passing}"
        )

    def lines(self) -> list[str]:
        """Polygraphy-style accuracy block."""
        shapes = " ".join(f"{n}:{','.join(map(str, d)) or '[]'}" for n, d in self.input_shapes.items())
        out = [
            f"[I] Accuracy Comparison | reference (masked input) vs shrunk | {self.draws} draw(s) on "
            f"{self.provider}" + (f" | random inputs {shapes}" if shapes else "")
        ]
        if self.kind != "full" or self.detail:
            tag = "[I]" if self.kind == "full" else "[W]"  # a partial proof says so
            out.append(f"{tag}     Proof: {self.kind}" + (f" ({self.detail})" if self.detail else ""))
        for o in self.outputs:
            rtol = self.rtol if o.rtol is None else o.rtol
            out.append(f"[I]     Comparing Output: '{o.name}' (shape={tuple(o.shape)})")
            why = f" ({o.tolerance})" if o.tolerance else ""
            out.append(
                f"[I]         Tolerance: [abs={self.atol:.5g}, rel={rtol:.5g}]{why} | Checking max error relative to the output's magnitude"
            )
            out.append(
                f"[I]         Minimum Required Tolerance: [abs={o.max_abs_error:.5g}] OR [rel={o.max_rel_error:.5g}]"
            )
            if o.judged:
                verdict = "rounding" if o.rounding else "not rounding" if o.rounding is False else "not judged"
                out.append(f"[I]         Float64 judge: {verdict} ({o.judged})")
            tag = "[I]         PASSED" if o.passed else "[E]         FAILED"
            bound = f"(rel={rtol:.5g}, abs={self.atol:.5g})"
            difference = (
                f"rounding, the same function in float64 (above the tolerance {bound})"
                if o.passed and o.rounding
                else f"{'within' if o.passed else 'NOT within'} tolerance {bound}"
            )
            out.append(f"{tag} | Output: '{o.name}' | Difference is {difference}")
        if self.error:
            out.append(f"[E]     FAILED | the shrunk model does not run: {self.error}")
            return out
        names = [o.name for o in self.outputs]
        if self.passed:
            out.append(f"[I]     PASSED | All outputs matched | Outputs: {names}")
        else:
            bad = [o.name for o in self.outputs if not o.passed]
            out.append(f"[E]     FAILED | Mismatched outputs: {bad}")
        return out


def round_up(x: float) -> str:
    """`x` with two significant digits, rounded up (a tolerance that passes)."""
    if x <= 0:
        return "0"
    exp = math.floor(math.log10(x)) - 1
    up = math.ceil(x / 10.0**exp - 1e-9) * 10.0**exp
    return f"{up:.2g}"


class ErrorTally:
    """The worst error of each output over several runs: reference vs candidate. A non-float
    output matches where it equals the reference, or `alternative` (the reference run another,
    equally valid way: an ArgMax of a near tie may differ between the two as well)."""

    def __init__(self, names: list[str]):
        self.names = names
        self.err = dict.fromkeys(names, 0.0)  # max |candidate - reference|
        self.mag = dict.fromkeys(names, 0.0)  # max |reference|
        self.exact = dict.fromkeys(names, True)  # shapes, dtypes and non-float values agree
        self.shape: dict[str, list[int]] = {n: [] for n in names}
        self.worst = dict.fromkeys(names, 0)  # the run with the largest error
        self.values_differ: set[str] = set()  # non-float outputs of one shape and dtype, other values
        self.runs = 0

    def add(
        self,
        reference: list[np.ndarray],
        candidate: list[np.ndarray],
        alternative: list[np.ndarray] | None = None,
    ) -> None:
        others: list[np.ndarray | None] = list(alternative) if alternative is not None else [None] * len(self.names)
        for n, r, s, a in zip(self.names, reference, candidate, others, strict=True):
            r, s = np.asarray(r), np.asarray(s)
            self.shape[n] = list(r.shape)
            if r.shape != s.shape or r.dtype != s.dtype:
                self.exact[n], self.err[n] = False, float("inf")
                self.values_differ.discard(n)
            elif np.issubdtype(r.dtype, np.floating):
                both_nan = np.isnan(r) & np.isnan(s)
                diff = np.where(both_nan, 0.0, np.abs(r.astype(np.float64) - s.astype(np.float64)))
                err = float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0))
                if err > self.err[n]:
                    self.err[n], self.worst[n] = err, self.runs
                self.mag[n] = max(self.mag[n], float(np.nanmax(np.abs(r), initial=0.0)))
            elif not np.array_equal(r, s) and (
                a is None or a.shape != s.shape or not bool(np.all((r == s) | (a == s)))
            ):
                if self.exact[n]:  # the first run it differs on: judged in float64 (an ArgMax
                    self.values_differ.add(n)  # of a near tie that float32 rounding moved)
                    self.worst[n] = self.runs
                self.exact[n], self.err[n] = False, float("inf")
        self.runs += 1

    def relative(self, name: str) -> float:
        err, mag = self.err[name], self.mag[name]
        return err / mag if mag > 0 else (0.0 if err == 0 else float("inf"))

    def checks(self, rtol: float | Mapping[str, float], atol: float) -> list[OutputCheck]:
        out = []
        for n in self.names:
            tol = rtol[n] if isinstance(rtol, Mapping) else rtol
            err, mag = self.err[n], self.mag[n]
            passed = self.exact[n] and err <= atol + tol * mag
            out.append(OutputCheck(n, self.shape[n], err, self.relative(n), passed, tol))
        return out


def parse_shapes(specs: list[str] | None) -> dict[str, list[int]]:
    """`name:1,3,224,224` (or `name:[1,3,224,224]`) -> {name: [1, 3, 224, 224]}."""
    out: dict[str, list[int]] = {}
    for spec in specs or []:
        name, sep, dims = spec.rpartition(":")
        dims = dims.strip().strip("[]()")
        try:
            if not sep or not name:
                raise ValueError
            out[name] = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            raise ShrinkError(
                f"--input-shapes '{spec}': expected name:d0,d1,... e.g. input:1,3,224,224"
            ) from None
        bad = [d for d in out[name] if d < 1]
        if bad:
            raise ShrinkError(
                f"--input-shapes '{spec}': dim {bad[0]} is not a size; every dim must be a "
                "positive integer, e.g. input:1,3,224,224"
            )
    return out


class InputFile(dict):
    """Validation inputs read from a file (`--inputs`): {input name: array}, and the file."""

    def __init__(self, arrays: Mapping[str, np.ndarray], source: str):
        super().__init__(arrays)
        self.source = source


def check_inputs(model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]] | None) -> None:
    """Refuse given validation inputs that do not fit the model: names it does not have, inputs
    missing, another dtype or rank, or a static dim that differs (each named)."""
    inputs = {i.name: i for i in _graph_inputs(model)}
    for feed in feeds or []:
        where = getattr(feed, "source", "inputs")
        unknown = sorted(set(feed) - set(inputs))
        if unknown:
            raise ShrinkError(
                f"{where}: holds '{unknown[0]}', which is not a model input; the model's inputs "
                f"are {sorted(inputs)} (give one array per input, named as the input)."
            )
        missing = sorted(set(inputs) - set(feed))
        if missing:
            raise ShrinkError(
                f"{where}: has no array for model input '{missing[0]}'; the model's inputs are "
                f"{sorted(inputs)} (give one array per input, named as the input)."
            )
        for name, value in feed.items():
            arr = np.asarray(value)
            t = inputs[name].type.tensor_type
            want = helper.tensor_dtype_to_np_dtype(t.elem_type)
            dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            if arr.dtype != want:
                raise ShrinkError(
                    f"{where}: array '{name}' is {arr.dtype}; the model's input '{name}' is {want}."
                )
            if t.HasField("shape") and (
                arr.ndim != len(dims)
                or any(d is not None and d != n for d, n in zip(dims, arr.shape, strict=False))
            ):
                shape = ["?" if d is None else d for d in dims]
                raise ShrinkError(
                    f"{where}: array '{name}' has shape {list(arr.shape)}; the model's input "
                    f"'{name}' has shape {shape}."
                )


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def resolve_shapes(
    model: onnx.ModelProto, given: Mapping[str, list[int]]
) -> dict[str, list[int]]:
    """Concrete shapes for every graph input: given ones, static dims, and sizes chosen for the
    dynamic ones (one value per dim name): those the ops reading the input require of it
    (`Handler.input_dims`: a fused attention's cache has its head size); 2 for a leading batch
    axis; for the others, 16 when
    the model's shapes infer at 16, else the smallest size its own downsampling survives (see
    `survived_size`)."""
    inputs = _graph_inputs(model)
    names = {i.name for i in inputs}
    for n in given:
        if n not in names:
            raise ShrinkError(
                f"--input-shapes names '{n}', which is not a model input; inputs are {sorted(names)}."
            )
    symbols: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    for inp in inputs:
        dims = inp.type.tensor_type.shape.dim
        if inp.name in given:
            shape = given[inp.name]
            if len(shape) != len(dims):
                raise ShrinkError(
                    f"--input-shapes '{inp.name}' has {len(shape)} dims; the model's input has {len(dims)}."
                )
            for d, v in zip(dims, shape, strict=True):
                if d.HasField("dim_value") and d.dim_value != v:
                    raise ShrinkError(
                        f"--input-shapes '{inp.name}': dim {v} differs from the model's static {d.dim_value}."
                    )
                if d.HasField("dim_param"):
                    symbols.setdefault(d.dim_param, v)
            shapes[inp.name] = shape
    required = _required_dims(model, [i for i in inputs if i.name not in shapes])
    for inp in inputs:
        for k, d in enumerate(inp.type.tensor_type.shape.dim):
            size = required.get(inp.name, {}).get(k)
            if size is not None and d.HasField("dim_param") and d.dim_param:
                symbols.setdefault(d.dim_param, size)
    free = [
        inp
        for inp in inputs
        if inp.name not in shapes
        and any(
            not d.HasField("dim_value") and k > 0 and d.dim_param not in symbols
            for k, d in enumerate(inp.type.tensor_type.shape.dim)
        )
    ]

    def at(size: int) -> dict[str, list[int]]:
        chosen, named = dict(shapes), dict(symbols)
        for inp in inputs:
            if inp.name in chosen:
                continue
            shape = []
            for k, d in enumerate(inp.type.tensor_type.shape.dim):
                if d.HasField("dim_value"):
                    shape.append(d.dim_value)
                elif k in required.get(inp.name, {}) and not d.dim_param:
                    shape.append(required[inp.name][k])
                else:
                    default = 2 if k == 0 else size
                    shape.append(named.setdefault(d.dim_param, default) if d.dim_param else default)
            chosen[inp.name] = shape
        return chosen

    if not free:
        return at(DEFAULT_SIZE)
    size = survived_size(model, at)
    return at(size if size is not None else DEFAULT_SIZE)


def _required_dims(model: onnx.ModelProto, inputs: list[onnx.ValueInfoProto]) -> dict[str, dict[int, int]]:
    """The sizes the ops reading these graph inputs require of their dynamic axes (each handler's
    `input_dims`: a fused attention's past cache has the query's head size), read from the
    static dims of the ops' other inputs; inferred only when some op reads such an input."""
    from onnxshrink.ops import facts
    from onnxshrink.prepare import default_opset
    from onnxshrink.prepare.shapes import inferred_shapes

    dynamic = {
        i.name: {k for k, d in enumerate(i.type.tensor_type.shape.dim) if not d.HasField("dim_value")}
        for i in inputs
    }
    dynamic = {name: axes for name, axes in dynamic.items() if axes}
    known: dict[str, list[int | None]] | None = None

    def dims(name: str) -> list[int | None] | None:
        nonlocal known
        if known is None:
            known = {t.name: list(t.dims) for t in model.graph.initializer}
            for vi in [*model.graph.input, *model.graph.value_info, *inferred_shapes(model)]:
                t = vi.type.tensor_type
                if vi.type.HasField("tensor_type") and t.HasField("shape"):
                    known[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        return known.get(name)

    opset = default_opset(model)
    required: dict[str, dict[int, int]] = {}
    for n in model.graph.node:
        if not any(x in dynamic for x in n.input):
            continue
        handler, op = facts(n, opset)
        for i, axes in (handler.input_dims(op, dims) if handler else {}).items():
            name = n.input[i] if i < len(n.input) else ""
            for k, size in axes.items():
                if k in dynamic.get(name, ()):
                    required.setdefault(name, {})[k] = size
    return required


# The size of a dynamic dim (other than a leading batch axis) when the model's shapes infer at it.
DEFAULT_SIZE = 16
# Sizes at which the downsampling of the dynamic dims is measured (see survived_size).
PROBES = (1024, 2048)


def survived_size(model: onnx.ModelProto, at: Callable[[int], dict[str, list[int]]]) -> int | None:
    """The size to give the dynamic dims (`at(size)`: every input's shape with them at `size`):
    DEFAULT_SIZE when the model's shapes infer there (onnx's shape inference in strict mode: a
    Concat of maps of different sizes fails it); else the smallest multiple of the model's
    downsampling (the largest factor by which a tensor's size falls as the dims grow, measured
    between two large sizes) at which every tensor keeps at least one element and the shapes
    infer (a YOLO neck's upsampled map meets the one it is concatenated with; a 7x7 pooling
    without padding after a stride of 32 needs 224). None when no size infers (the proof then
    runs at DEFAULT_SIZE, and asks for shapes if the model fails there)."""

    def empties(dims: dict[str, list[int]], large: dict[str, list[int]] | None) -> bool:
        """Does a tensor lose all its elements (an axis of 0 that is not 0 at a large size)?"""
        return any(
            d == 0 and (large is None or name not in large or large[name][k] != 0)
            for name, ds in dims.items()
            for k, d in enumerate(ds)
        )

    first = _infers(model, at(DEFAULT_SIZE))
    if first is not None and not empties(first, None):
        return DEFAULT_SIZE
    probes = [_infers(model, at(p)) for p in PROBES]
    if probes[0] is None or probes[1] is None:
        return None
    if first is not None and not empties(first, probes[0]):
        return DEFAULT_SIZE  # its empty tensors are empty at any size
    step, smallest = 1.0, DEFAULT_SIZE
    span = PROBES[1] - PROBES[0]
    for name, d1 in probes[0].items():
        d2 = probes[1].get(name)
        if d2 is None or len(d1) != len(d2):
            continue
        for a, b in zip(d1, d2, strict=True):
            if b > a and span / (b - a) >= 1:  # falls by span / (b - a) as the dims grow
                slope = span / (b - a)
                step = max(step, slope)
                smallest = max(smallest, int(np.ceil(PROBES[0] - (a - 1) * slope)))
    factor = int(np.ceil(step))
    start = -(-smallest // factor) * factor
    for size in range(start, start + 4 * factor, factor):
        found = _infers(model, at(size))
        if found is not None and not empties(found, probes[0]):
            return size
    return None


def _infers(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> dict[str, list[int]] | None:
    """The dims of every tensor whose dims are all static, as onnx's shape inference finds them
    in strict mode with the inputs at `shapes`; None when it finds them inconsistent (or a
    size below 0)."""
    from onnxshrink.prepare.shapes import fold_shape_arithmetic, skeleton

    try:
        light = fold_shape_arithmetic(skeleton(model, shapes))
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=True, data_prop=True)
    except Exception:
        return None
    out: dict[str, list[int]] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if any(d is not None and d < 0 for d in dims):
            return None
        if all(d is not None for d in dims):
            out[vi.name] = dims  # type: ignore[assignment]
    return out


def _index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """Int inputs read as indices into a table (Gather): their exclusive upper bound."""
    from onnxshrink.ops import facts
    from onnxshrink.prepare import default_opset

    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    opset = default_opset(model)
    bounds: dict[str, int] = {}
    for n in model.graph.node:
        handler, op = facts(n, opset)
        for i, (table, axis) in (handler.index_inputs(op) if handler else {}).items():
            if i < len(n.input) and table < len(n.input) and n.input[table] in shapes:
                dims = shapes[n.input[table]]
                size = dims[axis if axis >= 0 else axis + len(dims)]
                bounds[n.input[i]] = min(bounds.get(n.input[i], size), size)
    return bounds


def compared_values(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Integer graph inputs -> the constants the graph compares them with (Equal, Less, ...,
    in any subgraph: the conditions of If branches), followed through the ops that move their
    values unchanged (Reshape, Gather, Concat, ...; each handler says). A sample rate that
    picks a branch is drawn among these, not at random (a random one takes a branch that
    fails, or the wrong one)."""
    from onnxshrink.ops import facts
    from onnxshrink.prepare import default_opset

    ints = [
        i.name
        for i in _graph_inputs(model)
        if np.issubdtype(helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type), np.integer)
    ]
    if not ints:
        return {}
    opset = default_opset(model)
    graphs = list(ir.all_graphs(model.graph))
    small = {t.name: t for g in graphs for t in g.initializer if int(np.prod(t.dims)) <= COMPARED_SIZE}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in (n for g in graphs for n in g.node):
        for i, name in enumerate(n.input):
            readers.setdefault(name, []).append((n, i))
    constant_nodes = {
        n.output[0]: n for g in graphs for n in g.node if not n.input and len(n.output) == 1
    }

    def value(name: str) -> np.ndarray | None:
        if name in small:
            return onnx.numpy_helper.to_array(small[name])
        node = constant_nodes.get(name)
        handler, op = facts(node, opset) if node is not None else (None, None)
        v = handler.constant_value(op) if handler is not None and op is not None else None
        return v if v is not None and v.size <= COMPARED_SIZE else None

    out: dict[str, list[int]] = {}
    for name in ints:
        found: list[int] = []
        held, todo = {name}, [name]
        while todo:
            for n, i in readers.get(todo.pop(), []):
                handler, op = facts(n, opset)
                if handler is None:
                    continue
                if i in handler.moves_values(op) and n.output and n.output[0] not in held:
                    held.add(n.output[0])
                    todo.append(n.output[0])
                other = value(n.input[1 - i]) if handler.compares(op) and i in (0, 1) else None
                if other is not None and np.issubdtype(other.dtype, np.number):
                    found += [int(v) for v in other.reshape(-1) if float(v).is_integer()]
        if found:
            out[name] = list(dict.fromkeys(found))
    return out


# Constants at most this large are read for the values an input is compared with.
COMPARED_SIZE = 64


def make_inputs(
    model: onnx.ModelProto, shapes: dict[str, list[int]], draws: int, seed: int
) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    bounds = _index_bounds(model)
    compared = compared_values(model)
    feeds = []
    for draw in range(draws):
        feed: dict[str, np.ndarray] = {}
        for inp in _graph_inputs(model):
            dtype = helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)
            shape = shapes[inp.name]
            if inp.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16:
                # onnxruntime's Python API takes no bfloat16 arrays: float32 holding bfloat16
                # values, for the emulated model (onnxshrink.emulate)
                feed[inp.name] = rng.standard_normal(shape).astype(dtype).astype(np.float32)
            elif np.issubdtype(dtype, np.floating):
                feed[inp.name] = rng.standard_normal(shape).astype(dtype)
            elif dtype == np.bool_:
                feed[inp.name] = rng.random(shape) < 0.5
            elif np.issubdtype(dtype, np.integer):
                drawn = rng.integers(0, bounds.get(inp.name, 2), size=shape).astype(dtype)
                values = _drawable(compared.get(inp.name, []), dtype, bounds.get(inp.name))
                if values and drawn.size == 1:  # one value: each draw the next compared one
                    drawn[...] = values[draw % len(values)]
                elif values:  # half of the elements, compared values
                    picked = rng.random(shape) < 0.5
                    drawn = np.where(picked, rng.choice(np.asarray(values, dtype), size=shape), drawn)
                feed[inp.name] = drawn
            else:
                raise ShrinkError(
                    f"input '{inp.name}' has type {dtype}, which validation cannot generate; give inputs with --inputs."
                )
        feeds.append(feed)
    return feeds


def _drawable(values: list[int], dtype: np.dtype, bound: int | None) -> list[int]:
    """The compared values an integer input of `dtype` can hold (and, read as an index into a
    table of `bound` rows, that index it)."""
    info = np.iinfo(dtype)
    return [
        v
        for v in values
        if info.min <= v <= info.max and (bound is None or -bound <= v < bound)
    ]


def load_inputs(path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            return InputFile({k: f[k] for k in f.files}, path)
    except FileNotFoundError:
        raise ShrinkError(
            f"{path}: no such inputs file (.npz with one array per model input)."
        ) from None
    except Exception as exc:
        raise ShrinkError(
            f"{path}: cannot be read as a .npz of input arrays ({first_line(exc)})."
        ) from exc


def unrunnable_ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(domain:op, node name) of the nodes of custom domains onnxruntime has no kernel for
    (nor the model a function), which the proof cannot run."""
    from onnxshrink.prepare.shapes import runtime_schemas

    known = runtime_schemas() | {(f.domain, f.name) for f in model.functions}
    out: dict[str, str] = {}
    for n in (n for g in ir.all_graphs(model.graph) for n in g.node):
        if n.domain not in ("", "ai.onnx") and (n.domain, n.op_type) not in known:
            out.setdefault(f"{n.domain}:{n.op_type}", node_label(n))
    return list(out.items())


def node_label(n: onnx.NodeProto) -> str:
    """How a message names a node: by its name, or by its output when it has none."""
    if n.name:
        return f"node '{n.name}'"
    return f"the node writing '{n.output[0]}'" if n.output else "an unnamed node"


def check_runnable(model: onnx.ModelProto, source: str) -> None:
    """Refuse, before any work, a model whose proof onnxruntime cannot run (custom ops)."""
    ops = unrunnable_ops(model)
    if ops:
        listed = ", ".join(f"{op} ({node})" for op, node in ops[:5])
        raise ShrinkError(
            f"{source}: onnxruntime has no kernel for {listed}, so the proof cannot run the model. "
            "Pass --no-validate to shrink it without the proof (those nodes keep all their "
            "channels; the rest is shrunk by the analysis alone), or prove it yourself with the "
            "op's library registered in onnxruntime."
        )


def session_threads() -> int:
    """onnxruntime's threads per session of the proof: SESSION_THREADS when set, else the
    environment's ONNXSHRINK_THREADS (onnxruntime reads no OMP_NUM_THREADS), else 0: one per core."""
    if SESSION_THREADS:
        return SESSION_THREADS
    value = os.environ.get(THREADS_VARIABLE, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ShrinkError(
            f"{THREADS_VARIABLE}={value!r}: give the number of threads per onnxruntime session "
            f"(0 or unset: one per core), or unset it."
        )
    return int(value)


def _serialized(model: onnx.ModelProto) -> bytes | None:
    """The model's bytes; None past protobuf's 2 GB limit, where upb refuses to serialize.
    Serializing is how to tell: ByteSize() costs as much again (0.2 s for a 100 MB model whose
    weights are inline, as a pruned model's reference is)."""
    from google.protobuf.message import EncodeError  # type: ignore[import-untyped]

    try:
        return model.SerializeToString()
    except EncodeError:
        return None


# onnxruntime's graph optimization levels, by the names its Python API gives them, in order.
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_LAYOUT", "ORT_ENABLE_ALL")
OFF = "ORT_DISABLE_ALL"


def default_level() -> str:
    """The graph optimization level onnxruntime gives a session unless told otherwise: the
    level users run their models at."""
    import onnxruntime as ort

    return ort.SessionOptions().graph_optimization_level.name


def levels() -> list[str]:
    """The optimization levels this onnxruntime has (LEVELS it knows, in order)."""
    import onnxruntime as ort

    known = ort.GraphOptimizationLevel.__members__
    return [name for name in LEVELS if name in known]


def check_provider(provider: str) -> str:
    """The onnxruntime execution provider named by `provider`, or a ShrinkError."""
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise ShrinkError(f"--provider {provider}: choose one of {sorted(PROVIDERS)}.")
    ep = PROVIDERS[provider]
    if ep not in ort.get_available_providers():
        raise ShrinkError(
            f"--provider {provider}: onnxruntime here has no {ep} (available: {ort.get_available_providers()}). Install onnxruntime-gpu for CUDA."
        )
    return ep


def session(
    model: onnx.ModelProto,
    provider: str,
    data_dir: str | Path | None = None,
    level: str = OFF,
    data: bytes | None = None,
):
    """An onnxruntime session of `model` at graph optimization `level` (a LEVELS name); weights
    it keeps in external data are read (mapped) from `data_dir`, never copied into this process.
    `data`: the model already serialized (several sessions of one model)."""
    import onnxruntime as ort

    ep = check_provider(provider)
    so = ort.SessionOptions()
    so.log_severity_level = onnxruntime_severity()  # its errors: ours to report
    threads = session_threads()
    if threads:
        so.intra_op_num_threads = so.inter_op_num_threads = threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.__members__[level]
    so.use_deterministic_compute = True  # the same inputs give the same proof (and recovery)
    # a block-wise int4 DequantizeLinear -> MatMul fused into MatMulNBits multiplies in float32,
    # not with A quantized to int8 at run time (see qdq_proof.float_activations)
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if data_dir is not None:
        # Mapped external weights stay in the page cache, not this process: no packed copies,
        # and no arena holding on to the largest temporaries (fp16 kernels widen their weights).
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(data_dir))
        so.add_session_config_entry("session.disable_prepacking", "1")
        so.enable_cpu_mem_arena = False
    data = data if data is not None else _serialized(model)
    if data is not None:
        return ort.InferenceSession(data, so, providers=[ep])
    import tempfile

    from onnxshrink.io.model import save_model

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "model.onnx"
        save_model(model, p, external=True)
        return ort.InferenceSession(str(p), so, providers=[ep])


def _not_run(
    tally: ErrorTally,
    opts: ShrinkOptions,
    rtol: float,
    shapes: dict[str, list[int]],
    draws: int,
    error: str,
    t0: float,
) -> ValidationReport:
    checks = [OutputCheck(n, [], float("inf"), float("inf"), False) for n in tally.names]
    return ValidationReport(
        False, rtol, opts.atol, draws, opts.provider, shapes, checks,
        time.perf_counter() - t0, error,
    )  # fmt: skip


# Weights above which a proof runs a model segment by segment (one segment's weights mapped at
# a time: see onnxshrink.segment), so that it fits in memory whatever the model's size.
SEGMENT_BYTES = 512 * 2**20

# Machine epsilon of each float type a model may compute in; the default tolerance is ten of
# them for the least precise type the model computes in, and never below 1e-5.
EPS = {
    onnx.TensorProto.DOUBLE: 2.0**-52,
    onnx.TensorProto.FLOAT: 2.0**-23,
    onnx.TensorProto.FLOAT16: 2.0**-10,
    onnx.TensorProto.BFLOAT16: 2.0**-7,
}


# Where the float64 judge cannot decide, a failure by at most this many machine epsilons of the
# model's dtype is rounding (see ValidationReport.rounding).
ROUNDING_STEPS = 16

# The derived tolerance of an output: this many times the reference's own noise (its outputs
# with onnxruntime's graph optimizations on vs off: two equally valid float orders), at least
# default_tolerance, at most NOISE_CAP (past it the runtime, not rounding, is at odds with
# itself, and the float64 judge decides).
NOISE_FACTOR = 2.0


def default_tolerance(eps: float) -> float:
    """Ten machine epsilons of the dtype, and never below 1e-5: the floor of every tolerance."""
    return max(1e-5, 10 * eps)


def noise_cap(eps: float) -> float:
    """The largest tolerance the reference's noise may set: 8192 machine epsilons (1e-3 for
    float32), at most 0.1, never below the floor."""
    return max(default_tolerance(eps), min(0.1, 8192 * eps))


def output_tolerance(
    given: float | None, eps: float, dtype: str, noise: float | None
) -> tuple[float, str]:
    """One output's rtol, and why: given (--rtol), else NOISE_FACTOR x the reference's own
    relative noise, between the dtype's floor and noise_cap."""
    if given is not None:
        return given, "given"
    floor, derived = default_tolerance(eps), NOISE_FACTOR * (noise or 0.0)
    if derived <= floor:
        shown = f"; reference noise {noise:.2g}" if noise else ""
        return floor, f"the floor for {dtype}{shown}"
    cap = noise_cap(eps)
    if derived > cap:
        return cap, f"reference noise {noise:.2g} at {dtype}, capped at {cap:.2g}"
    return derived, f"reference noise {noise:.2g} at {dtype}: {NOISE_FACTOR:g} x noise"


def arithmetic(model: onnx.ModelProto) -> tuple[str, float]:
    """The least precise float type the model computes in (its nodes' outputs), and its machine
    epsilon."""
    from onnxshrink.prepare import inferred_shapes

    produced = {o for n in model.graph.node for o in n.output}
    types = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in [*inferred_shapes(model), *model.graph.output]
        if vi.type.HasField("tensor_type")
    }
    computed = {types[n] for n in produced if types.get(n) in EPS}
    worst = max(computed, key=lambda t: EPS[t], default=onnx.TensorProto.FLOAT)
    name = helper.tensor_dtype_to_np_dtype(worst).name if worst != onnx.TensorProto.BFLOAT16 else "bfloat16"
    return name, EPS[worst]


class _RunFailed(Exception):
    def __init__(self, message: str, loading: bool, feed: int | None = None):
        super().__init__(message)
        self.loading = loading  # onnxruntime refused the model (else: it failed on the inputs)
        self.feed = feed  # the index of the feed it failed on (given inputs come first)


def _reference_failed(
    reference: onnx.ModelProto, opts: ShrinkOptions, shapes: dict[str, list[int]], exc: _RunFailed
) -> str:
    """Why the proof could not even run the reference, and what to do about it."""
    text = f"the reference model (the input, masks applied) {exc}"
    if exc.loading:
        return (
            f"{text}, so the proof cannot run. Check the model with onnxruntime, or pass "
            "--no-validate to shrink it without the proof."
        )
    given = len(opts.inputs or [])
    if exc.feed is not None and exc.feed < given:
        return f"{text} on the arrays given with --inputs. Check them against the model's inputs."
    text += " on random inputs" + (
        " (the arrays given with --inputs run: --draws 0 proves it on those alone)" if given else ""
    )
    guessed = [
        i.name
        for i in _graph_inputs(reference)
        if np.issubdtype(helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type), np.integer)
        and i.name not in compared_values(reference)
    ]
    if guessed:
        text += (
            f" (integer input(s) {', '.join(repr(n) for n in guessed)} drawn at random: the graph "
            "compares them with no constant to draw instead)"
        )
    dynamic = {
        i.name: shapes[i.name]
        for i in _graph_inputs(reference)
        if any(not d.HasField("dim_value") for d in i.type.tensor_type.shape.dim)
        and i.name not in (opts.input_shapes or {})
    }
    if dynamic:
        chosen = ", ".join(f"{n}:{','.join(map(str, d))}" for n, d in dynamic.items())
        return (
            f"{text}, of the shapes chosen for its dynamic dims ({chosen}). "
            "Give the shapes it runs on with --input-shapes name:d0,d1,..., or real inputs with --inputs."
        )
    return f"{text}. Give real inputs it runs on with --inputs."


def run_model(
    model: onnx.ModelProto,
    feeds: list[dict[str, np.ndarray]],
    outputs: list[str],
    provider: str,
    data_dir: str | Path | None = None,
    progress=None,
    parts: list | None = None,
    level: str = OFF,
) -> list[list[np.ndarray]]:
    """`outputs` of `model` on each feed, with one session at a time: the whole model, or its
    segments in order when its weights exceed SEGMENT_BYTES (each run on every feed, its
    results kept, its session freed), at graph optimization `level`. _RunFailed when
    onnxruntime cannot load or run it. `parts`: the segments, when already cut
    (onnxshrink.segment.split)."""
    from onnxshrink.segment import Segment, split

    parts = parts or split(model, segment_bytes(model))
    parts = parts or [Segment(model, [i.name for i in model.graph.input], outputs)]
    values = [dict(feed) for feed in feeds]
    for k, part in enumerate(parts):
        try:
            sess = session(_inlined(part.model, own=len(parts) > 1), provider, data_dir, level)
        except ShrinkError:
            raise
        except Exception as exc:
            raise _RunFailed(f"cannot be loaded by onnxruntime ({first_line(exc)})", True) from exc
        names = [o.name for o in sess.get_outputs()]
        wanted = [i.name for i in sess.get_inputs()]
        for f, v in enumerate(values):
            try:
                v.update(zip(names, sess.run(names, {n: v[n] for n in wanted}), strict=True))
            except Exception as exc:
                raise _RunFailed(f"fails to run in onnxruntime ({first_line(exc)})", False, f) from exc
            if progress is not None:
                progress.update(1)
        del sess
        later = {i for p in parts[k + 1 :] for i in p.inputs} | set(outputs)
        for v in values:
            for n in [n for n in v if n not in later]:
                del v[n]
    return [[v[o] for o in outputs] for v in values]


def refusals(
    model: onnx.ModelProto, provider: str, data_dir: str | Path | None, at: Sequence[str]
) -> dict[str, str]:
    """The optimization levels of `at` at which onnxruntime refuses to load `model`, and why."""
    model = _inlined(model, own=False)
    data = _serialized(model)
    out = {}
    for level in at:
        try:
            session(model, provider, data_dir, level, data)
        except ShrinkError:
            raise
        except Exception as exc:
            out[level] = first_line(exc)
    return out


def segment_bytes(model: onnx.ModelProto) -> int:
    """The weight budget of a segment: SEGMENT_BYTES, a quarter of it when the model holds
    weights onnxruntime must be given inline (spilled masked weights: held by the segment's
    proto, its serialization and the session at once)."""
    from onnxshrink.io.weights import absolute

    spilled = any(absolute(t) is not None for g in ir.all_graphs(model.graph) for t in g.initializer)
    return SEGMENT_BYTES // 4 if spilled else SEGMENT_BYTES


def _inlined(model: onnx.ModelProto, own: bool) -> onnx.ModelProto:
    """`model` with the weights it keeps by absolute path (spilled masked weights, which
    onnxruntime refuses to read) inline; a copy unless `own` (a segment made for this run)."""
    from onnxshrink.io.weights import absolute, inline

    def spilled(m: onnx.ModelProto) -> list[onnx.TensorProto]:  # in bodies too
        return [t for g in ir.all_graphs(m.graph) for t in g.initializer if absolute(t) is not None]

    if not spilled(model):
        return model
    if not own:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    for t in spilled(model):
        inline(t)
    return model


def compare(
    reference: onnx.ModelProto,
    shrunk: onnx.ModelProto,
    opts: ShrinkOptions | None = None,
    reference_dir: str | Path | None = None,
    shrunk_dir: str | Path | None = None,
    twin: Callable[[], onnx.ModelProto] | None = None,
    judge_macs: float | None = None,
) -> ValidationReport:
    """Run both models on the given and random inputs as users run them (onnxruntime's default
    graph optimizations), one after the other (the reference's outputs kept, its session freed
    before the shrunk model's is made); the worst error per output, against a tolerance per
    output derived from the reference's own noise (the reference run again with the
    optimizations off) unless one is given. The shrunk model must load at every optimization
    level the reference loads at. An output off by more than the dtype's floor (or the rtol
    given) is judged in float64 (onnxshrink.judge; `twin()` makes the shrink of the reference
    widened to float64; `judge_macs` bounds the model size judged): another function fails,
    rounding passes, or under a given rtol fails as rounding. `*_dir`: where each model's
    external data are. With `opts.validate_layers`, only the first blocks are compared (see
    onnxshrink.segment.prefix)."""
    from onnxshrink.emulate import emulated, needs_emulation
    from onnxshrink.progress import bar
    from onnxshrink.qdq_proof import float_activations, integer_products
    from onnxshrink.segment import blocks, prefix, split

    opts = opts or ShrinkOptions()
    atol = opts.atol
    detail = []
    dtype, eps = arithmetic(reference)
    base = opts.rtol if opts.rtol is not None else default_tolerance(eps)
    t0 = time.perf_counter()
    shapes = resolve_shapes(reference, opts.input_shapes or {})
    feeds = list(opts.inputs or []) + make_inputs(reference, shapes, opts.draws, opts.seed)
    outputs = [o.name for o in reference.graph.output]
    kind, ref_model, new_model = "full", reference, shrunk
    if opts.validate_layers is not None:
        found = blocks(reference)
        if found is None:
            raise ShrinkError(
                "--validate-layers: the model's node order has no repeated blocks to count; "
                "validate it whole (omit --validate-layers)."
            )
        n = opts.validate_layers
        if n < found.count:  # else the whole model is proven
            head = prefix(reference, found.end(n))
            tail = prefix(shrunk, 0, head.outputs) if head is not None else None
            if head is None or tail is None:
                raise ShrinkError(
                    f"--validate-layers {n}: the tensors after block {n} are not all in the shrunk "
                    "model (or their types are unknown); validate it whole (omit --validate-layers)."
                )
            ref_model, new_model, outputs = head.model, tail.model, head.outputs
            kind = f"first {n} of {found.count} repeated blocks"
            detail.append(f"{head.nodes} of {len(reference.graph.node)} nodes; compared: {', '.join(outputs)}")
    if needs_emulation(ref_model):
        ref_model, new_model = emulated(ref_model), emulated(new_model)
        detail.append(
            "bfloat16 arithmetic emulated in float32, each bfloat16 tensor rounded to bfloat16: "
            "onnxruntime has few bfloat16 kernels"
        )
    integer = integer_products(ref_model, reference_dir)
    if integer is not None:  # both alike: the reference's products, and the shrunk model's
        ref_model, new_model = integer, integer_products(new_model, shrunk_dir) or new_model
        detail.append(
            "products of dequantized operands accumulated in integers, as quantized kernels do: "
            "in float32 a QuantizeLinear after them can round differently when zero terms are removed"
        )
    floats = float_activations(ref_model)
    if floats is not None:
        ref_model, new_model = floats, float_activations(new_model) or new_model
        detail.append(
            "MatMulNBits with float32 activations (accuracy_level 0): at run time int8 activations "
            "can round differently when float rounding moves a value by an ulp"
        )
    tally = ErrorTally(outputs)
    ref_parts = split(ref_model, segment_bytes(ref_model))
    new_parts = split(new_model, segment_bytes(new_model))
    counts = [len(p) if p else 1 for p in (ref_parts, new_parts)]
    level = default_level()
    if integer is not None:
        # The emulated products are what quantized kernels compute; at the default level
        # onnxruntime fuses the model's remaining Q/DQ pairs into int8 kernels that requantize
        # each step on their own, and a deep network's output then moves by whole quantization
        # steps with any change of float order (ResNet-50, QDQ: 0.1 between the levels for the
        # reference itself). Both models run with optimizations off; each still loads at every level.
        level = OFF

    def run_reference(at: str, what: str) -> list[list[np.ndarray]]:
        with bar(len(feeds) * counts[0], what, "run", opts.progress) as progress:
            return run_model(ref_model, feeds, outputs, opts.provider, reference_dir, progress, ref_parts, at)

    try:  # as users run it
        ref_out = run_reference(level, "proof: reference")
    except _RunFailed as exc:
        if not exc.loading or level == OFF:
            raise ShrinkError(_reference_failed(reference, opts, shapes, exc)) from exc
        detail.append(
            f"the reference does not load at onnxruntime's default optimizations ({level}: "
            f"{exc}): both models run with them off"
        )
        level = OFF
        try:
            ref_out = run_reference(OFF, "proof: reference")
        except _RunFailed as exc2:
            raise ShrinkError(_reference_failed(reference, opts, shapes, exc2)) from exc2
    noise: dict[str, float | None] = dict.fromkeys(outputs)
    noise_out = None
    if level != OFF:  # the reference's own noise: the same inputs, another valid float order
        try:
            noise_out = run_reference(OFF, "proof: reference's noise")
        except _RunFailed as exc:
            detail.append(f"the reference's noise not measured: with optimizations off it {exc}")
        else:
            spread = ErrorTally(outputs)
            for r_run, o_run in zip(ref_out, noise_out, strict=True):
                spread.add(r_run, o_run)
            noise = {n: spread.relative(n) for n in outputs}
    floor = f"rtol {default_tolerance(eps):g} for {dtype} arithmetic"
    if level != OFF:
        how = f"onnxruntime's default graph optimizations ({level}), as users run it"
        if opts.rtol is None:
            how += f"; tolerance per output: {NOISE_FACTOR:g} x the reference's own noise (its outputs with them off), and at least {floor}"
    else:
        how = f"onnxruntime with graph optimizations off ({OFF})" + ("" if opts.rtol is not None else f"; {floor}")
    detail.append(how)
    detail.append(
        "reference, then shrunk model"
        + (f", in {counts[0]} and {counts[1]} segments" if max(counts) > 1 else "")
    )

    def finish(report: ValidationReport) -> ValidationReport:
        report.kind, report.detail, report.dtype, report.eps = kind, "; ".join(detail), dtype, eps
        report.level, report.rtol_given = level, opts.rtol is not None
        report.seconds = time.perf_counter() - t0
        return report

    try:
        with bar(len(feeds) * counts[1], "proof: shrunk", "run", opts.progress) as progress:
            new_out = run_model(
                new_model, feeds, outputs, opts.provider, shrunk_dir, progress, new_parts, level
            )
    except _RunFailed as exc:
        at = f" at {level}" if exc.loading and level != OFF else ""
        return finish(_not_run(tally, opts, base, shapes, len(feeds), f"{exc}{at}", t0))
    if kind != "full":
        for name, r, s in zip(outputs, ref_out[0], new_out[0], strict=True):
            if r.shape != s.shape:
                raise ShrinkError(
                    f"--validate-layers: tensor '{name}' after the blocks has shape {list(s.shape)} "
                    f"in the shrunk model, {list(r.shape)} in the reference: not comparable there; "
                    "validate it whole (omit --validate-layers)."
                )
    refused = _refused_levels(ref_model, new_model, opts.provider, reference_dir, shrunk_dir, level, max(counts))
    if refused is not None:
        failure, note = refused
        if failure:
            return finish(_not_run(tally, opts, base, shapes, len(feeds), failure, t0))
        detail.append(note)
    for k, (r_run, s_run) in enumerate(zip(ref_out, new_out, strict=True)):
        tally.add(r_run, s_run, noise_out[k] if noise_out is not None else None)
    tolerances = {n: output_tolerance(opts.rtol, eps, dtype, noise[n]) for n in outputs}
    checks = tally.checks({n: t[0] for n, t in tolerances.items()}, atol)
    for c in checks:
        c.tolerance, c.noise = tolerances[c.name][1], noise[c.name]
    report = finish(
        ValidationReport(
            all(c.passed for c in checks), base, atol, len(feeds), opts.provider, shapes, checks
        )
    )
    # Above the floor, float32 cannot tell rounding from a wrong model of the same size (a
    # weight changed by 1e-4 moves a noisy model's outputs as much as its own rounding does):
    # the float64 judge decides, where it can (a model past GRAY_MACS passes within the noise).
    undecided = [
        c
        for c in checks
        if (tally.exact[c.name] and c.max_abs_error > atol + base * tally.mag[c.name])
        or c.name in tally.values_differ
    ]
    if undecided:
        _judge(reference, shrunk, twin, feeds, tally, ref_out, new_out, undecided, eps, dtype, shapes,
               reference_dir, shrunk_dir, kind, judge_macs)  # fmt: skip
        for c in undecided:
            if c.rounding is True and opts.rtol is None:
                c.passed = True  # the same function: rounding
            elif c.rounding is False:
                c.passed = False  # another function, within the noise or not
        report.passed = all(c.passed for c in checks)
        report.seconds = time.perf_counter() - t0
    return report


# Multiply-adds of a model whose outputs above the floor but within the reference's noise are
# judged in float64 (about 0.5 s in onnx's reference evaluator); a larger one passes on its noise.
GRAY_MACS = 5e7


def _judge(
    reference: onnx.ModelProto,
    shrunk: onnx.ModelProto,
    twin: Callable[[], onnx.ModelProto] | None,
    feeds: list[dict[str, np.ndarray]],
    tally: ErrorTally,
    ref_out: list[list[np.ndarray]],
    new_out: list[list[np.ndarray]],
    outputs: list[OutputCheck],
    eps: float,
    dtype: str,
    shapes: dict[str, list[int]],
    reference_dir: str | Path | None,
    shrunk_dir: str | Path | None,
    kind: str,
    judge_macs: float | None,
) -> None:
    """The float64 judge on `outputs` (see onnxshrink.judge): up to judge_macs (default
    judge.MACS) when one of them failed its float32 tolerance, GRAY_MACS when all are within it."""
    if kind != "full":
        for c in outputs:
            c.judged = "a partial proof (--validate-layers) is not judged in float64"
        return
    from onnxshrink.judge import MACS, Case, judge

    limit = MACS if judge_macs is None else judge_macs
    if all(c.passed for c in outputs):
        limit = min(limit, GRAY_MACS)
    case = Case(reference, shrunk, feeds, ref_out, new_out, eps, dtype, shapes, reference_dir, shrunk_dir)
    judge(case, twin, tally, outputs, limit)


def _refused_levels(
    ref_model: onnx.ModelProto,
    new_model: onnx.ModelProto,
    provider: str,
    reference_dir: str | Path | None,
    shrunk_dir: str | Path | None,
    ran_at: str,
    segments: int,
) -> tuple[str, str] | None:
    """Whether onnxruntime loads the shrunk model at every optimization level it loads the
    reference at: (the failure, or "" ; a note for the report). A model run in segments is
    loaded at the level it ran at only (a segment is not the model the optimizer would see)."""
    if segments > 1:
        return "", f"loaded at {ran_at} only (run in segments)"
    others = [lv for lv in levels() if lv != ran_at]
    refused = refusals(new_model, provider, shrunk_dir, others)
    if not refused:
        return None
    by_reference = refusals(ref_model, provider, reference_dir, list(refused))
    ours = [lv for lv in refused if lv not in by_reference]
    if ours:
        lv = ours[0]
        return (
            f"onnxruntime refuses to load it with graph optimization level {lv} "
            f"({refused[lv]}), where it loads the reference: users running it so could not",
            "",
        )
    return "", f"neither model loads at {', '.join(refused)} (onnxruntime refuses the reference there too)"

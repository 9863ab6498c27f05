"""Sizes that run: the dynamic dims of a model's inputs chosen by running the input model.

The proof draws random inputs, and a dynamic dim needs a size. A model does not run at every
size (a reflect `Pad` needs more samples than it pads; a detector's upsampled map must meet the
one it is concatenated with; a recurrent state's batch must be its input's), so the sizes are
tried on the input model in onnxruntime, one session, one draw each, and the first at which it
runs with finite outputs is taken. First what the model says: the shapes of the arrays given with
`--inputs`, its metadata (`imgsz`, `batch`, as Ultralytics writes them), the static sizes its
value_info and outputs record where its dims flow unchanged, one size per dim name (inputs that
share a name share the size), the sizes its ops require (`resolve_shapes`); then a few
candidates per dim (SIZES; a leading batch axis 2, then 1), each first checked by onnx's shape
inference (cheap) before it is run. None runs: ShrinkError naming the inputs and the sizes
tried.
"""

from __future__ import annotations

import ast
import itertools
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from onnxshrink.errors import ShrinkError, first_line
from onnxshrink.options import ShrinkOptions
from onnxshrink.proof.inputs import graph_inputs, infers, make_inputs, required_dims, resolve_shapes

# The sizes tried for a dynamic dim that is not a leading batch axis, after the model's own
# (in this order; the first at which the model runs is taken).
SIZES = (16, 64, 224, 256, 512, 640, 1024, 32, 8, 1)
# ... and for a leading batch axis: 2 proves that samples stay apart; 1 when the model fixes it.
BATCHES = (2, 1)
# Runs tried at most (each is one draw on one session of the input model), and seconds.
MAX_RUNS = 48
MAX_SECONDS = 60.0
# Dims tied to the batch size in every combination when at most this many are free.
MAX_TIED = 3


@dataclass(frozen=True)
class Dim:
    """A free dynamic dim, or all the dims of one name: where it is ((input, axis), ...)."""

    key: str  # its name, or "input[axis]" for an unnamed one
    places: tuple[tuple[str, int], ...]
    leading: bool  # some place is axis 0 (a batch axis)
    named: bool


@dataclass
class Search:
    """What the search found: the shapes chosen, the sizes tried per dim, the last failure."""

    shapes: dict[str, list[int]] = field(default_factory=dict)
    tried: dict[str, list[int]] = field(default_factory=dict)
    failure: str = ""
    runs: int = 0


def with_found_shapes(
    model: onnx.ModelProto,
    opts: ShrinkOptions,
    data_dir: str | None = None,
    model_bytes: int | None = None,
) -> ShrinkOptions:
    """`opts` with `found_shapes` set: the sizes found for the dynamic dims no shape was given
    for ({} when there is nothing to choose, validation is off, or the model is too large to
    try cheaply: the proof then draws at `resolve_shapes`' sizes). Says which sizes it took and
    how to change them. ShrinkError when the model runs at none of the sizes tried."""
    if opts.found_shapes is not None:
        return opts
    found: dict[str, list[int]] = {}
    finite = True
    size = model_bytes if model_bytes is not None else model.ByteSize()
    if opts.validate and size <= TRIAL_BYTES:
        found, finite = find_shapes(model, opts, data_dir)
    if found:
        shown = " ".join(f"{n}:{','.join(map(str, d))}" for n, d in found.items())
        how = "with finite outputs" if finite else "(with outputs not finite at every size tried)"
        opts.say(
            f"dynamic dims drawn at {shown}: the first sizes tried at which the input model runs "
            f"{how} (--input-shapes name:d0,d1,... chooses others)"
        )
    return opts.but(found_shapes=found)


# Models above this many bytes are not tried: their proof draws at resolve_shapes' sizes.
TRIAL_BYTES = 512 * 2**20


def free_dims(model: onnx.ModelProto, given: Mapping[str, list[int]]) -> list[Dim]:
    """The dynamic dims of the inputs no shape was given for, one per dim name (a name some given
    shape fixes is not free, nor a dim the ops reading the input require a size of: see
    inputs.required_dims)."""
    required = required_dims(model, [i for i in graph_inputs(model) if i.name not in given])
    fixed = {
        d.dim_param
        for i in graph_inputs(model)
        for k, d in enumerate(i.type.tensor_type.shape.dim)
        if d.HasField("dim_param") and (i.name in given or k in required.get(i.name, {}))
    }
    places: dict[str, list[tuple[str, int]]] = {}
    named: dict[str, bool] = {}
    for inp in graph_inputs(model):
        if inp.name in given:
            continue
        for k, d in enumerate(inp.type.tensor_type.shape.dim):
            if d.HasField("dim_value") or d.dim_param in fixed or k in required.get(inp.name, {}):
                continue
            key = d.dim_param or f"{inp.name}[{k}]"
            places.setdefault(key, []).append((inp.name, k))
            named[key] = bool(d.dim_param)
    return [Dim(k, tuple(p), any(a == 0 for _, a in p), named[k]) for k, p in places.items()]


def find_shapes(
    model: onnx.ModelProto, opts: ShrinkOptions, data_dir: str | None
) -> tuple[dict[str, list[int]], bool]:
    """The shapes of the inputs with free dynamic dims at the first sizes the input model runs
    at with finite outputs, else at the first it runs at, and whether its outputs were finite
    there ({} when none is free or onnxruntime does not load the model: the proof says why).
    ShrinkError when it runs at none."""
    from onnxshrink.proof.sessions import OFF, session

    given = dict(opts.input_shapes or {})
    dims = free_dims(model, given)
    if not dims or not opts.draws:
        return {}, True
    base = resolve_shapes(model, given)
    try:
        sess = session(model, opts.provider, data_dir, OFF)
    except ShrinkError:
        raise
    except Exception:
        return {}, True  # the proof reports it
    search, t0 = Search(), time.perf_counter()
    first: dict[str, list[int]] | None = None
    for shapes in _candidates(model, base, dims, opts, search):
        verdict = _run(sess, model, shapes, opts.seed, search)
        if verdict == "finite":
            return _free_inputs(shapes, dims), True
        if verdict == "non-finite" and first is None:
            first = shapes  # runs: the proof says the reference is not finite there
        if search.runs >= MAX_RUNS or time.perf_counter() - t0 > MAX_SECONDS:
            break
    if first is not None:
        return _free_inputs(first, dims), False
    if opts.inputs:  # inputs given: the proof says whether they run and the draws do not
        return {}, True
    raise ShrinkError(_none_ran(dims, search))


def _free_inputs(shapes: dict[str, list[int]], dims: list[Dim]) -> dict[str, list[int]]:
    """The shapes of the inputs that have free dims."""
    names = {name for d in dims for name, _ in d.places}
    return {n: s for n, s in shapes.items() if n in names}


def _run(sess, model: onnx.ModelProto, shapes: dict[str, list[int]], seed: int, search: Search) -> str:
    """One draw at `shapes`: "finite", "non-finite" (runs, some float output NaN or Inf), or
    "fails"."""
    search.runs += 1
    try:
        feed = make_inputs(model, shapes, 1, seed)[0]
        wanted = {i.name for i in sess.get_inputs()}
        outs = sess.run(None, {n: v for n, v in feed.items() if n in wanted})
    except ShrinkError:
        raise
    except Exception as exc:
        search.failure = first_line(exc)
        return "fails"
    floats = [np.asarray(o) for o in outs if np.issubdtype(np.asarray(o).dtype, np.floating)]
    return "finite" if all(np.isfinite(o).all() for o in floats) else "non-finite"


def _candidates(
    model: onnx.ModelProto,
    base: dict[str, list[int]],
    dims: list[Dim],
    opts: ShrinkOptions,
    search: Search,
) -> Iterator[dict[str, list[int]]]:
    """The shapes to try, in order, each once: those onnx's shape inference accepts first, then
    (when it accepts none) the others; each dim's sizes recorded in `search.tried`."""
    hints = model_hints(model, dims, opts)
    rejected: list[dict[str, list[int]]] = []
    seen: set[str] = set()
    for sizes in _assignments(dims, base, hints):
        shapes = _shapes(base, dims, sizes)
        key = repr(sorted(shapes.items()))
        if key in seen:
            continue
        seen.add(key)
        if infers(model, shapes) is None:
            rejected.append(shapes)
            continue
        _record(search, dims, sizes)
        yield shapes
    if len(rejected) == len(seen):  # onnx's inference accepts none: it may not know the ops
        for shapes in rejected:
            _record(search, dims, {d.key: shapes[d.places[0][0]][d.places[0][1]] for d in dims})
            yield shapes


def _record(search: Search, dims: list[Dim], sizes: Mapping[str, int]) -> None:
    for d in dims:
        tried = search.tried.setdefault(d.key, [])
        if sizes[d.key] not in tried:
            tried.append(sizes[d.key])


def _assignments(dims: list[Dim], base: dict[str, list[int]], hints: Mapping[str, int]) -> Iterator[dict[str, int]]:
    """Sizes for the free dims, in the order tried: the model's own (its hints over
    resolve_shapes' choice), then each size of SIZES for the dims that are not a batch axis,
    with each of BATCHES and then that size for the batch axes, and the unnamed dims tied to the batch size in
    every combination (a recurrent state's batch axis, which nothing names)."""
    own = {d.key: hints.get(d.key, base[d.places[0][0]][d.places[0][1]]) for d in dims}
    yield own
    untied = [d for d in dims if not d.named and not d.leading]
    ties = [c for r in range(min(len(untied), MAX_TIED) + 1) for c in itertools.combinations(untied, r)]
    sizes = [own[d.key] for d in dims if not d.leading][:1] + list(SIZES)
    for size in dict.fromkeys(sizes):
        for batch in dict.fromkeys((*BATCHES, size)):  # a leading axis may be no batch
            for tied in ties:
                out = {
                    d.key: hints.get(d.key, batch if d.leading or d in tied else size) for d in dims
                }
                yield out


def _shapes(base: dict[str, list[int]], dims: list[Dim], sizes: Mapping[str, int]) -> dict[str, list[int]]:
    shapes = {n: list(s) for n, s in base.items()}
    for d in dims:
        for name, k in d.places:
            shapes[name][k] = sizes[d.key]
    return shapes


def model_hints(model: onnx.ModelProto, dims: list[Dim], opts: ShrinkOptions) -> dict[str, int]:
    """Sizes the model says for free dims: the shapes of the arrays given with --inputs, its
    metadata (Ultralytics' `imgsz` and `batch`), the static sizes its value_info and outputs
    record where a dim flows unchanged."""
    hints = _value_info_hints(model, dims)
    hints.update(_metadata_hints(model, dims))
    for feed in opts.inputs or []:
        for d in dims:
            name, k = d.places[0]
            if name in feed and np.ndim(feed[name]) > k:
                hints[d.key] = int(np.shape(feed[name])[k])
        break
    return hints


def _metadata_hints(model: onnx.ModelProto, dims: list[Dim]) -> dict[str, int]:
    """Ultralytics' metadata: `batch` for the batch axis, `imgsz` [h, w] for the last two axes
    of a rank-4 image input (both free)."""
    meta = {p.key: p.value for p in model.metadata_props}
    out: dict[str, int] = {}
    try:
        imgsz = ast.literal_eval(meta["imgsz"]) if "imgsz" in meta else None
        batch = int(meta["batch"]) if "batch" in meta else None
    except (ValueError, SyntaxError):
        return out
    if isinstance(imgsz, int):
        imgsz = [imgsz, imgsz]
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in graph_inputs(model)}
    for d in dims:
        for name, k in d.places:
            if k == 0 and batch is not None and batch > 0:
                out[d.key] = batch
            elif isinstance(imgsz, list | tuple) and len(imgsz) == 2 and ranks[name] == 4 and k >= 2:
                value = imgsz[k - 2]
                if isinstance(value, int) and value > 0:
                    out[d.key] = value
    return out


def _value_info_hints(model: onnx.ModelProto, dims: list[Dim]) -> dict[str, int]:
    """Static sizes the model's value_info and outputs record at the places its free dims flow
    to unchanged (onnx's shape inference with each free dim its own symbol): an exporter that
    traced the model at some size wrote it there."""
    from onnxshrink.io.skeleton import skeleton

    recorded = {
        vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        for vi in [*model.graph.value_info, *model.graph.output]
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
    }
    if not any(v is not None for dims_ in recorded.values() for v in dims_):
        return {}
    light = skeleton(model)
    symbol: dict[str, str] = {}
    for inp in light.graph.input:
        for k, d in enumerate(inp.type.tensor_type.shape.dim):
            key = next((x.key for x in dims if (inp.name, k) in x.places), None)
            if key is not None:
                d.Clear()
                d.dim_param = f"onnxshrink_free_{len(symbol)}"
                symbol[d.dim_param] = key
    for o in light.graph.output:
        o.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:
        return {}
    votes: dict[str, dict[int, int]] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        for d, value in zip(vi.type.tensor_type.shape.dim, recorded.get(vi.name, []), strict=False):
            if value and d.dim_param in symbol:
                counts = votes.setdefault(symbol[d.dim_param], {})
                counts[value] = counts.get(value, 0) + 1
    return {key: max(counts, key=lambda v: counts[v]) for key, counts in votes.items()}


def _none_ran(dims: list[Dim], search: Search) -> str:
    """Why no size was found, what was tried, and what to do."""
    where = ", ".join(
        f"{d.key} ({' and '.join(f'{n} axis {k}' for n, k in d.places)}): {', '.join(map(str, search.tried.get(d.key, [])))}"
        for d in dims
    )
    last = f" (last: {search.failure})" if search.failure else ""
    return (
        f"the input model does not run in onnxruntime at any of the sizes tried for its dynamic "
        f"dims, {search.runs} run(s){last}; sizes tried per dim: {where}. Give the shapes it runs "
        "on with --input-shapes name:d0,d1,..., or real inputs with --inputs FILE.npz."
    )

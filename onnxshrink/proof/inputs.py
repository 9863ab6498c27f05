"""The proof's inputs: the shapes chosen for dynamic dims (`resolve_shapes`), random draws that
run (`make_inputs`: indices within their tables, integers drawn among the values the graph
compares them with), and inputs given in files (`load_inputs`, checked by `check_inputs`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from onnxshrink import ir
from onnxshrink.errors import ShrinkError, first_line


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


class InputFile(dict[str, np.ndarray]):
    """Validation inputs read from a file (`--inputs`): {input name: array}, and the file."""

    def __init__(self, arrays: Mapping[str, np.ndarray], source: str):
        super().__init__(arrays)
        self.source = source


def check_inputs(model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]] | None) -> None:
    """Refuse given validation inputs that do not fit the model: names it does not have, inputs
    missing, another dtype or rank, or a static dim that differs (each named)."""
    inputs = {i.name: i for i in graph_inputs(model)}
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


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
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
    inputs = graph_inputs(model)
    shapes, symbols = _given_shapes(inputs, given)
    required = required_dims(model, [i for i in inputs if i.name not in shapes])
    for inp in inputs:  # a dim name an op requires a size of takes that size (unless given)
        for k, d in enumerate(inp.type.tensor_type.shape.dim):
            size = required.get(inp.name, {}).get(k)
            if size is not None and d.HasField("dim_param") and d.dim_param:
                symbols.setdefault(d.dim_param, size)

    def at(size: int) -> dict[str, list[int]]:
        return _shapes_at(inputs, shapes, symbols, required, size)

    if not _free_dims(inputs, shapes, symbols):
        return at(DEFAULT_SIZE)
    size = survived_size(model, at)
    return at(size if size is not None else DEFAULT_SIZE)


def _given_shapes(
    inputs: list[onnx.ValueInfoProto], given: Mapping[str, list[int]]
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """The shapes given (--input-shapes), checked against the model's inputs, and the sizes they
    give the dim names; ShrinkError for a shape that does not fit its input."""
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
    return shapes, symbols


def _free_dims(
    inputs: list[onnx.ValueInfoProto], shapes: Mapping[str, list[int]], symbols: Mapping[str, int]
) -> bool:
    """Has an input no shape was given for a dynamic dim past its first that nothing sizes?"""
    return any(
        inp.name not in shapes
        and any(
            not d.HasField("dim_value") and k > 0 and d.dim_param not in symbols
            for k, d in enumerate(inp.type.tensor_type.shape.dim)
        )
        for inp in inputs
    )


def _shapes_at(
    inputs: list[onnx.ValueInfoProto],
    shapes: Mapping[str, list[int]],
    symbols: Mapping[str, int],
    required: Mapping[str, Mapping[int, int]],
    size: int,
) -> dict[str, list[int]]:
    """Every input's shape with its free dynamic dims at `size` (2 for a leading batch axis): the
    given shapes, static dims, the sizes ops require, one size per dim name."""
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


def required_dims(model: onnx.ModelProto, inputs: list[onnx.ValueInfoProto]) -> dict[str, dict[int, int]]:
    """The sizes the ops reading these graph inputs require of their dynamic axes (each handler's
    `input_dims`: a fused attention's past cache has the query's head size, a recurrent layer's
    X its W's input size), read from the static dims of the ops' other inputs; also where the op
    reads the input through others that carry the dim unchanged (`Flows`: madmom's RNNs read
    their input unsqueezed). Inferred only when some op requires a size."""
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
    flows: Flows | None = None
    for n in model.graph.node:
        handler, op = facts(n, opset)
        asked = handler.input_dims(op, dims) if handler else {}
        for i, axes in asked.items():
            name = n.input[i] if i < len(n.input) else ""
            for k, size in axes.items():
                if k in dynamic.get(name, ()):
                    required.setdefault(name, {})[k] = size
                elif name and name not in dynamic and dynamic:  # a dim that flows from an input
                    flows = flows if flows is not None else Flows(model, dynamic)
                    for inp, axis in flows.places(name, k):
                        required.setdefault(inp, {})[axis] = size
    return required


class Flows:
    """Where the graph inputs' dynamic dims flow unchanged: onnx's shape inference on the model's
    skeleton with each such dim a symbol of its own (one per dim name; an unnamed dim gets one),
    so a tensor's axis that carries the symbol is, by the ops' shape rules, that input's size
    (an Unsqueeze, a Slice on another axis, a Concat along another axis keep it)."""

    def __init__(self, model: onnx.ModelProto, dynamic: Mapping[str, set[int]]):
        from onnxshrink.io.skeleton import skeleton
        from onnxshrink.prepare.shapes import inferred_shapes

        light = skeleton(model)
        self.at: dict[str, list[tuple[str, int]]] = {}
        for inp in light.graph.input:
            for k, d in enumerate(inp.type.tensor_type.shape.dim):
                if k in dynamic.get(inp.name, ()):
                    if not d.dim_param:
                        d.dim_param = f"onnxshrink_flow_{len(self.at)}"
                    self.at.setdefault(d.dim_param, []).append((inp.name, k))
        self.symbols = {
            vi.name: [d.dim_param if d.HasField("dim_param") else "" for d in vi.type.tensor_type.shape.dim]
            for vi in inferred_shapes(light)
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
        }

    def places(self, name: str, axis: int) -> list[tuple[str, int]]:
        """The graph inputs' dynamic axes whose size tensor `name` has at `axis`."""
        syms = self.symbols.get(name, [])
        return self.at.get(syms[axis], []) if axis < len(syms) and syms[axis] else []


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

    first = infers(model, at(DEFAULT_SIZE))
    if first is not None and not empties(first, None):
        return DEFAULT_SIZE
    probes = [infers(model, at(p)) for p in PROBES]
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
        found = infers(model, at(size))
        if found is not None and not empties(found, probes[0]):
            return size
    return None


def infers(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> dict[str, list[int]] | None:
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
        for i in graph_inputs(model)
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
        for inp in graph_inputs(model):
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

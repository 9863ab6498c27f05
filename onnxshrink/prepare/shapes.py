"""Shape inference on a model's skeleton (its graph without the weights' data).

onnx's shape inference copies the model; on a large model that is the weights twice. These
helpers infer on a skeleton instead, fold small constant shape arithmetic first (shape inference
propagates values through Shape/Gather/Concat, not through every op exporters use), and make
static the dims that do not depend on the dynamic input sizes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.core.handler import Dims, OpNode
from onnxshrink.io.skeleton import FLOAT_TYPES as FLOAT_TYPES
from onnxshrink.io.skeleton import heavy, onnx_knows, skeleton
from onnxshrink.ir import all_graphs
from onnxshrink.ops import facts, handler_for_op


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return 1


def _dims(vi: onnx.ValueInfoProto) -> Dims | None:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


def _probe_shapes(model: onnx.ModelProto, pick) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    symbols: dict[object, int] = {}
    inits = {t.name for t in model.graph.initializer}
    for i in model.graph.input:
        if i.name in inits:
            continue
        dims = i.type.tensor_type.shape.dim
        shapes[i.name] = [
            d.dim_value
            if d.HasField("dim_value")
            else symbols.setdefault(d.dim_param or (i.name, k), pick(k))
            for k, d in enumerate(dims)
        ]
    return shapes


def complete_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Make static the dims that shape inference left symbolic although they do not depend on
    the dynamic input sizes (e.g. Reshape(x, Concat(Shape(x)[0], -1))): infer twice with two
    different concrete input sizes; a dim equal in both runs is static. Except where a Slice
    of a dynamic axis clamps its bounds into sizes both runs agree on (x[-1:7] is empty at
    both, not at a size under 7): a third run gives each such Slice another output size, and
    the dims that follow it are not static."""
    dynamic = any(
        not d.HasField("dim_value") for i in model.graph.input for d in i.type.tensor_type.shape.dim
    )
    if not dynamic:
        return model
    picks = (lambda k: 2 if k == 0 else 96, lambda k: 3 if k == 0 else 160)
    runs = []
    for pick in picks:
        try:
            inferred = onnx.shape_inference.infer_shapes(
                skeleton(model, _probe_shapes(model, pick)), data_prop=True
            )
        except Exception:
            return model
        runs.append({vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]})
    moved = _resized_slices(model, _probe_shapes(model, picks[0]), runs[0])
    if moved is not None:
        try:
            inferred = onnx.shape_inference.infer_shapes(moved, data_prop=True)
        except Exception:
            return model
        runs.append({vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]})
    known = {vi.name: vi for vi in model.graph.value_info}
    keep_io = {i.name for i in [*model.graph.input, *model.graph.output]}
    for name, probe in runs[0].items():
        d1 = _dims(probe)
        d2 = _dims(runs[1][name]) if name in runs[1] else None
        if name in keep_io or d1 is None or d2 is None or len(d1) != len(d2):
            continue
        if len(runs) > 2:  # the same sizes, the clamped Slices' outputs resized: must agree
            d3 = _dims(runs[2][name]) if name in runs[2] else None
            d2 = d2 if d3 is not None and len(d3) == len(d2) else [None] * len(d2)
            d2 = [b if a == c else None for a, b, c in zip(d1, d2, d3 or d2, strict=True)]
        vi = known.get(name)
        base = _dims(vi) if vi is not None else [None] * len(d1)
        if base is None or len(base) != len(d1):
            continue
        if vi is None:
            vi = model.graph.value_info.add()
            vi.name = name
            vi.type.tensor_type.elem_type = probe.type.tensor_type.elem_type
        shape = vi.type.tensor_type.shape
        shape.Clear()
        for k, (a, b) in enumerate(zip(d1, d2, strict=True)):
            dim = shape.dim.add()
            if isinstance(base[k], int):
                dim.dim_value = base[k]
            elif isinstance(a, int) and a == b:
                dim.dim_value = a
            elif isinstance(base[k], str):
                dim.dim_param = base[k]
    return model


def _resized_slices(
    model: onnx.ModelProto, probe_sizes: dict[str, list[int]], probed: dict[str, onnx.ValueInfoProto]
) -> onnx.ModelProto | None:
    """The skeleton at `probe_sizes` (`probed`: its inferred shapes) with each Slice of an axis
    that is dynamic in `model`, whose output size varies with that size (its handler's
    `resized_bounds`), made to output one element more (or fewer) there; None when the model
    has none."""
    opset = default_opset(model)
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:
        handler, op = facts(n, opset)
        value = handler.constant_value(op) if handler is not None else None
        if value is not None:
            consts[n.output[0]] = value
    dims = {vi.name: _dims(vi) for vi in [*model.graph.input, *model.graph.value_info]}
    resized: dict[int, list[list[int]]] = {}  # node index -> its starts, ends, axes, steps
    for k, node in enumerate(model.graph.node):
        handler, op = facts(node, opset)
        base = dims.get(node.input[0]) if node.input else None
        now = _dims(probed[node.input[0]]) if node.input and node.input[0] in probed else None
        if handler is None or base is None or now is None or len(base) != len(now):
            continue
        bounds = handler.resized_bounds(op, consts, base, now)
        if bounds is not None:
            resized[k] = bounds
    if not resized:
        return None
    probe = skeleton(model, probe_sizes)
    for k, bounds in resized.items():
        node = probe.graph.node[k]  # the skeleton keeps the nodes in order
        del node.input[1:]
        for label, values in zip(("starts", "ends", "axes", "steps"), bounds, strict=True):
            node.input.append(f"{node.name or node.output[0]}__probe_{label}")
            probe.graph.initializer.append(numpy_helper.from_array(np.asarray(values, np.int64), node.input[-1]))
    return probe


_FOLD_LIMIT = 4096  # elements: shape arithmetic, not weights


def fold_shape_arithmetic(
    model: onnx.ModelProto, integers_only: bool = False, static: Mapping[str, list[int]] | None = None
) -> onnx.ModelProto:
    """Replace nodes whose inputs are all small constants by their values, in place (meant for a
    skeleton): shape inference propagates values through Shape/Gather/Concat but not through
    e.g. the legacy exporter's Where(Equal(c, -1), 1, c) that builds an Expand target, and
    without the value every size downstream of it is unknown. `integers_only`: only the nodes
    whose values are integers or booleans (sizes, pads, indices and their tests): a float
    computation on constants stays (the MAC count counts it). `static`: tensors' shapes known
    whole (from an inference): a node that reads only their sizes (Shape, Size) is folded too
    (`Handler.sizes_value`), which shape inference's own propagation does not follow into e.g.
    an opset-7 Slice (`static_shapes` and `inferred_static`: repeat until nothing folds)."""
    opset = default_opset(model)

    g = model.graph
    small = [t for t in g.initializer if int(np.prod(t.dims, dtype=np.int64)) <= _FOLD_LIMIT]
    known = {t.name: numpy_helper.to_array(t) for t in small}
    outputs = {o.name for o in g.output}
    kept, folded = [], []
    for n in g.node:
        ins = [i for i in n.input if i]
        handler = handler_for_op(n.op_type, n.domain, opset)
        fold = (
            n.domain in ("", "ai.onnx")
            and (handler is None or handler.deterministic)  # sizes fold here: shapes only
            and all(i in known for i in ins)
            and not any(o in outputs for o in n.output)
            and not any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                for a in n.attribute
            )
        )
        ort = bool(handler and handler.evaluate_with_ort)
        values = _evaluate(n, known, opset, ort) if fold else None
        if values is None and static and handler is not None and not any(o in outputs for o in n.output):
            value = handler.sizes_value(OpNode.of(n), [static.get(i) if i else None for i in n.input])
            values = [value] if value is not None else None
        if values is not None and integers_only and not all(v.dtype.kind in "iub" for v in values):
            values = None  # (integers and the booleans of their tests)
        if values is None:
            kept.append(n)
            continue
        for name, v in zip(n.output, values, strict=True):
            known[name] = v
            folded.append(numpy_helper.from_array(v, name))
    if folded:
        del g.node[:]
        g.node.extend(kept)
        g.initializer.extend(folded)
    return model


# Rounds of folding sizes (`inferred_static`): each round's inference can make more shapes whole.
SIZE_ROUNDS = 4


def inferred_static(light: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference (with data propagation) on a skeleton whose integer arithmetic is folded,
    repeated with the sizes it found folded in (`fold_shape_arithmetic`'s `static`) while that
    folds anything, at most SIZE_ROUNDS times: Shape -> opset-7 Slice -> Concat -> Reshape, as
    paddle2onnx writes it, leaves every size after the Reshape unknown to one inference."""
    light = fold_shape_arithmetic(light, integers_only=True)
    inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
    for _ in range(SIZE_ROUNDS):
        nodes = len(light.graph.node)
        light = fold_shape_arithmetic(light, integers_only=True, static=static_shapes(inferred))
        if len(light.graph.node) == nodes:
            break
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
    return inferred


def static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """The tensors of `model`'s main graph whose every dim is known, by name."""
    out = {}
    for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if t is not None and t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            out[vi.name] = [d.dim_value for d in t.shape.dim]
    return out


def _evaluate(
    node: onnx.NodeProto, known: dict[str, np.ndarray], opset: int, ort: bool
) -> list[np.ndarray] | None:
    from onnxshrink.core.evaluate import EvaluationError, evaluate_op

    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    inputs = [known[i] if i else None for i in node.input]
    try:
        out = evaluate_op(node.op_type, attrs, inputs, opset, len(node.output), ort=ort)
    except EvaluationError:  # not evaluable here: left to shape inference as it is
        return None
    out = [np.asarray(v) for v in out]
    if any(v.dtype == object or v.size > _FOLD_LIMIT for v in out):
        return None
    return out


def contrib_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx's shape inference knows no onnxruntime contrib op (com.microsoft, and the few it
    defines in the ONNX domain: the fused attention and normalizations its transformer
    optimizer writes), so every shape after one is unknown. onnxruntime's symbolic shape
    inference knows them: used for models that have ops onnx does not know (custom ones too:
    where it knows nothing either, what onnx inferred stays)."""
    if all(onnx_knows(n) for n in model.graph.node):
        return model
    try:
        SymbolicShapeInference = _symbolic_shape_inference()  # noqa: N806  (a class)
        # Its `infer_shapes` raises when one node's shapes stay unknown (and saves the model to
        # the working directory first): run its steps and keep whatever it inferred.
        infer = SymbolicShapeInference(2**31 - 1, True, False, 0)
        infer.dispatcher_.update(_declared_rules(infer, model))
        infer._preprocess(model)
        while infer.run_:
            infer._infer_impl()
        infer._update_output_from_vi()
        return infer.out_mp_
    except Exception:  # it gave up (or its internals changed): the shapes onnx inferred
        return model


@functools.cache
def _symbolic_shape_inference() -> type:
    """onnxruntime's SymbolicShapeInference, its module loaded from its file: importing it as
    `onnxruntime.tools.symbolic_shape_infer` runs the `onnxruntime.tools` package, which imports
    torch when it is installed (seconds, for every model with a contrib op)."""
    import importlib.util
    from pathlib import Path

    import onnxruntime

    name = "_onnxshrink_symbolic_shape_infer"
    if name not in sys.modules:
        path = Path(onnxruntime.__file__).parent / "tools" / "symbolic_shape_infer.py"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].SymbolicShapeInference


def _declared_rules(infer, model: onnx.ModelProto) -> dict[str, Callable[[onnx.NodeProto], None]]:
    """Shape rules, by op type as `infer` (a SymbolicShapeInference) dispatches them, for the
    model's ops whose handlers declare the output types shape inference lacks (onnxruntime's
    QOperator contrib ops, which onnxruntime.quantization writes)."""
    opset = default_opset(model)

    def rule(node: onnx.NodeProto) -> None:
        handler = handler_for_op(node.op_type, node.domain, opset)
        if handler is None or not handler.types_unknown_to_inference:
            return
        types = handler.output_types(OpNode.of(node), _InferredTypes(infer, node))
        for name, typed in zip(node.output, types or [], strict=False):
            if name and typed is not None:
                infer.known_vi_[name].CopyFrom(onnx.helper.make_tensor_value_info(name, typed[1], typed[0]))

    declared = set()
    for graph in all_graphs(model.graph):
        for n in graph.node:
            handler = handler_for_op(n.op_type, n.domain, opset)
            if handler is not None and handler.types_unknown_to_inference:
                declared.add(n.op_type)
    return dict.fromkeys(declared, rule)


class _InferredTypes:
    """A node's inputs as onnxruntime's symbolic shape inference `infer` knows them (the
    `InputTypes` a handler's `output_types` reads)."""

    def __init__(self, infer, node: onnx.NodeProto) -> None:
        self.infer = infer
        self.node = node

    def dims(self, i: int) -> Dims | None:
        return self.infer._get_shape(self.node, i)

    def known_dims(self, i: int) -> Dims:
        dims = self.dims(i)
        if dims is None:
            raise LookupError(f"{self.node.input[i]}: no shape")
        return dims

    def dtype(self, i: int) -> int:
        return self.infer.known_vi_[self.node.input[i]].type.tensor_type.elem_type

    def float_op_dims(self, op: str, inputs: Sequence[int], channels_last: bool = False) -> Dims | None:
        """For symbolic dims, its conv/pool rule; for static ones, onnx's inference of the float
        op, unless onnx's inference of the node itself (already run) knows them."""
        node, infer = self.node, self.infer
        like = onnx.helper.make_node(op, [node.input[i] for i in inputs], list(node.output[:1]))
        like.attribute.extend(a for a in node.attribute if a.name != "channels_last")
        x = self.dims(0)
        if x is None:
            return None
        if all(isinstance(d, int) for d in x):
            return None if onnx_knows(node) else _static_float_op_dims(like, x, channels_last)
        shape = infer._compute_conv_pool_shape(like, channels_last)
        infer._update_computed_dims(shape)
        return sys.modules[type(infer).__module__].get_shape_from_sympy_shape(shape)


def _static_float_op_dims(like: onnx.NodeProto, x: Dims, channels_last: bool) -> Dims | None:
    """Output 0's dims of `like` (a float op) on an input 0 of static dims `x`, by onnx's inference."""
    helper = onnx.helper
    first = [x[0], x[-1], *x[1:-1]] if channels_last else list(x)
    graph = helper.make_graph(
        [like], "pool", [helper.make_tensor_value_info(like.input[0], onnx.TensorProto.FLOAT, first)],
        [helper.make_tensor_value_info(like.output[0], onnx.TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    y = _dims(onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output[0])
    if y is None:
        return None
    return [y[0], *y[2:], y[1]] if channels_last else y


def inferred_shapes(model: onnx.ModelProto, subgraphs: bool = False) -> list[onnx.ValueInfoProto]:
    """Shapes of the model's intermediate tensors, inferred on its skeleton (no weight data is
    copied: shape inference of a large model would otherwise serialize it twice), with its
    shape arithmetic folded first. `subgraphs`: those of the tensors inside If/Loop/Scan bodies
    too (names are unique across scopes in the graphs the analysis reads)."""
    try:
        light = fold_shape_arithmetic(skeleton(model))
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # a model onnx cannot infer: work with the shapes it carries
        inferred = model
    else:
        inferred = contrib_shapes(inferred)
        complete_shapes(inferred)
    original = {t.name for t in model.graph.initializer}
    folded = [
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in inferred.graph.initializer
        if t.name not in original
    ]
    inner = [
        vi for g in list(all_graphs(inferred.graph))[1:] for vi in [*g.input, *g.value_info, *g.output]
    ] if subgraphs else []  # fmt: skip
    if subgraphs:
        inner += _branch_shapes(model, inferred)
    return [*inferred.graph.value_info, *folded, *inner]


def _branch_shapes(model: onnx.ModelProto, inferred: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The shapes inside each top-level If branch, inferred with the branch as a model of its own
    (its outer reads its inputs, typed as the whole model's inference found them): onnx's shape
    inference propagates no values inside a subgraph, so a branch's Reshape to a computed
    target (an optimum merged decoder's attention heads) is left without dims. Later entries
    win (see prepare.graph), so these come after the subgraph's own."""
    types = {vi.name: vi for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]}
    # the model's weights, and the constants folded in its skeleton (Constant nodes among them)
    inits = {t.name: t for t in [*model.graph.initializer, *inferred.graph.initializer]}
    out: list[onnx.ValueInfoProto] = []
    opset = default_opset(model)
    for node in model.graph.node:
        handler = handler_for_op(node.op_type, node.domain, opset)
        if handler is None or not handler.runs_one_body:
            continue
        for attr in node.attribute:
            if attr.type != onnx.AttributeProto.GRAPH or attr.g.input:
                continue
            branch = _branch_model(model, attr.g, types, inits)
            if branch is not None:
                outer = {i.name for i in branch.graph.input} | {t.name for t in branch.graph.initializer}
                out += [vi for vi in inferred_shapes(branch, subgraphs=True) if vi.name not in outer]
                out += [vi for vi in _outputs_inferred(branch) if vi.name not in outer]
    return out


def _branch_model(
    model: onnx.ModelProto,
    body: onnx.GraphProto,
    types: dict[str, onnx.ValueInfoProto],
    inits: dict[str, onnx.TensorProto],
) -> onnx.ModelProto | None:
    """`body` as a model: what it reads from outside as inputs (small constants as
    initializers); None when the type of something it reads is unknown."""
    produced = {o for g in all_graphs(body) for n in g.node for o in n.output}
    produced |= {t.name for g in all_graphs(body) for t in g.initializer}
    produced |= {i.name for g in list(all_graphs(body))[1:] for i in g.input}
    read = [i for g in all_graphs(body) for n in g.node for i in n.input if i and i not in produced]
    branch = onnx.ModelProto()
    branch.ir_version = model.ir_version
    branch.opset_import.extend(model.opset_import)
    branch.functions.extend(model.functions)
    g = branch.graph
    g.name = body.name or "branch"
    g.node.extend(body.node)
    g.initializer.extend(body.initializer)
    g.output.extend(body.output)
    for name in dict.fromkeys(read):
        if name in inits:
            t = inits[name]
            if heavy(t):
                g.input.append(onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
            else:
                g.initializer.append(t)
        elif name in types and types[name].type.tensor_type.elem_type:
            g.input.append(types[name])
        else:
            return None
    return branch


def _outputs_inferred(branch: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The branch's outputs with the dims its inference gives them."""
    try:
        inferred = onnx.shape_inference.infer_shapes(fold_shape_arithmetic(skeleton(branch)), data_prop=True)
    except Exception:
        return []
    return list(inferred.graph.output)

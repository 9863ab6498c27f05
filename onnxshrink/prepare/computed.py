"""Weights the model computes from constants only are weights.

A model exported with its pruning still attached computes each pruned weight at run time from
stored tensors: `torch.nn.utils.prune`'s hooks as `weight_orig * weight_mask`, a
`torch.ao.pruning` parametrization as `original * mask`, other wrappers as a chain of such
products. Such a product is the weight the model uses: its zeros are the masks, the framework's
parameter is its name (the op reading it is in the parameter's module), and it is what a
deployed model holds. onnxruntime folds it when a session is created (with the same kernels it
would run), so the model as given and the model with the product stored compute the same
numbers; `fold_computed_weights` stores it before the masks are bound.

What is folded: a connected set of nodes (standard ops, no subgraphs, no random ops) whose
inputs are all constants (initializers that are not graph inputs, Constant nodes), computing a
floating-point tensor a non-constant node reads, from at least two floating-point constants (a
combination of stored tensors: a lone weight behind a Transpose, Reshape or Identity is a view
of a stored tensor, left as written), when storing the results takes no more bytes than the
constants that only they read, and when the tensor read is not a conversion (an output of
another element type than the op's first input: a DequantizeLinear of an int8 weight, a Cast,
is how the model chose to store it). The values are computed by onnxruntime, as a session of the
model computes them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxshrink.io.weights import WeightStore
from onnxshrink.ir import all_graphs
from onnxshrink.ops import handler_for_op, is_constant_node
from onnxshrink.prepare.shapes import FLOAT_TYPES, default_opset

# Past this many bytes of products, the model is left as written (they would be held in memory).
MAX_FOLDED_BYTES = 1 << 30


@dataclass
class _Component:
    nodes: list[int] = field(default_factory=list)
    leaves: set[str] = field(default_factory=set)  # initializers and Constant outputs read
    outputs: list[str] = field(default_factory=list)  # computed tensors a non-constant node reads


def _tensor_bytes(elem_type: int, dims: list[int]) -> int:
    n = int(np.prod(dims, dtype=np.int64)) if dims else 1
    return n * np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read (If/Loop/Scan bodies may read outer tensors)."""
    names: set[str] = set()
    for a in node.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            for sub in all_graphs(g):
                names |= {i for n in sub.node for i in n.input}
    return names


@dataclass
class _Plan:
    nodes: list[onnx.NodeProto]
    inits: dict[str, onnx.TensorProto]
    types: dict[str, tuple[int, list[int]]]
    readers: dict[str, set[int]]
    chosen: list[_Component]


def _plan(model: onnx.ModelProto) -> _Plan | None:
    """The components to fold (see the module's doc), or None; nothing is read or changed."""
    g = model.graph
    graph_inputs = {i.name for i in g.input}
    inits = {t.name: t for t in g.initializer}
    if model.ir_version >= 4:  # an initializer listed as an input can be fed: not a constant
        inits = {k: t for k, t in inits.items() if k not in graph_inputs}
    nodes = list(g.node)
    opset = default_opset(model)
    handlers = [handler_for_op(n.op_type, n.domain, opset) for n in nodes]
    const_nodes = {k for k, n in enumerate(nodes) if (h := handlers[k]) is not None and h.is_constant and len(n.output) == 1}
    drawn = {k for k, h in enumerate(handlers) if h is not None and h.draws_random}  # never constants
    constant = set(inits) | {nodes[k].output[0] for k in const_nodes}
    computed: list[int] = []
    for k, n in enumerate(nodes):
        if k in const_nodes or not n.input or n.domain not in ("", "ai.onnx") or k in drawn:
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            continue
        if all(i == "" or i in constant for i in n.input):
            computed.append(k)
            constant.update(o for o in n.output if o)
    if not computed:
        return None
    readers: dict[str, set[int]] = defaultdict(set)  # tensor -> nodes reading it (subgraphs too)
    for k, n in enumerate(nodes):
        for name in set(n.input) | _subgraph_reads(n):
            readers[name].add(k)
    outputs = {o.name for o in g.output}
    leaves = set(inits) | {nodes[k].output[0] for k in const_nodes}
    produced_by = {o: k for k in computed for o in nodes[k].output}
    types = _types(model, inits, nodes, computed, const_nodes)
    chosen: list[_Component] = []
    for comp in _components(nodes, computed, leaves):
        members = set(comp.nodes)
        if any(o in outputs for k in comp.nodes for o in nodes[k].output):
            continue  # a graph output: left as written
        comp.outputs = [o for k in comp.nodes for o in nodes[k].output if o and readers[o] - members]
        if not comp.outputs or any(o not in types for o in comp.outputs):
            continue
        float_leaves = [x for x in comp.leaves if x in types and types[x][0] in FLOAT_TYPES]
        if len(float_leaves) < 2 or any(types[o][0] not in FLOAT_TYPES for o in comp.outputs):
            continue
        if any(_converts(nodes[produced_by[o]], types) for o in comp.outputs):
            continue
        freed = sum(
            _tensor_bytes(*types[x]) for x in comp.leaves if x in types and not readers[x] - members
        )
        if sum(_tensor_bytes(*types[o]) for o in comp.outputs) > freed:
            continue
        chosen.append(comp)
    total = sum(_tensor_bytes(*types[o]) for c in chosen for o in c.outputs)
    if not chosen or total > MAX_FOLDED_BYTES:
        return None
    return _Plan(nodes, inits, types, readers, chosen)


def has_computed_weights(model: onnx.ModelProto) -> bool:
    """Does `fold_computed_weights` find weights to fold (without reading any)?"""
    return _plan(model) is not None


def fold_computed_weights(
    model: onnx.ModelProto, base_dir: str | Path | None = None, store: WeightStore | None = None
) -> list[str]:
    """Store every weight the main graph computes from constants only (see the module's doc) as
    an initializer of its own name, in place; the nodes and constants only it used are dropped.
    Returns the names of the weights stored ([]: the model is unchanged)."""
    plan = _plan(model)
    if plan is None:
        return []
    nodes, g = plan.nodes, model.graph
    values: dict[str, np.ndarray] = {}
    for comp in plan.chosen:
        try:
            values |= _evaluate(model, comp, nodes, plan.inits, plan.types, base_dir, store)
        except Exception:  # noqa: BLE001 - a chain onnxruntime cannot run alone stays as written
            continue
    if not values:
        return []
    done = [c for c in plan.chosen if all(o in values for o in c.outputs)]
    drop = {k for c in done for k in c.nodes}
    kept_nodes = [n for k, n in enumerate(nodes) if k not in drop]
    still_read = {o.name for o in g.output} | {i.name for i in g.input}
    for n in kept_nodes:
        still_read |= set(n.input) | _subgraph_reads(n)
    del g.node[:]
    opset = default_opset(model)
    g.node.extend(n for n in kept_nodes if not (is_constant_node(n, opset) and n.output[0] not in still_read))
    keep_inits = [t for t in g.initializer if t.name in still_read]
    del g.initializer[:]
    g.initializer.extend(keep_inits)
    folded = [name for c in done for name in c.outputs]
    for name in folded:
        g.initializer.append(numpy_helper.from_array(values[name], name))
    stale = {o for k in drop for o in nodes[k].output}
    kept_info = [vi for vi in g.value_info if vi.name not in stale]
    del g.value_info[:]
    g.value_info.extend(kept_info)
    return folded


def _components(nodes: list[onnx.NodeProto], computed: list[int], leaves: set[str]) -> list[_Component]:
    """The computed nodes in connected sets: joined by a tensor one computes and another reads,
    or by a constant both read (whose bytes are freed only when all its readers go)."""
    parent = {k: k for k in computed}

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    producer = {o: k for k in computed for o in nodes[k].output if o}
    first_reader: dict[str, int] = {}
    for k in computed:
        for i in nodes[k].input:
            if not i:
                continue
            if i in producer:
                parent[find(k)] = find(producer[i])
            if i in leaves:
                if i in first_reader:
                    parent[find(k)] = find(first_reader[i])
                else:
                    first_reader[i] = k
    comps: dict[int, _Component] = {}
    for k in computed:
        c = comps.setdefault(find(k), _Component())
        c.nodes.append(k)
        c.leaves |= {i for i in nodes[k].input if i in leaves}
    return list(comps.values())


def _types(
    model: onnx.ModelProto,
    inits: dict[str, onnx.TensorProto],
    nodes: list[onnx.NodeProto],
    computed: list[int],
    const_nodes: set[int],
) -> dict[str, tuple[int, list[int]]]:
    """(element type, dims) of the constants and of every computed tensor, by onnx's inference
    on the constant part of the graph (no weight data read)."""
    out: dict[str, tuple[int, list[int]]] = {
        k: (t.data_type, [int(d) for d in t.dims]) for k, t in inits.items()
    }
    needed = {i for k in computed for i in nodes[k].input if i}
    sub_inputs = [helper.make_tensor_value_info(k, *out[k]) for k in sorted(needed & set(inits))]
    sub_nodes = [nodes[k] for k in sorted(const_nodes | set(computed))]
    graph = helper.make_graph(sub_nodes, "constants", sub_inputs, [])
    sub = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    try:
        inferred = onnx.shape_inference.infer_shapes(sub, strict_mode=False)
    except Exception:  # noqa: BLE001 - without types nothing is folded
        return out
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        tt = vi.type.tensor_type
        if tt.elem_type and tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            out[vi.name] = (tt.elem_type, [d.dim_value for d in tt.shape.dim])
    for k in const_nodes:  # Constant outputs: their own value says
        for a in nodes[k].attribute:
            if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                out[nodes[k].output[0]] = (a.t.data_type, [int(d) for d in a.t.dims])
    return out


def _converts(node: onnx.NodeProto, types: dict[str, tuple[int, list[int]]]) -> bool:
    """Does the node output another element type than its first input's (a conversion)?"""
    first = node.input[0] if node.input else ""
    return first not in types or types[first][0] != types[node.output[0]][0]


def _evaluate(
    model: onnx.ModelProto,
    comp: _Component,
    nodes: list[onnx.NodeProto],
    inits: dict[str, onnx.TensorProto],
    types: dict[str, tuple[int, list[int]]],
    base_dir: str | Path | None,
    store: WeightStore | None,
) -> dict[str, np.ndarray]:
    """The component's outputs, computed by onnxruntime from the stored constants."""
    import onnxruntime as ort

    feeds: dict[str, np.ndarray] = {}
    for name in sorted(comp.leaves & set(inits)):
        t = inits[name]
        if t.data_location == onnx.TensorProto.EXTERNAL:
            store = store or WeightStore()
            feeds[name] = np.asarray(store.array(t, base_dir or "."))
        else:
            feeds[name] = numpy_helper.to_array(t)
    opset = default_opset(model)
    const_outputs = {nodes[k].output[0]: k for k, n in enumerate(nodes) if is_constant_node(n, opset) and n.output}
    sub_nodes = [nodes[const_outputs[x]] for x in sorted(comp.leaves) if x in const_outputs]
    sub_nodes += [nodes[k] for k in sorted(comp.nodes)]
    graph = helper.make_graph(
        sub_nodes,
        "computed_weights",
        [helper.make_tensor_value_info(k, *types[k]) for k in feeds],
        [helper.make_tensor_value_info(o, *types[o]) for o in comp.outputs],
    )
    sub = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(sub.SerializeToString(), so, providers=["CPUExecutionProvider"])
    results = sess.run(comp.outputs, feeds)
    return {o: np.asarray(v) for o, v in zip(comp.outputs, results, strict=True)}

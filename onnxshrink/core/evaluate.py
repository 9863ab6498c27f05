"""Evaluate a single ONNX node on concrete arrays (constant folding, constant channel values)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

# Heavy kernels go to onnxruntime, light ones to onnx's numpy reference evaluator, which costs no
# session build (the op's handler says which: `Handler.evaluate_with_ort`). Both give ONNX
# semantics for every attribute, so no op is re-implemented here.
_IR_VERSION = 8  # understood by every onnxruntime this project supports


class EvaluationError(RuntimeError):
    pass


def _attrs(node: gs.Node) -> dict[str, Any]:
    """The node's attributes as onnx.helper.make_node takes them (a tensor as a TensorProto)."""
    out = {}
    for k, v in node.attrs.items():
        if isinstance(v, gs.Tensor):  # tensor attribute (e.g. ConstantOfShape value)
            v = onnx.numpy_helper.from_array(np.asarray(v.values), name=k)
        out[k] = v
    return out


def op_model(
    op: str,
    attrs: dict[str, Any],
    inputs: Sequence[np.ndarray | None],
    n_outputs: int,
    opset: int,
    domain: str = "",
) -> onnx.ModelProto:
    in_names = [f"i{k}" if a is not None else "" for k, a in enumerate(inputs)]
    out_names = [f"o{k}" for k in range(n_outputs)]
    onode = helper.make_node(op, in_names, out_names, domain=domain, **attrs)
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in zip(in_names, inputs, strict=True)
        if a is not None
    ]
    graph_outputs = [onnx.ValueInfoProto(name=n) for n in out_names]  # types left to the runtime
    graph = helper.make_graph([onode], "node", graph_inputs, graph_outputs)
    # A contrib op (com.microsoft) is version 1 of its domain; `opset` is the model's default one.
    imports = [helper.make_opsetid("", opset)]
    if domain and domain != "ai.onnx":
        imports.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=imports, ir_version=_IR_VERSION)


def evaluate(
    node: gs.Node,
    inputs: Sequence[np.ndarray | None],
    opset: int,
    *,
    ort: bool = False,
    n_outputs: int | None = None,
) -> list[np.ndarray]:
    """Run `node` on `inputs` (None for an absent optional input); returns its outputs."""
    n = len(node.outputs) if n_outputs is None else n_outputs
    return evaluate_op(node.op, _attrs(node), inputs, opset, n, node.domain or "", ort=ort)


def evaluate_op(
    op: str,
    attrs: dict[str, Any],
    inputs: Sequence[np.ndarray | None],
    opset: int,
    n_outputs: int = 1,
    domain: str = "",
    *,
    ort: bool = False,
) -> list[np.ndarray]:
    """Run one ONNX op with `attrs` on `inputs`, with onnxruntime (`ort`) or onnx's reference
    evaluator; EvaluationError when it cannot."""
    inputs = list(inputs)
    while inputs and inputs[-1] is None:
        inputs.pop()
    model = op_model(op, attrs, inputs, n_outputs, opset, domain)
    # C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray makes them 1-d: a scalar Gather
    # index would gather a kept axis).
    feeds = {f"i{k}": np.asarray(a, order="C") for k, a in enumerate(inputs) if a is not None}
    try:
        if ort:
            return _run_ort(model, feeds)
        from onnx.reference import ReferenceEvaluator

        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            outs = ReferenceEvaluator(model).run(None, feeds)
        return [np.asarray(o) for o in outs]
    except Exception as exc:  # the evaluator does not support this op/attribute mix
        raise EvaluationError(f"cannot evaluate {op}: {exc}") from exc


def _run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    from onnxshrink.logs import onnxruntime_severity

    so = ort.SessionOptions()
    so.log_severity_level = onnxruntime_severity()  # its errors: ours to report
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)

"""Constant: a value with no inputs. Graph preparation turns it into an initializer; one that
is a graph output stays and keeps its value."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxshrink.core import ConstInfo, ConstView, Handler, KeepView, OpNode, register
from onnxshrink.ops.oracle import declare_cases

# value_* attributes and the dtype each holds
_TYPED = {
    "value_float": np.float32,
    "value_int": np.int64,
    "value_floats": np.float32,
    "value_ints": np.int64,
}


@register("Constant")
class Constant(Handler):
    is_constant = True

    def constant_value(self, node: OpNode) -> np.ndarray | None:
        a = node.attrs
        if "value" in a:
            v = a["value"]
            if isinstance(v, onnx.TensorProto):
                return onnx.numpy_helper.to_array(v)
            return np.asarray(v.values) if isinstance(v, gs.Constant) else np.asarray(v)
        for key, dtype in _TYPED.items():
            if key in a:
                value = a[key]  # a number, a string, or a list of them (the `s` forms)
                return np.asarray(list(cast(Iterable[object], value)) if key.endswith("s") else value, dtype=dtype)
        return None

    def constant_tensor(self, node: OpNode, name: str) -> onnx.TensorProto | None:
        v = node.attrs.get("value")
        return v if isinstance(v, onnx.TensorProto) else super().constant_tensor(node, name)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        v = self.constant_value(OpNode.of(node))
        return None if v is None else [ConstInfo.of_array(v)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        ks.pin(node.outputs[0])


declare_cases(excluded={"Constant": "no input"})

"""The vocabulary a handler speaks: constant values, shape symbols, reasons, the views of the
analysis, the `Handler` contract and the registry. It imports nothing above it (the analysis,
the ops and the rewrite import it), so a handler imports from here alone:

    from onnxshrink.core import ConstInfo, Handler, KeepView, Reason, register
"""

from onnxshrink.core.evaluate import EvaluationError, evaluate, evaluate_op
from onnxshrink.core.handler import BiasSlot, Dims, Handler, HeadAxis, OpNode, Quantized, WeightAxes
from onnxshrink.core.nonzero import pattern
from onnxshrink.core.reasons import INTERFACE, LIVE, PROOF, AxisKey, Reason
from onnxshrink.core.registry import (
    Lookup,
    facts,
    handler_for,
    handler_for_op,
    lookup,
    register,
    registered_ops,
)
from onnxshrink.core.shape_rules import elementwise_dims, opaque_value, shape_operands, sized_dims
from onnxshrink.core.symbols import (
    DimRef,
    Item,
    MaxOf,
    Opaque,
    Prod,
    SymValue,
    broadcast_items,
    item_deps,
    item_size,
    items_equal,
    max_item,
    opaque,
    own_axes,
    product_item,
)
from onnxshrink.core.values import ConstInfo, compress, expand_to, static_batch1
from onnxshrink.core.views import ConstView, KeepView, Reader, RewriteView, ShapeView

__all__ = [
    "AxisKey",
    "BiasSlot",
    "ConstInfo",
    "ConstView",
    "DimRef",
    "Dims",
    "EvaluationError",
    "Handler",
    "HeadAxis",
    "INTERFACE",
    "Item",
    "KeepView",
    "LIVE",
    "Lookup",
    "MaxOf",
    "OpNode",
    "Opaque",
    "PROOF",
    "Prod",
    "Quantized",
    "Reader",
    "Reason",
    "RewriteView",
    "ShapeView",
    "SymValue",
    "WeightAxes",
    "broadcast_items",
    "compress",
    "elementwise_dims",
    "evaluate",
    "evaluate_op",
    "expand_to",
    "facts",
    "handler_for",
    "handler_for_op",
    "item_deps",
    "item_size",
    "items_equal",
    "lookup",
    "max_item",
    "opaque",
    "opaque_value",
    "own_axes",
    "pattern",
    "product_item",
    "register",
    "registered_ops",
    "shape_operands",
    "sized_dims",
    "static_batch1",
]

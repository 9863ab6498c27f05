"""Op handlers, one module per op family. Every module in this package is imported here, so a
new module registers its handlers by being in the package (onnxshrink/core/handler.py says what
a handler declares; docs/architecture.md, "Adding an op", walks through one).

Code above the ops asks for handlers through this package, which guarantees they are registered:
`lookup(opset)` for the analysis (with its fallback for ops no handler claims), `facts` and
`handler_for_op` for static facts of an ONNX node.
"""

import importlib
import pkgutil

from onnxshrink.core.registry import (
    facts,
    handler_for,
    handler_for_op,
    is_constant_node,
    registered_ops,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["facts", "handler_for", "handler_for_op", "is_constant_node", "registered_ops"]

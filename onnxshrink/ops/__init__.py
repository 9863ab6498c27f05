"""Op handlers, one module per op family. Every module in this package is imported here, so a
new module registers its handlers by being in the package (see contract.py for what a handler
declares, and the README's "Adding an op")."""

import importlib
import pkgutil

from onnxshrink.ops.contract import Handler, OpNode, WeightAxes
from onnxshrink.ops.registry import (
    facts,
    handler_for,
    handler_for_op,
    lookup,
    register,
    registered_ops,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "Handler",
    "OpNode",
    "WeightAxes",
    "facts",
    "handler_for",
    "handler_for_op",
    "lookup",
    "register",
    "registered_ops",
]

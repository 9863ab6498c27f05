"""Op handlers, one module per op family; importing this package registers them all."""

from onnxshrink.ops import concat, conv, elementwise, linear, norm, pool, reduce, reshape, spatial  # noqa: F401
from onnxshrink.ops.registry import Handler, handler_for, register, registered_ops

__all__ = ["Handler", "handler_for", "register", "registered_ops"]

"""onnxshrink: turn a masked (pruned) ONNX model into a physically smaller one that computes
exactly the same function, proven with onnxruntime."""

__version__ = "0.1.0"

from onnxshrink.api import ShrinkResult, shrink  # noqa: E402
from onnxshrink.errors import ShrinkError, ValidationFailed  # noqa: E402
from onnxshrink.export import export_and_shrink  # noqa: E402

__all__ = [
    "ShrinkError",
    "ShrinkResult",
    "ValidationFailed",
    "__version__",
    "export_and_shrink",
    "shrink",
]

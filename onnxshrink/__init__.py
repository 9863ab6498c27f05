"""onnxshrink: turn a masked (pruned) ONNX model into a physically smaller one that computes
exactly the same function, proven with onnxruntime.

    result = onnxshrink.shrink("model.onnx", "masks.pt", "small.onnx")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public names and the module each lives in: imported on first use, so that `onnxshrink --help`
# does not load onnx, onnxruntime or the op handlers.
_PUBLIC = {
    "shrink": "onnxshrink.api",
    "ShrinkResult": "onnxshrink.result",
    "ShrinkOptions": "onnxshrink.options",
    "ShrinkError": "onnxshrink.errors",
    "ValidationFailed": "onnxshrink.errors",
    "export_and_shrink": "onnxshrink.export",
}

if TYPE_CHECKING:
    from onnxshrink.api import shrink
    from onnxshrink.errors import ShrinkError, ValidationFailed
    from onnxshrink.export import export_and_shrink
    from onnxshrink.options import ShrinkOptions
    from onnxshrink.result import ShrinkResult


# Subpackages the README uses as `onnxshrink.NAME.f(...)` after a plain `import onnxshrink`.
_SUBMODULES = ("prune", "options")


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"onnxshrink.{name}")
    raise AttributeError(f"module 'onnxshrink' has no attribute {name!r}")


__all__ = [
    "ShrinkError",
    "ShrinkOptions",
    "ShrinkResult",
    "ValidationFailed",
    "__version__",
    "export_and_shrink",
    "shrink",
]

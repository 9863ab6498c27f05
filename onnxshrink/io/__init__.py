"""Reading models and masks files, writing models."""

from onnxshrink.io.masks import load_masks_file
from onnxshrink.io.model import load_model, save_model

__all__ = ["load_masks_file", "load_model", "save_model"]

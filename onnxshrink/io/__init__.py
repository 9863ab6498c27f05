"""Reading models and masks, writing models."""

from onnxshrink.io.masks import read_masks
from onnxshrink.io.model import load_model, save_model

__all__ = ["load_model", "read_masks", "save_model"]

"""Prepare the reference model for the analysis: shapes (`shapes`), the gs graph (`graph`),
untied shared initializers (`tie`)."""

from onnxshrink.prepare.graph import prepare
from onnxshrink.prepare.shapes import FLOAT_TYPES, default_opset, inferred_shapes, skeleton
from onnxshrink.prepare.tie import retie, untie

__all__ = ["FLOAT_TYPES", "default_opset", "inferred_shapes", "prepare", "retie", "skeleton", "untie"]

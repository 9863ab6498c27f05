"""Random ops: not functions of their inputs. Barriers that are never folded to a constant."""

from __future__ import annotations

from onnxshrink.core import Handler, register
from onnxshrink.ops.oracle import declare_cases


@register(
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
)
class Random(Handler):
    deterministic = False
    draws_random = True


declare_cases(excluded=dict.fromkeys(
    ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"),
    "not a function of its inputs",
))

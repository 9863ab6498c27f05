"""Random ops: not functions of their inputs. Barriers that are never folded to a constant."""

from __future__ import annotations

from onnxshrink.core import Handler, register


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

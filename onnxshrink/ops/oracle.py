"""The replay oracle's cases, declared by the op modules: for each registered op, a random
single-node graph (or the reason it has none), which tests/test_replay_oracle.py and
tools/oracle.py run the handler's rule on and compare with the replay of the node.

An op module declares its ops' cases once, at its end: `declare_cases({op: maker},
excluded={op: reason})`. A maker writes one graph in ONNX text: the op's data inputs are graph
inputs (live, lower-case names), its weights and parameters initializers (capitalized: random,
some slices zeroed, as masks leave them), with random shapes, attributes and opset; plus what a
consumer reads of each output (random subsets of indices). The helpers here draw and write what
every maker needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: the header of a graph with onnxruntime's contrib ops
MS_HEADER = '<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>\n'
#: the header of a graph of opset 23 (the ONNX Attention and RotaryEmbedding)
OPSET23 = '<ir_version: 10, opset_import: ["" : 23]>\n'


#: what a consumer reads of each output: {output: {axis: indices}}
Needs = dict[str, dict[int, list[int]]]


@dataclass
class OracleCase:
    """One random graph of an op, for the oracle."""

    op: str
    text: str  # the graph in ONNX text (onnxshrink.testing.model_from_text)
    opset: int
    zero: dict[str, Any] = field(default_factory=dict)  # initializer -> index expression set to 0
    values: dict[str, Any] = field(default_factory=dict)  # initializers given exactly (arrays, numbers)
    needs: Needs = field(default_factory=dict)  # output -> {axis: indices a consumer reads}
    node_op: str = ""  # the node under test (when the graph has helpers)


#: an op's case maker: its op type and a random generator -> a case
CaseMaker = Callable[[str, np.random.Generator], OracleCase]

_MAKERS: dict[str, CaseMaker] = {}
_EXCLUDED: dict[str, str] = {}


def declare_cases(
    makers: Mapping[str, CaseMaker] | None = None, excluded: Mapping[str, str] | None = None
) -> None:
    """Declare the oracle's case maker of each op in `makers`, and why each op in `excluded` has
    none (nothing in it to draw at random and compare, or another test checks it). An op is
    declared once, by the module that handles it."""
    makers, excluded = makers or {}, excluded or {}
    for op in [*makers, *excluded]:
        if op in _MAKERS or op in _EXCLUDED:
            raise ValueError(f"{op}'s oracle case is already declared")
    _MAKERS.update(makers)
    _EXCLUDED.update(excluded)


def case_ops() -> list[str]:
    """The ops with a case (declared by the op modules: import onnxshrink.ops first)."""
    return sorted(_MAKERS)


def excluded_ops() -> dict[str, str]:
    """The ops without a case, and why."""
    return dict(_EXCLUDED)


def oracle_case(op: str, seed: int) -> OracleCase:
    """A random single-node graph of `op` (KeyError for an op without a case)."""
    made = _MAKERS[op](op, np.random.default_rng(seed))
    made.node_op = op
    return made


# ------------------------------------------------------------------ drawing and writing
def _dims(shape: list[int]) -> str:
    return ", ".join(str(d) for d in shape)


def sig(
    inputs: list[tuple[str, str, list[int]]], outputs: list[tuple[str, list[int]]], out_type: str = "float"
) -> str:
    """A graph's signature in ONNX text: its (name, type, shape) inputs and (name, shape)
    outputs, all of `out_type`."""
    ins = ", ".join(f"{t}[{_dims(s)}] {n}" for n, t, s in inputs)
    outs = ", ".join(f"{out_type}[{_dims(s)}] {n}" for n, s in outputs)
    return f"g ({ins}) => ({outs})"


def needs(rng: np.random.Generator, name: str, shape: list[int]) -> Needs:
    """What a consumer reads of output `name`: a random non-empty subset of each axis of more
    than one index."""
    out: dict[int, list[int]] = {}
    for a, n in enumerate(shape):
        if n > 1 and rng.random() < 0.7:
            out[a] = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
    return {name: out} if out else {}


def zero_rows(rng: np.random.Generator, n: int) -> list[int]:
    """Random indices of an axis of `n` to zero (up to half of them, maybe none)."""
    return sorted(rng.choice(n, size=int(rng.integers(0, max(1, n // 2) + 1)), replace=False).tolist())


def layout_dims(rng: np.random.Generator) -> tuple[int, int, int]:
    """The channels, height and width of a layout op's input [1, c, h, w]."""
    return int(rng.choice([2, 4, 6])), 2, 3

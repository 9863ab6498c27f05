"""The replay as an oracle for every handler (models/oracle.py): random single-node graphs of
every registered op, as its op module declares them (onnxshrink/ops/oracle.py: random shapes,
attributes, opsets, masks, and what a consumer reads of the outputs); the handler's rule must
keep every input index the replay finds a kept output depends on. Keeping more is imprecision
(tools/oracle.py counts it); keeping less is a bug."""

import os

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from models.oracle import compare
from onnxshrink.core import registry
from onnxshrink.core.handler import Handler
from onnxshrink.core.views import KeepView
from onnxshrink.ops import registered_ops
from onnxshrink.ops.oracle import case_ops, excluded_ops, oracle_case

SEEDS = int(os.environ.get("ONNXSHRINK_ORACLE_SEEDS", "3"))
# Boolean outputs change only on values random draws never hit (equality, infinities): the
# replay cannot judge what they depend on, and says so.
BOOLEAN_OUTPUTS = {"Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "IsInf", "IsNaN"}


def test_every_registered_op_has_a_case_or_a_stated_reason():
    assert set(case_ops()) | set(excluded_ops()) == set(registered_ops())
    assert not set(case_ops()) & set(excluded_ops())


@pytest.mark.parametrize("op", case_ops())
def test_the_rule_keeps_what_the_replay_finds_needed(op):
    for seed in range(SEEDS):
        found = compare(oracle_case(op, seed))
        assert found.judged == (op not in BOOLEAN_OUTPUTS), f"{op} seed {seed}"
        assert not found.missing, f"{op} seed {seed}: the rule drops needed indices {found.missing}"
        assert set(found.rule) == set(found.replay)


def test_the_oracle_catches_a_rule_that_keeps_too_little():
    class Broken(Handler):  # ties nothing: every input index looks unneeded
        def keep(self, node: gs.Node, ks: KeepView) -> None:
            ks.demand(node.inputs[0], pin=False)

    saved = registry._REGISTRY.pop(("", "Softsign"))
    registry.register("Softsign")(Broken)
    try:
        found = compare(oracle_case("Softsign", 0))
    finally:
        registry._REGISTRY[("", "Softsign")] = saved
    assert found.missing  # e.g. {("x", 1): [0, 1, ...]}
    assert all(np.asarray(v).size for v in found.missing.values())

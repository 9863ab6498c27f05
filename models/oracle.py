"""The replay as an oracle for a handler's rule: on one of the random single-node graphs the op
modules declare (onnxshrink/ops/oracle.py), run the handler's rule and replay the node with the
kept sets of its outputs; the rule must keep every input index the replay finds needed.
tests/test_replay_oracle.py and tools/oracle.py run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxshrink.ops.oracle import OracleCase


@dataclass
class Comparison:
    """The rule's kept indices against the replay's needed ones, per live input axis."""

    case: OracleCase
    rule: dict[tuple[str, int], list[int]]  # (input, axis) -> kept by the rule
    replay: dict[tuple[str, int], list[int]]  # (input, axis) -> needed by the replay
    judged: bool = True  # False: an output the draws cannot judge (boolean): nothing compared

    @property
    def missing(self) -> dict[tuple[str, int], list[int]]:
        """Needed indices the rule does not keep: a bug in the rule."""
        out = {}
        for key, need in self.replay.items():
            lost = sorted(set(need) - set(self.rule[key]))
            if lost:
                out[key] = lost
        return out

    @property
    def extra(self) -> int:
        """Indices the rule keeps beyond what the replay finds needed (imprecision, not a bug)."""
        return sum(len(set(self.rule[k]) - set(v)) for k, v in self.replay.items())


def compare(c: OracleCase) -> Comparison:
    """Run the handler's rule on the case (its data inputs free: what the node demands shows in
    their kept sets) and replay the node with the kept sets of its outputs."""
    from onnxshrink.analyze.replay import replay
    from onnxshrink.testing import analyze_node, model_from_text

    model = model_from_text(c.text, opset=c.opset, values=c.values, zero=c.zero)
    bench = analyze_node(model, needs=c.needs, free_inputs=True)
    ks = bench.analysis.keep
    # the node under test (not the Gathers `needs` adds after it)
    [node] = [
        n for n in bench.analysis.graph.nodes
        if n.op == c.node_op and not any("__needs_" in t.name for t in n.inputs if t is not None)
    ]  # fmt: skip
    inputs, live, axes, fixed = [], [], {}, {}
    for i, t in enumerate(node.inputs):
        value = ks.value(t) if t is not None and t.name else None
        floating = t is not None and t.dtype is not None and np.issubdtype(np.dtype(t.dtype), np.floating)
        if value is not None or not floating:
            shape = [d if isinstance(d, int) else 1 for d in (t.shape or [])] if t is not None else []
            inputs.append(np.asarray(value) if value is not None else np.zeros(shape, np.dtype(t.dtype)) > 0)
            live.append(False)
        else:
            inputs.append(np.zeros(t.shape, np.dtype(t.dtype)))
            live.append(True)
            axes[i] = list(range(len(t.shape)))
            if ks.const(t) is not None:
                fixed[i] = (ks.const(t).mask, ks.const(t).value)
    found = replay(node, inputs, live, axes, bench.analysis.opset, fixed=fixed)
    kept = [
        [ks.kept(y, b) for b in range(len(y.shape or []))] if ks.exists(y) else None
        for y in node.outputs
    ]
    rule, need = {}, {}
    if not all(found.judged[o] for o, k in enumerate(kept) if k is not None):
        return Comparison(c, rule, need, judged=False)
    for i, probed in axes.items():
        name = node.inputs[i].name
        for a in probed:
            k = ks.kept(node.inputs[i], a)
            rule[(name, a)] = np.flatnonzero(k).tolist() if k is not None else list(range(node.inputs[i].shape[a]))
            need[(name, a)] = np.flatnonzero(found.needed(i, a, kept)).tolist()
    return Comparison(c, rule, need)

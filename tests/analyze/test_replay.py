"""The replay (analyze/replay.py): what a node's outputs depend on, read off onnxruntime runs;
ops without a rule shrink through it where it proves they act per channel; --analysis replay."""

import contextlib

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from conftest import export_cached, params, shapes, shrink_checked, tiny

from models.zoo import ZOO, choose_kept, randomize, zero_groups
from onnxshrink import shrink
from onnxshrink.analyze.replay import commutes, replay
from onnxshrink.core import registry
from onnxshrink.testing import analyze_node


def lone(op: str, shape=(1, 4, 3, 3), **attrs) -> gs.Node:
    x, y = gs.Variable("x", np.float32, list(shape)), gs.Variable("y", np.float32, list(shape))
    return gs.Node(op, attrs=attrs, inputs=[x], outputs=[y])


@contextlib.contextmanager
def without_rule(op: str):
    """The registry as if no handler knew `op` (to replay an op the rules know)."""
    saved = registry._REGISTRY.pop(("", op))
    try:
        yield
    finally:
        registry._REGISTRY[("", op)] = saved


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize(
    "op, attrs", [("Relu", {}), ("Shrink", {"lambd": 5.0}), ("Clip", {}), ("Softsign", {})]
)
def test_an_elementwise_op_depends_on_each_channel_alone(op, attrs):
    # Shrink's flat region is |x| < 5: only the large draws leave it; one element per slice.
    node = lone(op, shape=(1, 6), **attrs)
    found = replay(node, [np.zeros((1, 6), np.float32)], [True], {0: [1]}, 17)
    np.testing.assert_array_equal(found.relation[(0, 1)][0][1], np.eye(6, dtype=bool))


def test_a_channel_mixing_op_depends_on_every_channel():
    found = replay(lone("LpNormalization", axis=1), [np.zeros((1, 4, 3, 3), np.float32)], [True], {0: [1, 2]}, 17)
    assert found.relation[(0, 1)][0][1].all()  # every output channel on every input channel
    np.testing.assert_array_equal(found.relation[(0, 2)][0][2], np.eye(3, dtype=bool))  # rows alone


def test_constant_elements_are_never_redrawn():
    # Channel 2 of the input is a constant: no output depends on it changing.
    mask = np.zeros((1, 4, 1, 1), bool)
    mask[0, 2] = True
    found = replay(lone("Relu"), [np.zeros((1, 4, 3, 3), np.float32)], [True], {0: [1]}, 17,
                   fixed={0: (mask, np.full((1, 4, 1, 1), 0.5, np.float32))})
    assert found.relation[(0, 1)][0][1].diagonal().tolist() == [True, True, False, True]
    assert not found.depends[0][0, 2].any() and found.depends[0][0, 1].all()


def test_slicing_commutes_with_a_per_channel_op_and_not_with_one_that_regroups():
    x = np.zeros((1, 6, 2, 2), np.float32)
    assert commutes(lone("Softsign", shape=(1, 6, 2, 2)), [x], [True], [0], 1, 17)
    # DepthToSpace's output channel c is built from input channels c, c+C, ...: removing an
    # input channel does not remove an output channel.
    d2s = gs.Node("DepthToSpace", attrs={"blocksize": 2}, inputs=[gs.Variable("x", np.float32, [1, 8, 2, 2])],
                  outputs=[gs.Variable("y", np.float32, [1, 2, 4, 4])])
    assert not commutes(d2s, [np.zeros((1, 8, 2, 2), np.float32)], [True], [0], 1, 17)


# ------------------------------------------------------------------ ops with no rule
BETWEEN = """
agraph (float[1, 3, 6, 6] x, float[6, 3, 3, 3] W1, float[6] B1, float[4, 6, 1, 1] W2, float[4] B2) => (float[1, 4, 6, 6] y)
{{
  a = Conv <pads = [1, 1, 1, 1]> (x, W1, B1)
  s = {op} (a)
  y = Conv (s, W2, B2)
}}
"""
DEAD = {"W1": np.s_[[1, 4]], "B1": np.s_[[1, 4]]}


def test_an_op_without_a_rule_that_acts_per_channel_passes_channels_through():
    model = tiny(BETWEEN.format(op="Shrink <lambd = 0.5>"), zero=DEAD)
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 3, 3, 3)
    assert shapes(result.model)["W2"] == (4, 4, 1, 1)
    [found] = result.replayed
    assert found["op"] == "Shrink" and "axis [1, 2, 3] pass(es) through" in found["finding"]
    assert not result.barriers


def test_a_channel_mixing_op_without_a_rule_keeps_its_channels():
    # LpNormalization over channels, its rule removed: the replay sees every output channel
    # depend on every input channel, so channel 1 and 4 stay (their zeros change the norm).
    with without_rule("LpNormalization"):
        result = shrink_checked(tiny(BETWEEN.format(op="LpNormalization <axis = 1>"), zero=DEAD))
        assert shapes(result.model)["W1"] == (6, 3, 3, 3)
        [found] = result.replayed
        assert found["op"] == "LpNormalization" and "axis [2, 3] pass(es) through" in found["finding"]
        [kept] = [g for g in result.kept_zeroed if g.tensor == "W1"]
        assert kept.count == 2 and "mixes the indices of this axis" in kept.reason


def test_a_removed_rule_is_found_again_by_the_replay():
    # Softsign's rule removed: the replay alone shrinks through it, to what the rule gives.
    model = tiny(BETWEEN.format(op="Softsign"), zero=DEAD)
    with_rule = shrink_checked(model)
    with without_rule("Softsign"):
        replayed = shrink_checked(model)
    assert params(replayed.model) == params(with_rule.model) < params(model)
    assert [r["op"] for r in replayed.replayed] == ["Softsign"]


def test_an_op_of_a_domain_onnxruntime_does_not_know_stays_a_barrier():
    text = BETWEEN.format(op="custom.Mystery").replace("agraph", "agraph").strip()
    model = tiny('<ir_version: 8, opset_import: ["" : 17, "custom" : 1]>\n' + text, zero=DEAD)
    result = shrink(model, validate=False)
    assert shapes(result.model)["W1"] == (6, 3, 3, 3)
    [mystery] = [b for b in result.barriers if b["op"] == "Mystery"]  # (the Conv after it: no shapes)
    assert "no handler" in mystery["reason"]
    assert not result.replayed


# ------------------------------------------------------------------ --analysis replay
@pytest.mark.parametrize("name", ["resnet_basic", "mobilenetv2", "densenet", "inception", "resnext"])
def test_replay_mode_reaches_the_rules_on_the_zoo(zoo_dir, name):
    entry = ZOO[name]

    def masked():
        model = randomize(entry.build(), seed=1)
        zero_groups(model, choose_kept(model, 0.5, seed=2))
        return model, entry.input_shape, {"dynamic_batch": False}

    path = export_cached(zoo_dir, (name, "masked", 0.5, False), masked)
    rules = shrink_checked(path)
    replayed = shrink_checked(path, analysis="replay")
    assert replayed.after.params == rules.after.params < rules.before.params


def test_replay_mode_explains_a_kept_channel_by_the_output_that_needs_it():
    bench = analyze_node(BETWEEN.format(op="Relu"), zero={"W2": np.s_[:, [4]]}, analysis="replay")
    assert bench.kept("a", 1) == [0, 1, 2, 3, 5]  # W2 does not read channel 4
    why = bench.why("a", 1)
    assert why[0].startswith("replaying an unnamed Conv node shows that a kept output depends on it: ")
    # The 5 channels the rule needs were redrawn together (one run): the reason says so, and
    # which output index that run changed (output channel 0 of y reads them all).
    assert why[0].endswith(
        ": redrawn together with the 4 other slices its rule needs, output 'y' index 0 (axis 1) changes"
    )
    assert bench.why("a", 1)[4] is None


# ------------------------------------------------------------------ the replay's cost
def test_a_scalar_output_is_replayed():
    # Every element of x reaches the sum; the output has no axis for the relation to project on.
    x, y = gs.Variable("x", np.float32, [1, 3, 2]), gs.Variable("y", np.float32, [])
    node = gs.Node("ReduceSum", attrs={"keepdims": 0}, inputs=[x], outputs=[y])
    found = replay(node, [np.zeros((1, 3, 2), np.float32)], [True], {0: [1, 2]}, 17)
    assert found.depends[0].shape == () and bool(found.depends[0])
    assert found.relation[(0, 1)] == [[]] and found.relation[(0, 2)] == [[]]


def test_a_scalar_output_with_no_rule_keeps_the_channels_it_sums():
    text = BETWEEN.replace("float[1, 4, 6, 6] y", "float y").replace(
        "y = Conv (s, W2, B2)", "y = ReduceSum <keepdims = 0> (s)"
    )
    with without_rule("ReduceSum"):
        result = shrink_checked(tiny(text.format(op="Relu"), zero=DEAD))
    # The sum mixes every channel: the replay finds no axis it passes through.
    assert shapes(result.model)["W1"] == (6, 3, 3, 3)
    [found] = result.replayed
    assert found["op"] == "ReduceSum" and "it mixes every axis; kept whole" in found["finding"]


def test_copies_in_one_session_find_what_single_runs_find(monkeypatch):
    # The same node replayed with one run per probe and with up to 32 probes per run (copies
    # of the node side by side): the same relation, the same outputs.
    from onnxshrink.analyze import replay as engine

    node = lone("LpNormalization", shape=(1, 80, 3, 2), axis=1)
    mask = np.zeros((1, 80, 1, 1), bool)
    mask[0, ::3] = True
    fixed = {0: (mask, np.full(mask.shape, 0.25, np.float32))}
    x = np.zeros((1, 80, 3, 2), np.float32)
    found = {}
    for below in (0.0, 1.0):  # runs under `below` seconds get copies: never, always
        monkeypatch.setattr(engine, "_BATCH_BELOW", below)
        monkeypatch.setattr(engine, "_RUNNERS", engine.OrderedDict())
        monkeypatch.setattr(engine, "_REPLAYS", engine.OrderedDict())
        found[below] = replay(node, [x], [True], {0: [1, 2, 3]}, 17, fixed=fixed)
        [runner] = engine._RUNNERS.values()
        assert runner.copies == (1 if below == 0.0 else 32)
        assert (runner._many is not None) == (below == 1.0)  # 53 probes a draw: one group
    for key, rel in found[0.0].relation.items():
        for per_output, again in zip(rel, found[1.0].relation[key], strict=True):
            for r, s in zip(per_output, again, strict=True):
                np.testing.assert_array_equal(r, s)
    np.testing.assert_array_equal(found[0.0].depends[0], found[1.0].depends[0])
    np.testing.assert_array_equal(found[0.0].outputs[0], found[1.0].outputs[0])
    assert not found[0.0].relation[(0, 1)][0][1][::3].any()  # constant channels: never redrawn
    assert found[0.0].relation[(0, 1)][0][1][1].all()  # the norm: every channel on every other


def test_a_node_is_run_in_one_session_and_a_second_replay_runs_nothing(monkeypatch):
    from onnxshrink.analyze import replay as engine

    monkeypatch.setattr(engine, "_RUNNERS", engine.OrderedDict())
    monkeypatch.setattr(engine, "_REPLAYS", engine.OrderedDict())
    monkeypatch.setattr(engine, "_KERNELS", {})
    sessions, runs = [], [0]
    make, run = engine._session, engine.NodeRunner.run
    monkeypatch.setattr(engine, "_session", lambda model, *weights: sessions.append(model) or make(model, *weights))

    def counted(self, inputs):
        runs[0] += 1
        return run(self, inputs)

    monkeypatch.setattr(engine.NodeRunner, "run", counted)
    node = lone("Softsign", shape=(1, 5, 2, 2))
    x = np.zeros((1, 5, 2, 2), np.float32)
    first = replay(node, [x], [True], {0: [1]}, 17)
    built, ran = len(sessions), runs[0]
    # Softsign has no float64 kernel: the check's session fails; then the float32 one (5
    # probes a draw: too few for a session of copies).
    assert built == 2 and ran > 0
    again = replay(lone("Softsign", shape=(1, 5, 2, 2)), [x], [True], {0: [1]}, 17)
    assert again is first and len(sessions) == built and runs[0] == ran
    # Known slices are not probed: their rows stay empty; the others are as before.
    known = np.array([True, False, True, False, False])
    part = replay(node, [x], [True], {0: [1]}, 17, enough=lambda *_: False, known={(0, 1): known})
    assert len(sessions) == built
    np.testing.assert_array_equal(part.relation[(0, 1)][0][1], np.diag(~known))
    np.testing.assert_array_equal(first.relation[(0, 1)][0][1], np.eye(5, dtype=bool))


# ------------------------------------------------------------------ presumed slices
def test_a_presumed_set_that_reaches_is_kept_whole_and_the_rest_probed_alone():
    # Relu over 6 channels, only output channel 2 kept. Presumed {1, 2, 3}: redrawn together
    # they reach channel 2, so all three are kept (1 and 3 only with 2: the safe direction).
    # The slices not presumed are probed alone, in every draw, as without `presumed`.
    from onnxshrink.analyze.replay import reaches

    kept = [[None, np.arange(6) == 2]]
    x = np.zeros((1, 6), np.float32)

    def run(presumed):
        return replay(lone("Relu", shape=(1, 6)), [x], [True], {0: [1]}, 17, whole=False,
                      enough=lambda i, a, rows: reaches(rows, kept), presumed=presumed)  # fmt: skip

    alone, grouped = run(None), run({(0, 1): np.isin(np.arange(6), [1, 2, 3])})
    assert alone.needed(0, 1, kept).tolist() == [False, False, True, False, False, False]
    assert grouped.needed(0, 1, kept).tolist() == [False, True, True, True, False, False]
    for j in (0, 4, 5):  # probed alone: the same rows, from the same draws
        np.testing.assert_array_equal(grouped.relation[(0, 1)][0][1][j], alone.relation[(0, 1)][0][1][j])
    # Presumed wrongly ({0, 4}: they reach no kept index): the set does not reach, so each is
    # probed alone and found unneeded; channel 2, not presumed, is found needed alone.
    wrong = run({(0, 1): np.isin(np.arange(6), [0, 4])})
    assert wrong.needed(0, 1, kept).tolist() == [False, False, True, False, False, False]


def test_a_slice_whose_change_shows_in_one_draw_only_is_found_beside_a_presumed_set():
    # Shrink's flat region is |x| < 5: a redraw changes its output only where a draw leaves it
    # (the large draws). Channel 5 is not presumed: it must still be found needed.
    from onnxshrink.analyze.replay import reaches

    kept = [[None, np.ones(6, bool)]]
    found = replay(lone("Shrink", shape=(1, 6), lambd=5.0), [np.zeros((1, 6), np.float32)], [True],
                   {0: [1]}, 17, whole=False, enough=lambda i, a, rows: reaches(rows, kept),
                   presumed={(0, 1): np.arange(6) < 5})  # fmt: skip
    assert found.needed(0, 1, kept).tolist() == [True] * 6
    # Presumed {0, 5}, only output channel 5 kept: in a draw where the pair redrawn together
    # stays in the flat region, each is probed alone; channel 5 is found in a large draw (and
    # 0 kept with it, as the pair reached together there).
    kept = [[None, np.arange(6) == 5]]
    found = replay(lone("Shrink", shape=(1, 6), lambd=5.0), [np.zeros((1, 6), np.float32)], [True],
                   {0: [1]}, 17, whole=False, enough=lambda i, a, rows: reaches(rows, kept),
                   presumed={(0, 1): np.isin(np.arange(6), [0, 5])})  # fmt: skip
    assert found.needed(0, 1, kept).tolist() == [True] + [False] * 4 + [True]


def test_replay_mode_redraws_the_slices_the_rule_needs_together(monkeypatch):
    # The second Conv reads 5 of its 6 input channels (W2's column 4 is masked); channel 1 is
    # constant (W1's row 1 and B1[1] masked). The replay keeps what the rules keep; the shrunk
    # model, run here, matches the input with the masks applied by numpy.
    from onnxshrink.analyze import replay as engine

    probed, together = [], []
    probe, joint = engine._probe, engine._together
    monkeypatch.setattr(engine, "_probe", lambda *a: probed.append(a[5].tolist()) or probe(*a))
    monkeypatch.setattr(engine, "_together", lambda *a: together.append(a[5].tolist()) or joint(*a))
    model = tiny(BETWEEN.format(op="Relu"))
    masks = {"W1": np.ones((6, 3, 3, 3)), "B1": np.ones(6), "W2": np.ones((4, 6, 1, 1))}
    masks["W1"][1] = masks["B1"][1] = masks["W2"][:, 4] = 0
    rules = shrink_checked(model, masks=masks)
    replayed = shrink_checked(model, masks=masks, analysis="replay")
    assert shapes(replayed.model)["W1"] == shapes(rules.model)["W1"] == (4, 3, 3, 3)
    assert shapes(replayed.model)["W2"] == shapes(rules.model)["W2"] == (4, 4, 1, 1)
    # The second Conv: its 4 live channels the rule reads in one joint run (it reaches);
    # channel 4, which the rule lets go, probed alone in each of the 6 draws (found unneeded).
    assert together == [[0, 2, 3, 5]] and probed == [[4]] * 6



def test_a_piecewise_op_in_replay_mode_keeps_every_channel_it_passes_on():
    # Clip's flat regions: output channels of a Clip(-0.1, 0.1) change only where a draw
    # crosses its bounds. Replayed, the kept channels are the rules' and the shrunk model,
    # validation off, computes what the input with its masks (numpy) computes.
    text = BETWEEN.format(op="Clip").replace("s = Clip (a)", "s = Clip (a, lo, hi)").replace(
        "float[4] B2)", "float[4] B2, float lo, float hi)"
    )
    model = tiny(text, values={"lo": np.float32(-0.1), "hi": np.float32(0.1)})
    masks = {"W2": np.ones((4, 6, 1, 1))}
    masks["W2"][:, [0, 3]] = 0
    rules = shrink_checked(model, masks=masks)
    replayed = shrink_checked(model, masks=masks, analysis="replay")
    assert shapes(replayed.model) == shapes(rules.model)
    assert shapes(replayed.model)["W1"] == (4, 3, 3, 3) and shapes(replayed.model)["W2"] == (4, 4, 1, 1)


def test_the_caches_hold_within_a_shrink_and_are_freed_after_it(monkeypatch):
    # Two Softsign nodes alike (no rule: replayed): one session for both within the shrink;
    # when shrink returns no session is held.
    from onnxshrink.analyze import replay as engine

    sessions = []
    monkeypatch.setattr(engine, "_KERNELS", {})
    make = engine._session
    monkeypatch.setattr(engine, "_session", lambda model, *weights: sessions.append(model) or make(model, *weights))
    text = BETWEEN.format(op="Softsign").replace("y = Conv (s, W2, B2)", "t = Softsign (s)\n  y = Conv (t, W2, B2)")
    with without_rule("Softsign"):
        result = shrink_checked(tiny(text, zero=DEAD))
    assert [r["op"] for r in result.replayed] == ["Softsign", "Softsign"]
    assert shapes(result.model)["W1"] == (4, 3, 3, 3)
    # Softsign has no float64 kernel: the check's session fails, then the float32 one, which
    # both nodes share (the commutes checks slice an axis: sessions of their own shapes).
    whole = [m for m in sessions if [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [1, 6, 6, 6]]
    assert len(whole) == 2
    assert not engine._RUNNERS and not engine._REPLAYS and not engine._COMMUTES


def test_a_large_weight_is_keyed_by_its_array_and_handed_to_onnxruntime_as_it_lies(monkeypatch):
    # A conv's weights of 64 KiB or more key its session by the array object (not a hash of
    # its bytes) and are not serialized into its model: the same array, one session; an
    # equal copy, a session of its own; the same relation from both, and the same outputs as
    # a model that holds the weights.
    from onnx import helper, numpy_helper

    from onnxshrink.analyze import replay as engine

    monkeypatch.setattr(engine, "_RUNNERS", engine.OrderedDict())
    monkeypatch.setattr(engine, "_REPLAYS", engine.OrderedDict())
    sessions = []
    make = engine._session
    monkeypatch.setattr(engine, "_session", lambda model, *weights: sessions.append(model) or make(model, *weights))
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 32, 3, 3)).astype(np.float32)  # 73,728 bytes
    w[:, 5] = 0  # input channel 5 reaches no output
    x = gs.Variable("x", np.float32, [1, 32, 5, 5])
    node = gs.Node("Conv", attrs={"pads": [1, 1, 1, 1]}, inputs=[x, gs.Constant("w", w)],
                   outputs=[gs.Variable("y", np.float32, [1, 64, 5, 5])])  # fmt: skip
    feed = np.zeros((1, 32, 5, 5), np.float32)
    first = replay(node, [feed, w], [True, False], {0: [1]}, 17)
    built = len(sessions)
    assert replay(node, [feed, w], [True, False], {0: [1]}, 17) is first and len(sessions) == built
    weights = [t for m in sessions for t in m.graph.initializer]  # (the kernel check feeds all)
    assert weights and all(not t.raw_data and t.data_location == 1 for t in weights)  # handed
    again = replay(node, [feed, w.copy()], [True, False], {0: [1]}, 17)
    assert len(sessions) > built and again is not first
    reach = first.relation[(0, 1)][0][1]
    np.testing.assert_array_equal(reach, again.relation[(0, 1)][0][1])
    assert not reach[5].any() and reach[np.arange(32) != 5].all()
    # The runner's outputs: those of the same kernel in a model that holds the weights.
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
        [helper.make_tensor_value_info("x", 1, [1, 32, 5, 5])], [helper.make_tensor_value_info("y", 1, None)],
        [numpy_helper.from_array(w, "w")],
    )  # fmt: skip
    held = make(helper.make_model(graph, ir_version=8))  # the same session options, weights held
    value = rng.standard_normal((1, 32, 5, 5)).astype(np.float32)
    [runner] = [r for r in engine._RUNNERS.values() if r.key == engine._digest(node, [feed, w], [True, False], 17)]
    np.testing.assert_array_equal(runner.run([value, w])[0], held.run(None, {"x": value})[0])


def test_an_array_identity_is_never_given_to_another_array():
    from onnxshrink.analyze import replay as engine

    seen = set()
    for _ in range(50):  # arrays made and freed in turn often reuse an address
        a = np.zeros(1 << 15)
        number = engine._identity(a)
        assert number is not None and number not in seen and engine._identity(a) == number
        seen.add(number)
        del a
    assert len(engine._IDENTITIES) < 50  # entries go with their arrays


def test_a_replay_with_nothing_to_probe_runs_nothing_more(monkeypatch):
    # Every slice known (kept already): no draw and no run beyond the one that gives the
    # outputs' shapes; the relation has the shapes of a replay that ran, and no dependence.
    from onnxshrink.analyze import replay as engine

    monkeypatch.setattr(engine, "_RUNNERS", engine.OrderedDict())
    runs = [0]
    run = engine.NodeRunner.run

    def counted(self, inputs):
        runs[0] += 1
        return run(self, inputs)

    monkeypatch.setattr(engine.NodeRunner, "run", counted)
    node = lone("Softsign", shape=(1, 5, 2, 2))  # one form: float32 (no float64 kernel)
    x = np.zeros((1, 5, 2, 2), np.float32)
    found = replay(node, [x], [True], {0: [1]}, 17, enough=lambda *_: False,
                   known={(0, 1): np.ones(5, bool)}, whole=False)  # fmt: skip
    assert runs[0] == 1
    assert [r.shape for r in found.relation[(0, 1)][0]] == [(5, 1), (5, 5), (5, 2), (5, 2)]
    assert not any(r.any() for r in found.relation[(0, 1)][0]) and not found.depends[0].any()
    probed = replay(node, [x], [True], {0: [1]}, 17, enough=lambda *_: False, whole=False)
    assert runs[0] > 1 and probed.relation[(0, 1)][0][1].tolist() == np.eye(5, dtype=bool).tolist()

"""Binding masks to initializers (by name and through Identity aliases) and applying them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import CONV2, error_against, init, params, tiny

from onnxshrink import shrink
from onnxshrink.bind import BoundMasks, apply_masks, bind_masks
from onnxshrink.errors import ShrinkError

# Older exporters read weights through Identity nodes; the mask may name the Identity output.
ALIASED = """
g (float[1,3,8,8] x, float[6,3,3,3] W1, float[6] B1, float[4,6,1,1] W2, float[4] B2)
  => (float[1,4,8,8] y) {
  w1 = Identity(W1)
  b1 = Identity(B1)
  xi = Identity(x)
  h = Conv<pads=[1,1,1,1]>(xi, w1, b1)
  r = Relu(h)
  y = Conv(r, W2, B2)
}
"""
FLAGS = np.array([1, 0, 1, 0, 1, 1], np.float32)
KEEP = np.flatnonzero(FLAGS)


def w1_mask(flags=FLAGS) -> np.ndarray:
    return np.broadcast_to(np.asarray(flags, np.float32).reshape(6, 1, 1, 1), (6, 3, 3, 3)).copy()


@pytest.fixture
def model() -> onnx.ModelProto:
    return tiny(CONV2, seed=31)


@pytest.fixture
def aliased() -> onnx.ModelProto:
    return tiny(ALIASED, seed=31)


def message(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    assert exc.value.exit_code == 2
    return text


# ------------------------------------------------------------------ binding
def test_exact_names_bind(model):
    bound = bind_masks(model, {"W1": w1_mask(), "B1": FLAGS})
    assert isinstance(bound, BoundMasks)
    assert sorted(bound.masks) == ["B1", "W1"]
    assert bound.unbound == []
    assert bound.masks["W1"].shape == (6, 3, 3, 3)
    np.testing.assert_array_equal(bound.masks["W1"], w1_mask())
    np.testing.assert_array_equal(bound.masks["B1"], FLAGS)


def test_identity_alias_binds_to_the_initializer(aliased):
    bound = bind_masks(aliased, {"w1": w1_mask(), "b1": FLAGS})
    assert sorted(bound.masks) == ["B1", "W1"]
    assert bound.unbound == []
    np.testing.assert_array_equal(bound.masks["W1"], w1_mask())

    result = shrink(aliased, {"w1": w1_mask(), "b1": FLAGS})
    assert result.masks_bound == 2
    assert params(result.model) == params(aliased) - 2 * (27 + 1 + 4)
    np.testing.assert_array_equal(init(result.model, "W1"), init(aliased, "W1")[KEEP])


def test_identity_of_a_graph_input_is_not_an_alias(aliased):
    bound = bind_masks(aliased, {"xi": np.ones((1, 3, 8, 8))}, allow_unbound=True)
    assert bound.masks == {}
    assert bound.unbound == ["xi"]


def test_alias_and_name_masks_of_one_initializer_multiply(aliased):
    by_name = w1_mask([0, 1, 1, 1, 1, 1])
    by_alias = w1_mask([1, 1, 0, 1, 1, 1])
    bound = bind_masks(aliased, {"W1": by_name, "w1": by_alias})
    assert list(bound.masks) == ["W1"]
    rows = bound.masks["W1"].reshape(6, -1).min(axis=1)
    assert rows.tolist() == [0, 1, 0, 1, 1, 1]
    assert int(bound.masks["W1"].sum()) == 4 * 27


def test_unbound_masks_are_listed_in_order_with_allow_unbound(model):
    masks = {"x": np.ones(3), "W1": w1_mask(), "conv9.weight": np.ones(2), "r": np.ones(1)}
    bound = bind_masks(model, masks, allow_unbound=True)
    assert bound.unbound == ["x", "conv9.weight", "r"]  # graph input, unknown, intermediate
    assert list(bound.masks) == ["W1"]


def test_unbound_masks_are_refused_by_default_naming_them(model):
    with pytest.raises(ShrinkError) as info:
        bind_masks(model, {"W1": w1_mask(), "conv9.weight": np.ones(2)}, source="m.pt")
    text = message(info)
    assert text.startswith("m.pt: 1 mask(s) match no initializer of the model: 'conv9.weight'.")
    assert "the model has e.g. 'W1', 'B1', 'W2', 'B2'" in text
    assert "--allow-unbound" in text


def test_many_unbound_masks_are_counted(model):
    masks = {f"layer{i}.weight": np.ones(1) for i in range(13)}
    with pytest.raises(ShrinkError) as info:
        bind_masks(model, masks, source="big.npz")
    text = message(info)
    assert text.startswith("big.npz: 13 mask(s) match no initializer")
    assert "'layer9.weight' and 3 more." in text
    assert "'layer10.weight'" not in text


@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, np.nan])
def test_non_binary_mask_is_refused_naming_it(model, bad):
    mask = w1_mask()
    mask[4, 1, 2, 0] = bad
    with pytest.raises(ShrinkError) as info:
        bind_masks(model, {"B1": FLAGS, "W1": mask}, source="s.safetensors")
    text = message(info)
    assert text.startswith("s.safetensors: mask 'W1' holds ")
    assert str(bad) in text
    assert "masks must be 0/1 (or boolean)" in text


@pytest.mark.parametrize(
    "shape",
    [(3, 6, 3, 3), (6, 3, 3), (5,), (6, 1), (), (1, 3, 3, 3)],
)
def test_mask_of_wrong_shape_is_refused_naming_both_shapes(model, shape):
    with pytest.raises(ShrinkError) as info:
        bind_masks(model, {"W1": np.ones(shape)}, source="k.pt")
    assert message(info).startswith(
        f"k.pt: mask 'W1' has shape {list(shape)} but initializer 'W1' has shape [6, 3, 3, 3]."
    )


def test_per_output_channel_mask_is_broadcast(model):
    bound = bind_masks(model, {"W1": FLAGS, "W2": np.array([1, 1, 0, 1])})
    assert bound.masks["W1"].shape == (6, 3, 3, 3)
    np.testing.assert_array_equal(bound.masks["W1"], w1_mask())
    assert bound.masks["W2"].shape == (4, 6, 1, 1)
    assert bound.masks["W2"].reshape(4, -1).min(axis=1).tolist() == [1, 1, 0, 1]
    assert bound.masks["W2"].reshape(4, -1).max(axis=1).tolist() == [1, 1, 0, 1]


def test_bool_mask_is_accepted(model):
    bound = bind_masks(model, {"W1": w1_mask().astype(bool), "B1": FLAGS.astype(bool)})
    assert bound.masks["W1"].dtype == np.uint8
    assert int(bound.masks["W1"].sum()) == 4 * 27
    assert bound.masks["B1"].tolist() == [1, 0, 1, 0, 1, 1]


# ------------------------------------------------------------------ applying
def test_apply_multiplies_exactly_and_leaves_the_rest_untouched(model):
    original = model.SerializeToString()
    mask = (np.random.default_rng(0).random((6, 3, 3, 3)) < 0.5).astype(np.float32)
    ref = apply_masks(model, bind_masks(model, {"W1": mask}))

    assert model.SerializeToString() == original  # the input model is not modified
    w = init(model, "W1")
    got = init(ref, "W1")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, w * mask)
    assert int(np.count_nonzero(got)) == int(mask.sum())
    before = {t.name: t.SerializeToString() for t in model.graph.initializer}
    after = {t.name: t.SerializeToString() for t in ref.graph.initializer}
    assert list(after) == ["W1", "B1", "W2", "B2"]
    for name in ("B1", "W2", "B2"):
        assert after[name] == before[name]
    assert [n.SerializeToString() for n in ref.graph.node] == [
        n.SerializeToString() for n in model.graph.node
    ]


def test_apply_per_channel_and_alias_masks(aliased):
    ref = apply_masks(aliased, bind_masks(aliased, {"w1": FLAGS, "b1": FLAGS}))
    np.testing.assert_array_equal(init(ref, "W1"), init(aliased, "W1") * w1_mask())
    np.testing.assert_array_equal(init(ref, "B1"), init(aliased, "B1") * FLAGS)
    np.testing.assert_array_equal(init(ref, "W2"), init(aliased, "W2"))


def test_apply_keeps_float16_and_zeroes_non_finite_weights():
    model = tiny(
        "g (float16[1,4] x, float16[4,3] W) => (float16[1,3] y) { y = MatMul(x, W) }",
        values={"W": [[1, np.inf, 2], [np.nan, 3, -4], [5, 6, 7], [-8, 9, np.nan]]},
    )
    mask = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 1], [1, 1, 0]], np.uint8)
    got = init(apply_masks(model, bind_masks(model, {"W": mask})), "W")
    assert got.dtype == np.float16
    # masked entries are exactly 0 even where the weight was inf or nan (0 * inf is nan)
    np.testing.assert_array_equal(
        got, np.array([[1, 0, 2], [0, 3, -4], [5, 6, 7], [-8, 9, 0]], np.float16)
    )


def test_apply_without_masks_returns_the_model_itself(model):
    assert apply_masks(model, BoundMasks()) is model
    assert apply_masks(model, bind_masks(model, {"x": np.ones(1)}, allow_unbound=True)) is model


# ------------------------------------------------------------------ layouts from the graph
def named(model: onnx.ModelProto, *names: str) -> onnx.ModelProto:
    """Give the nodes legacy-exporter names, which carry their module scope."""
    for node, name in zip(model.graph.node, names, strict=True):
        node.name = name
    return model


SQUARE = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], np.uint8)  # output 0 masked


@pytest.mark.parametrize(
    "text, name, zeroed",
    [
        # MatMul's B is [in, out]: a Linear weight ([out, in]) stored for it is transposed.
        ("y = MatMul(x, V3)", "/fc/MatMul", (slice(None), 0)),
        # Gemm says with transB how B is stored.
        ("y = Gemm<transB=1>(x, V3)", "/fc/Gemm", (0, slice(None))),
        ("y = Gemm<transB=0>(x, V3)", "/fc/Gemm", (slice(None), 0)),
    ],
)
def test_a_square_weight_takes_the_mask_the_way_its_reader_stores_it(text, name, zeroed):
    model = named(tiny(f"g (float[1,4] x, float[4,4] V3) => (float[1,4] y) {{ {text} }}", seed=3), name)
    [b] = bind_masks(model, {"fc.weight": SQUARE}).bindings
    assert b.how == "scope"
    expected = np.ones((4, 4), np.uint8)
    expected[zeroed] = 0
    np.testing.assert_array_equal(b.values, expected)


@pytest.mark.parametrize(
    "text, axis",
    [
        ("y = MatMul(x, W)", 1),  # [in, out] as named (a Keras kernel): flags along the outputs
        ("wt = Transpose(W)\n y = MatMul(x, wt)", 0),  # stored [out, in], transposed in the graph
        ("y = Gemm<transB=1>(x, W)", 0),
    ],
)
def test_per_output_flags_follow_the_reader_not_the_shape(text, axis):
    model = tiny(f"g (float[1,4] x, float[4,4] W) => (float[1,4] y) {{ {text} }}", seed=3)
    [b] = bind_masks(model, {"W": np.array([1, 0, 1, 1])}).bindings
    assert b.how == "name"
    assert np.flatnonzero(b.values.min(axis=1 - axis)).tolist() == [0, 2, 3]
    assert b.values.max(axis=axis).tolist() == [1, 1, 1, 1]


def test_per_output_flags_on_a_matrix_no_op_gives_roles_are_refused():
    model = tiny("g (float[4,4] x, float[4,4] W) => (float[4,4] y) { y = Mul(x, W) }", seed=3)
    with pytest.raises(ShrinkError) as info:
        bind_masks(model, {"W": np.array([1, 0, 1, 1])}, source="f.pt")
    text = message(info)
    assert "'W'" in text and "says which axis holds its output channels" in text


def test_a_mask_of_the_transposed_shape_is_not_transposed_by_guess(model):
    with pytest.raises(ShrinkError, match=r"mask 'W2' has shape \[1, 1, 6, 4\]"):
        bind_masks(model, {"W2": np.ones((1, 1, 6, 4))})


# ------------------------------------------------------------------ the reference
def masked_conv2(flags) -> onnx.ModelProto:
    zero = np.flatnonzero(np.asarray(flags) == 0)
    return tiny(CONV2, seed=31, zero={"W1": zero, "B1": zero})


def test_masks_the_model_already_holds_leave_it_as_the_reference():
    model = masked_conv2(FLAGS)
    result = shrink(model, {"W1": w1_mask(), "B1": FLAGS})
    assert result.input_masked is True
    assert result.reference is model
    assert params(result.model) == params(model) - 2 * (27 + 1 + 4)


def test_masks_of_an_unmasked_model_are_applied():
    model = tiny(CONV2, seed=31)
    result = shrink(model, {"W1": w1_mask(), "B1": FLAGS})
    assert result.input_masked is False
    np.testing.assert_array_equal(init(result.reference, "W1"), init(model, "W1") * w1_mask())


def test_a_mask_the_masked_model_contradicts_is_refused_with_what_it_would_change():
    model = masked_conv2(FLAGS)  # filters 1 and 3 zeroed
    other = np.array([1, 1, 0, 0, 1, 1], np.float32)  # filters 2 and 3: 2 would change
    with pytest.raises(ShrinkError) as info:
        shrink(model, {"W1": w1_mask(other)})
    text = message(info)
    assert "'W1' (initializer 'W1') would change 27 of the 54 weights it masks" in text
    assert "the other 27 are already zero" in text and "--unmasked-input" in text
    # The user says it is a further round of masking: applied.
    result = shrink(model, {"W1": w1_mask(other)}, input_masked=False)
    assert result.input_masked is False
    assert params(result.model) == params(model) - 3 * (27 + 1 + 4)


def test_masks_some_of_which_the_model_holds_and_some_not_are_refused():
    model = masked_conv2(FLAGS)
    w2 = np.ones((4, 6, 1, 1), np.float32)
    w2[1] = 0  # not zero in the model
    with pytest.raises(ShrinkError) as info:
        shrink(model, {"W1": w1_mask(), "W2": w2})
    text = message(info)
    assert "1 mask(s) do not match the model: 'W2'" in text
    assert "already holds the zeros of 1 other mask(s)" in text


# A learned scalar (a layer scale: a 0-d initializer) with a mask of its own shape, as a pruner
# writes one for every parameter: the mask stays 0-d (it was made 1-d once, and checking it
# against the model failed with "cannot broadcast a non-scalar to a scalar array", exit 3).
SCALED = """
g (float[1,3,8,8] x, float[6,3,3,3] W1, float[6] B1, float S, float[4,6,1,1] W2, float[4] B2)
  => (float[1,4,8,8] y) {
  h = Conv<pads=[1,1,1,1]>(x, W1, B1)
  s = Mul(h, S)
  r = Relu(s)
  y = Conv(r, W2, B2)
}
"""


@pytest.mark.parametrize(
    "one", [np.array(1.0, np.float32), np.float32(1.0), np.array(True), 1.0], ids=["0-d", "numpy scalar", "bool", "float"]
)
def test_a_mask_on_a_scalar_initializer_binds_in_every_form(one):
    zero = np.flatnonzero(FLAGS == 0)
    model = tiny(SCALED, seed=31, zero={"W1": zero, "B1": zero}, values={"S": 1.5})
    result = shrink(model, {"W1": w1_mask(), "B1": FLAGS, "S": one}, validate=False)
    assert result.input_masked is True and result.reference is model
    assert params(result.model) == params(model) - 2 * (27 + 1 + 4)
    assert error_against(model, result.model) <= 1e-5


def test_a_zero_mask_on_a_scalar_initializer_is_applied():
    model = tiny(SCALED, seed=31, values={"S": 1.5})
    result = shrink(model, {"S": np.array(0.0, np.float32)}, validate=False, input_masked=False)
    assert init(result.reference, "S").shape == () and init(result.reference, "S") == 0
    # y = W2 relu(0 * h) + B2 = B2: every channel of h is a constant (0), one is left (a tensor
    # keeps one channel), with S, W2's column for it and B2
    assert params(result.model) == (27 + 1) + 1 + 4 + 4
    assert error_against(result.reference, result.model) == 0

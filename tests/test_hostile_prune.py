"""--prune and its options given hostile values through the real command line: exit 2 with one
line naming the option or file and what to do, nothing written (not even --masks-out), no
input changed; or exit 0 with a model that matches the input with the written masks applied."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from conftest import WIDE, WIDE_BEFORE, cli, error_against, params, snapshot, tiny
from onnx import numpy_helper
from test_user_errors import check_refused, custom_op_model


@pytest.fixture
def wide(tmp_path):
    onnx.save(tiny(WIDE, seed=11), tmp_path / "m.onnx")
    return tmp_path


def _feed(**arrays) -> dict:
    return arrays


@pytest.mark.parametrize(
    "arrays, culprit",
    [
        # the input's rank and channel count differ
        (_feed(x=np.ones((1, 3, 8, 8), np.float32)), "array 'x' has shape [1, 3, 8, 8]"),
        (_feed(x=np.ones((1, 16, 8, 8), np.int64)), "array 'x' is int64"),
        (_feed(y=np.ones((1, 16, 8, 8), np.float32)), "holds 'y', which is not a model input"),
    ],
    ids=["shape", "dtype", "name"],
)
def test_activation_inputs_that_do_not_fit_the_model(wide, arrays, culprit):
    np.savez(wide / "in.npz", **arrays)
    before = snapshot(wide)
    p = cli(
        "m.onnx", "--prune", "0.5", "--criterion", "activation", "--inputs", "in.npz",
        "-o", "out.onnx", "--masks-out", "masks.npz", cwd=wide,
    )  # fmt: skip
    check_refused(p, "in.npz", culprit)
    assert snapshot(wide) == before


def test_masks_out_is_not_written_when_the_shrink_is_refused(tmp_path):
    onnx.save(custom_op_model(), tmp_path / "m.onnx")  # onnxruntime cannot run its MyScale
    before = snapshot(tmp_path)
    p = cli("m.onnx", "--prune", "0.5", "-o", "out.onnx", "--masks-out", "masks.npz", cwd=tmp_path)
    check_refused(p, "my.ops:MyScale")
    assert snapshot(tmp_path) == before


def test_masks_out_without_prune_is_refused(wide):
    before = snapshot(wide)
    p = cli("m.onnx", "-o", "out.onnx", "--masks-out", "masks.npz", cwd=wide)
    check_refused(p, "--masks-out masks.npz", "--prune")
    assert snapshot(wide) == before


def test_masks_out_with_an_upper_case_suffix_is_written_where_named(wide):
    """numpy appends .npz to a name not ending in it: 'masks.NPZ' became 'masks.NPZ.npz'."""
    p = cli("m.onnx", "--prune", "0.5", "-o", "out.onnx", "--masks-out", "masks.NPZ", cwd=wide)
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in wide.iterdir()) == ["m.onnx", "masks.NPZ", "out.onnx"]
    # the masks are those of the pruned model: the input with them applied computes its outputs
    reference = onnx.load(wide / "m.onnx")
    masks = np.load(wide / "masks.NPZ")
    for t in reference.graph.initializer:
        if t.name in masks.files:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * masks[t.name], t.name))
    small = onnx.load(wide / "out.onnx")
    assert params(small) == WIDE_BEFORE - 32 * (16 * 9 + 1 + 32)  # half of W1's 64 filters
    assert error_against(reference, small) < 1e-5


@pytest.mark.parametrize(
    "option, culprit",
    [
        (["--seed", "-5"], "--seed -5"),  # numpy's generator refused it: exit 3
        (["--rtol", "-1"], "--rtol -1.0"),  # failed every proof: exit 1, "error (relative 0)"
        (["--rtol", "nan"], "--rtol nan"),
        (["--atol", "inf"], "--atol inf"),  # proved nothing: exit 0
    ],
)
@pytest.mark.parametrize("prune", [True, False], ids=["prune", "shrink"])
def test_seed_and_tolerances_that_cannot_mean_anything(wide, option, culprit, prune):
    args = ["--prune", "0.5", "--criterion", "random"] if prune else []
    before = snapshot(wide)
    p = cli("m.onnx", *args, *option, "-o", "out.onnx", cwd=wide)
    check_refused(p, culprit)
    assert snapshot(wide) == before


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        ({"seed": -1}, "seed=-1"),
        ({"rtol": float("nan")}, "rtol=nan"),
        ({"atol": -0.5}, "atol=-0.5"),
    ],
)
def test_the_api_refuses_them_too_before_any_work(kwargs, culprit):
    from onnxshrink import shrink
    from onnxshrink.errors import ShrinkError
    from onnxshrink.prune import prune

    model = tiny(WIDE, seed=12)
    for call in (
        lambda: shrink(model, **kwargs),
        lambda: prune(model, 0.5, criterion="random", **kwargs),
    ):
        with pytest.raises(ShrinkError, match=culprit):
            call()


def test_groups_alone_with_an_output_is_refused(wide):
    """--groups without --prune writes no model: -o was ignored in silence."""
    before = snapshot(wide)
    p = cli("m.onnx", "--groups", "groups.json", "-o", "out.onnx", cwd=wide)
    check_refused(p, "-o out.onnx", "--prune")
    assert snapshot(wide) == before


@pytest.mark.parametrize(
    "args, why",
    [
        (["--prune", "0.5", "--ignore", "*"], "every layer matched --ignore *"),
        (["--prune", "0"], "--prune 0.0 of each layer rounds to none"),
    ],
)
def test_a_prune_that_removes_nothing_says_so(wide, args, why):
    p = cli("m.onnx", *args, "-o", "out.onnx", cwd=wide)
    assert p.returncode == 0, p.stderr
    assert f"[W] nothing was pruned ({why})" in p.stdout
    assert params(onnx.load(wide / "out.onnx")) == WIDE_BEFORE


EMBED = """
g (int64[1,4] ids, float[16,8] E, float[8,12] W1, float[12,6] W2) => (float[1,4,6] y) {
  e = Gather(E, ids)
  h = MatMul(e, W1)
  r = Relu(h)
  y = MatMul(r, W2)
}
"""


def test_activation_inputs_the_model_cannot_run_on(tmp_path):
    """A token id past the vocabulary: onnxruntime's Gather refused it inside the activation
    pass, an internal error (the proof already named --inputs for the same arrays)."""
    onnx.save(tiny(EMBED, seed=13), tmp_path / "m.onnx")
    np.savez(tmp_path / "ids.npz", ids=np.array([[1, 2, 99, 3]], np.int64))
    before = snapshot(tmp_path)
    p = cli(
        "m.onnx", "--prune", "0.5", "--criterion", "activation", "--inputs", "ids.npz",
        "-o", "out.onnx", "--masks-out", "masks.npz", cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    last = p.stderr.strip().splitlines()[-1]  # onnxruntime logs its own line before it
    assert last.startswith("[E] ids.npz: the model fails to run on these inputs"), last
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr
    assert snapshot(tmp_path) == before
    np.savez(tmp_path / "ids.npz", ids=np.array([[1, 2, 15, 3]], np.int64))  # in range: pruned
    p = cli(
        "m.onnx",
        "--prune",
        "0.5",
        "--criterion",
        "activation",
        "--inputs",
        "ids.npz",
        "-o",
        "out.onnx",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    # half of each layer: 4 of the 8 embedding channels, 6 of the 12 neurons
    assert params(onnx.load(tmp_path / "out.onnx")) == 16 * 4 + 4 * 6 + 6 * 6


def test_masks_out_that_cannot_be_written_leaves_no_model(wide):
    """The masks were written after the model: a place they could not go (a read-only
    directory) was exit 2 saying "Nothing was written" with the model written."""
    from test_user_errors import _no_permission_override

    (wide / "ro").mkdir()
    (wide / "ro").chmod(0o555)
    before = snapshot(wide)
    try:
        p = cli(
            "m.onnx", "--prune", "0.5", "-o", "out.onnx", "--masks-out", "ro/masks.npz",
            cwd=wide, preexec_fn=_no_permission_override,
        )  # fmt: skip
        check_refused(p, "cannot write ro/masks.npz (Permission denied)", "Nothing was written")
        assert snapshot(wide) == before and not (wide / "out.onnx").exists()
    finally:
        (wide / "ro").chmod(0o755)
    p = cli("m.onnx", "--prune", "0.5", "-o", "out.onnx", "--masks-out", "ro/masks.npz", cwd=wide)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(wide / "ro")) == [
        "masks.npz"
    ]  # staged beside it, renamed: no leftovers
    assert sorted(np.load(wide / "ro" / "masks.npz").files) == ["B1", "W1", "W2"]


@pytest.mark.parametrize("prune", [True, False], ids=["prune", "shrink"])
def test_input_shapes_too_large_for_memory(tmp_path, prune):
    """Validation inputs of 3.2 TB: numpy's MemoryError was an internal error (exit 3)."""
    dynamic = "g (float[N,8] x, float[8,6] W1, float[6,4] W2) => (float[N,4] y) {\n"
    onnx.save(
        tiny(dynamic + "  h = MatMul(x, W1)\n  r = Relu(h)\n  y = MatMul(r, W2)\n}", seed=14),
        tmp_path / "m.onnx",
    )
    before = snapshot(tmp_path)
    args = ["--prune", "0.5"] if prune else []
    p = cli("m.onnx", *args, "--input-shapes", "x:100000000000,8", "-o", "out.onnx", cwd=tmp_path)
    check_refused(p, "out of memory", "x:100000000000,8", "give smaller --input-shapes")
    assert snapshot(tmp_path) == before


def test_masks_out_covers_weights_held_by_constant_nodes(tmp_path):
    """Weights given as Constant nodes are pruned (the analysis sees them as initializers), but
    their masks were left out of --masks-out as if they were shared initializers."""
    rng = np.random.default_rng(15)
    w1, w2 = rng.standard_normal((6, 4, 1, 1)), rng.standard_normal((2, 6, 1, 1))

    def text(a, b):
        def const(v):
            return f"float[{','.join(map(str, v.shape))}] {{{','.join(f'{x:.6f}' for x in v.ravel())}}}"

        return (
            "g (float[1,4,8,8] x) => (float[1,2,8,8] y) {\n"
            f"  W1 = Constant<value={const(a)}>()\n  h = Conv(x, W1)\n  r = Relu(h)\n"
            f"  W2 = Constant<value={const(b)}>()\n  y = Conv(r, W2)\n}}"
        )

    onnx.save(tiny(text(w1, w2)), tmp_path / "m.onnx")
    p = cli("m.onnx", "--prune", "0.5", "-o", "out.onnx", "--masks-out", "masks.npz", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "no mask written" not in p.stdout
    masks = np.load(tmp_path / "masks.npz")
    assert sorted(masks.files) == ["W1", "W2"]
    assert masks["W1"].reshape(6, 4).all(axis=1).sum() == 3  # 3 of 6 filters kept
    # the input with the masks applied to its constants is the pruned model
    reference = tiny(text(w1 * masks["W1"], w2 * masks["W2"]))
    small = onnx.load(tmp_path / "out.onnx")
    assert params(small) == 3 * 4 + 2 * 3
    assert error_against(reference, small) < 1e-5

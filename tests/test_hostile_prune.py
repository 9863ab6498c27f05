"""--prune and its options given hostile values through the real command line: exit 2 with one
line naming the option or file and what to do, nothing written (not even --masks-out), no
input changed; or exit 0 with a model that matches the input with the written masks applied."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import WIDE, cli, snapshot, tiny
from test_user_errors import check_refused


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

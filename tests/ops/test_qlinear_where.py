"""QLinearWhere (ops/qlinear_where.py): channels pass through it like an elementwise op, and a
channel whose picked operands sit at their zero points leaves at the output's zero point, so the
integer product after it drops its column and the one before it its filter.

Each model is shrunk with validation off and compared here with the input in onnxruntime, bit
for bit (the outputs are uint8 codes).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import params, run, shapes, shrink_checked, tiny

# QLinearConv (3 -> 8) -> QLinearWhere(c, a, B) -> QLinearConv (8 -> 4), the condition a
# spatial mask (an input's channels are the model's interface: a condition as wide as the
# channels would keep them all, as an Add's live operand does). No value_info: onnx's shape
# inference knows no com.microsoft op, so z's shape comes from the handler's output_types.
WHERE_QOP = """<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (uint8[1, 3, 6, 6] x, bool[1, 1, 6, 6] c, int8[8, 3, 3, 3] Wq, float[8] Ws, int8[8] Wz,
   int32[8] Wb, uint8[8, 1, 1] Bq, float Bs, uint8 Bz, int8[4, 8, 1, 1] Fq, float[4] Fs,
   int8[4] Fz, int32[4] Fb, float Xs, uint8 Xz, float As, uint8 Az, float Zs, uint8 Zz,
   float Os, uint8 Oz) => (uint8[1, 4, 6, 6] y) {
  a = QLinearConv <pads = [1, 1, 1, 1]> (x, Xs, Xz, Wq, Ws, Wz, As, Az, Wb)
  z = com.microsoft.QLinearWhere (c, a, As, Az, Bq, Bs, Bz, Zs, Zz)
  y = QLinearConv (z, Zs, Zz, Fq, Fs, Fz, Os, Oz, Fb)
}"""

# The same with a constant condition C, one flag per channel.
WHERE_QOP_CONSTANT_CONDITION = WHERE_QOP.replace("bool[1, 1, 6, 6] c", "bool[1, 8, 1, 1] C").replace(
    "QLinearWhere (c,", "QLinearWhere (C,"
)


def where_values(dead_filters: list[int], zero_b: list[int], default: bool, seed: int = 21) -> dict:
    """W's `dead_filters` at their zero points with no bias, B's channels `zero_b` at B's zero
    point. `default`: zero points 0 and unit scales wherever onnxruntime allows them."""
    rng = np.random.default_rng(seed)
    wz = np.zeros(8, np.int64) if default else rng.integers(-3, 3, 8)
    wq, wb = rng.integers(-60, 60, (8, 3, 3, 3)), rng.integers(-300, 300, 8)
    wq[dead_filters], wb[dead_filters] = wz[dead_filters, None, None, None], 0
    bz = 0 if default else int(rng.integers(100, 150))
    bq = (bz + rng.integers(1, 256, (8, 1, 1))) % 256  # off the zero point...
    bq[zero_b] = bz  # ...but where asked
    scale = (lambda: 1.0) if default else (lambda: float(rng.uniform(0.02, 0.1)))
    point = (lambda: 0) if default else (lambda: int(rng.integers(100, 150)))
    return {
        "Wq": wq, "Ws": np.ones(8) * 0.01 if default else rng.uniform(0.005, 0.01, 8), "Wz": wz, "Wb": wb,
        "Bq": bq, "Bs": scale(), "Bz": bz,
        "Fq": rng.integers(-60, 60, (4, 8, 1, 1)), "Fs": rng.uniform(0.005, 0.01, 4),
        "Fz": np.zeros(4, np.int64) if default else rng.integers(-3, 3, 4), "Fb": rng.integers(-300, 300, 4),
        "Xs": scale(), "Xz": point(), "As": scale(), "Az": point(), "Zs": scale(), "Zz": point(),
        "Os": scale(), "Oz": point(),
    }  # fmt: skip


def same_codes(model, shrunk, constant_condition: bool = False, draws: int = 3) -> None:
    rng = np.random.default_rng(22)
    for _ in range(draws):
        feed = {"x": rng.integers(0, 256, (1, 3, 6, 6)).astype(np.uint8)}
        if not constant_condition:
            feed["c"] = rng.random((1, 1, 6, 6)) < 0.5
        assert np.array_equal(run(model, feed)[0], run(shrunk, feed)[0])


PER_FILTER = 27 + 3  # a W filter, its scale, zero point and bias
PER_CHANNEL = PER_FILTER + 1 + 4  # ... its B code and its F column


@pytest.mark.parametrize("default", [False, True])
def test_a_channel_at_both_zero_points_goes_through_qlinear_where(default):
    model = tiny(WHERE_QOP, values=where_values([2, 5], [2, 5], default))
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Wq"] == (6, 3, 3, 3) and s["Wb"] == s["Ws"] == (6,)
    assert s["Bq"] == (6, 1, 1) and s["Fq"] == (4, 6, 1, 1)
    assert s["Bs"] == s["Bz"] == s["Zs"] == ()  # per-tensor parameters stay whole
    assert params(result.model) == params(model) - 2 * PER_CHANNEL
    assert not result.barriers  # z's shape was known: the handler's output_types
    same_codes(model, result.model)


def test_a_channel_at_one_zero_point_under_a_live_condition_stays():
    # filter 2 is dead but B's channel 2 is not at its zero point: z's channel 2 depends on c
    model = tiny(WHERE_QOP, values=where_values([2, 5], [5], default=False))
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Bq"] == (7, 1, 1) and s["Fq"] == (4, 7, 1, 1)
    same_codes(model, result.model)


def test_a_constant_condition_picking_the_operand_at_its_zero_point_removes_the_channel():
    # channel 2: C picks a (filter 2 dead) while B's channel 2 is live; channel 5: C picks B
    # (at its zero point) while filter 5 is live. Both leave z at its zero point.
    values = where_values([2], [5], default=False)
    flags = np.random.default_rng(23).random((1, 8, 1, 1)) < 0.5
    flags[0, 2], flags[0, 5] = True, False
    model = tiny(WHERE_QOP_CONSTANT_CONDITION, values={**values, "C": flags})
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Fq"] == (4, 6, 1, 1) and s["Bq"] == (6, 1, 1) and s["C"] == (1, 6, 1, 1)
    assert s["Wq"] == (6, 3, 3, 3)  # neither filter is read any more
    same_codes(model, result.model, constant_condition=True)

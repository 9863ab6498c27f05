"""Random graphs in exporter forms (models/randgraph.py): shrunk, then checked independently.

For ONNXSHRINK_RANDOM_GRAPHS seeds (default 300): build the seed's model (its masked channels
are zeros in its weights, so it is its own reference), `shrink(model, validate=False)`, and with
onnxruntime sessions of our own (one thread, no graph optimizations; not onnxshrink.validate)
check that the shrunk model loads and runs, has the same outputs (names, shapes, dtypes) and
matches on 2 random inputs (dynamic dims 2, then 3): max |shrunk - ref| <= 1e-5 * max |ref| per
float output, integer outputs equal; and that it has no more float parameters than the input.
An exception in shrink is a failure (the generator makes no bad input). A failing seed's model
is saved as $TMPDIR/onnxshrink_random/seed_N.onnx (and the shrunk one as seed_N.shrunk.onnx);
`python tools/sweep.py --start N --seeds 1` re-runs it, `python -m models.randgraph N` prints it.
"""

from __future__ import annotations

import os

import pytest

from models.randgraph import BATCHES, RTOL, check, save_failure

SEEDS = int(os.environ.get("ONNXSHRINK_RANDOM_GRAPHS", "300"))


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_graph(seed):
    out = check(seed)
    saved = f"model saved to {save_failure(out)}" if out.failure else ""
    where = f"seed {seed} (stages {out.info.get('stages')}, opset {out.info.get('opset')}, {saved})"
    assert out.failure != "generator", f"{where}: the generator failed: {out.detail}"
    raised = out.failure == "exception in shrink"
    assert not raised, f"{where}: shrink raised {out.detail}"
    assert len(out.diffs) == len(BATCHES), f"{where}: {out.failure}: {out.detail}"
    for k, draw in enumerate(out.diffs):
        assert len(draw) == len(out.info["outputs"]), f"{where}: draw {k}: outputs {[d.name for d in draw]}"
        for d in draw:
            what = f"{where}: output {d.name}, draw {k} (dynamic dims = {BATCHES[k]})"
            assert d.got_shape == d.ref_shape, f"{what}: shape {d.got_shape}, expected {d.ref_shape}"
            if d.exact:  # an integer output
                assert d.max_abs_err == 0, f"{what}: differs by up to {d.max_abs_err:g}"
            else:
                assert d.max_abs_err <= RTOL * d.max_ref, (
                    f"{what}: max |shrunk - ref| = {d.max_abs_err:.3g}, max |ref| = "
                    f"{d.max_ref:.3g}, relative error {d.rel_err:.3g} > {RTOL}"
                )
    assert out.params_after <= out.params_before, (
        f"{where}: float parameters grew from {out.params_before} to {out.params_after}"
    )
    assert out.failure is None, f"{where}: {out.failure}: {out.detail}"

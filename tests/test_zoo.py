"""End to end on the zoo: whole-group masks shrink to exactly the natively built model."""

import numpy as np
import onnx
import pytest
from conftest import error_against, export_cached, params, run, shrink_checked

from models.zoo import ZOO, choose_kept, native_widths, randomize, zero_groups
from onnxshrink import shrink


def masked_and_native(zoo_dir, name: str, fraction: float = 0.5, dynamic_batch: bool = False):
    entry = ZOO[name]

    def masked():
        model = randomize(entry.build(), seed=1)
        zero_groups(model, choose_kept(model, fraction, seed=2))
        return model, entry.input_shape, {"dynamic_batch": dynamic_batch}

    def native():
        kept = choose_kept(randomize(entry.build(), seed=1), fraction, seed=2)
        return randomize(entry.build(native_widths(kept)), seed=3), entry.input_shape, {}

    return (export_cached(zoo_dir, (name, "masked", fraction, dynamic_batch), masked),
            export_cached(zoo_dir, (name, "native", fraction), native))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_whole_group_masks_give_the_native_parameter_count(zoo_dir, name):
    masked, native = masked_and_native(zoo_dir, name)
    result = shrink_checked(masked)  # validation off; compared with the masked export here
    assert params(result.model) == result.after.params == params(onnx.load(native))
    assert result.after.params < 0.5 * result.before.params
    assert not result.barriers
    assert not result.kept_zeroed


@pytest.mark.parametrize("name", ["resnet_basic", "mobilenetv2", "densenet"])
def test_dynamic_batch_exports_shrink_the_same(zoo_dir, name):
    masked, native = masked_and_native(zoo_dir, name, dynamic_batch=True)
    shapes = {"x": [3, *ZOO[name].input_shape[1:]]}
    result = shrink(masked, input_shapes=shapes)
    assert params(result.model) == result.after.params == params(onnx.load(native))
    assert result.validation.input_shapes["x"][0] == 3  # the proof ran at the given batch
    assert result.validation.passed
    assert error_against(masked, result.model, shapes) <= 1e-5


def test_unmasked_model_is_left_as_it_is(zoo_dir):
    def plain():
        return randomize(ZOO["inception"].build(), seed=4), ZOO["inception"].input_shape, {}

    path = export_cached(zoo_dir, ("inception", "plain"), plain)
    result = shrink(path)
    assert result.after.params == result.before.params
    assert result.after.macs == result.before.macs
    x = np.random.default_rng(0).standard_normal(ZOO["inception"].input_shape).astype(np.float32)
    a, b = run(onnx.load(path), {"x": x})[0], run(result.model, {"x": x})[0]
    assert np.array_equal(a, b)  # the same graph: the same outputs

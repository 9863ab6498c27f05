"""Library messages (onnx-graphsurgeon prints its warnings on stdout) go through logging:
nowhere by default, on stderr with -v; stdout holds the tool's own report."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import cli, init, run
from onnx import TensorProto, helper, numpy_helper


def test_library_messages_stay_off_stdout_and_show_with_verbose(tmp_path):
    """A bf16 weight makes onnx-graphsurgeon print "Could not convert: BFLOAT16" (and that
    `colored` is missing) on stdout; they go through logging: nowhere by default, on stderr
    with -v."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 3, 3, 3)).astype(np.float32)
    w[[1, 3]] = 0
    bf16 = TensorProto(name="Wb", dims=list(w.shape), data_type=TensorProto.BFLOAT16)
    bf16.raw_data = (w.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    w2 = numpy_helper.from_array(rng.standard_normal((4, 6, 1, 1)).astype(np.float32), "W2")
    nodes = [
        helper.make_node("Cast", ["Wb"], ["W1"], to=TensorProto.FLOAT),
        helper.make_node("Conv", ["x", "W1"], ["h"], pads=[1] * 4),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Conv", ["r", "W2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", 1, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", 1, [1, 4, 8, 8])], [bf16, w2],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")

    p = cli("m.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    assert all(line.startswith(("[I]", "[W]", "|", "+", "Time:")) for line in p.stdout.splitlines())
    assert "BFLOAT16" not in p.stdout and "colored" not in p.stdout
    small = onnx.load(tmp_path / "out.onnx")
    assert init(small, "W2").shape == (4, 4, 1, 1)  # the bf16 filters 1 and 3 went
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(small, {"x": x})[0], run(model, {"x": x})[0], rtol=1e-5, atol=1e-5)

    p = cli("m.onnx", "-v", cwd=tmp_path)
    assert p.returncode == 0
    assert "[W] (onnx_graphsurgeon) Could not convert: BFLOAT16" in p.stderr
    assert "BFLOAT16" not in p.stdout


def test_onnxruntime_error_log_stays_off_the_terminal_and_shows_with_verbose(tmp_path):
    """A reference that fails to run (Range with a zero step, whatever the input) makes
    onnxruntime log its error on stderr from C++ before the exception reaches the tool: only the
    tool's own message is shown; onnxruntime's lines with -v."""
    consts = [numpy_helper.from_array(np.float32(v), n) for n, v in (("zero", 0), ("start", 0), ("stop", 10))]
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "zero"], ["z"]), helper.make_node("Range", ["start", "stop", "z"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])], consts,
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    p = cli("m.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert p.returncode == 2
    [line] = p.stderr.splitlines()
    assert line.startswith("[E] the reference model (the input, masks applied) fails to run")
    assert "delta in Range operator can not be zero" in line
    verbose = cli("m.onnx", "-o", "out.onnx", "-v", cwd=tmp_path)
    assert verbose.returncode == 2
    assert "[E:onnxruntime:" in verbose.stderr
    assert not (tmp_path / "out.onnx").exists()

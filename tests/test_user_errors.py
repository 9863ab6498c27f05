"""User mistakes and hostile inputs through the real command line: each is exit 2 with one line
naming the file, tensor, option or node at fault and what to do; nothing is written, and nothing
outside the model's folder is opened (not even stat()ed, checked in-process)."""

from __future__ import annotations

import builtins
import ctypes
import os
import resource
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import CONV2, WIDE, cli, error_against, params, snapshot, tiny
from onnx import TensorProto, helper, numpy_helper

from onnxshrink.cli import main

# CONV2 with filters 1 and 3 of W1 and their biases zeroed: 196 -> 132 parameters.
ZEROED = {"W1": np.s_[[1, 3]], "B1": np.s_[[1, 3]]}


def check_refused(p, *culprits: str) -> None:
    """Exit 2, one line on stderr naming every culprit, no traceback."""
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith("[E] ") and p.stderr.strip().count("\n") == 0, p.stderr
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr
    for text in culprits:
        assert text in p.stderr, p.stderr


# ------------------------------------------------------------------ external data out of the folder
def external(model: onnx.ModelProto, name: str, location: str) -> bytes:
    """Make initializer `name` refer to external data at `location` (in place); its bytes."""
    t = next(t for t in model.graph.initializer if t.name == name)
    raw = numpy_helper.to_array(t).tobytes()
    t.ClearField("raw_data")
    del t.float_data[:]
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(len(raw)))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return raw


@pytest.fixture
def outside(tmp_path) -> tuple[Path, Path]:
    """A model folder, and beside it a folder holding a file the test owns (W1's true bytes),
    its access time set before its modification time so that a read would update it."""
    folder, away = tmp_path / "model", tmp_path / "away"
    folder.mkdir()
    away.mkdir()
    return folder, away


LOCATIONS = {
    "dotdot": lambda folder, away: "../away/w1.bin",
    "deep-dotdot": lambda folder, away: "sub/../../away/w1.bin",
    "absolute": lambda folder, away: str(away / "w1.bin"),
    "etc-passwd": lambda folder, away: "/etc/passwd",
    "symlink-out": lambda folder, away: _link(folder / "w1.bin", away / "w1.bin"),
    "relative-symlink-out": lambda folder, away: _link(folder / "w1.bin", Path("../away/w1.bin")),
}


def _link(link: Path, target: Path) -> str:
    link.symlink_to(target)
    return link.name


def _hostile_model(folder: Path, away: Path, case: str) -> tuple[str, Path]:
    model = tiny(CONV2, seed=1, zero=ZEROED)
    (folder / "sub").mkdir()
    location = LOCATIONS[case](folder, away)
    raw = external(model, "W1", location)
    owned = away / "w1.bin"
    owned.write_bytes(raw)
    onnx.save(model, folder / "m.onnx")
    return location, owned


def _read_would_show(path: Path) -> float:
    """Set the access time before the modification time, so that a read updates it (relatime)."""
    mtime = path.stat().st_mtime
    os.utime(path, (mtime - 86400 * 10, mtime))
    return path.stat().st_atime


@pytest.mark.parametrize("case", list(LOCATIONS))
def test_external_data_outside_the_folder_is_refused_unread(outside, case):
    folder, away = outside
    location, owned = _hostile_model(folder, away, case)
    before, before_away = snapshot(folder), snapshot(away)
    atime = _read_would_show(owned)

    p = cli("m.onnx", "-o", "out.onnx", cwd=folder)
    check_refused(p, f"m.onnx: tensor 'W1' keeps its data in '{location}'", "model's own folder")
    assert owned.stat().st_atime == atime  # the file outside was never read
    assert snapshot(folder) == before and snapshot(away) == before_away  # nothing written


@pytest.mark.parametrize("case", list(LOCATIONS))
def test_external_data_outside_the_folder_is_not_even_stat(outside, case, monkeypatch, capsys):
    """In-process, where every stat, lstat and open is seen: nothing under the outside folder
    is touched before the refusal (a subprocess cannot tell a stat apart)."""
    folder, away = outside
    _hostile_model(folder, away, case)
    touched: list[str] = []

    def watch(fn):
        def watched(path, *args, **kwargs):
            if isinstance(path, str | os.PathLike) and not isinstance(path, int):
                text = os.fspath(path)
                text = text.decode() if isinstance(text, bytes) else text
                if text == "/etc/passwd" or os.path.abspath(text).startswith(str(away)):
                    touched.append(f"{fn.__name__} {text}")
            return fn(path, *args, **kwargs)

        return watched

    for name in ("stat", "lstat", "open", "readlink"):
        monkeypatch.setattr(os, name, watch(getattr(os, name)))
    monkeypatch.setattr(builtins, "open", watch(builtins.open))
    monkeypatch.chdir(folder)
    assert main(["m.onnx", "-o", "out.onnx"]) == 2
    assert "only from the model's own folder" in capsys.readouterr().err
    assert touched == []


def test_external_data_in_a_subfolder_is_read(tmp_path):
    """A location inside the folder, even spelled with '..', is fine."""
    model = tiny(CONV2, seed=1, zero=ZEROED)
    reference = onnx.ModelProto()
    reference.CopyFrom(model)
    raw = external(model, "W1", "data/../data/w1.bin")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "w1.bin").write_bytes(raw)
    onnx.save(model, tmp_path / "m.onnx")
    p = cli("m.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    small = onnx.load(tmp_path / "out.onnx")
    assert params(small) == 132
    assert error_against(reference, small) <= 1e-5


# ------------------------------------------------------------------ damaged weights
def test_initializer_shorter_than_its_shape_is_named(tmp_path):
    model = tiny(CONV2, seed=1)
    w1 = next(t for t in model.graph.initializer if t.name == "W1")
    w1.raw_data = w1.raw_data[:40]
    onnx.save(model, tmp_path / "m.onnx")
    before = snapshot(tmp_path)
    p = cli("m.onnx", "-o", "out.onnx", cwd=tmp_path)
    check_refused(p, "m.onnx: initializer 'W1' holds 40 bytes", "[6, 3, 3, 3]", "needs 648", "re-export")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ where the output goes
def _no_permission_override() -> None:
    """preexec_fn: the command as a user whom directory permissions bind. Root ignores them
    (CAP_DAC_OVERRIDE): dropped from the capability bounding set, they are gone after exec."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_read_only_output_directory(tmp_path):
    onnx.save(tiny(CONV2, seed=1, zero=ZEROED), tmp_path / "m.onnx")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        p = cli("m.onnx", "-o", "ro/out.onnx", cwd=tmp_path, preexec_fn=_no_permission_override)
        out = tmp_path / "ro" / "out.onnx"
        check_refused(p, f"cannot write {out} (Permission denied): no permission", "write elsewhere")
        assert os.listdir(tmp_path / "ro") == []
        assert "[I] analyzing" not in p.stdout  # refused before any work
    finally:
        (tmp_path / "ro").chmod(0o755)


def _file_size_limit(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("external_data", [False, True], ids=["inline", "external-data"])
def test_disk_full_while_writing(tmp_path, external_data):
    """A write that fails midway (a file size limit: the same failure as a full disk), for the
    model file and for a streamed external data file: exit 2, nothing left behind."""
    if external_data:
        model = tiny(WIDE, seed=1, zero={"W1": np.s_[:8], "B1": np.s_[:8]})
        onnx.save_model(model, tmp_path / "m.onnx", save_as_external_data=True, size_threshold=0)
    else:
        onnx.save(tiny(CONV2, seed=1, zero=ZEROED), tmp_path / "m.onnx")
    (tmp_path / "out").mkdir()
    before = snapshot(tmp_path)
    p = cli("m.onnx", "-o", "out/small.onnx", cwd=tmp_path, preexec_fn=_file_size_limit(300))
    check_refused(p, "cannot write", str(tmp_path / "out"), "File too large", "Nothing was written")
    assert snapshot(tmp_path) == before


def test_disk_full_message_in_process(tmp_path, monkeypatch, capsys):
    """ENOSPC itself (what a full disk raises): exit 2 naming the output and what to do."""
    import errno

    model_path = tmp_path / "m.onnx"
    onnx.save(tiny(CONV2, seed=1, zero=ZEROED), model_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(onnx, "save_model", full)
    assert main([str(model_path), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"[E] cannot write {tmp_path / 'o.onnx'} (No space left on device): free some space on "
        "that disk or write elsewhere. Nothing was written.\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_output_that_is_not_a_regular_file_is_not_replaced(tmp_path):
    """-o naming a pipe (or a device such as /dev/full): refused, never renamed over."""
    onnx.save(tiny(CONV2, seed=1, zero=ZEROED), tmp_path / "m.onnx")
    os.mkfifo(tmp_path / "pipe")
    p = cli("m.onnx", "-o", "pipe", cwd=tmp_path)
    check_refused(p, "pipe: exists and is not a regular file", "choose a file path")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "pipe"]


# ------------------------------------------------------------------ options
def test_negative_input_shape(tmp_path):
    onnx.save(tiny(CONV2.replace("float[1,3,8,8] x", "float[1,3,H,W] x"), seed=1), tmp_path / "m.onnx")
    p = cli("m.onnx", "--input-shapes", "x:1,3,-8,8", "-o", "o.onnx", cwd=tmp_path)
    check_refused(p, "--input-shapes 'x:1,3,-8,8': dim -8 is not a size", "positive integer")
    assert os.listdir(tmp_path) == ["m.onnx"]


# ------------------------------------------------------------------ models onnxruntime refuses
def custom_op_model() -> onnx.ModelProto:
    model = tiny(CONV2, seed=1, zero=ZEROED)
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    relu.op_type, relu.domain, relu.name = "MyScale", "my.ops", "scale"
    model.opset_import.append(helper.make_opsetid("my.ops", 1))
    return model


def test_custom_op_onnxruntime_cannot_run(tmp_path):
    onnx.save(custom_op_model(), tmp_path / "m.onnx")
    p = cli("m.onnx", "-o", "out.onnx", cwd=tmp_path)
    check_refused(p, "m.onnx: onnxruntime has no kernel for my.ops:MyScale (node 'scale')", "--no-validate")
    assert "[I] analyzing" not in p.stdout  # refused before any work
    assert os.listdir(tmp_path) == ["m.onnx"]



def test_duplicate_node_names_are_named_apart(tmp_path):
    """onnx's checker accepts nodes that share a name, onnxruntime refuses them: the tool takes
    the model, says so, and writes nodes named apart."""
    model = tiny(CONV2, seed=1, zero=ZEROED)
    for n in model.graph.node:
        n.name = "same"
    onnx.checker.check_model(model)
    onnx.save(model, tmp_path / "m.onnx")
    p = cli("m.onnx", "-o", "out.onnx", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (
        "[W] 2 node(s) had the name of another node (e.g. 'same'), which onnxruntime refuses: "
        "the output names them apart (e.g. 'same_1')" in p.stdout
    )
    assert "Found distinct Nodes" not in p.stdout + p.stderr  # no library dump
    small = onnx.load(tmp_path / "out.onnx")
    assert sorted(n.name for n in small.graph.node) == ["same", "same_1", "same_2"]
    assert params(small) == 132
    named = onnx.ModelProto()
    named.CopyFrom(model)
    for k, n in enumerate(named.graph.node):
        n.name = f"n{k}"  # the input as onnxruntime takes it, named here independently
    assert error_against(named, small) <= 1e-5


# ------------------------------------------------------------------ side files over inputs
@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--groups", "m.onnx"], "--groups m.onnx: that is also m.onnx"),
        (["--groups", "m.onnx.data"], "--groups m.onnx.data: that is also"),
        (["--groups", "g.json", "--report", "g.json"], "--report g.json: that is also g.json"),
        (["--prune", "0.5", "-o", "out.onnx", "--masks-out", "m.onnx"], "--masks-out m.onnx"),
        (["--prune", "0.5", "-o", "out.onnx", "--masks-out", "out.onnx"], "--masks-out out.onnx"),
    ],
)
def test_a_side_file_over_an_input_or_another_output_is_refused(tmp_path, args, culprit):
    """--groups, --report and --masks-out are checked before any work like -o: never over the
    model, its data or another output (--groups m.onnx used to replace the model with JSON)."""
    onnx.save_model(tiny(WIDE, seed=2), str(tmp_path / "m.onnx"), save_as_external_data=True,
                    location="m.onnx.data")  # fmt: skip
    before = snapshot(tmp_path)
    p = cli("m.onnx", *args, "-q", cwd=tmp_path)
    check_refused(p, culprit, "choose another")
    assert snapshot(tmp_path) == before

"""Start-up and long phases: torch is imported only when a .pt file or the export API needs it,
what takes seconds is announced first (and -q silences it), and the exporter's noise does not
reach the user. Each runs in a fresh process: what is imported, and what torch logs on its first
export, depend on the process's history."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import torch
from conftest import CONV2, ROOT, output_error, params, run, tiny

# Two filters of W1 zeroed: 196 -> 132 parameters (their W1 rows, B1 entries, W2 columns).
DROP = [1, 4]
MODEL = tiny(CONV2, zero={"W1": np.s_[DROP]})

# Prints a line to stdout when torch is first imported: its place among the tool's lines says
# what the user saw before the import.
WATCH = """
import importlib.abc, sys
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("<torch imported>", flush=True)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Watch())
"""


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=None,  # the test's environment: threads pinned by conftest
    )


def files(tmp_path: Path) -> tuple[Path, Path]:
    onnx.save(MODEL, tmp_path / "m.onnx")
    mask = np.ones(6, dtype=np.float32)
    mask[DROP] = 0
    np.savez(tmp_path / "masks.npz", W1=mask)
    torch.save({"W1": torch.from_numpy(mask)}, tmp_path / "masks.pt")
    return tmp_path / "m.onnx", tmp_path / "small.onnx"


def test_an_onnx_model_with_npz_masks_and_help_do_not_import_torch(tmp_path):
    _, out = files(tmp_path)
    proc = python(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from onnxshrink.cli import main
        try:
            main(["--help"])
        except SystemExit as e:
            print("help exit", e.code)
        print("shrink exit", main(["m.onnx", "masks.npz", "-o", "small.onnx"]))
        print("torch loaded:", "torch" in sys.modules)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "help exit 0" in proc.stdout and "shrink exit 0" in proc.stdout
    assert "torch loaded: False" in proc.stdout
    assert params(onnx.load(out)) == 132


def test_a_pt_masks_file_is_announced_before_torch_is_imported(tmp_path):
    _, out = files(tmp_path)
    code = WATCH + f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from onnxshrink.cli import main
sys.exit(main(sys.argv[1:]))
"""
    script = tmp_path / "watched.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script), "m.onnx", "masks.pt", "-o", "small.onnx"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    said = next(k for k, line in enumerate(lines) if "importing torch to read it" in line)
    assert lines[said] == "[I] reading masks.pt: importing torch to read it (seconds, more on a busy machine) ..."
    assert lines.index("<torch imported>") == said + 1
    assert params(onnx.load(out)) == 132
    out.unlink()
    # -q: nothing at all on stdout
    proc = subprocess.run(
        [sys.executable, str(script), "m.onnx", "masks.pt", "-o", "small.onnx", "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "<torch imported>\n" and proc.stderr == ""
    assert params(onnx.load(out)) == 132


# Whether torchvision is installed is decided here, not by the environment: torch's exporter asks
# importlib.util.find_spec("torchvision"), which answers None for a module set to None in
# sys.modules (absent), and a spec for a finder that offers one (present, without importing it).
TORCHVISION = """
import importlib.machinery, sys
class OfferTorchvision:
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, None) if name == "torchvision" else None
def torchvision(present):
    sys.modules.pop("torchvision", None)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, OfferTorchvision)]
    if present:
        sys.meta_path.insert(0, OfferTorchvision())
    else:
        sys.modules["torchvision"] = None
"""


def test_export_and_shrink_says_what_it_does_and_hides_the_exporters_torchvision_notices(tmp_path):
    # A fresh process: torch's exporter logs its "torchvision is not installed" notices when it
    # builds its registry, on every export. Ours are filtered; a plain export after ours still
    # logs them (the filter is only around our call); with torchvision there are none.
    proc = python(
        TORCHVISION + f"""
import sys, time, torch
sys.path.insert(0, {str(ROOT)!r})
from torch import nn
import onnxshrink
torchvision(present=False)
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
with torch.no_grad():
    m[0].weight[[1, 6]] = 0
x = torch.randn(1, 3, 8, 8)
r = onnxshrink.export_and_shrink(m, (x,), output="small.onnx", log=lambda s: print("[I]", s, flush=True))
print("params", r.before.params, r.after.params, "export" in r.timings)
with torch.no_grad():
    torch.save({{"x": x, "y": m(x)}}, "io.pt")
print("--- plain export", flush=True)
print("--- plain export", file=sys.stderr, flush=True)
torch.onnx.export(m, (x,), "plain.onnx", dynamo=True)
torchvision(present=True)
print("--- with torchvision", file=sys.stderr, flush=True)
torch.onnx.export(m, (x,), "plain.onnx", dynamo=True)
""",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out, (ours, plain, present) = proc.stdout, re.split("--- plain export|--- with torchvision", proc.stderr)
    assert "[I] exporting Sequential with torch.onnx.export (dynamo exporter; its first export" in out
    assert "[I] exported in " in out and "[I] validating against the PyTorch module ..." in out
    assert out.index("[I] exporting") < out.index("[I] exported in") < out.index("[I] validating against")
    # BN folded into the first conv: 8*27+8 + 4*8+4 = 260 -> two filters, biases and columns fewer
    assert "params 260 196 True" in out
    assert "torchvision" not in ours, ours
    # one notice per torchvision op torch's registry knows (roi_align, roi_pool, nms, ...)
    assert plain.count("torchvision is not installed") >= 1
    assert "torchvision is not installed" not in present
    # the written model computes what the module computes
    io = torch.load(tmp_path / "io.pt")
    small = onnx.load(tmp_path / "small.onnx")
    got = run(small, {small.graph.input[0].name: io["x"].numpy()})[0]
    assert output_error(io["y"].numpy(), got) <= 1e-5
    assert got.shape == (1, 4, 6, 6)
    assert params(small) == 196


SESSION_THREADS = """
import sys
sys.path.insert(0, {root!r})
import onnx
from onnxshrink.proof.sessions import session
s = session(onnx.load("m.onnx"), "cpu")
o = s.get_session_options()
print(o.intra_op_num_threads, o.inter_op_num_threads, o.get_session_config_entry("session.intra_op.allow_spinning")
      if o.intra_op_num_threads else "-")
"""


def test_processes_the_tests_start_run_onnxruntime_on_one_thread(tmp_path):
    # conftest pins torch, BLAS and the tool's onnxruntime sessions in the environment, which
    # the command line run by a test inherits (onnxruntime itself reads no OMP_NUM_THREADS)
    import os

    files(tmp_path)
    assert all(os.environ[v] == "1" for v in ("OMP_NUM_THREADS", "ONNXSHRINK_THREADS"))
    code = SESSION_THREADS.format(root=str(ROOT))
    proc = python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "1", "0"]
    # unset: onnxruntime's own default (0: one per core, spinning)
    env = {k: v for k, v in os.environ.items() if k != "ONNXSHRINK_THREADS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "0", "-"]
    # a value that is no number: exit 2, the variable named, nothing written
    proc = subprocess.run(
        [sys.executable, "-m", "onnxshrink.cli", "m.onnx", "masks.npz", "-o", "small.onnx"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**env, "ONNXSHRINK_THREADS": "two"},
    )
    assert proc.returncode == 2
    assert "[E] ONNXSHRINK_THREADS='two': give the number of threads per onnxruntime session" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "small.onnx").exists()

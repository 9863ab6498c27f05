"""Does the config.json written beside a block-removed LLaMA describe the shrunk model?

Needs `transformers` (not a project dependency: `pip install --target DIR transformers` and
DIR on PYTHONPATH). A small LlamaForCausalLM (2 layers, hidden 32, 4 heads, 2 K/V heads, FFN
64, the library's own initialization) is saved with its config.json and exported; then:

- `block`: `--prune 0.5 --units block` removes one of the two blocks. If a config is written,
  a LlamaForCausalLM is built from it, given the input's weights of the blocks kept (renumbered),
  and its logits are compared here with the shrunk ONNX model's in onnxruntime;
- `mlp`: masks zero layer 1's whole MLP (its gate and up rows, its down columns). No
  config gives one layer an MLP and the other none: it must not be written, and the run must
  say why.

Prints one line per case; exit status 1 when a written config gives other logits, or a config is
written for the MLP case.

    PYTHONPATH=/tmp/tf python tools/hf_config_check.py
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "onnxshrink", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"onnxshrink {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return proc.stdout


def _logits_of_onnx(path: Path, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: ids})[0]


def _kept_blocks_model(model, config_path: Path, removed: int):
    """A LlamaForCausalLM from the written config, holding `model`'s weights without block
    `removed` (the later blocks renumbered)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaForCausalLM(LlamaConfig.from_pretrained(str(config_path.parent))).eval()
    state = {}
    for name, value in model.state_dict().items():
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i == removed:
                continue
            name = name.replace(f"model.layers.{i}.", f"model.layers.{i - (i > removed)}.", 1)
        state[name] = value
    small.load_state_dict(state)
    return small


def main() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32, use_cache=False,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (1, 8))
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "in"), Path(tmp, "out")
        src.mkdir(), out.mkdir()
        config.save_pretrained(str(src))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            torch.onnx.export(model, (ids,), str(src / "model.onnx"))
        printed = _run(str(src / "model.onnx"), "--prune", "0.5", "--units", "block", "--no-price",
                       "-q", "-o", str(out / "block.onnx"), "--report", str(out / "block.json"))
        written = out / "config.json"
        if written.exists():
            got = _logits_of_onnx(out / "block.onnx", ids.numpy())
            errors = []
            for removed in range(2):
                with torch.no_grad():
                    want = _kept_blocks_model(model, written, removed)(ids).logits.numpy()
                errors.append(float(np.abs(got - want).max() / np.abs(want).max()))
            layers = json.loads(written.read_text())["num_hidden_layers"]
            ok = min(errors) <= 1e-5
            bad += not ok
            print(f"block: config.json written (num_hidden_layers {layers}); transformers from it, "
                  f"the kept block's weights: max rel error {min(errors):.2e} "
                  f"({'OK' if ok else 'WRONG'})")
            written.unlink()
        else:
            print(f"block: config.json not written: {printed.strip() or '(no reason printed: WRONG)'}")
            bad += "config.json" not in printed
        gate = np.ones((64, 32), np.float32)
        gate[:] = 0
        masks = {"model.layers.1.mlp.gate_proj.weight": gate, "model.layers.1.mlp.up_proj.weight": gate,
                 "model.layers.1.mlp.down_proj.weight": np.zeros((32, 64), np.float32)}
        np.savez(Path(tmp, "mlp.npz"), **masks)
        printed = _run(str(src / "model.onnx"), str(Path(tmp, "mlp.npz")), "-o", str(out / "mlp.onnx"))
        reason = [line for line in printed.splitlines() if "config.json" in line]
        ok = not written.exists() and any("not written" in line for line in reason)
        bad += not ok
        print(f"mlp: {'; '.join(reason) or 'nothing said about config.json'} ({'OK' if ok else 'WRONG'})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

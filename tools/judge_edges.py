"""The float64 judge at LLM size: a correct prune passes its first proof, wrong models fail.

Builds a LLaMA-shaped model (models.llama: RMSNorm as Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul,
rotary attention with grouped K/V heads, SwiGLU FFN; random weights at trained-like scales:
N(0, 1/d) matrices, gains 1 + N(0, 0.1)), prunes it to 80% of its parameters (the hidden width
through every RMSNorm among the groups), and prints the first proof: its float32 error, the
tolerance, the judge's verdict and the time. Then the same prune with the rewrite's result made
wrong (monkeypatched, as tests/test_proof.py does; the float64 twin alike), each without
recovery: a rescaled norm gain off by 1e-4, a weight tensor off by 1e-4 (relative), one weight
element off by 1e-4, a live FFN neuron removed, a weight read along the wrong axis. Each
must fail. `--no-twin` judges without the float64 twin (the shrunk model with its new constants
moved), as for a model past judge.TWIN_BYTES; `--pieces BYTES` sets the float64 piece size.

    python tools/judge_edges.py                        # 4 layers, hidden 576, vocab 8192
    python tools/judge_edges.py --layers 8 --no-twin
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _edited(change):
    """The rewrite's result changed by `change(initializers by name)`: a context."""
    import onnxshrink.stages.attempt as attempt
    from onnxshrink.testing import edited

    real = attempt.apply

    @contextlib.contextmanager
    def patched():
        attempt.apply = edited(real, change)
        try:
            yield
        finally:
            attempt.apply = real

    return patched()


def _line(what: str, validation, seconds: float, failed: bool) -> str:
    (o,) = validation.outputs
    verdict = {True: "rounding", False: "another function", None: "not judged"}[o.rounding]
    return (
        f"{what:48s} {'FAILED' if failed else 'passed':6s} | float32 {o.max_rel_error:.3g} (tolerance "
        f"{o.rtol:.3g}) | judge: {verdict}" + (f", float64 {o.float64:.3g}" if o.float64 is not None else "")
        + f" | {seconds:.1f} s\n    {o.judged}"
    )


def _prune(path: Path):
    from onnxshrink import ValidationFailed
    from onnxshrink.prune import prune

    t0 = time.perf_counter()
    try:
        result = prune(path, params=0.8, price=False, recover=False, input_shapes={"input_ids": [1, 16]})
        return result.shrink.validation, time.perf_counter() - t0, False, result
    except ValidationFailed as exc:
        return exc.result.validation, time.perf_counter() - t0, True, None


def main() -> int:
    from onnxshrink.testing import element_moved, row_removed, scaled, wrong_axis

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--no-twin", action="store_true")
    ap.add_argument("--pieces", type=int, default=None, help="float64 piece size in bytes")
    ap.add_argument("--only", default=None, help="run only the edges whose description contains this")
    args = ap.parse_args()
    import onnxshrink.proof.judge as judge
    import onnxshrink.proof.widen as widen
    from models.llama import LlamaConfig, build

    if args.no_twin:
        judge.TWIN_BYTES = 0
    if args.pieces:
        widen.PIECE_BYTES = args.pieces
    cfg = LlamaConfig(
        layers=args.layers, hidden=args.hidden, heads=9, kv_heads=3, ffn=int(args.hidden * 8 / 3), vocab=args.vocab, seed=3
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama.onnx"
        built = build(cfg, path)
        print(f"LLaMA-shaped: {cfg.layers} layers, hidden {cfg.hidden}, FFN {cfg.ffn}, vocab {cfg.vocab}: "
              f"{built.params / 1e6:.1f} M parameters; twin {'off' if args.no_twin else 'on'}; "
              f"float64 pieces of {widen.PIECE_BYTES / 2**20:.0f} MiB")  # fmt: skip
        validation, seconds, failed, result = _prune(path)
        print(_line("correct prune (--prune-to-params 0.8)", validation, seconds, failed))
        if result is not None:
            kept = sum(int(np.prod(t.dims)) for t in result.shrink.model.graph.initializer)
            print(f"    parameters {built.params} -> {kept}")
        norm, up = "model.layers.1.post_attention_layernorm.weight", "model.layers.1.mlp.up_proj.weight_t"
        edges = {
            "a rescaled RMSNorm gain off by 1e-4": scaled(norm, 1e-4),
            "a weight tensor off by 1e-4 (relative)": scaled(up, 1e-4),
            "one weight element off by 1e-4": element_moved(up, 1e-4),
            "a live FFN neuron removed": row_removed("model.layers.2.mlp.down_proj.weight_t", 7),
            "a weight read along the wrong axis": wrong_axis("model.layers.0.self_attn.o_proj.weight_t", 1),
        }
        wrong_passed = 0
        if args.only:
            edges = {k: v for k, v in edges.items() if args.only in k}
        for what, change in edges.items():
            with _edited(change):
                validation, seconds, failed, _ = _prune(path)
            wrong_passed += not failed
            print(_line(what, validation, seconds, failed))
        print(f"wrong models that passed: {wrong_passed} of {len(edges)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

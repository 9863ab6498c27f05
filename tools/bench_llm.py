"""Large models: shrink a LLaMA-shaped model of several GB and measure time, memory and size.

The model is built by `models.llama.build` (random weights written straight to external data,
never held whole in memory), with half of the K/V heads (and the query heads they serve) and
half of the FFN neurons masked, as a head/neuron pruner leaves them. The shrink runs in a fresh
child process, which prints:

* the time of each phase of the shrink (`ShrinkResult.timings`) and of the whole call;
* the read+write floor, measured in the same child: reading the input files once (16 MiB
  chunks into one buffer, before the shrink) and writing as many bytes as the shrink wrote
  (after it, beside the output, then deleted);
* peak RSS of the child (VmHWM, reset just before the shrink) and its ratio to the model's files;
* parameters before / after / ideal (the model built natively without the masked heads and
  neurons), and the proof: which kind, its tolerance and relative error.

    python tools/bench_llm.py --preset tinyllama                      # fp32, 4.4 GB, full proof
    python tools/bench_llm.py --preset llama7b --validate-layers 2    # fp16, first blocks proven
    python tools/bench_llm.py --preset tiny --layers 4 --compute fp16 # quick
    python tools/bench_llm.py --preset tinyllama --element-masks --no-validate

`--element-masks` also writes, tensor by tensor (never the model in memory), an element-wise
masks file (a full-size bool mask for every masked weight, as torch.nn.utils.prune leaves them)
and a state dict of every weight for --weights, each as .safetensors and .pt, and shrinks with
each pair after the run above: peak RSS and time of each against it (the masks files and state
dicts are deleted at the end; `--clean` deletes the model too).

Models are built in --workdir (default: a directory under /tmp) and reused by later runs with
the same configuration; `--clean` deletes the model and the shrunk copy at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _proc import proc_status, reset_peak  # tools/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 2**20
GIB = 2**30


def _files(path: Path) -> list[Path]:
    data = path.with_name(path.name + ".data")
    return [path, data] if data.exists() else [path]


def _read_all(paths: list[Path]) -> tuple[int, float]:
    buf = bytearray(16 * MIB)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def _write_bytes(path: Path, size: int) -> float:
    chunk = b"\1" * (16 * MIB)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


class _Sampler:
    """Samples VmRSS every 20 ms, by the phase the shrink's log lines name: the peak of each."""

    def __init__(self) -> None:
        import threading

        self.phase = "load"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def log(self, line: str) -> None:
        for word, phase in (("analyzing", "analyze"), ("rewriting", "rewrite"), ("validating", "validate")):
            if line.startswith(word) or f"; {word}" in line:
                self.phase = phase

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            rss = proc_status()["VmRSS"]
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def child(src: str, out: str, options: str) -> None:
    import onnxshrink
    from onnxshrink.report import to_jsonable

    opts = json.loads(options)
    masks = opts.pop("masks", None)
    floor = opts.pop("floor", True)
    if masks is not None and masks.endswith(".pt"):
        import torch  # noqa: F401 (imported before the peak is reset, as the shrink would)
    rss_imports = proc_status()["VmRSS"]
    src_path = Path(src)
    read_bytes, read_s = _read_all(_files(src_path)) if floor else (0, 0.0)
    from onnxshrink.core import nonzero

    scan = nonzero._scan
    scanned = {"seconds": 0.0, "bytes": 0}

    def timed_scan(w):  # the analysis' passes over the weights, timed apart
        t = time.perf_counter()
        try:
            return scan(w)
        finally:
            scanned["seconds"] += time.perf_counter() - t
            scanned["bytes"] += w.nbytes

    nonzero._scan = timed_scan
    reset_peak()
    sampler = _Sampler()
    t0 = time.perf_counter()
    result = onnxshrink.shrink(src_path, masks, output=out, log=sampler.log, **opts)
    wall = time.perf_counter() - t0
    sampler.phase = "after"
    peak = proc_status()["VmHWM"]
    phase_peaks = sampler.stop()
    written = sum(Path(p).stat().st_size for p in result.written)
    write_s = _write_bytes(Path(out).with_name(".bench-floor"), written) if floor else 0.0
    v = result.validation
    record = {
        "wall": wall,
        "timings": dict(result.timings),
        "rss_after_imports": rss_imports,
        "rss_peak": peak,
        "rss_peak_by_phase": phase_peaks,
        "scan_seconds": scanned["seconds"],
        "scan_bytes": scanned["bytes"],
        "read_bytes": read_bytes,
        "read_s": read_s,
        "written_bytes": written,
        "write_s": write_s,
        "params_before": result.before.params,
        "params_after": result.after.params,
        "validation": to_jsonable(v) if v is not None else None,
    }
    print("BENCH-LLM " + json.dumps(record), flush=True)


def run_child(src: Path, out: Path, options: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(src), str(out), json.dumps(options)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH-LLM ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the shrink failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("BENCH-LLM ") :])


def _masked_weights(cfg) -> dict[str, tuple[int, ...]]:
    """{initializer: (axis, zeroed indices)} of every weight the half-masked model zeroes."""
    hd = cfg.head_dim
    q = [c for h in cfg.masked_heads for c in range(h * hd, (h + 1) * hd)]
    kv = [c for j in cfg.masked_kv for c in range(j * hd, (j + 1) * hd)]
    ffn = list(cfg.masked_ffn)
    out: dict = {}
    for i in range(cfg.layers):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.self_attn.q_proj.weight_t": (1, q),
            f"{p}.self_attn.k_proj.weight_t": (1, kv),
            f"{p}.self_attn.v_proj.weight_t": (1, kv),
            f"{p}.self_attn.o_proj.weight_t": (0, q),
            f"{p}.mlp.gate_proj.weight_t": (1, ffn),
            f"{p}.mlp.up_proj.weight_t": (1, ffn),
            f"{p}.mlp.down_proj.weight_t": (0, ffn),
        }
    return out


_ST_NAMES = {"float32": "F32", "float16": "F16", "bool": "BOOL", "uint16": "BF16"}


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], str, object]]) -> None:
    """A .safetensors file written a tensor at a time: (name, shape, numpy dtype name, blocks)
    where blocks() yields the tensor's bytes in order (rows at a time)."""
    import numpy as np

    header, offset = {}, 0
    for name, shape, dtype, _ in tensors:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype if dtype != "uint16" else np.uint16).itemsize
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _, _, _, blocks in tensors:
            for block in blocks():  # type: ignore[operator]
                f.write(block)


def _safetensors_entries(src: Path) -> list[tuple[str, int, tuple[int, ...], str]]:
    """(name, offset in the file, shape, numpy dtype name) of each tensor of a .safetensors file."""
    with open(src, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    names = {v: k for k, v in _ST_NAMES.items()}
    return [
        (k, 8 + n + v["data_offsets"][0], tuple(v["shape"]), names[v["dtype"]])
        for k, v in header.items()
        if k != "__metadata__"
    ]


def _save_pt(src: Path, entries: list[tuple[str, int, tuple[int, ...], str]], dst: Path) -> None:
    """torch.save of tensors that are memory maps of `src` (never all in memory at once):
    (name, offset, shape, numpy dtype name; "uint16" for bf16)."""
    import warnings

    import numpy as np
    import torch

    tensors = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only maps: torch warns they are not writable
        for name, offset, shape, dtype in entries:
            arr = np.memmap(src, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)
            t = torch.from_numpy(arr)
            tensors[name] = t.view(torch.bfloat16) if dtype == "uint16" else t
    torch.save(tensors, dst)


def write_element_files(model: Path, cfg, workdir: Path, tag: str, fmt: str) -> tuple[Path, Path]:
    """The element-wise masks file and the state dict, as `fmt` ("safetensors" first, then
    "pt"), beside the model (see the docstring): one format at a time on disk."""
    import numpy as np
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    data = model.with_name(model.name + ".data")
    shapes = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    masked = _masked_weights(cfg)

    def mask_blocks(name: str):
        shape, (axis, zero) = shapes[name], masked[name]

        def blocks():
            rows = max(1, (1 << 24) // max(int(np.prod(shape[1:])), 1))
            for r in range(0, shape[0], rows):
                block = np.ones((min(rows, shape[0] - r), *shape[1:]), bool)
                if axis == 1:
                    block[:, zero] = False
                else:
                    z = np.asarray(zero)
                    block[z[(z >= r) & (z < r + len(block))] - r] = False
                yield block.tobytes()

        return blocks

    def weight_blocks(t: onnx.TensorProto):
        info = {e.key: e.value for e in t.external_data}

        def blocks():
            with open(data, "rb") as f:
                f.seek(int(info["offset"]))
                left = int(info["length"])
                while left > 0:
                    chunk = f.read(min(left, 1 << 24))
                    left -= len(chunk)
                    yield chunk

        return blocks

    dtypes = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "uint16"}
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    masks_st = workdir / f"{tag}.masks.safetensors"
    if fmt == "safetensors":
        state = workdir / f"{tag}.state.safetensors"
        _write_safetensors(masks_st, [(n, shapes[n], "bool", mask_blocks(n)) for n in masked])
        _write_safetensors(state, [(t.name, tuple(t.dims), dtypes[t.data_type], weight_blocks(t)) for t in external])
        return masks_st, state
    # .pt: the masks from the .safetensors file written before (then deleted), the state dict
    # straight from the model's external data
    masks_pt, state = workdir / f"{tag}.masks.pt", workdir / f"{tag}.state.pt"
    _save_pt(masks_st, _safetensors_entries(masks_st), masks_pt)
    masks_st.unlink()
    offsets = {t.name: int({e.key: e.value for e in t.external_data}["offset"]) for t in external}
    _save_pt(data, [(t.name, offsets[t.name], tuple(t.dims), dtypes[t.data_type]) for t in external], state)
    return masks_pt, state


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return 0
    from models.llama import LlamaConfig, build

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tinyllama", choices=sorted(LlamaConfig.PRESETS))
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--compute", choices=["fp32", "fp16"], help="override the compute dtype")
    p.add_argument("--storage", choices=["fp32", "fp16", "bf16"], help="weights' dtype (Cast)")
    p.add_argument("--validate-layers", type=int, help="prove the first N blocks only")
    p.add_argument("--no-validate", action="store_true")
    p.add_argument("--seq", type=int, default=16, help="validation sequence length")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/onnxshrink-bench-llm"))
    p.add_argument("--clean", action="store_true", help="delete the model and its shrunk copy")
    p.add_argument("--json", type=Path, help="write the figures here too")
    p.add_argument(
        "--element-masks",
        action="store_true",
        help="also shrink with a full-size masks file and a --weights state dict (.safetensors, .pt)",
    )
    args = p.parse_args(argv)

    changes = {k: v for k, v in (("layers", args.layers), ("compute", args.compute), ("storage", args.storage)) if v}
    cfg = LlamaConfig.preset(args.preset, **changes).half_masked()
    tag = f"{args.preset}-L{cfg.layers}-{cfg.compute}" + (f"-{cfg.storage}" if cfg.storage else "")
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.workdir / f"{tag}.onnx"
    meta = args.workdir / f"{tag}.json"
    print(f"load average {os.getloadavg()[0]:.2f}; {tag}: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, {cfg.kv_heads} K/V heads ({len(cfg.masked_kv)} masked), FFN {cfg.ffn} ({len(cfg.masked_ffn)} masked), vocab {cfg.vocab}", flush=True)
    if not (model.exists() and meta.exists()):
        print(f"building {model} ...", flush=True)
        built = build(cfg, model)
        meta.write_text(json.dumps({"params": built.params, "ideal": built.ideal_params, "bytes": built.bytes, "seconds": built.seconds}))
        print(f"built in {built.seconds:.1f} s: {gib(built.bytes)}", flush=True)
    info = json.loads(meta.read_text())
    out = args.workdir / f"{tag}.shrunk.onnx"
    options: dict = {"input_shapes": {"input_ids": [1, args.seq]}}
    if args.no_validate:
        options["validate"] = False
    elif args.validate_layers is not None:
        options["validate_layers"] = args.validate_layers
    rec = run_child(model, out, options)
    rec.update(model=tag, model_bytes=info["bytes"], params_ideal=info["ideal"], load_average=os.getloadavg()[0])
    floor = rec["read_s"] + rec["write_s"]
    shrink_s = sum(v for k, v in rec["timings"].items() if k != "validate")
    lines = [
        f"model {tag}: {gib(info['bytes'])} on disk, {info['params']:,} parameters",
        "phases: " + " | ".join(f"{k} {v:.2f} s" for k, v in rec["timings"].items()) + f" | call {rec['wall']:.2f} s",
        f"analysis: {rec['timings']['analyze'] - rec['scan_seconds']:.2f} s on the graph, "
        f"{rec['scan_seconds']:.2f} s reading {gib(rec['scan_bytes'])} of weights (one pass each)",
        f"shrink without validation: {shrink_s:.2f} s; read+write floor {floor:.2f} s "
        f"(read {gib(rec['read_bytes'])} in {rec['read_s']:.2f} s, write {gib(rec['written_bytes'])} in {rec['write_s']:.2f} s); "
        f"ratio {shrink_s / floor:.2f}",
        f"peak RSS {gib(rec['rss_peak'])} (after imports {gib(rec['rss_after_imports'])}); "
        f"peak RSS / model file {rec['rss_peak'] / info['bytes']:.3f}; by phase (sampled every 20 ms): "
        + ", ".join(f"{k} {gib(v)}" for k, v in rec["rss_peak_by_phase"].items()),
        f"parameters before {rec['params_before']:,} after {rec['params_after']:,} ideal {info['ideal']:,} "
        f"({'at' if rec['params_after'] == info['ideal'] else 'NOT at'} the ideal count)",
    ]
    v = rec["validation"]
    if v is None:
        lines.append("proof: none (--no-validate)")
    else:
        worst = max((o["max_rel_error"] for o in v["outputs"]), default=0.0)
        lines.append(
            f"proof: {v.get('kind', 'full')}, {'PASSED' if v['passed'] else 'FAILED'}, rtol {v['rtol']:g}, "
            f"max relative error {float(worst):.3g}, {v['seconds']:.1f} s"
        )
    lines.append(f"load average {rec['load_average']:.2f}")
    print("\n".join(lines), flush=True)
    if args.element_masks:
        rec["element_runs"] = {}
        files: list[Path] = []
        try:
            for fmt in ("safetensors", "pt"):
                t0 = time.perf_counter()
                masks, state = write_element_files(model, cfg, args.workdir, tag, fmt)
                files += [masks, state]
                print(
                    f"element-wise masks and state dict written in {time.perf_counter() - t0:.1f} s: "
                    f"{masks.name} {gib(masks.stat().st_size)}, {state.name} {gib(state.stat().st_size)}",
                    flush=True,
                )
                run = run_child(model, out, {**options, "masks": str(masks), "weights": str(state), "floor": False})
                state.unlink()  # disk is shared: one state dict at a time
                rec["element_runs"][fmt] = run
                print(
                    f"element-wise masks + --weights (.{fmt}): peak RSS {gib(run['rss_peak'])} "
                    f"(the run above: {gib(rec['rss_peak'])}; after imports {gib(run['rss_after_imports'])}); "
                    "by phase: " + ", ".join(f"{k} {gib(v)}" for k, v in run["rss_peak_by_phase"].items())
                    + f"; call {run['wall']:.2f} s (above: {rec['wall']:.2f} s), load {run['timings'].get('load', 0):.2f} s, "
                    f"bind {run['timings'].get('bind', 0):.2f} s; parameters after {run['params_after']:,} "
                    f"({'at' if run['params_after'] == info['ideal'] else 'NOT at'} the ideal count)",
                    flush=True,
                )
        finally:
            for f in [*files, args.workdir / f"{tag}.masks.safetensors"]:
                f.unlink(missing_ok=True)
    if args.json:
        args.json.write_text(json.dumps(rec, indent=2))
    if args.clean:
        for f in [*_files(model), *_files(out), meta]:
            f.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

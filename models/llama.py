"""LLaMA-shaped ONNX models written straight to disk, weights as external data.

The graph has the form torch's dynamo exporter writes for a HuggingFace LlamaForCausalLM (see
tools/hf_check.py): Linear weights stored pre-transposed for MatMul ([in, out]), literal
reshape targets `[1, -1, heads, head_dim]`, RMSNorm as Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul,
rotary embeddings (tables computed in fp32 from the positions, cast to the compute dtype),
grouped-query attention repeating each K/V head with Unsqueeze/Expand/Reshape, a causal mask,
SwiGLU MLPs and an untied LM head. Batch 1, a dynamic sequence length.

Weights are random (normal, scaled by 1/sqrt(fan_in)) and generated one tensor at a time in
chunks of rows, written to `<model>.data` as they are made: building a 13 GB model never holds
more than a chunk in memory. Masked heads and neurons are zeroed as a pruner leaves them (the
export of the masked module): a masked K/V head zeroes its K and V projection columns, the query
heads it serves their Q columns and their output-projection rows; a masked FFN neuron zeroes its
gate and up columns and its down-projection row.

    cfg = LlamaConfig.preset("tinyllama")
    info = build(cfg, Path("tinyllama.onnx"))   # info.params, info.ideal_params, info.bytes
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

DTYPES = {
    "fp32": (np.dtype(np.float32), TensorProto.FLOAT),
    "fp16": (np.dtype(np.float16), TensorProto.FLOAT16),
}


def _bf16() -> tuple[np.dtype, int]:
    import ml_dtypes  # onnx's own dependency for bfloat16 arrays

    return np.dtype(ml_dtypes.bfloat16), TensorProto.BFLOAT16


def dtype_of(name: str) -> tuple[np.dtype, int]:
    """(numpy dtype, ONNX element type) of "fp32", "fp16" or "bf16"."""
    return _bf16() if name == "bf16" else DTYPES[name]


@dataclass(frozen=True)
class LlamaConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 96
    vocab: int = 128
    compute: str = "fp32"  # the dtype the graph computes in
    storage: str | None = None  # the weights' dtype when it differs: each is Cast to `compute`
    masked_kv: tuple[int, ...] = ()  # K/V heads zeroed, with the query heads they serve
    masked_ffn: tuple[int, ...] = ()  # FFN neurons zeroed (the same in every layer)
    seed: int = 0

    PRESETS = {
        # TinyLlama-1.1B: 22 layers, hidden 2048, 32 heads, 4 K/V heads, FFN 5632, fp32: 4.4 GB
        "tinyllama": dict(layers=22, hidden=2048, heads=32, kv_heads=4, ffn=5632, vocab=32000),
        # LLaMA-7B with 8 K/V heads, fp16
        "llama7b": dict(
            layers=32, hidden=4096, heads=32, kv_heads=8, ffn=11008, vocab=32000, compute="fp16"
        ),
        # SmolLM-135M's shape (9 heads, 3 K/V heads), its embedding untied: 163 M, fp32: 0.65 GB
        "smollm135m": dict(layers=30, hidden=576, heads=9, kv_heads=3, ffn=1536, vocab=49152),
        # small enough for CI
        "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128),
    }

    @staticmethod
    def preset(name: str, **changes) -> LlamaConfig:
        return replace(LlamaConfig(**LlamaConfig.PRESETS[name]), **changes)  # type: ignore[arg-type]

    def half_masked(self) -> LlamaConfig:
        """Every other K/V head (and its query heads) and every other FFN neuron masked."""
        return replace(
            self,
            masked_kv=tuple(range(1, self.kv_heads, 2)),
            masked_ffn=tuple(range(1, self.ffn, 2)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.heads // self.kv_heads

    @property
    def masked_heads(self) -> list[int]:
        return [h for h in range(self.heads) if h // self.group in self.masked_kv]

    def removed_params(self) -> int:
        """Parameters the masked heads and neurons own: what a model built natively without
        them does not have."""
        d, hd = self.hidden, self.head_dim
        removed_heads = len(self.masked_heads) * hd * d * 2  # Q columns, O rows
        removed_kv = len(self.masked_kv) * hd * d * 2  # K and V columns
        removed_ffn = len(self.masked_ffn) * d * 3  # gate and up columns, down row
        return self.layers * (removed_heads + removed_kv + removed_ffn)


@dataclass
class Built:
    path: Path
    params: int
    ideal_params: int
    bytes: int  # .onnx + .data on disk
    seconds: float = 0.0
    weights: list[str] = field(default_factory=list)


class _DataWriter:
    """Appends tensors to one external data file (offsets aligned to 4096, as onnx writes)."""

    CHUNK = 1 << 24  # elements generated at once

    def __init__(self, path: Path, rng: np.random.Generator):
        self.path = path
        self.f = open(path, "wb")  # noqa: SIM115 (closed by close(), after the last tensor)
        self.offset = 0
        self.rng = rng

    def close(self) -> None:
        self.f.close()

    def tensor(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: np.dtype,
        onnx_type: int,
        make: Callable[[np.random.Generator, int, int], np.ndarray],
    ) -> TensorProto:
        """Write rows of `shape` made by `make(rng, first_row, rows)` (float32, [rows, *rest])."""
        pad = -self.offset % 4096
        self.f.write(b"\0" * pad)
        self.offset += pad
        start = self.offset
        rows = shape[0]
        per_row = int(np.prod(shape[1:], dtype=np.int64))
        step = max(1, self.CHUNK // max(per_row, 1))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            block = make(self.rng, r, n).astype(dtype).reshape(n, *shape[1:])
            self.f.write(block.tobytes())
            self.offset += block.nbytes
        t = TensorProto(name=name, data_type=onnx_type, dims=list(shape))
        t.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self.path.name),
            ("offset", str(start)),
            ("length", str(self.offset - start)),
        ):
            e = t.external_data.add()
            e.key, e.value = key, value
        return t


def _normal(scale: float, zero_cols=None, zero_rows=None):
    """Rows of a random matrix N(0, scale²), with some columns and global rows zeroed."""
    cols = np.asarray(sorted(zero_cols or []), dtype=np.int64)
    rows = np.asarray(sorted(zero_rows or []), dtype=np.int64)

    def make(rng: np.random.Generator, first: int, n: int) -> np.ndarray:
        shape = (n,) if make.width is None else (n, make.width)  # type: ignore[attr-defined]
        block = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
        if len(cols):
            block[:, cols] = 0
        if len(rows):
            local = rows[(rows >= first) & (rows < first + n)] - first
            block[local] = 0
        return block

    make.width = None  # type: ignore[attr-defined]
    return make


def _matrix(scale: float, width: int, zero_cols=None, zero_rows=None):
    make = _normal(scale, zero_cols, zero_rows)
    make.width = width  # type: ignore[attr-defined]
    return make


def _near_one(rng: np.random.Generator, first: int, n: int) -> np.ndarray:
    return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)


class _Graph:
    """Nodes and small constants, with unique names."""

    def __init__(self, compute_type: int, compute_dtype: np.dtype):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.ct = compute_type
        self.cd = compute_dtype
        self._n = 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def op(self, op: str, inputs: list[str], hint: str | None = None, **attrs) -> str:
        out = self.name(hint or op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"/{out}/{op}", **attrs))
        return out

    def const(self, values, dtype=None, hint: str = "c") -> str:
        arr = np.asarray(values, dtype=dtype if dtype is not None else self.cd)
        name = self.name(hint)
        self.inits.append(onnx.numpy_helper.from_array(arr, name))
        return name

    def ints(self, values, hint: str = "shape") -> str:
        return self.const(np.asarray(values, dtype=np.int64), np.int64, hint)


def build(cfg: LlamaConfig, path: Path, progress: Callable[[int], None] | None = None) -> Built:
    """Write the model to `path` and its weights to `<path>.data`; `progress(bytes)` is called
    as weights are written."""
    import time

    t0 = time.perf_counter()
    cdt, ctype = dtype_of(cfg.compute)
    sdt, stype = dtype_of(cfg.storage or cfg.compute)
    g = _Graph(ctype, cdt)
    data = path.with_name(path.name + ".data")
    writer = _DataWriter(data, np.random.default_rng(cfg.seed))
    D, H, KV, hd, F, V = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn, cfg.vocab
    weights: list[str] = []

    def weight(name: str, shape: tuple[int, ...], make) -> str:
        writer_before = writer.offset
        g.inits.append(writer.tensor(name, shape, sdt, stype, make))
        weights.append(name)
        if progress is not None:
            progress(writer.offset - writer_before)
        if stype != ctype:  # a weight stored in another dtype: cast where it is read
            return g.op("Cast", [name], f"{name}_cast", to=ctype)
        return name

    q_cols = [c for h in cfg.masked_heads for c in range(h * hd, (h + 1) * hd)]
    kv_cols = [c for j in cfg.masked_kv for c in range(j * hd, (j + 1) * hd)]
    ffn = list(cfg.masked_ffn)

    # sizes and positions
    ids = "input_ids"
    seq = g.op("Shape", [ids], "seq", start=1, end=2)
    seq0 = g.op("Squeeze", [seq, g.ints([0], "axes")], "seq_scalar")
    pos = g.op("Range", [g.const(0, np.int64, "zero"), seq0, g.const(1, np.int64, "one")], "pos")
    # rotary tables, computed in fp32 (as exporters do for fp16 models) then cast
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    posf = g.op("Cast", [pos], "posf", to=TensorProto.FLOAT)
    freqs = g.op("Mul", [g.op("Unsqueeze", [posf, g.ints([1], "axes")]), g.const(inv_freq, np.float32, "inv_freq")], "freqs")
    emb = g.op("Concat", [freqs, freqs], "emb", axis=-1)
    tables = []
    for fn in ("Cos", "Sin"):
        t = g.op(fn, [emb])
        if ctype != TensorProto.FLOAT:
            t = g.op("Cast", [t], to=ctype)
        tables.append(g.op("Unsqueeze", [t, g.ints([0, 1], "axes")], fn.lower()))
    cos, sin = tables
    # causal mask [seq, seq]: 0 where a position may attend, a large negative value elsewhere
    rows = g.op("Unsqueeze", [pos, g.ints([1], "axes")])
    cols = g.op("Unsqueeze", [pos, g.ints([0], "axes")])
    allowed = g.op("LessOrEqual", [cols, rows], "allowed")
    neg = -1e4 if cfg.compute == "fp16" else -1e9
    mask = g.op("Where", [allowed, g.const(0.0, hint="zero_f"), g.const(neg, hint="neg")], "causal")

    eps = g.const(1e-6, hint="eps")
    two = g.const(2.0, hint="two")
    last = g.ints([-1], "axes")

    def rmsnorm(x: str, w: str) -> str:
        ms = g.op("ReduceMean", [g.op("Pow", [x, two]), last], "ms", keepdims=1)
        r = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, eps])])])
        return g.op("Mul", [w, g.op("Mul", [x, r])], "normed")

    def rotate(x: str) -> str:
        half = hd // 2
        lo = g.op("Slice", [x, g.ints([0]), g.ints([half]), g.ints([3])])
        hi = g.op("Slice", [x, g.ints([half]), g.ints([hd]), g.ints([3])])
        rot = g.op("Concat", [g.op("Neg", [hi]), lo], axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rot, sin])], "rope")

    def heads(x: str, n: int) -> str:
        r = g.op("Reshape", [x, g.ints([1, -1, n, hd])], allowzero=1)
        return g.op("Transpose", [r], perm=[0, 2, 1, 3])

    def repeat_kv(x: str) -> str:  # [1, KV, T, hd] -> [1, H, T, hd]
        u = g.op("Unsqueeze", [x, g.ints([2], "axes")])
        e = g.op("Expand", [u, g.ints([1, KV, cfg.group, 1, 1])])
        return g.op("Reshape", [e, g.ints([1, H, -1, hd])], allowzero=1)

    embed = weight("model.embed_tokens.weight", (V, D), _matrix(1.0, D))
    h = g.op("Gather", [embed, ids], "embedding", axis=0)
    scale = g.const(1.0 / math.sqrt(hd), hint="scale")
    for i in range(cfg.layers):
        p = f"model.layers.{i}"
        n1 = rmsnorm(h, weight(f"{p}.input_layernorm.weight", (D,), _near_one))
        s = 1.0 / math.sqrt(D)
        q = g.op("MatMul", [n1, weight(f"{p}.self_attn.q_proj.weight_t", (D, H * hd), _matrix(s, H * hd, q_cols))])
        k = g.op("MatMul", [n1, weight(f"{p}.self_attn.k_proj.weight_t", (D, KV * hd), _matrix(s, KV * hd, kv_cols))])
        v = g.op("MatMul", [n1, weight(f"{p}.self_attn.v_proj.weight_t", (D, KV * hd), _matrix(s, KV * hd, kv_cols))])
        qh, kh, vh = rotate(heads(q, H)), repeat_kv(rotate(heads(k, KV))), repeat_kv(heads(v, KV))
        scores = g.op("MatMul", [qh, g.op("Transpose", [kh], perm=[0, 1, 3, 2])], "scores")
        scores = g.op("Add", [g.op("Mul", [scores, scale]), mask])
        att = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), vh], "attended")
        att = g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]), g.ints([1, -1, H * hd])], allowzero=1)
        o_w = weight(f"{p}.self_attn.o_proj.weight_t", (H * hd, D), _matrix(1.0 / math.sqrt(H * hd), D, None, q_cols))
        h = g.op("Add", [h, g.op("MatMul", [att, o_w])], "residual")
        n2 = rmsnorm(h, weight(f"{p}.post_attention_layernorm.weight", (D,), _near_one))
        gate = g.op("MatMul", [n2, weight(f"{p}.mlp.gate_proj.weight_t", (D, F), _matrix(s, F, ffn))])
        up = g.op("MatMul", [n2, weight(f"{p}.mlp.up_proj.weight_t", (D, F), _matrix(s, F, ffn))])
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])], "silu"), up])
        down_w = weight(f"{p}.mlp.down_proj.weight_t", (F, D), _matrix(1.0 / math.sqrt(F), D, None, ffn))
        h = g.op("Add", [h, g.op("MatMul", [act, down_w])], "residual")
    n = rmsnorm(h, weight("model.norm.weight", (D,), _near_one))
    head = weight("lm_head.weight_t", (D, V), _matrix(1.0 / math.sqrt(D), V))
    g.nodes.append(helper.make_node("MatMul", [n, head], ["logits"], name="/lm_head/MatMul"))
    writer.close()

    graph = helper.make_graph(
        g.nodes,
        "llama",
        [helper.make_tensor_value_info(ids, TensorProto.INT64, [1, "seq"])],
        [helper.make_tensor_value_info("logits", ctype, [1, "seq", V])],
        initializer=g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="models.llama")
    model.ir_version = 8
    onnx.save_model(model, str(path))
    size = path.stat().st_size + data.stat().st_size
    floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
    params = sum(int(np.prod(t.dims, dtype=np.int64)) for t in g.inits if t.data_type in floats)
    ideal = params - cfg.removed_params()
    return Built(path, params, ideal, size, time.perf_counter() - t0, weights)

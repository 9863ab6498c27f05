"""onnxruntime sessions as the proof runs them: providers, threads, optimization levels, and a
model run whole or segment by segment (`run_model`), its weights mapped, never copied."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import onnx

from onnxshrink import ir
from onnxshrink.errors import ShrinkError, first_line
from onnxshrink.logs import onnxruntime_severity
from onnxshrink.options import PROVIDERS, Provider

if TYPE_CHECKING:  # run_model imports the segmenting (and shape inference) when it runs
    from onnxshrink.proof.segment import Piece

M = TypeVar("M", onnx.ModelProto, onnx.GraphProto)

# onnxruntime's name of each provider a run can be given (options.Provider)
EXECUTION_PROVIDERS: dict[Provider, str] = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


# onnxruntime's threads per session (0: its default, one per core). Tests set 1; a process
# started by them (the command line) reads ONNXSHRINK_THREADS (see session_threads).
SESSION_THREADS = 0


THREADS_VARIABLE = "ONNXSHRINK_THREADS"


def unrunnable_ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(domain:op, node name) of the nodes of custom domains onnxruntime has no kernel for
    (nor the model a function), which the proof cannot run."""
    from onnxshrink.io.skeleton import runtime_schemas

    known = runtime_schemas() | {(f.domain, f.name) for f in model.functions}
    out: dict[str, str] = {}
    for n in (n for g in ir.all_graphs(model.graph) for n in g.node):
        if n.domain not in ("", "ai.onnx") and (n.domain, n.op_type) not in known:
            out.setdefault(f"{n.domain}:{n.op_type}", node_label(n))
    return list(out.items())


def node_label(n: onnx.NodeProto) -> str:
    """How a message names a node: by its name, or by its output when it has none."""
    if n.name:
        return f"node '{n.name}'"
    return f"the node writing '{n.output[0]}'" if n.output else "an unnamed node"


def check_runnable(model: onnx.ModelProto, source: str) -> None:
    """Refuse, before any work, a model whose proof onnxruntime cannot run (custom ops)."""
    ops = unrunnable_ops(model)
    if ops:
        listed = ", ".join(f"{op} ({node})" for op, node in ops[:5])
        raise ShrinkError(
            f"{source}: onnxruntime has no kernel for {listed}, so the proof cannot run the model. "
            "Pass --no-validate to shrink it without the proof (those nodes keep all their "
            "channels; the rest is shrunk by the analysis alone), or prove it yourself with the "
            "op's library registered in onnxruntime."
        )


def session_threads() -> int:
    """onnxruntime's threads per session of the proof: SESSION_THREADS when set, else the
    environment's ONNXSHRINK_THREADS (onnxruntime reads no OMP_NUM_THREADS), else 0: one per core."""
    if SESSION_THREADS:
        return SESSION_THREADS
    value = os.environ.get(THREADS_VARIABLE, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ShrinkError(
            f"{THREADS_VARIABLE}={value!r}: give the number of threads per onnxruntime session "
            f"(0 or unset: one per core), or unset it."
        )
    return int(value)


def _serialized(model: onnx.ModelProto) -> bytes | None:
    """The model's bytes; None past protobuf's 2 GB limit, where upb refuses to serialize.
    Serializing is how to tell: ByteSize() costs as much again (0.2 s for a 100 MB model whose
    weights are inline, as a pruned model's reference is)."""
    from google.protobuf.message import EncodeError  # type: ignore[import-untyped]

    try:
        return model.SerializeToString()
    except EncodeError:
        return None


# onnxruntime's graph optimization levels, by the names its Python API gives them, in order.
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_LAYOUT", "ORT_ENABLE_ALL")


OFF = "ORT_DISABLE_ALL"


def default_level() -> str:
    """The graph optimization level onnxruntime gives a session unless told otherwise: the
    level users run their models at."""
    import onnxruntime as ort

    return ort.SessionOptions().graph_optimization_level.name


def levels() -> list[str]:
    """The optimization levels this onnxruntime has (LEVELS it knows, in order)."""
    import onnxruntime as ort

    known = ort.GraphOptimizationLevel.__members__
    return [name for name in LEVELS if name in known]


def check_provider(provider: str) -> str:
    """The onnxruntime execution provider named by `provider`, or a ShrinkError."""
    import onnxruntime as ort

    if provider not in EXECUTION_PROVIDERS:
        raise ShrinkError(f"--provider {provider}: choose one of {sorted(PROVIDERS)}.")
    ep = EXECUTION_PROVIDERS[provider]
    if ep not in ort.get_available_providers():
        raise ShrinkError(
            f"--provider {provider}: onnxruntime here has no {ep} (available: {ort.get_available_providers()}). Install onnxruntime-gpu for CUDA."
        )
    return ep


def session(
    model: onnx.ModelProto,
    provider: str,
    data_dir: str | Path | None = None,
    level: str = OFF,
    data: bytes | Serialized | None = None,
    threads: int | None = None,
):
    """An onnxruntime session of `model` at graph optimization `level` (a LEVELS name); weights
    it keeps in external data are read (mapped) from `data_dir`, never copied into this process.
    `data`: the model already serialized (several sessions of one model: `weights_apart`).
    `threads`: its threads (default session_threads())."""
    import onnxruntime as ort

    ep = check_provider(provider)
    so = ort.SessionOptions()
    so.log_severity_level = onnxruntime_severity()  # its errors: ours to report
    threads = session_threads() if threads is None else threads
    if threads:
        so.intra_op_num_threads = so.inter_op_num_threads = threads
    # no thread spins waiting for work: the proof measures no latency, and on a shared machine
    # spinning threads take the cores the others' work needs (ResNet-50's proof, loaded machine:
    # see tools/bench_peer_prune.py)
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.__members__[level]
    so.use_deterministic_compute = True  # the same inputs give the same proof (and recovery)
    # a block-wise int4 DequantizeLinear -> MatMul fused into MatMulNBits multiplies in float32,
    # not with A quantized to int8 at run time (see proof/qdq.float_activations)
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if data_dir is not None:
        # Mapped external weights stay in the page cache, not this process: no packed copies,
        # and no arena holding on to the largest temporaries (fp16 kernels widen their weights).
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(data_dir))
        so.add_session_config_entry("session.disable_prepacking", "1")
        so.enable_cpu_mem_arena = False
    data = data if data is not None else _serialized(model)
    if isinstance(data, Serialized):  # its weights given as they are, not parsed from bytes
        so.add_external_initializers(list(data.weights), [ort.OrtValue.ortvalue_from_numpy(a) for a in data.weights.values()])
        sess = ort.InferenceSession(data.skeleton, so, providers=[ep])
        sess._onnxshrink_weights = data  # onnxruntime may read them where they are for the session's life
        return sess
    if data is not None:
        return ort.InferenceSession(data, so, providers=[ep])
    import tempfile

    from onnxshrink.io.model import save_model

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "model.onnx"
        save_model(model, p, external=True)
        return ort.InferenceSession(str(p), so, providers=[ep])


# Weights above which a proof runs a model segment by segment (one segment's weights mapped at
# a time: see onnxshrink.proof.segment), so that it fits in memory whatever the model's size.
SEGMENT_BYTES = 512 * 2**20


class RunFailed(Exception):
    def __init__(self, message: str, loading: bool, feed: int | None = None):
        super().__init__(message)
        self.loading = loading  # onnxruntime refused the model (else: it failed on the inputs)
        self.feed = feed  # the index of the feed it failed on (given inputs come first)


def run_model(
    model: onnx.ModelProto,
    feeds: list[dict[str, np.ndarray]],
    outputs: list[str],
    provider: str,
    data_dir: str | Path | None = None,
    progress=None,
    parts: list[Piece] | None = None,
    level: str = OFF,
    data: bytes | Serialized | None = None,
    threads: int | None = None,
) -> list[list[np.ndarray]]:
    """`outputs` of `model` on each feed, with one session at a time: the whole model, or its
    segments in order when its weights exceed SEGMENT_BYTES (each run on every feed, its
    results kept, its session freed), at graph optimization `level`. RunFailed when
    onnxruntime cannot load or run it. `parts`: the segments, when already cut
    (onnxshrink.proof.segment.pieces: each made when it runs, one piece's weights copied at a time).
    `data`: the whole model as `weights_apart` (or `serialized`) made it (several runs of one
    model), when run whole. `threads`: each session's (default session_threads())."""
    from onnxshrink.proof.segment import Piece, pieces

    parts = parts or pieces(model, segment_bytes(model))
    if parts:
        data = None  # the bytes are the whole model's, not a segment's
    parts = parts or [Piece(lambda: model, [i.name for i in model.graph.input], outputs)]
    values = [dict(feed) for feed in feeds]
    for k, part in enumerate(parts):
        try:
            if data is None and len(parts) > 1:  # a segment: its spilled weights handed over mapped
                sess = session(part.model, provider, data_dir, level, _spilled_apart(part.model), threads)
            else:
                run = model if data is not None else _inlined(part.model, own=len(parts) > 1)
                sess = session(run, provider, data_dir, level, data, threads)
        except ShrinkError:
            raise
        except Exception as exc:
            raise RunFailed(f"cannot be loaded by onnxruntime ({first_line(exc)})", True) from exc
        names = [o.name for o in sess.get_outputs()]
        wanted = [i.name for i in sess.get_inputs()]
        for f, v in enumerate(values):
            try:
                v.update(zip(names, sess.run(names, {n: v[n] for n in wanted}), strict=True))
            except Exception as exc:
                raise RunFailed(f"fails to run in onnxruntime ({first_line(exc)})", False, f) from exc
            if progress is not None:
                progress.update(1)
        del sess
        later = {i for p in parts[k + 1 :] for i in p.inputs} | set(outputs)
        for v in values:
            for n in [n for n in v if n not in later]:
                del v[n]
    return [[v[o] for o in outputs] for v in values]


@dataclass
class Serialized:
    """A model as onnxruntime's sessions of it are given it: its bytes without the values of its
    large weights (`skeleton`: each such initializer marked external, with no data), and those
    values as arrays over the model's own bytes (`weights`, by name), which each session is given
    as they are (SessionOptions.add_external_initializers). The same graph and the same values,
    bit for bit, as the model serialized whole, without serializing a model's worth of weights
    and parsing them again in every session (ResNet-50's pruning reference: 100 MB, 0.2 s to
    serialize, 0.05-0.2 s more per session)."""

    skeleton: bytes
    weights: dict[str, np.ndarray]


# the initializers given to a session apart from the model's bytes: of a dtype numpy has
# (io.weights.HANDED), at least this large (a smaller one costs more to hand over than to serialize)
APART_BYTES = 4096


def serialized(model: onnx.ModelProto) -> bytes | None:
    """The bytes onnxruntime is given for `model` run whole (its spilled weights inline); None
    past protobuf's 2 GB limit."""
    return _serialized(_inlined(model, own=False))


def weights_apart(model: onnx.ModelProto) -> Serialized | None:
    """What onnxruntime is given for `model` run whole (its spilled weights inline), made once
    for several sessions of it (`Serialized`: its large weights apart); None past protobuf's
    2 GB limit."""
    model = _inlined(model, own=False)
    weights = _apart(model)
    skeleton = _serialized(_skeleton(model, weights) if weights else model)
    return Serialized(skeleton, weights) if skeleton is not None else None


def _spilled_apart(model: onnx.ModelProto) -> Serialized | None:
    """What onnxruntime is given for a segment (`model`, made for this run: changed here) whose
    main graph holds spilled weights (stored by absolute path, which onnxruntime refuses): each
    handed to its session as it lies in the spill file, mapped read-only, rather than read into
    the proto, serialized and copied by onnxruntime again (three copies of a segment's weights
    at once: TinyLlama's default prune peaked 1.3 GiB above its shrink in the proof). Those it
    cannot hand over (a dtype numpy lacks, a name used twice, in a subgraph) are inlined; None
    when there is nothing to hand over (the caller inlines as before)."""
    from onnxshrink.io.weights import HANDED, absolute

    names = _name_counts(model)
    apart: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        path = absolute(t)
        if path is None or names[t.name] > 1:
            continue
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        info = {e.key: e.value for e in t.external_data}
        shape = tuple(int(d) for d in t.dims)
        count = int(np.prod(shape, dtype=np.int64))
        if dtype in HANDED and count and int(info.get("length", -1)) == count * dtype.itemsize:
            apart[t.name] = np.memmap(path, dtype, "r", int(info.get("offset", 0)), shape)
    if not apart:
        return None
    skeleton = _serialized(_skeleton(_inlined(model, own=True, but=set(apart)), apart))
    return Serialized(skeleton, apart) if skeleton is not None else None


def _name_counts(model: onnx.ModelProto) -> Counter[str]:
    """How often each name is an initializer or an input of the main graph: a weight handed to
    a session apart must name one value only."""
    names = Counter(t.name for t in model.graph.initializer)
    names.update(i.name for i in model.graph.input)
    return names


def _apart(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The main graph's initializers a session can be given apart (a numpy dtype, inline raw
    bytes of their size, at least APART_BYTES, a name no other initializer nor input has),
    as arrays over (a copy of) their bytes."""
    from onnxshrink.io.weights import HANDED

    types = {onnx.helper.np_dtype_to_tensor_dtype(d) for d in HANDED}
    names = _name_counts(model)
    out: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if t.data_type not in types or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        size = math.prod(t.dims) * dtype.itemsize
        if size < APART_BYTES or names[t.name] > 1 or not t.HasField("raw_data"):
            continue
        raw = t.raw_data  # a copy: read once
        if len(raw) == size:  # else as it is: onnxruntime says what is wrong with it
            out[t.name] = np.frombuffer(raw, dtype).reshape(tuple(t.dims))
    return out


def _skeleton(model: onnx.ModelProto, apart: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` whose initializers named in `apart` are marked external, without their
    values (the model's main graph: the initializers a session can be given)."""
    from onnxshrink.io.weights import handed

    skeleton = _copy_but(model, "graph", onnx.ModelProto())
    graph = _copy_but(model.graph, "initializer", skeleton.graph)
    for t in model.graph.initializer:
        graph.initializer.append(handed(t.name, apart[t.name]) if t.name in apart else t)
    return skeleton


def _copy_but(message: M, field: str, out: M) -> M:
    """`out` (empty) made a copy of the protobuf `message` without its `field`."""
    from google.protobuf.message import Message

    for fd, value in message.ListFields():
        if fd.name == field:
            continue
        if isinstance(value, Message):
            getattr(out, fd.name).CopyFrom(value)
        elif isinstance(value, (str, bytes, int, float)):
            setattr(out, fd.name, value)
        else:  # a repeated field
            getattr(out, fd.name).extend(value)
    return out


def refusals(
    model: onnx.ModelProto,
    provider: str,
    data_dir: str | Path | None,
    at: Sequence[str],
    data: bytes | Serialized | None = None,
) -> dict[str, str]:
    """The optimization levels of `at` at which onnxruntime refuses to load `model`, and why
    (`data`: what `weights_apart` made of it, when already made)."""
    if data is None:  # with its bytes given, the model itself is not read by session()
        model = _inlined(model, own=False)
        data = weights_apart(model)
    out = {}
    for level in at:
        try:
            session(model, provider, data_dir, level, data)
        except ShrinkError:
            raise
        except Exception as exc:
            out[level] = first_line(exc)
    return out


def segment_bytes(model: onnx.ModelProto) -> int:
    """The weight budget of a segment: SEGMENT_BYTES, a quarter of it when the model holds
    weights onnxruntime must be given inline (spilled masked weights: held by the segment's
    proto, its serialization and the session at once)."""
    from onnxshrink.io.weights import absolute

    spilled = any(absolute(t) is not None for g in ir.all_graphs(model.graph) for t in g.initializer)
    return SEGMENT_BYTES // 4 if spilled else SEGMENT_BYTES


def _inlined(model: onnx.ModelProto, own: bool, but: AbstractSet[str] = frozenset()) -> onnx.ModelProto:
    """`model` with the weights it keeps by absolute path (spilled masked weights, which
    onnxruntime refuses to read) inline, but the main graph's named in `but` (handed over
    apart); a copy unless `own` (a segment made for this run)."""
    from onnxshrink.io.weights import absolute, inline

    def spilled(m: onnx.ModelProto) -> list[onnx.TensorProto]:  # in bodies too
        return [
            t for g in ir.all_graphs(m.graph) for t in g.initializer
            if absolute(t) is not None and not (g is m.graph and t.name in but)
        ]  # fmt: skip

    if not spilled(model):
        return model
    if not own:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    for t in spilled(model):
        inline(t)
    return model

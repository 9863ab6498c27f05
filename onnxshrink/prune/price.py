"""What a prune cost, shown before it is written: on the held-out inputs (or the calibration ones,
or the proof's random ones: labelled so), per output of the model, the relative error
||y - y0|| / ||y0|| and the cosine of each sample's output (rows of the batch axis) with the
input model's, top-1 agreement for classifier-like outputs ([batch, classes]); and the latency
before and after, measured (targets.LatencyMeter). A model whose weights the proof runs in
segments is priced in segments too (proof.sessions.run_model), with no latency: a model run in
pieces is not the model deployed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx


@dataclass
class OutputPrice:
    name: str
    rel_error: float
    cosine_mean: float | None  # None: one value per sample (a score), whose cosine is its sign
    cosine_min: float | None
    top1: float | None = None  # argmax agreement over the batch, for a [batch, classes] output


@dataclass
class Price:
    inputs: str  # which inputs, e.g. "held-out inputs (heldout.npz)"
    outputs: list[OutputPrice] = field(default_factory=list)
    latency_before_ms: float | None = None
    latency_after_ms: float | None = None
    threads: int | None = None  # onnxruntime's intra-op threads for the latency (0: one per core)
    macs_ratio: float | None = None  # the pruned model's MACs over the input's
    note: str | None = None  # why a figure is missing

    def lines(self) -> list[str]:
        out = [f"price on the {self.inputs}:"]
        for o in self.outputs:
            text = f"    {o.name}: relative error {o.rel_error:.4g}, " + (
                f"cosine mean {o.cosine_mean:.4f} / min {o.cosine_min:.4f}"
                if o.cosine_mean is not None and o.cosine_min is not None
                else "no cosine (one value per sample: its cosine would be its sign alone)"
            )
            if o.top1 is not None:
                text += f", top-1 agreement {o.top1:.1%}"
            out.append(text)
        if self.latency_before_ms is not None and self.latency_after_ms is not None:
            ratio = self.latency_after_ms / self.latency_before_ms
            threads = "one per core" if not self.threads else f"{self.threads} thread(s)"
            out.append(
                f"    latency {self.latency_before_ms:.2f} ms -> {self.latency_after_ms:.2f} ms "
                f"({ratio:.2f}x; onnxruntime, all optimizations, {threads}, on this machine)"
            )
            # only when the prune took MACs out (an unchanged model's ratio is the timer's noise)
            pruned = self.macs_ratio is None or self.macs_ratio < 1.0
            if pruned and (ratio > 1.0 or (self.macs_ratio is not None and ratio > 1.5 * self.macs_ratio)):
                macs = f" with {self.macs_ratio:.2f}x its MACs" if self.macs_ratio is not None else ""
                out.append(
                    f"    it runs at {ratio:.2f}x the input's latency{macs}: runtimes keep their fast "
                    "kernels for some channel counts only (onnxruntime's blocked NCHWc convolutions: "
                    "multiples of 8 with AVX2, 16 with AVX-512); prune again with --round-to 16 (or 8)"
                )
        if self.note:
            out.append(f"    {self.note}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# float64 copies of at most about this many bytes at a time: an LLM's logits on a held-out batch
# are hundreds of MB in float32 (SmolLM2's on 16 x 128 tokens: 0.4 GB), each copy twice that
CHUNK_BYTES = 64 * 2**20


def compare_outputs(
    before: Sequence[Mapping[str, np.ndarray]], after: Sequence[Mapping[str, np.ndarray]]
) -> list[OutputPrice]:
    """Each float output of `after` against `before`, over every feed, in float64 (a few rows
    of the batch axis at a time)."""
    out = []
    for name in before[0]:
        y0s = [np.asarray(b[name]) for b in before]
        if not np.issubdtype(y0s[0].dtype, np.floating):
            continue
        sums = np.zeros(2)  # ||y - y0||^2, ||y0||^2
        cosines: list[np.ndarray] = []
        agree, rows = 0, 0
        for y0, y in zip(y0s, (np.asarray(x[name]) for x in after), strict=True):
            r0 = y0.reshape(y0.shape[0], -1) if y0.ndim >= 2 else y0.reshape(1, -1)
            cosines.append(_rows_compared(r0, y.reshape(r0.shape), sums))
            if y0.ndim == 2 and y0.shape[1] >= 2:
                agree += int(np.sum(np.argmax(y0, axis=1) == np.argmax(y, axis=1)))
                rows += y0.shape[0]
        cos = np.concatenate(cosines)
        num, den = float(sums[0]), float(sums[1])
        # a row of one value (a wake word's or a detector's score per sample): its cosine is
        # +-1, the sign alone, 1 whatever the error of a positive score: not given
        scores = all(y0.size == (y0.shape[0] if y0.ndim >= 2 else 1) for y0 in y0s)
        out.append(
            OutputPrice(
                name,
                float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num)),
                None if scores else float(np.mean(cos)),
                None if scores else float(np.min(cos)),
                agree / rows if rows else None,
            )
        )
    return out


def _rows_compared(r0: np.ndarray, r: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """The cosine of each row of `r` with `r0`'s, in float64; their squared difference and
    `r0`'s squares added to `sums`."""
    step = max(1, CHUNK_BYTES // max(8 * r0.shape[1], 1))
    cosines = [np.zeros(0)]
    for s in range(0, r0.shape[0], step):
        a0, a = r0[s : s + step].astype(np.float64), r[s : s + step].astype(np.float64)
        sums += (float(np.sum((a - a0) ** 2)), float(np.sum(a0**2)))
        n0, n = np.linalg.norm(a0, axis=1), np.linalg.norm(a, axis=1)
        both = (n0 > 0) & (n > 0)
        cosines.append(
            np.where(both, np.sum(a0 * a, axis=1) / np.where(both, n0 * n, 1), (n0 == n).astype(float))
        )
    return np.concatenate(cosines)


# ---------------------------------------------------------------------- measuring it
@dataclass
class PriceInput:
    """What the price compares the pruned model with: the input model untouched (`model`: its
    file, read by onnxruntime, or the ModelProto the caller gave: the prune zeroes groups in its
    own copy of it), the inputs the price is taken on and what they are called, the input's
    outputs on them when the calibration has run it there already, and the latency meter when
    one was made (a latency target's). `note`: why there is no price. `segments`: the input as
    read (its weights inline, or on disk in `data_dir`), when the proof runs it in segments:
    the price runs it so too."""

    model: str | onnx.ModelProto | None
    feeds: list[Mapping[str, np.ndarray]]
    label: str
    outputs: list[dict[str, np.ndarray]] | None = None
    meter: Any = None  # targets.LatencyMeter
    note: str | None = None
    segments: onnx.ModelProto | None = None
    data_dir: str | None = None
    ahead: Ahead | None = None  # the run of `segments` started early (run_ahead)

    def settled(self) -> None:
        """Wait for a run started ahead (a prune that fails waits for it before it exits)."""
        if self.ahead is not None:
            self.ahead.join()


class Ahead:
    """`work()` on a background thread; `result()` waits for it and returns what it returned,
    or raises what it raised. Joined before the caller finishes, whatever happens: a thread
    still inside onnxruntime when the interpreter exits is ended by force (abort)."""

    def __init__(self, work: Callable[[], Any]):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="onnxshrink-price", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._value = work()
        except BaseException as exc:  # raised again where the result is wanted
            self._error = exc

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self.join()
        if self._error is not None:
            raise self._error
        return self._value


def run_ahead(given: PriceInput) -> PriceInput:
    """Start running the input in segments on the price's inputs now, on a background thread
    with half the cores (onnxruntime lets go of the interpreter as it runs): the prune's own
    work until the price (the zeroing and the shrink: the interpreter's work and writes, on one
    core) goes on meanwhile. Only a model the price runs in segments (a large one), and only
    when its outputs are not known already."""
    if given.segments is None or given.outputs is not None or given.model is None:
        return given
    import os

    from onnxshrink.proof.sessions import session_threads

    model, data_dir, feeds = given.segments, given.data_dir, given.feeds
    names = [o.name for o in model.graph.output]
    threads = max(1, (session_threads() or os.cpu_count() or 2) // 2)
    given.ahead = Ahead(lambda: _run(model, data_dir, feeds, names, "the input model", False, threads))
    return given


def price_feeds(
    model: onnx.ModelProto,
    held_out: Sequence[Mapping[str, np.ndarray]] | None,
    data: Sequence[Mapping[str, np.ndarray]] | None,
    shapes: dict[str, list[int]],
    draws: int,
    seed: int,
) -> tuple[list[Mapping[str, np.ndarray]], str]:
    """The inputs the price is measured on, and how to call them."""
    from onnxshrink.proof.inputs import make_inputs
    from onnxshrink.prune.calibrate import feed_label

    if held_out:
        return list(held_out), f"held-out inputs ({feed_label(held_out)})"
    if data:
        return list(data), f"calibration inputs ({feed_label(data)}; no held-out set given: optimistic)"
    drawn: list[Mapping[str, np.ndarray]] = list(make_inputs(model, shapes, max(draws, 1), seed))
    return drawn, "random inputs (no --inputs given: a poor stand-in for your data)"


def price_input(
    given: onnx.ModelProto,
    untouched: str | onnx.ModelProto,
    feeds: list[Mapping[str, np.ndarray]],
    label: str,
    known: list[dict[str, np.ndarray]] | None = None,
    meter: Any = None,
    read: onnx.ModelProto | None = None,
    data_dir: str | None = None,
) -> PriceInput:
    """The price's input model, `untouched` (its file or the caller's ModelProto; `given`: the
    copy the prune read, whose weights are counted here), its inputs `feeds`, and what is known
    already (the calibration's outputs on them, a latency meter). A model whose weights the
    proof runs in segments (past SEGMENT_BYTES) is run so here too: `read`, the input as read
    (never the prune's copy, whose chosen groups are zeroed), its external data in `data_dir`."""
    from onnxshrink.proof.segment import weight_bytes
    from onnxshrink.proof.sessions import SEGMENT_BYTES

    if weight_bytes(given) > SEGMENT_BYTES:
        if read is None and isinstance(untouched, onnx.ModelProto):
            read = untouched
        elif read is None:  # its file: the weights it holds in external data stay on disk
            from onnxshrink.io.model import load_model

            read, data_dir = load_model(untouched, keep_external=True), str(Path(untouched).parent)
        return PriceInput(untouched, feeds, label, known, segments=read, data_dir=data_dir)
    return PriceInput(untouched, feeds, label, known, meter)


def measure(
    given: PriceInput, pruned: onnx.ModelProto, progress: bool = False, pruned_dir: str | Path | None = None
) -> Price:
    """The input's and the pruned model's outputs on the same inputs, compared, and both
    latencies (the CPU provider, all of onnxruntime's optimizations, as a deployment runs them).
    The two run feed by feed in turns; after the first (the sessions' slow first runs), each
    pair on inputs of the latency feed's shapes is timed as one round of the latency's.
    `progress`: a bar counting the inputs, on a terminal. An input the proof runs in segments
    (`given.segments`) is run so, and the pruned model as the proof runs it (`pruned_dir`:
    where its external data are): see in_segments."""
    from onnxshrink.progress import bar
    from onnxshrink.prune.calibrate import run_feeds
    from onnxshrink.prune.targets import LatencyMeter

    if given.model is None:
        return Price(given.label, note=given.note)
    if given.segments is not None:
        return in_segments(given, given.segments, pruned, pruned_dir, progress)
    meter = given.meter or LatencyMeter(given.model, given.feeds[0], rounds=3, budget=0.05)  # a glance
    base, candidate = meter.base, _session(meter, pruned, pruned_dir)
    names = [o.name for o in base.get_outputs()]
    before: list[dict[str, np.ndarray]] = list(given.outputs or [])
    after: list[dict[str, np.ndarray]] = []
    rounds: tuple[list[float], list[float]] = ([], [])
    with bar(len(given.feeds), "price: the input and the pruned model", "input", progress) as shown:
        for k, feed in enumerate(given.feeds):
            pair = []
            for sess, outputs in ((base, before), (candidate, after)):
                if sess is base and given.outputs is not None:
                    continue
                t0 = time.perf_counter()
                outputs.extend(run_feeds(sess, [feed], names, "inputs"))
                pair.append((time.perf_counter() - t0) * 1e3)
            if len(pair) == 2 and k > 0 and _same_shapes(feed, meter.feed):
                rounds[0].append(pair[0])
                rounds[1].append(pair[1])
            shown.update(1)
    result = Price(given.label, compare_outputs(before, after))
    result.latency_before_ms, result.latency_after_ms = meter.compare(candidate, given.outputs is None, rounds)
    result.threads = meter.threads
    return result


def _session(meter: Any, pruned: onnx.ModelProto, data_dir: str | Path | None):
    """The meter's session of the pruned model; one whose weights a streamed shrink left in a
    file of `data_dir` reads them there (those it keeps by absolute path, inline)."""
    if data_dir is None:
        return meter.session(pruned)
    from onnxshrink.proof.sessions import serialized

    return meter.session(serialized(pruned) or pruned, data_dir)


def _same_shapes(feed: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> bool:
    return all(k in feed and np.shape(feed[k]) == np.shape(v) for k, v in like.items())


# ---------------------------------------------------------------------- a model past SEGMENT_BYTES
ALL = "ORT_ENABLE_ALL"  # the latency's sessions' level: onnxruntime's default, as deployed


def in_segments(
    given: PriceInput,
    model: onnx.ModelProto,
    pruned: onnx.ModelProto,
    pruned_dir: str | Path | None = None,
    progress: bool = False,
) -> Price:
    """The price of a model whose weights the proof runs in segments (proof.sessions.run_model:
    one segment's session at a time, each segment's weights copied when it runs), run so: the
    input `model` (as read, its external data in `given.data_dir`) on every feed, its outputs
    kept and its sessions freed, then the pruned model (its external data in `pruned_dir`), each
    at all of onnxruntime's optimizations; no latency (the note says why)."""
    from onnxshrink.proof import sessions

    names = [o.name for o in model.graph.output]
    before, cut = given.outputs, 0
    if before is None and given.ahead is not None:
        before, cut = given.ahead.result()
    elif before is None:
        before, cut = _run(model, given.data_dir, given.feeds, names, "the input model", progress)
    after, pieces = _run(pruned, pruned_dir, given.feeds, names, "the pruned model", progress)
    result = Price(given.label, compare_outputs(before, after))
    ran = (f"the input {_pieces(cut)}, " if cut else "") + f"the pruned model {_pieces(pieces)}"
    result.note = (
        f"latency not measured: a model whose weights pass {_gib(sessions.SEGMENT_BYTES)} is run here as "
        f"the proof runs it, one segment's session at a time ({ran}): not its latency deployed"
    )
    return result


def _gib(size: int) -> str:
    return f"{size / 2**30:.2g} GiB"


def _pieces(count: int) -> str:
    return f"in {count} segments" if count > 1 else "whole"


def piece_bytes(model: onnx.ModelProto) -> int:
    """The weights of one piece the price runs: a quarter of a proof's segment. onnxruntime maps
    a piece's weights from its file, resident while the piece's session runs, on top of what
    the prune holds then (its groups, the shrunk model): SmolLM-135M's shape (0.61 GiB) peaked
    in the price at 0.92 GiB, 0.50 GiB of it the mapped piece of the input. The outputs were
    the same, bit for bit, at 512, 256 and 128 MiB (that model and TinyLlama's 1.1 B shape),
    and no slower: a session costs little beside a piece's run."""
    from onnxshrink.proof.sessions import SEGMENT_BYTES, segment_bytes

    return min(segment_bytes(model), SEGMENT_BYTES // 4)


def _run(
    model: onnx.ModelProto,
    data_dir: str | Path | None,
    feeds: Sequence[Mapping[str, np.ndarray]],
    names: list[str],
    what: str,
    progress: bool,
    threads: int | None = None,
) -> tuple[list[dict[str, np.ndarray]], int]:
    """`model`'s outputs `names` on each feed, and the segments it ran in (1: whole). A feed it
    cannot run on is the user's, named (as calibrate.run_feeds names it). `threads`: each
    session's (default: the proof's)."""
    from onnxshrink.errors import ShrinkError, first_line
    from onnxshrink.progress import bar
    from onnxshrink.proof.segment import pieces
    from onnxshrink.proof.sessions import RunFailed, run_model

    parts = pieces(model, piece_bytes(model))
    count = len(parts) if parts else 1
    with bar(len(feeds) * count, f"price: {what}", "run", progress) as shown:
        try:
            ran = run_model(model, [dict(f) for f in feeds], names, "cpu", data_dir, shown, parts, ALL, threads=threads)
        except RunFailed as exc:
            if exc.loading or exc.feed is None:
                raise
            raise ShrinkError(
                f"{getattr(feeds[exc.feed], 'source', 'inputs')}: {what} {first_line(exc)} on these "
                "inputs. Check the arrays' values against the model's inputs (e.g. token ids below "
                "the vocabulary size)."
            ) from exc
    return [dict(zip(names, r, strict=True)) for r in ran], count

"""What a prune cost, shown before it is written: on the held-out inputs (or the calibration ones,
or the proof's random ones: labelled so), per output of the model, the relative error
||y - y0|| / ||y0|| and the cosine of each sample's output (rows of the batch axis) with the
input model's, top-1 agreement for classifier-like outputs ([batch, classes]); and the latency
before and after, measured (targets.LatencyMeter)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx


@dataclass
class OutputPrice:
    name: str
    rel_error: float
    cosine_mean: float
    cosine_min: float
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
            text = (
                f"    {o.name}: relative error {o.rel_error:.4g}, cosine mean {o.cosine_mean:.4f} "
                f"/ min {o.cosine_min:.4f}"
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


def compare_outputs(
    before: Sequence[Mapping[str, np.ndarray]], after: Sequence[Mapping[str, np.ndarray]]
) -> list[OutputPrice]:
    """Each float output of `after` against `before`, over every feed."""
    out = []
    for name in before[0]:
        y0s = [np.asarray(b[name]) for b in before]
        if not np.issubdtype(y0s[0].dtype, np.floating):
            continue
        num = den = 0.0
        cosines: list[np.ndarray] = []
        agree, rows = 0, 0
        for b, a in zip(y0s, (np.asarray(x[name]) for x in after), strict=True):
            y0, y = b.astype(np.float64), a.astype(np.float64)
            num += float(np.sum((y - y0) ** 2))
            den += float(np.sum(y0**2))
            r0 = y0.reshape(y0.shape[0], -1) if y0.ndim >= 2 else y0.reshape(1, -1)
            r = y.reshape(r0.shape)
            n0, n = np.linalg.norm(r0, axis=1), np.linalg.norm(r, axis=1)
            both = (n0 > 0) & (n > 0)
            c = np.where(both, np.sum(r0 * r, axis=1) / np.where(both, n0 * n, 1), (n0 == n).astype(float))
            cosines.append(c)
            if y0.ndim == 2 and y0.shape[1] >= 2:
                agree += int(np.sum(np.argmax(y0, axis=1) == np.argmax(y, axis=1)))
                rows += y0.shape[0]
        cos = np.concatenate(cosines)
        out.append(
            OutputPrice(
                name,
                float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num)),
                float(np.mean(cos)),
                float(np.min(cos)),
                agree / rows if rows else None,
            )
        )
    return out


# ---------------------------------------------------------------------- measuring it
@dataclass
class PriceInput:
    """What the price compares the pruned model with: the input model untouched (`model`: its
    file, read by onnxruntime, or the ModelProto the caller gave: the prune zeroes groups in its
    own copy of it), the inputs the price is taken on and what they are called, the input's
    outputs on them when the calibration has run it there already, and the latency meter when
    one was made (a latency target's). `note`: why there is no price."""

    model: str | onnx.ModelProto | None
    feeds: list[Mapping[str, np.ndarray]]
    label: str
    outputs: list[dict[str, np.ndarray]] | None = None
    meter: Any = None  # targets.LatencyMeter
    note: str | None = None


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
) -> PriceInput:
    """The price's input model, `untouched` (its file or the caller's ModelProto; `given`: the
    copy the prune read, whose weights are counted here), its inputs `feeds`, and what is known
    already (the calibration's outputs on them, a latency meter). A model whose weights the
    proof runs in segments is not priced (sessions of it and of the pruned model would not fit
    where the proof's segments do)."""
    from onnxshrink.proof.segment import weight_bytes
    from onnxshrink.proof.sessions import SEGMENT_BYTES

    weights = weight_bytes(given)
    if weights > SEGMENT_BYTES:
        note = f"not measured: the model's {weights / 2**30:.1f} GiB of weights are run in segments by the proof, not whole"
        return PriceInput(None, feeds, label, note=note)
    return PriceInput(untouched, feeds, label, known, meter)


def measure(given: PriceInput, pruned: onnx.ModelProto, progress: bool = False) -> Price:
    """The input's and the pruned model's outputs on the same inputs, compared, and both
    latencies (the CPU provider, all of onnxruntime's optimizations, as a deployment runs them).
    The two run feed by feed in turns; after the first (the sessions' slow first runs), each
    pair on inputs of the latency feed's shapes is timed as one round of the latency's.
    `progress`: a bar counting the inputs, on a terminal."""
    from onnxshrink.progress import bar
    from onnxshrink.prune.calibrate import run_feeds
    from onnxshrink.prune.targets import LatencyMeter

    if given.model is None:
        return Price(given.label, note=given.note)
    meter = given.meter or LatencyMeter(given.model, given.feeds[0], rounds=3, budget=0.05)  # a glance
    base, candidate = meter.base, meter.session(pruned)
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


def _same_shapes(feed: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> bool:
    return all(k in feed and np.shape(feed[k]) == np.shape(v) for k, v in like.items())

"""What the calibration inputs say about the activations the groups' weights read, and a runner
that evaluates the model with some of its weights changed, many times, in one session.

- `collect`: one onnxruntime run of the model per calibration feed, with every activation a
  group's input-side weight reads added as an output; per channel of each, the sums of x, x^2 and
  |x| over every other axis (batch, tokens, pixels), and, for the least-squares refit, a sample
  of whole rows (positions) of channels. The model's own outputs are kept too: the reference
  every deviation is measured from.
- `Runner`: the model with the weights a prune may change turned into graph inputs, so that a
  prune with other groups removed runs in the same session (a session per variant costs more
  than the run on a model of MiniLM's size).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.errors import ShrinkError, first_line
from onnxshrink.io import weights
from onnxshrink.options import Provider

if TYPE_CHECKING:
    from onnxshrink.io.model import Scratch
    from onnxshrink.io.weights import DataWriter

# At most this many positions (rows of channels) are kept per activation for the refit: the
# covariance of a few thousand positions is what a small calibration set can estimate anyway.
MAX_SAMPLES = 4096


@dataclass
class ChannelStats:
    """Per channel of one activation: sums over every position (all axes but the channel's)."""

    count: int
    total: np.ndarray  # sum of x
    squares: np.ndarray  # sum of x^2
    absolute: np.ndarray  # sum of |x|
    # [positions, channels] for the refit, in the activation's dtype (float16/32, exact in
    # float64, which the refit computes in), else float64
    samples: np.ndarray | None = None

    @property
    def mean(self) -> np.ndarray:
        return self.total / self.count

    @property
    def rms(self) -> np.ndarray:
        return np.sqrt(self.squares / self.count)

    @property
    def mean_abs(self) -> np.ndarray:
        return self.absolute / self.count

    @property
    def variance(self) -> np.ndarray:
        return np.maximum(self.squares / self.count - self.mean**2, 0.0)


@dataclass
class Calibration:
    """The statistics of the activations the groups read, by tensor name, and the model's own
    outputs on each calibration feed."""

    stats: dict[str, ChannelStats]
    feeds: list[Mapping[str, np.ndarray]]
    outputs: list[dict[str, np.ndarray]]
    source: str = "--inputs"
    # (stream before, stream after, channel axis) of a block -> the mean over the feeds of the
    # mean over positions of the two streams' cosine (a block's influence is 1 - it)
    cosines: dict[tuple[str, str, int], float] = field(default_factory=dict)
    scratch: Scratch | None = None  # the samples' file (`collect`'s), deleted when this goes


def feed_label(feeds: Sequence[Mapping[str, np.ndarray]]) -> str:
    """How messages name the feeds: their file (`--inputs` reads InputFile), or 'inputs'."""
    sources = sorted({str(getattr(f, "source", "")) for f in feeds} - {""})
    return ", ".join(sources) or "the given inputs"


def run_feeds(sess, feeds: Sequence[Mapping[str, np.ndarray]], names: list[str], what: str):
    """onnxruntime's outputs `names` on each feed, {name: array}; a feed the model cannot run
    on is the user's (a token id out of range, ...): named, as the proof names it."""
    wanted = {i.name for i in sess.get_inputs()}
    for feed in feeds:
        try:
            ran = sess.run(names, {k: v for k, v in feed.items() if k in wanted})
        except Exception as exc:  # onnxruntime on the user's values
            raise ShrinkError(
                f"{getattr(feed, 'source', what)}: the model fails to run on these inputs in "
                f"onnxruntime ({first_line(exc)}). Check the arrays' values against the model's "
                "inputs (e.g. token ids below the vocabulary size)."
            ) from exc
        yield dict(zip(names, ran, strict=True))


def probe_model(model: onnx.ModelProto, wanted: Iterable[str]) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of `model` that also gives out the `wanted` tensors, and all its output names."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in model.graph.output}
    for name in wanted:
        if name not in present:
            probe.graph.output.append(onnx.ValueInfoProto(name=name))
    return probe, [o.name for o in probe.graph.output]


def collect(
    model: onnx.ModelProto,
    activations: Mapping[str, int],
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    samples: bool = False,
    streams: Collection[tuple[str, str, int]] = (),
    seed: int = 0,
    provider: Provider = "cpu",
    data_dir: str | None = None,
    scratch: Scratch | None = None,
) -> Calibration:
    """Statistics of each activation in `activations` ({tensor: channel axis}) over `feeds`,
    and the model's outputs on them. `samples`: keep up to MAX_SAMPLES positions per
    activation (the least-squares refit needs their covariance). `streams`: blocks' (before,
    after, axis) whose cosine to measure in the same runs. `data_dir`: where `model` keeps its
    external weights (not loaded): a large model is then run segment by segment (with
    `samples`, whole again when a feed has more than MAX_SAMPLES positions of an activation:
    its draw is made in the whole run's order, so the samples are the same either way).
    `scratch`: where the samples go once drawn, mapped back (a large model's are a gigabyte:
    resident only while the refit reads one activation's)."""
    from onnxshrink.proof.inputs import check_inputs
    from onnxshrink.proof.sessions import session

    check_inputs(model, feeds)  # names, dtypes and shapes, as for the proof (each named)
    # only the main graph's tensors can be outputs: a group read inside an If/Loop/Scan body has
    # no statistics (the criteria fall back to its magnitude; it is not compensated)
    visible = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    activations = {k: v for k, v in activations.items() if k in visible}
    streams = [s for s in streams if s[0] in visible and s[1] in visible]
    outputs = [o.name for o in model.graph.output]
    probe, names = probe_model(model, [*activations, *(n for s in streams for n in s[:2])])
    spill = scratch.spill() if scratch is not None and samples else None
    acc = _Accumulator(activations, streams, len(feeds), samples, np.random.default_rng(seed), spill)
    if data_dir is not None:  # weights on disk: run in segments if they are large
        try:
            kept = _in_segments(probe, feeds, outputs, acc, provider, data_dir)
        except _OutOfOrder:  # samples drawn: in the whole run's order, as the whole run draws them
            kept = None
            acc = _Accumulator(activations, streams, len(feeds), samples, np.random.default_rng(seed), spill)
        if kept is not None:
            acc.finish()
            return Calibration(acc.stats, list(feeds), kept, feed_label(feeds), acc.cosines, scratch)
    sess = session(probe, provider, data_dir)
    kept = []
    for f, ran in enumerate(run_feeds(sess, feeds, names, "--inputs")):
        kept.append({k: ran[k] for k in outputs})
        acc.add(ran, feed=f)
    acc.finish()
    return Calibration(acc.stats, list(feeds), kept, feed_label(feeds), acc.cosines, scratch)


class _OutOfOrder(Exception):
    """A feed's positions of an activation would be sampled out of the whole run's order."""


class _Accumulator:
    """The statistics of the activations and the blocks' cosines, a feed's values at a time.
    `in_order` False (a run in segments: a segment's activations for every feed, then the
    next segment's): a feed with more positions of an activation than are sampled raises
    _OutOfOrder, as its draw would not be the whole run's; with fewer, every sample is kept,
    feed after feed, as the whole run keeps them."""

    def __init__(
        self, activations: Mapping[str, int], streams, feeds: int, samples: bool, rng, spill: DataWriter | None = None
    ) -> None:
        self.activations, self.streams, self.feeds, self.samples, self.rng = activations, streams, feeds, samples, rng
        self.spill = spill  # where whole samples go (`settle`), mapped back
        self.stats: dict[str, ChannelStats] = {}
        self.cosines = dict.fromkeys(streams, 0.0)
        self.done: set[tuple[tuple[str, str, int], int]] = set()  # (stream, feed) measured
        self.in_order = True

    def add(self, ran: Mapping[str, np.ndarray], held: Mapping[str, np.ndarray] | None = None, feed: int = 0) -> None:
        """What feed `feed`'s run gave, `ran` (all of it, or a segment's part: each activation
        comes once per feed, the feeds in order), with `held`: the values at hand beside it (a
        block's stream made by an earlier segment)."""
        held = ran if held is None else held
        for stream in self.streams:
            before, after, axis = stream
            if (stream, feed) not in self.done and before in held and after in held:
                self.done.add((stream, feed))
                self.cosines[stream] += mean_cosine(held[before], held[after], axis) / self.feeds
        for name, axis in self.activations.items():
            if name in ran:
                self._channels(name, axis, np.asarray(ran[name]))

    def waiting(self, feed: int) -> set[str]:
        """The streams' tensors whose block's cosine feed `feed` still lacks."""
        return {n for s in self.streams for n in s[:2] if (s, feed) not in self.done}

    def _channels(self, name: str, axis: int, value: np.ndarray) -> None:
        x = np.asarray(value, np.float64)
        rows = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])
        s = self.stats.get(name)
        if s is None:
            c = rows.shape[1]
            s = self.stats[name] = ChannelStats(
                0, np.zeros(c), np.zeros(c), np.zeros(c), np.zeros((0, c), _held(value.dtype)) if self.samples else None
            )
        s.count += rows.shape[0]
        s.total += rows.sum(axis=0)
        s.squares += np.einsum("ij,ij->j", rows, rows)
        s.absolute += np.abs(rows).sum(axis=0)
        if s.samples is not None:
            rng = self.rng
            if len(rows) > MAX_SAMPLES and not self.in_order:
                raise _OutOfOrder(name)
            # as the run gave them (a float32 held in float64 is the same number: half the memory)
            given = np.moveaxis(value, axis, -1).reshape(rows.shape)
            take = given if len(rows) <= MAX_SAMPLES else given[rng.choice(len(rows), MAX_SAMPLES, replace=False)]
            s.samples = np.concatenate([s.samples, take])

    def settle(self, names: Iterable[str]) -> None:
        """Every feed's samples of `names` are in (a segment ran on every feed): to the spill
        file now, mapped back (a large model's samples are not all held until the last segment)."""
        if self.spill is None:
            return
        written = False
        for name in names:
            s = self.stats.get(name)
            if s is not None and s.samples is not None and s.samples.size and weights.owner(s.samples) is None:
                s.samples = self.spill.write(f"samples of {name}", iter([s.samples]), s.samples.shape, s.samples.dtype)
                written = True
        if written:
            weights.trim(0)  # the samples' pages written go back to the page cache

    def finish(self) -> None:
        """The samples drawn down to MAX_SAMPLES (and to the spill file)."""
        # in the activations' order: the order the whole run first meets them in, whatever
        # order a run in segments met them in
        names = [n for n in self.activations if n in self.stats]
        for name in names:
            s = self.stats[name]
            if s.samples is not None and len(s.samples) > MAX_SAMPLES:
                s.samples = s.samples[self.rng.choice(len(s.samples), MAX_SAMPLES, replace=False)]
        self.settle(names)
        if self.spill is not None:
            self.spill.close()


def _held(dtype: np.dtype) -> np.dtype:
    """The dtype a sample is kept in: the activation's own when float64 holds it exactly."""
    return np.dtype(dtype) if np.dtype(dtype) in (np.dtype(np.float16), np.dtype(np.float32)) else np.dtype(np.float64)


def _in_segments(
    probe: onnx.ModelProto,
    feeds: Sequence[Mapping[str, np.ndarray]],
    outputs: list[str],
    acc: _Accumulator,
    provider: Provider,
    data_dir: str,
) -> list[dict[str, np.ndarray]] | None:
    """The model's outputs on each feed, run segment by segment as the proof runs a large model
    (one segment's weights in memory at a time), each activation added to `acc` as its segment
    makes it and then dropped; None when the model needs no cut (or cannot be cut)."""
    from onnxshrink.proof.segment import pieces
    from onnxshrink.proof.sessions import segment_bytes, session

    parts = pieces(probe, segment_bytes(probe))  # each piece's model made when it runs
    if not parts:
        return None
    acc.in_order = False
    values: list[dict[str, np.ndarray]] = [dict(feed) for feed in feeds]
    for k, part in enumerate(parts):
        sess = session(part.model, provider, data_dir)
        names = [o.name for o in sess.get_outputs()]
        wanted = [i.name for i in sess.get_inputs()]
        later = {i for p in parts[k + 1 :] for i in p.inputs} | set(outputs)
        for f, (feed, v) in enumerate(zip(feeds, values, strict=True)):
            what = str(getattr(feed, "source", "--inputs"))
            ran = next(run_feeds(sess, [{n: v[n] for n in wanted}], names, what))
            v.update(ran)
            acc.add(ran, v, f)
            # what no later segment reads goes now, not once every feed has run: a segment's
            # activations are every one a group reads (SmolLM-135M's shape, in one or two
            # segments: 0.1 GiB a feed, all 8 feeds' held at once, 1.7 GiB peak)
            keep = later | acc.waiting(f)
            for n in [n for n in v if n not in keep]:
                del v[n]
            del ran
        del sess
        acc.settle(names)  # this segment's activations: every feed's are in
    return [{o: v[o] for o in outputs} for v in values]


def mean_cosine(x: np.ndarray, y: np.ndarray, axis: int) -> float:
    """The mean over positions of the cosine of x's and y's vectors along `axis` (1 where
    either is zero)."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    y = np.moveaxis(np.asarray(y, np.float64), axis, -1)
    dot = np.sum(x * y, axis=-1)
    norms = np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1)
    return float(np.mean(np.where(norms > 0, dot / np.where(norms > 0, norms, 1), 1.0)))


def deviation(
    reference: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[Mapping[str, np.ndarray]]
) -> float:
    """How far `outputs` are from `reference`, over every feed: the relative L2 error
    ||y - y0|| / ||y0|| of each float output, averaged over the outputs."""
    errors = []
    for name in reference[0]:
        y0 = [np.asarray(r[name]) for r in reference]
        if not np.issubdtype(y0[0].dtype, np.floating):
            continue
        num = sum(float(np.sum((np.asarray(o[name], np.float64) - r) ** 2)) for o, r in zip(outputs, y0, strict=True))
        den = sum(float(np.sum(np.asarray(r, np.float64) ** 2)) for r in y0)
        errors.append(np.sqrt(num / den) if den > 0 else np.sqrt(num))
    return float(np.mean(errors)) if errors else 0.0


@dataclass
class Runner:
    """`model` with the initializers `variable` as graph inputs of one onnxruntime session:
    `run(changes)` runs the feeds with `changes` ({initializer: new value}) and the other
    variable initializers as they were."""

    model: onnx.ModelProto
    variable: Iterable[str]
    feeds: Sequence[Mapping[str, np.ndarray]]
    provider: Provider = "cpu"
    values: dict[str, np.ndarray] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        import onnxruntime as ort

        from onnxshrink.proof.sessions import EXECUTION_PROVIDERS, session_threads

        probe = onnx.ModelProto()
        probe.CopyFrom(self.model)
        wanted = set(self.variable)
        keep = []
        for t in probe.graph.initializer:
            if t.name in wanted:
                value = numpy_helper.to_array(t)
                self.values[t.name] = value
                probe.graph.input.append(
                    onnx.helper.make_tensor_value_info(t.name, t.data_type, list(value.shape))
                )
            else:
                keep.append(t)
        del probe.graph.initializer[:]
        probe.graph.initializer.extend(keep)
        so = ort.SessionOptions()
        threads = session_threads()
        if threads:
            so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.outputs = [o.name for o in probe.graph.output]
        self.session = ort.InferenceSession(
            probe.SerializeToString(), so, providers=[EXECUTION_PROVIDERS[self.provider]]
        )

    def run(self, changes: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        weights = {**self.values, **changes}
        return list(run_feeds(self.session, [{**f, **weights} for f in self.feeds], self.outputs, "inputs"))

"""`prune`: choose whole groups by importance, zero them, and shrink exactly.

The pruned model is not the input model (it is pruned): it is the input with the chosen groups
zeroed, the *reference*, and the shrink is proven against that reference as any shrink is. The
masks that make the reference are returned (and written with `masks_out`) under the framework's
parameter names the exporter recorded, so that they can be applied in the framework too.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxshrink import ir
from onnxshrink.analyze.replay import scoped
from onnxshrink.api import shrink
from onnxshrink.errors import NotShrunk, ShrinkError, ValidationFailed, file_access, first_line
from onnxshrink.io import weights as mapped
from onnxshrink.io.model import Scratch, check_output, load_external
from onnxshrink.options import (
    ALLOCATIONS,
    COMPENSATIONS,
    DATA_CRITERIA,
    DEFAULT_UNITS,
    UNITS,
    PruneOptions,
    ShrinkOptions,
)
from onnxshrink.prepare import default_opset
from onnxshrink.progress import PhaseClock
from onnxshrink.proof.inputs import check_inputs, resolve_shapes
from onnxshrink.proof.sizes import with_found_shapes
from onnxshrink.prune import allocate as alloc
from onnxshrink.prune import compensate as comp_mod
from onnxshrink.prune.calibrate import Calibration, collect
from onnxshrink.prune.compensate import Compensation
from onnxshrink.prune.groups import Group, GroupSet, Member, find_groups, kept_when_zeroed
from onnxshrink.prune.importance import activations, block_streams, scores
from onnxshrink.prune.masks_out import MaskSlices, as_created, mask_slices, masks_kind, stage_masks
from onnxshrink.prune.price import Price, PriceInput, measure, price_feeds, price_input, run_ahead
from onnxshrink.prune.reference import zeroed as zeroed_reference
from onnxshrink.prune.select import LayerPlan
from onnxshrink.prune.sensitivity import Family
from onnxshrink.prune.spill import Disk
from onnxshrink.prune.targets import Costs, LatencyMeter, RatioMeaning, Target
from onnxshrink.report import ModelStats, macs_of, model_stats
from onnxshrink.result import ShrinkResult, in_memory
from onnxshrink.stages.assemble import constant_weight
from onnxshrink.stages.read import Source, check_against_model, check_options, read_model
from onnxshrink.stages.save import save, write_runtime_configs


@dataclass
class PruneResult:
    """What `prune` did: the groups, the plan per layer, the masks, and the exact shrink."""

    groups: GroupSet
    plans: list[LayerPlan]
    slices: MaskSlices  # what the masks zero (`masks` makes them when asked)
    shrink: ShrinkResult
    original: ModelStats  # the unpruned input
    skipped_masks: list[str] = field(default_factory=list)  # shared initializers with no name
    # seconds per phase: load, groups, importance, select, zero (the reference), then the
    # shrink's own phases (its validate is the proof), and masks when written
    timings: dict[str, float] = field(default_factory=dict)
    started: float = 0.0  # time.perf_counter() when the first phase began
    target: Any = None  # the Target met (targets.Target)
    reached: float | None = None  # its measure of the result (a fraction of the input's)
    allocation: str = "uniform"
    compensate: str = "none"
    price: Any = None  # what the prune cost (price.Price), measured before it was written
    families: list[Family] | None = None  # the measured sensitivity
    predicted: float | None = None  # the relative error the sensitivity predicts for the plan
    # the values changed other than by zeroing, by framework name (`--weights-out`); those
    # with no framework parameter of that value under onnx/NAME, named in `unnamed_weights`
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    unnamed_weights: list[str] = field(default_factory=list)

    @property
    def masks(self) -> dict[str, np.ndarray]:
        """Framework parameter (or initializer) name -> 0/1 mask, as `--masks-out` writes them:
        made on first use (a model's worth of arrays, which the pruned model does not need)."""
        return self.slices.masks()

    @property
    def model(self) -> onnx.ModelProto:
        return self.shrink.model

    def removed(self) -> list[int]:
        return [i for p in self.plans for i in p.removed]

    def to_dict(self) -> dict[str, Any]:
        quality = {
            "target": {"kind": self.target.kind, "value": self.target.value} if self.target else None,
            "reached": self.reached,
            "allocation": self.allocation,
            "compensate": self.compensate,
            "price": self.price.to_dict() if self.price is not None else None,
            "sensitivity": [f.to_dict() for f in self.families] if self.families else None,
            "predicted_error": self.predicted,
            "weights_out": sorted(self.weights),
            "timings": self.timings,
        }
        return prune_report(self.plans, self.original, self.skipped_masks, self.shrink.to_dict(), quality)


QUALITY_KEYS = (
    "target", "reached", "allocation", "compensate", "price", "sensitivity", "predicted_error", "weights_out", "timings",
)  # fmt: skip


def prune_report(
    plans: list[LayerPlan],
    original: ModelStats,
    skipped: list[str],
    shrink: dict[str, Any],
    quality: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What --report writes for a prune (`shrink`: the shrink's report, or an empty one of the
    same keys when the shrink made no result; `quality`: the target, the price, the sensitivity,
    each None when not made)."""
    layers = [
        {
            "layer": p.layer.name,
            "kind": p.layer.kind,
            "groups": p.total,
            "removed": len(p.removed),
            "ignored": p.ignored,
        }
        for p in plans
        if p.total
    ]
    return {
        "layers": layers,
        "original": {"params": original.params, "macs": original.macs},
        "skipped_masks": skipped,
        "shrink": shrink,
        **dict.fromkeys(QUALITY_KEYS),
        **(quality or {}),
    }


@scoped
def prune(
    model: str | Path | onnx.ModelProto,
    ratio: float | None = None,
    output: str | Path | None = None,
    *,
    how: PruneOptions | None = None,
    options: ShrinkOptions | None = None,
    **option_values: Any,
) -> PruneResult:
    """Remove the least important groups by `criterion` ("l1", "l2", "random", or on the
    calibration inputs `data`: "activation", "wanda", "fluctuation") and shrink exactly.

    What to remove: `ratio` of every layer's groups (`allocation` "uniform", the default), of all
    groups ranked together ("global", or `global_ranking`), or where the measured sensitivity
    says it costs least ("sensitivity", on `data`); or as much as keeps the fraction `params`,
    `macs` or `latency` (measured with onnxruntime) of the input's: give exactly one of `ratio`,
    `params`, `macs`, `latency`. `compensate` "bias" folds each removed channel's mean on `data`
    into its consumers' biases, "refit" also refits their weights on the kept channels (ridge
    least squares, `ridge` x the channels' mean variance). `sensitivity`: write the measured
    curves there (a self-contained HTML page). `price`: measure what the prune cost on
    `held_out` (else `data`, else the proof's random inputs). Shrink options as for `shrink`
    (validation is against the model with the groups zeroed and the biases compensated).
    `units`: the unit kinds that may go (default: every kind but `block`; see groups.UNITS).

    What to prune is a `PruneOptions` (`how`; each argument above is one of its fields), how to
    shrink a `ShrinkOptions` (`options`); keyword arguments name fields of either."""
    how, opts = _options(ratio, how, options, option_values)
    units = _check_units(how.units)
    check_options(opts)  # before the groups and importance are computed, not at the shrink
    ask = Request(  # checked as it is made, before any work
        _target(how.ratio, how.params, how.macs, how.latency),
        how.criterion, how.allocation or ("global" if how.global_ranking else "uniform"), how.compensate, how.ridge,
        how.ignore, how.round_to, how.max_layer_ratio, units, how.data, how.held_out, how.sensitivity, how.masks_out,
        how.weights_out, how.price,
    )  # fmt: skip
    clock = PhaseClock()
    given = _read_input(model, output, ask, opts)
    opts = opts.but(found_shapes=given.found)  # the shrink draws where the input ran
    clock.lap("load")
    gset = _find_groups(given, ask, opts)
    clock.lap("groups")
    with _out_of_collections():
        target = _ratio_target(given, gset, ask, opts)
        clock.lap("target")
        scored = _score(given, gset, ask, opts, clock, target)
        choice, zeroed, result, cost = _choose_and_shrink(given, scored, ask, opts, target, output, clock)
        return _outputs(given, scored, choice, zeroed, result, cost, ask, clock)


@contextlib.contextmanager
def _out_of_collections() -> Iterator[None]:
    """What is alive now (the groups: a 1.1 B LLaMA's 848 K members, found with their analysis
    collected) is left out of the cyclic collector's passes until the prune ends (gc.freeze):
    they hold no cycles, and every full collection the shrink's objects set off scanned them all
    again (2.7 s of SmolLM-135M's prune, loaded machine). Given back to it at the end, whatever
    happened (gc.unfreeze), as they were. Nothing is frozen when the process froze objects of its
    own (a forking server's): its freeze is its own to undo, not the prune's."""
    mine = gc.isenabled() and gc.get_freeze_count() == 0
    if mine:
        gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()


# Times the groups are chosen again when the shrink would keep some of them (then, the shrink
# keeps what it must and says so).
CHOOSE_AGAIN = 3


class _ChosenKept(Exception):
    """The shrink's analysis keeps some index of chosen groups: {group id: why}."""

    def __init__(self, groups: dict[int, str]):
        super().__init__(f"{len(groups)} chosen group(s) kept")
        self.groups = groups


def _all_go(chosen: list[Group]) -> Callable[[Any], None]:
    """The check the shrink runs on the analysis of the reference: every chosen group goes."""

    def check(analysis: Any) -> None:
        kept = kept_when_zeroed(analysis, chosen)
        if kept:
            raise _ChosenKept(kept)

    return check


def _without(kept: dict[int, str], given: Input, scored: Scored, zeroed: Zeroed, opts: ShrinkOptions) -> None:
    """The groups the shrink would keep are not exact (with why), and what the last choice
    changed is undone: its spilled weights, the input its reference was made in."""
    _not_exact(kept, scored.gset, len(zeroed.chosen), opts)
    if zeroed.scratch is not None:
        zeroed.scratch.discard_spills()
    if zeroed.reference is scored.builder.model:  # zeroed in place: the input read again
        given.proto = scored.builder.model = _own_copy(given.source)


def _not_exact(kept: dict[int, str], gset: GroupSet, chosen: int, opts: ShrinkOptions) -> None:
    """The groups a shrink would keep ({group id: why}) are not exact, and the run says so."""
    gset.not_exact(kept)
    opts.say(
        f"{len(kept)} of the {chosen} groups chosen cannot be removed "
        f"({next(iter(kept.values()))}); choosing again without them"
    )


def _choose_and_shrink(
    given: Input, scored: Scored, ask: Request, opts: ShrinkOptions, target: Target, output: str | Path | None,
    clock: PhaseClock,
) -> tuple[alloc.Choice, Zeroed, ShrinkResult, Price | None]:  # fmt: skip
    """The groups chosen, zeroed and shrunk. The shrink checks that every chosen group goes (its
    analysis is of the model with them zeroed: the only verification the groups get); those it
    would keep are not exact, and the groups are chosen again without them, a few times at most."""
    meters: list[LatencyMeter] = []
    before = None
    try:
        for tries_left in range(CHOOSE_AGAIN, -1, -1):
            choice = _allocate(given, scored, ask, opts, meters, target)
            clock.lap("allocation")
            if ask.price and before is None:
                # a large input's run on the price's inputs starts now, beside the shrink
                before = run_ahead(_price_input(given, scored, ask, opts, meters))
                clock.lap("price.input")
            zeroed = _zero(given, scored, choice, ask, opts)  # may zero given.proto in place
            clock.lap("zero")
            check = _all_go(zeroed.chosen) if tries_left else None
            try:
                result, cost = _shrink_and_write(given, scored, zeroed, choice.plans, ask, opts, output, before, clock, check)
                return choice, zeroed, result, cost
            except _ChosenKept as kept:
                clock.lap("shrink")
                _without(kept.groups, given, scored, zeroed, opts)
        raise AssertionError("the last try has no check")  # pragma: no cover
    finally:
        if before is not None:
            before.settled()


def _options(
    ratio: float | None, how: PruneOptions | None, options: ShrinkOptions | None, values: Mapping[str, Any]
) -> tuple[PruneOptions, ShrinkOptions]:
    """What to prune (`how`, changed by the keywords that name its fields, and `ratio`) and how
    to shrink (`options`, changed by the other keywords: an unknown name is refused there)."""
    pruning = {f.name for f in fields(PruneOptions)}
    told = {k: v for k, v in values.items() if k in pruning} | ({} if ratio is None else {"ratio": ratio})
    return (how or PruneOptions()).but(**told), (options or ShrinkOptions()).but(
        **{k: v for k, v in values.items() if k not in pruning}
    )


# ---------------------------------------------------------------------- the request
@dataclass
class Request:
    """What a prune is asked (prune's arguments, the target made one `Target`), checked."""

    target: Target
    criterion: str
    allocation: str
    compensate: str
    ridge: float
    ignore: Sequence[str]
    round_to: int | None
    max_layer_ratio: float
    units: tuple[str, ...]
    data: list[Mapping[str, np.ndarray]] | None
    held_out: list[Mapping[str, np.ndarray]] | None
    sensitivity: str | Path | None
    masks_out: str | Path | None
    weights_out: str | Path | None
    price: bool

    def __post_init__(self) -> None:
        self.check()

    @property
    def needs(self) -> list[str]:
        """The choices that read the model's activations on the calibration inputs."""
        return [
            *([f"--criterion {self.criterion}"] if self.criterion in DATA_CRITERIA else []),
            *([f"--compensate {self.compensate}"] if self.compensate != "none" else []),
            *(["--allocation sensitivity"] if self.allocation == "sensitivity" else []),
            *(["--sensitivity"] if self.sensitivity is not None else []),
        ]

    @property
    def measures_sensitivity(self) -> bool:
        return self.allocation == "sensitivity" or self.sensitivity is not None

    def check(self) -> None:
        """Refuse choices that cannot mean anything, or lack what they need, before any work."""
        if self.allocation not in ALLOCATIONS:
            raise ShrinkError(f"--allocation {self.allocation}: choose one of {', '.join(ALLOCATIONS)}.")
        if self.compensate not in COMPENSATIONS:
            raise ShrinkError(f"--compensate {self.compensate}: choose one of {', '.join(COMPENSATIONS)}.")
        if not (np.isfinite(self.ridge) and self.ridge >= 0):
            raise ShrinkError(f"--ridge {self.ridge}: give a regularization >= 0 (1 by default).")
        if self.needs and not self.data:
            raise ShrinkError(
                f"{', '.join(self.needs)} read(s) the model's activations on your inputs: give them with "
                "--inputs data.npz (one array per model input; a batch of samples along the batch axis)."
            )
        if self.weights_out is not None and self.compensate == "none":
            raise ShrinkError(
                f"--weights-out {self.weights_out}: it writes the values --compensate changes; add "
                "--compensate bias (or refit), or drop --weights-out."
            )
        for flag, path in (("--masks-out", self.masks_out), ("--weights-out", self.weights_out)):
            if path is not None:
                masks_kind(path, flag)  # a name it cannot write is refused before any work


def _check_units(units: Sequence[str] | None) -> tuple[str, ...]:
    out = tuple(DEFAULT_UNITS if units is None else units)
    unknown = sorted(set(out) - set(UNITS))
    if unknown:
        raise ShrinkError(f"--units {' '.join(unknown)}: choose among {', '.join(UNITS)}.")
    return out


# ---------------------------------------------------------------------- the phases
@dataclass
class Input:
    """The model to prune, read once: its `Source`, this call's own copy (the caller's proto is
    never changed; the references are made from this copy), the shapes the proof draws, and the
    statistics of the unpruned input. A model with external data stays on disk (`streamed`):
    its weights are mapped as they are read, and `full()` loads them for what still needs them
    in memory (a latency target's sessions and candidates, the sensitivity's runs)."""

    source: Source
    proto: onnx.ModelProto
    shapes: dict[str, list[int]]
    original: ModelStats
    found: dict[str, list[int]]  # the sizes found for its free dynamic dims (proof.sizes)
    # its MACs at `shapes`, and each node's (report.macs_of: one shape inference, for its
    # statistics and for what the groups cost; zeroing weights changes neither)
    macs: tuple[int, dict[str, int]] | None = None
    _full: onnx.ModelProto | None = None

    @property
    def streamed(self) -> bool:
        """Weights on disk, read mapped, the reference's zeroed ones spilled: as the shrink does
        a large model with external data (a small one's are read into memory)."""
        s = self.source
        return s.base_dir is not None and s.streamed and not in_memory(s.file_bytes)

    def full(self) -> onnx.ModelProto:
        """The input with its weights in memory (read on first use)."""
        if not self.streamed:
            return self.proto
        if self._full is None:
            self._full = onnx.ModelProto()
            self._full.CopyFrom(self.proto)
            load_external(self._full, Path(str(self.source.base_dir)), str(self.source.path))
        return self._full


def _read_input(model: str | Path | onnx.ModelProto, output: str | Path | None, ask: Request, opts: ShrinkOptions) -> Input:
    """The input read and checked (the output may not overwrite it; its inputs fit the
    calibration and held-out feeds), before the groups are found."""
    source = read_model(model)
    if output is not None:  # the shrink below sees an in-memory model: guard the input here
        check_output(output, protect=source.protected)
    check_against_model(source.proto, opts, str(source.path or "model"))  # before the groups
    for feeds in (ask.data, ask.held_out):
        check_inputs(source.proto, feeds)  # names, dtypes and shapes, each named
    proto = _own_copy(source)
    # the unpruned input as its file holds it (before the reference is made from it: Constant
    # weights made initializers, a weight copied per reader), at the shapes the proof draws
    found = dict(with_found_shapes(proto, opts, source.base_dir, source.file_bytes).found_shapes or {})
    shapes = resolve_shapes(proto, {**found, **(opts.input_shapes or {})})
    macs = macs_of(proto, shapes)
    return Input(source, proto, shapes, model_stats(proto, shapes, source.file_bytes, macs[0]), found, macs)


def _own_copy(source: Source) -> onnx.ModelProto:
    """This call's own copy of the input (the caller's is never changed), its weights in memory
    unless it is streamed."""
    proto = onnx.ModelProto()
    proto.CopyFrom(source.proto)
    if source.base_dir is not None and (not source.streamed or in_memory(source.file_bytes)):
        load_external(proto, Path(source.base_dir), str(source.path))
    return proto


def _find_groups(given: Input, ask: Request, opts: ShrinkOptions) -> GroupSet:
    opts.say("finding the coupled groups ...")
    # grouped-query attention's query heads by rank when heads may go but K/V groups may not
    query_ranks = "head" in ask.units and "kv_group" not in ask.units
    return find_groups(
        given.proto,
        given.source.base_dir,
        str(given.source.path or ""),
        verify=False,  # the shrink checks the groups chosen (`_all_go`)
        query_ranks=query_ranks,
        store=given.source.store,
        progress=opts.progress,
    )


@dataclass
class Scored:
    """The groups scored: their importance, what the calibration inputs showed, what the
    compensation reads, the builder of each plan's reference, and the measured sensitivity."""

    gset: GroupSet
    importance: np.ndarray
    calibration: Calibration | None
    comp: Compensation | None
    builder: alloc.Builder
    families: list[Family] | None


def _score(
    given: Input, gset: GroupSet, ask: Request, opts: ShrinkOptions, clock: PhaseClock, target: Target
) -> Scored:
    """Calibration, importance, the compensation's consumers and the sensitivity, each timed."""
    calibration = None
    if ask.needs:
        opts.say(f"running the model on the calibration inputs ({len(ask.data or [])} feed(s)) ...")
        # a streamed input runs in segments, its weights read from disk (the refit's samples
        # too, unless a feed has more positions than are sampled: collect runs it whole then)
        calibration = collect(
            given.proto,  # a streamed input: its weights read from disk (data_dir)
            activations(gset.exact()),
            ask.data or [],
            samples=ask.compensate == "refit",
            streams=block_streams(gset, gset.exact()),
            seed=opts.seed,
            provider=opts.provider,
            data_dir=given.source.base_dir if given.streamed else None,
            # a streamed input's samples (TinyLlama's: 1 GiB) mapped from a file, not held
            scratch=Scratch(given.source.store, None) if given.streamed and ask.compensate == "refit" else None,
        )
        clock.lap("calibrate")
    importance = scores(gset, ask.criterion, seed=opts.seed, calibration=calibration)
    clock.lap("importance")
    comp = None
    # a streamed input's references (a ratio's, and the candidates a parameter or MAC target
    # counts) are zeroed on disk (`_zero`, `_allocate`), compensated or not; a latency target's
    # candidates (onnxruntime times them), and the sensitivity's runs (one session of the
    # whole model), are made in memory
    on_disk = given.streamed and target.kind != "latency" and not ask.measures_sensitivity
    if ask.compensate != "none" or ask.measures_sensitivity:
        comp = comp_mod.prepare(given.proto, gset, _mapped(given)) if on_disk else comp_mod.prepare(given.full(), gset)
        clock.lap("compensation")
    held = not on_disk and (comp is not None or target.kind == "latency")
    builder = alloc.Builder(given.full() if held else given.proto, gset, comp, calibration, ask.compensate, ask.ridge)
    scored = Scored(gset, importance, calibration, comp, builder, None)
    if ask.measures_sensitivity:
        scored.families = _sensitivity(given, scored, ask, opts)
        clock.lap("sensitivity")
    return scored


def _mapped(given: Input) -> Callable[[onnx.TensorProto], np.ndarray]:
    """How a streamed input's initializers are read: a read-only view of the mapped external
    data (nothing read until used), else the TensorProto's own values."""
    store, base_dir = given.source.store, str(given.source.base_dir)

    def read(t: onnx.TensorProto) -> np.ndarray:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            return store.array(t, base_dir)
        return onnx.numpy_helper.to_array(t)

    return read


def _sensitivity(given: Input, scored: Scored, ask: Request, opts: ShrinkOptions) -> list[Family]:
    """Each family's measured deviation as more of it goes; the page written when asked."""
    calibration = scored.calibration
    assert calibration is not None
    opts.say("measuring each family's sensitivity on the calibration inputs ...")
    families = alloc.measure_families(
        alloc.families_of(scored.gset, scored.importance, ask.ignore, ask.units),
        scored.builder,
        calibration,
        round_to=ask.round_to,
        max_layer_ratio=ask.max_layer_ratio,
        say=opts.say,
        progress=opts.progress,
    )
    if ask.sensitivity is not None:
        how = (
            f"Each family pruned alone ({ask.criterion} order, compensation {ask.compensate}) at each "
            f"ratio; relative output error on the calibration inputs ({calibration.source})."
        )
        with file_access(ask.sensitivity):
            title = f"Sensitivity of {given.source.path or 'the model'}"
            write_sensitivity(families, ask.sensitivity, title, how)
    return families


def _ratio_target(given: Input, gset: GroupSet, ask: Request, opts: ShrinkOptions) -> Target:
    """What `--prune R` means, printed before the work: the parameter and MAC fractions R of
    every layer's groups remove, counted on that plan shrunk without the proof where a weight is
    read by several nodes (the shrink may store it apart per reader), else estimated from the
    groups (and for a streamed input); the choice within a layer does not change them where
    its groups cost alike); the target every allocation then meets: R itself (uniform), or that
    fraction of the parameters (global, sensitivity). A group that shrink would keep is not
    exact (as the prune's own shrink finds: `_without`), and the plan is chosen again."""
    if ask.target.kind != "ratio":
        return ask.target
    from onnxshrink.prune.select import choose
    from onnxshrink.prune.targets import ratio_meaning

    costs = Costs(gset, given.proto, given.shapes, given.macs)
    for tries_left in range(CHOOSE_AGAIN, -1, -1):
        plans = choose(
            gset, np.zeros(len(gset.groups)), ask.target.value, ignore=ask.ignore, round_to=ask.round_to,
            max_layer_ratio=ask.max_layer_ratio, units=ask.units,
        )  # fmt: skip
        meaning = ratio_meaning(gset, ask.target.value, costs, plans)
        if given.streamed or meaning.params <= 0.0 or not gset.untied:
            # the estimate: a streamed input is not shrunk twice, and without a weight several
            # nodes read the groups' costs are what the shrink removes (but for a fold's constant)
            break
        chosen = [gset.groups[i] for p in plans for i in p.removed]
        try:
            meaning = _counted(given, gset, chosen, meaning, opts.but(check_analysis=_all_go(chosen) if tries_left else None))
            break
        except _ChosenKept as kept:
            _not_exact(kept.groups, gset, len(chosen), opts)
    opts.say(meaning.text(ask.allocation))
    return meaning.target(ask.allocation) or ask.target


def _counted(given: Input, gset: GroupSet, chosen: list[Group], meaning: RatioMeaning, opts: ShrinkOptions) -> RatioMeaning:
    """`meaning` with the fractions counted on the `chosen` groups zeroed and shrunk (analysis and
    rewrite, quietly, without the proof), against the input's own counts. The groups' costs miss
    what the shrink stores anew: a shared weight's copy per reader where they keep different
    slices, a fold's constant."""
    reference = zeroed_reference(given.proto, gset, gset.zeroed_members(chosen), copy=True)
    quiet = opts.but(validate=False, log=None, progress=False, input_masked=None)
    after = shrink_reference(reference, quiet, given.original).after
    params, macs = given.original.params, given.original.macs
    return replace(
        meaning,
        params=1.0 - after.params / max(params, 1),
        macs=1.0 - after.macs / macs if macs else meaning.macs,
        counted=True,
    )


def _allocate(
    given: Input, scored: Scored, ask: Request, opts: ShrinkOptions, meters: list[LatencyMeter], target: Target
) -> alloc.Choice:
    """The plans meeting `target`: measured targets are met by shrinking candidate
    references, quietly (`meters`: the latency meter, made on first use, kept for the price)."""
    quiet = opts.but(validate=False, log=None, progress=False, input_masked=None)

    def shrunk(reference: onnx.ModelProto) -> onnx.ModelProto:
        return shrink_reference(reference, quiet, given.original).model

    def count(plans: list[LayerPlan]) -> tuple[int, int]:
        if _zeroed_on_disk(given, scored):  # a streamed input: never the model in memory
            reference, scratch = _disk_reference(given, scored, plans)
            try:
                after = shrink_reference(reference, quiet, given.original).after
            finally:
                scratch.discard_spills()
        else:
            after = shrink_reference(scored.builder.reference(plans), quiet, given.original).after
        # a shrink's result holds reference cycles: the candidate (in memory, a copy of the
        # input's weights and its shrink) goes now, not at some later full collection (SmolLM2-
        # 135M in memory: 1.1 GiB held through the final shrink, peak 5.56 -> 4.41 GiB)
        gc.collect()
        return after.params, after.macs

    def meter() -> LatencyMeter:
        if not meters:
            feeds = price_feeds(given.proto, ask.held_out, ask.data, given.shapes, opts.draws, opts.seed)[0]
            meters.append(LatencyMeter(given.full(), feeds[0]))
        return meters[0]

    return alloc.plan(
        scored.gset,
        scored.importance,
        target,
        allocation=ask.allocation,
        ignore=ask.ignore,
        round_to=ask.round_to,
        max_layer_ratio=ask.max_layer_ratio,
        units=ask.units,
        builder=scored.builder,
        costs=lambda: Costs(scored.gset, given.proto, given.shapes, given.macs),  # dims only: no weights loaded
        count=count,
        shrunk=shrunk,
        meter=meter,
        families=scored.families,
        say=opts.say,
    )


@dataclass
class Zeroed:
    """The chosen groups zeroed: their members, the reference, what the masks zero, and the
    values the compensation changed by framework name (`unnamed`: those with no name)."""

    chosen: list[Group]
    members: list[Member]
    reference: onnx.ModelProto
    slices: MaskSlices
    weights: dict[str, np.ndarray]
    unnamed: list[str]
    # a streamed input's reference: its weights on disk (the zeroed ones in the spill file of
    # `scratch`, which lives as long as this), the Source the shrink reads it as
    source: Source | None = None
    scratch: Scratch | None = None

    @property
    def shrink_input(self) -> onnx.ModelProto | Source:
        return self.source if self.source is not None else self.reference


def _zero(given: Input, scored: Scored, choice: alloc.Choice, ask: Request, opts: ShrinkOptions) -> Zeroed:
    gset, plans = scored.gset, choice.plans
    chosen = [gset.groups[i] for p in plans for i in p.removed]
    opts.say(f"removing {len(chosen)} of {len(gset.exact())} exact groups ({ask.criterion}, {ask.allocation})")
    members = gset.zeroed_members(chosen)
    source = scratch = None
    if _zeroed_on_disk(given, scored):  # zeroed (and compensated) on disk, tensor by tensor
        source, scratch = _disk_reference(given, scored, plans)
        reference = source.proto
    else:  # given.proto is this call's own copy: the last reference may be made in it
        reference = scored.builder.reference(plans, copy=scored.comp is not None or ask.target.kind != "ratio")
    # after zeroed, which makes Constant weights initializers (as the analysis saw them): their
    # masks were left out as if shared
    framework = any(m.params for g in gset.groups for m in g.members)
    slices = mask_slices(reference, members, framework, gset.untied)
    comp = scored.comp
    weights, unnamed = comp_mod.framework_values(gset, scored.builder.values, comp) if comp is not None else ({}, [])
    return Zeroed(chosen, members, reference, slices, weights, unnamed, source, scratch)


def _zeroed_on_disk(given: Input, scored: Scored) -> bool:
    """Is a reference of this prune zeroed on disk (a streamed input, no reference held in
    memory: no latency target, no sensitivity measured)?"""
    return scored.builder.model is given.proto and given.streamed


def _disk_reference(given: Input, scored: Scored, plans: list[LayerPlan]) -> tuple[Source, Scratch]:
    """The streamed input with the plans' groups zeroed (and compensated) on disk, tensor by
    tensor (the zeroed weights' ranges of a spill file in the returned Scratch, reserved,
    written only when read whole), as the Source the shrink reads."""
    scratch = Scratch(given.source.store, None)
    disk = Disk(str(given.source.base_dir), given.source.store, scratch.spill())
    reference = scored.builder.on_disk(plans, disk)
    disk.writer.close()
    s = given.source
    data = [*s.data, disk.writer.path]
    return Source(reference, None, s.base_dir, data, s.file_bytes, s.store, mapped_in_place=s.mapped_in_place), scratch


def shrink_reference(reference: onnx.ModelProto | Source, opts: ShrinkOptions, original: ModelStats) -> ShrinkResult:
    """The exact shrink of a prune's reference, an in-memory model whose zeros are the masks,
    nothing written; `before` is the unpruned input's `original`."""
    return shrink(reference, options=opts, input_stats=original)


def _shrink_and_write(
    given: Input,
    scored: Scored,
    zeroed: Zeroed,
    plans: list[LayerPlan],
    ask: Request,
    opts: ShrinkOptions,
    output: str | Path | None,
    before: PriceInput | None,
    clock: PhaseClock,
    check: Callable[[Any], None] | None = None,
) -> tuple[ShrinkResult, Price | None]:
    """The reference shrunk exactly, the price measured, and the outputs written. The masks (and
    weights) are written before the shrink (a place they cannot be written fails the run before
    the model is), staged beside their name, and put there only once the shrink has passed: a
    refused or failed shrink leaves neither. `check`: run on the reference's analysis."""
    # The reference is in memory: say what the input was, so that the output is written as a
    # plain shrink of it would be (external data when the input had it) and never over it.
    external = opts.external_data if opts.external_data is not None else bool(given.source.data)
    shrink_opts = opts.but(input_masked=None, external_data=external)
    staged: dict[Path, Path] = {}
    try:
        _stage(zeroed, ask, staged)
        clock.lap("masks")
        result = shrink_reference(zeroed.shrink_input, shrink_opts.but(check_analysis=check), given.original)
        _check_removed(result, zeroed, ask, output, shrink_opts)
        clock.lap("shrink")  # its phases are the shrink's own timings
        cost = _priced(given, result, ask, opts, before, clock) if before is not None else None
        if output is not None:
            t0 = time.perf_counter()
            # as the input's shrink: external data because the input had it (not asked for),
            # never larger than the input's files
            s = given.source
            as_input = Source(result.reference, base_dir=s.base_dir, data=s.data, mapped_in_place=s.mapped_in_place)
            save(result, as_input, output, shrink_opts.but(external_data=opts.external_data), given.original.file_bytes)
            if given.source.path is not None:
                write_runtime_configs(result, given.source.path, given.proto, given.source.base_dir, output, scored.gset)
            result.timings["save"] = time.perf_counter() - t0
        for path, tmp in staged.items():
            with file_access(path):
                os.replace(tmp, path)
        clock.lap("save")
    except ValidationFailed as exc:  # its report, as a prune's (the same keys as one that passed)
        if exc.result is not None:
            exc.result.before = given.original
            if output is not None and opts.keep_failed:
                save(exc.result, Source(exc.result.reference), output, shrink_opts)
        shrunk_report = exc.result.to_dict() if exc.result is not None else ShrinkResult.empty_report()
        exc.report = prune_report(plans, given.original, zeroed.slices.skipped, shrunk_report)
        raise
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    result.before = given.original  # what the table and the summary compare with: the input
    return result, cost


def _stage(zeroed: Zeroed, ask: Request, staged: dict[Path, Path]) -> None:
    """The masks and weights written beside their names, into `staged`. A prune that removed
    nothing has no masks, and changed nothing: no file (an empty one is no masks file)."""
    if ask.masks_out is not None and zeroed.slices.zeroed:
        staged[Path(ask.masks_out)] = stage_masks(zeroed.slices.masks(), ask.masks_out)
    if ask.weights_out is not None and zeroed.weights:
        staged[Path(ask.weights_out)] = stage_masks(zeroed.weights, ask.weights_out)


def _check_removed(
    result: ShrinkResult, zeroed: Zeroed, ask: Request, output: str | Path | None, opts: ShrinkOptions
) -> None:
    """NotShrunk when none of the groups chosen could be removed (the model with them zeroed,
    written only with --keep-failed)."""
    if not zeroed.chosen or removed_any(result.reference, result.model, zeroed.members):
        return
    kept = output is not None and opts.keep_failed
    if kept:
        assert output is not None
        save(result, Source(result.reference), output, opts)
    target = ask.target
    raise NotShrunk(
        f"{target.flag()} {target.value:g}: none of the {len(zeroed.chosen)} groups chosen could "
        "be removed (" + _why_kept(result) + "); the model with them zeroed would have the "
        "pruned model's quality at the input's size. "
        + ("It was written anyway (--keep-failed)." if kept else "Nothing was written.")
    )


def _price_input(
    given: Input, scored: Scored, ask: Request, opts: ShrinkOptions, meters: list[LatencyMeter]
) -> PriceInput:
    """What the price compares the pruned model with, chosen before any group is zeroed: the
    input untouched (its file, or the caller's model: `given.proto` is the copy a `--prune
    RATIO` without compensation zeroes in place), and the inputs, drawn from it when not given."""
    feeds: list[Mapping[str, np.ndarray]] = []
    label = "inputs"
    try:
        feeds, label = price_feeds(given.proto, ask.held_out, ask.data, given.shapes, opts.draws, opts.seed)
        calibration = scored.calibration
        known = calibration.outputs if calibration is not None and not ask.held_out else None
        source = given.source
        untouched = str(source.path) if source.path is not None else source.proto
        meter = meters[0] if meters else None
        # source.proto: the input as read (given.proto is the copy the groups are zeroed in)
        return price_input(given.proto, untouched, feeds, label, known, meter, source.proto, source.base_dir)
    except Exception as exc:  # inputs it cannot draw
        return PriceInput(None, feeds, label, note=f"not measured: {first_line(exc)}")


def _priced(
    given: Input, result: ShrinkResult, ask: Request, opts: ShrinkOptions, before: PriceInput, clock: PhaseClock
) -> Price:
    """What the prune cost, measured and said: the shrunk model against the input model as it
    was before anything was zeroed (`before`), on the same inputs."""
    opts.say("measuring the price ...")
    # the weight pages the prune mapped go back to the page cache before onnxruntime maps and
    # reads the models' own (the two add up at the price's peak: SmolLM2-135M 1.14 -> 0.95 GiB)
    mapped.trim(0)
    try:
        data = result.data_file  # the pruned model's weights, when they are in a file
        cost = measure(before, result.model, opts.progress, data.parent if data is not None else None)
    except Exception as exc:  # ops onnxruntime cannot run (--no-validate)
        if isinstance(exc, ShrinkError) and ask.held_out:
            raise  # the user's held-out inputs the pruned model cannot run on
        cost = Price(before.label, note=f"not measured: {first_line(exc)}")
    if cost.latency_after_ms is not None and given.original.macs:
        cost.macs_ratio = result.after.macs / given.original.macs
    clock.lap("price")
    for line in cost.lines():
        opts.say(line)
    return cost


def _outputs(
    given: Input,
    scored: Scored,
    choice: alloc.Choice,
    zeroed: Zeroed,
    result: ShrinkResult,
    cost: Price | None,
    ask: Request,
    clock: PhaseClock,
) -> PruneResult:
    """What the prune did, its phases' timings followed by its shrink's."""
    timings = {**clock.timings, **{f"shrink.{k}": v for k, v in result.timings.items()}}
    slices = zeroed.slices
    out = PruneResult(scored.gset, choice.plans, slices, result, given.original, slices.skipped, timings, clock.started)
    out.target, out.reached, out.allocation, out.compensate = ask.target, choice.reached, ask.allocation, ask.compensate
    out.price, out.families, out.weights, out.unnamed_weights = cost, scored.families, zeroed.weights, zeroed.unnamed
    if scored.families is not None:
        out.predicted = predicted_error(scored.families, {p.layer.id: len(p.removed) for p in choice.plans})
    return out


def _target(ratio, params, macs, latency):
    given = [
        Target(kind, float(v))
        for kind, v in (("ratio", ratio), ("params", params), ("macs", macs), ("latency", latency))
        if v is not None
    ]
    if len(given) != 1:
        raise ShrinkError(
            "give one of --prune RATIO, --prune-to-params, --prune-to-macs, --prune-to-latency"
            + (f" (not {' and '.join(t.flag() for t in given)})" if given else "")
            + "."
        )
    given[0].check()
    return given[0]


def write_sensitivity(families, path: str | Path, title: str, how: str) -> None:
    """The page, written beside its name and renamed over it (never half-written). It describes
    the input model, so it is written whether or not the prune's shrink then passes."""
    from onnxshrink.prune.sensitivity import write_html

    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent.absolute())
    os.close(fd)
    try:
        write_html(families, tmp, title, how)
        as_created(tmp)
        os.replace(tmp, p)
    finally:
        Path(tmp).unlink(missing_ok=True)


def predicted_error(families, chosen) -> float:
    from onnxshrink.prune.sensitivity import predicted

    return predicted(families, chosen)


def removed_any(reference: onnx.ModelProto, shrunk: onnx.ModelProto, members: list[Member]) -> bool:
    """Did the shrink take out any of the members' slices (their weights, under the name they
    have in the reference or the analysis's copy of a shared one, hold fewer elements)?"""
    names = {n for m in members for n in (m.initializer, m.tensor)}

    def held(model: onnx.ModelProto) -> int:  # in every scope, as initializers or Constant nodes
        total = 0
        opset = default_opset(model)
        for g in ir.all_graphs(model.graph):
            total += sum(math.prod(t.dims) for t in g.initializer if t.name in names)
            for n in g.node:
                value = constant_weight(n, opset) if n.output and n.output[0] in names else None
                total += math.prod(value.dims) if value is not None else 0
        return total

    return held(shrunk) < held(reference)


def _why_kept(result: ShrinkResult) -> str:
    if result.kept_after_failed_proof:
        return f"the proof failed ({result.first_failure}) and they were kept back"
    reasons = sorted({k.reason for k in result.kept_zeroed})
    return "; ".join(reasons[:3]) if reasons else "the analysis kept them"



"""`prune`: choose whole groups by importance, zero them, and shrink exactly.

The pruned model is not the input model (it is pruned): it is the input with the chosen groups
zeroed, the *reference*, and the shrink is proven against that reference as any shrink is. The
masks that make the reference are returned (and written with `masks_out`) under the framework's
parameter names the exporter recorded, so that they can be applied in the framework too.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxshrink import ir
from onnxshrink.analyze.replay import scoped
from onnxshrink.api import (
    ShrinkResult,
    Source,
    check_against_model,
    check_options,
    read_model,
    save,
    shrink,
    write_runtime_configs,
)
from onnxshrink.errors import NotShrunk, ShrinkError, ValidationFailed, file_access, first_line
from onnxshrink.io.model import check_output, load_external
from onnxshrink.options import (
    ALLOCATIONS,
    COMPENSATIONS,
    DATA_CRITERIA,
    DEFAULT_UNITS,
    UNITS,
    ShrinkOptions,
)
from onnxshrink.progress import PhaseClock
from onnxshrink.proof.inputs import check_inputs, resolve_shapes
from onnxshrink.prune.groups import GroupSet, Member, find_groups
from onnxshrink.prune.importance import scores
from onnxshrink.prune.masks_out import MaskSlices, as_created, mask_slices, masks_kind, stage_masks
from onnxshrink.prune.select import LayerPlan
from onnxshrink.report import ModelStats, model_stats


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
    target: Any = None  # the Target met (targets.Target)
    reached: float | None = None  # its measure of the result (a fraction of the input's)
    allocation: str = "uniform"
    compensate: str = "none"
    price: Any = None  # what the prune cost (price.Price), measured before it was written
    families: list | None = None  # the measured sensitivity (sensitivity.Family)
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
        }
        return prune_report(self.plans, self.original, self.skipped_masks, self.shrink.to_dict(), quality)


QUALITY_KEYS = ("target", "reached", "allocation", "compensate", "price", "sensitivity", "predicted_error", "weights_out")


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
    criterion: str = "l1",
    global_ranking: bool = False,
    allocation: str | None = None,
    compensate: str = "none",
    ridge: float = 1.0,
    macs: float | None = None,
    params: float | None = None,
    latency: float | None = None,
    ignore: Sequence[str] = (),
    round_to: int | None = None,
    max_layer_ratio: float = 1.0,
    units: Sequence[str] | None = None,
    data: list[Mapping[str, np.ndarray]] | None = None,
    held_out: list[Mapping[str, np.ndarray]] | None = None,
    sensitivity: str | Path | None = None,
    masks_out: str | Path | None = None,
    weights_out: str | Path | None = None,
    price: bool = True,
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
    `units`: the unit kinds that may go (default: every kind but `block`; see groups.UNITS)."""
    from onnxshrink.prune import allocate as alloc
    from onnxshrink.prune import compensate as comp_mod
    from onnxshrink.prune.calibrate import collect
    from onnxshrink.prune.importance import activations, block_streams
    from onnxshrink.prune.targets import Costs, LatencyMeter

    units = tuple(DEFAULT_UNITS if units is None else units)
    unknown = sorted(set(units) - set(UNITS))
    if unknown:
        raise ShrinkError(f"--units {' '.join(unknown)}: choose among {', '.join(UNITS)}.")
    opts = (options or ShrinkOptions()).but(**option_values)
    check_options(opts)  # before the groups and importance are computed, not at the shrink
    target = _target(ratio, params, macs, latency)
    allocation = allocation or ("global" if global_ranking else "uniform")
    if allocation not in ALLOCATIONS:
        raise ShrinkError(f"--allocation {allocation}: choose one of {', '.join(ALLOCATIONS)}.")
    if compensate not in COMPENSATIONS:
        raise ShrinkError(f"--compensate {compensate}: choose one of {', '.join(COMPENSATIONS)}.")
    if not (np.isfinite(ridge) and ridge >= 0):
        raise ShrinkError(f"--ridge {ridge}: give a regularization >= 0 (1 by default).")
    needs = [
        *([f"--criterion {criterion}"] if criterion in DATA_CRITERIA else []),
        *([f"--compensate {compensate}"] if compensate != "none" else []),
        *(["--allocation sensitivity"] if allocation == "sensitivity" else []),
        *(["--sensitivity"] if sensitivity is not None else []),
    ]
    if needs and not data:
        raise ShrinkError(
            f"{', '.join(needs)} read(s) the model's activations on your inputs: give them with "
            "--inputs data.npz (one array per model input; a batch of samples along the batch axis)."
        )
    if weights_out is not None and compensate == "none":
        raise ShrinkError(
            f"--weights-out {weights_out}: it writes the values --compensate changes; add "
            "--compensate bias (or refit), or drop --weights-out."
        )
    for flag, path in (("--masks-out", masks_out), ("--weights-out", weights_out)):
        if path is not None:
            masks_kind(path, flag)  # a name it cannot write is refused before any work
    clock = PhaseClock()
    source = read_model(model)
    if output is not None:  # the shrink below sees an in-memory model: guard the input here
        check_output(output, protect=[source.path, *source.data] if source.path is not None else [])
    check_against_model(source.proto, opts, str(source.path or "model"))  # before the groups
    for given in (data, held_out):
        check_inputs(source.proto, given)  # names, dtypes and shapes, each named
    proto = onnx.ModelProto()
    proto.CopyFrom(source.proto)
    if source.base_dir is not None:
        load_external(proto, Path(source.base_dir), str(source.path))
    # the unpruned input as its file holds it (before the reference is made from it: Constant
    # weights made initializers, a weight copied per reader), at the shapes the proof draws
    shapes = resolve_shapes(proto, opts.input_shapes or {})
    original = model_stats(proto, shapes, source.file_bytes)
    clock.lap("load")
    opts.say("finding the coupled groups ...")
    # grouped-query attention's query heads by rank when heads may go but K/V groups may not
    query_ranks = "head" in units and "kv_group" not in units
    gset = find_groups(proto, name=str(source.path or ""), query_ranks=query_ranks)
    clock.lap("groups")
    calibration = None
    if needs:
        opts.say(f"running the model on the calibration inputs ({len(data or [])} feed(s)) ...")
        calibration = collect(
            proto,
            activations(gset.exact()),
            data or [],
            samples=compensate == "refit",
            streams=block_streams(gset, gset.exact()),
            seed=opts.seed,
            provider=opts.provider,
        )
        clock.lap("calibrate")
    importance = scores(gset, criterion, seed=opts.seed, model=proto, inputs=data, calibration=calibration)
    clock.lap("importance")
    comp = None
    if compensate != "none" or allocation == "sensitivity" or sensitivity is not None:
        comp = comp_mod.prepare(proto, gset)
        clock.lap("compensation")
    builder = alloc.Builder(proto, gset, comp, calibration, compensate, ridge)
    families = None
    if allocation == "sensitivity" or sensitivity is not None:
        assert calibration is not None
        opts.say("measuring each family's sensitivity on the calibration inputs ...")
        families = alloc.measure_families(
            alloc.families_of(gset, importance, ignore, units),
            builder,
            calibration,
            round_to=round_to,
            max_layer_ratio=max_layer_ratio,
            say=opts.say,
        )
        if sensitivity is not None:
            how = (
                f"Each family pruned alone ({criterion} order, compensation {compensate}) at each "
                f"ratio; relative output error on the calibration inputs ({calibration.source})."
            )
            with file_access(sensitivity):
                write_sensitivity(families, sensitivity, f"Sensitivity of {source.path or 'the model'}", how)
        clock.lap("sensitivity")
    quiet = opts.but(validate=False, log=None, progress=False)

    def shrunk(reference: onnx.ModelProto) -> onnx.ModelProto:
        return shrink(reference, None, None, options=quiet.but(input_masked=None), input_stats=original).model

    def count(reference: onnx.ModelProto) -> tuple[int, int]:
        after = shrink(reference, None, None, options=quiet.but(input_masked=None), input_stats=original).after
        return after.params, after.macs

    meters: list[LatencyMeter] = []

    def meter() -> LatencyMeter:
        if not meters:
            meters.append(LatencyMeter(proto, _price_feeds(proto, held_out, data, shapes, opts)[0][0]))
        return meters[0]

    choice = alloc.plan(
        gset,
        importance,
        target,
        allocation=allocation,
        ignore=ignore,
        round_to=round_to,
        max_layer_ratio=max_layer_ratio,
        units=units,
        builder=builder,
        costs=lambda: Costs(gset, proto, shapes),
        count=count,
        shrunk=shrunk,
        meter=meter,
        families=families,
        say=opts.say,
    )
    plans = choice.plans
    clock.lap("select")
    chosen = [gset.groups[i] for p in plans for i in p.removed]
    opts.say(f"removing {len(chosen)} of {len(gset.exact())} exact groups ({criterion}, {allocation})")
    members = gset.zeroed_members(chosen)
    # proto is this call's own copy: the last reference may be made in it
    reference = builder.reference(plans, copy=comp is not None or target.kind != "ratio")
    # after zeroed, which makes Constant weights initializers (as the analysis saw them): their
    # masks were left out as if shared
    framework = any(m.params for g in gset.groups for m in g.members)
    slices = mask_slices(reference, members, framework)
    weights, unnamed = comp_mod.framework_values(gset, builder.values, comp) if comp is not None else ({}, [])
    clock.lap("zero")
    # The masks (and weights) are written before the shrink (a place they cannot be written
    # fails the run before the model is), staged beside their name, and put there only once the
    # shrink has passed: a refused or failed shrink leaves neither. A prune that removed nothing
    # has no masks, and changed nothing: no file (an empty one is no masks file).
    staged = {}
    try:
        if masks_out is not None and slices.zeroed:
            staged[Path(masks_out)] = stage_masks(slices.masks(), masks_out)
        if weights_out is not None and weights:
            staged[Path(weights_out)] = stage_masks(weights, weights_out)
        clock.lap("masks")
        # The reference is in memory: say what the input was, so that the output is written as
        # a plain shrink of it would be (external data when the input had it) and never over it.
        external = opts.external_data if opts.external_data is not None else bool(source.data)
        shrink_opts = opts.but(input_masked=None, external_data=external)
        result = shrink(reference, None, None, options=shrink_opts, input_stats=original)
        if chosen and not removed_any(result.reference, result.model, members):
            if output is not None and opts.keep_failed:
                save(result, Source(result.reference), output, shrink_opts)
            raise NotShrunk(
                f"{target.flag()} {target.value:g}: none of the {len(chosen)} groups chosen could "
                "be removed (" + _why_kept(result) + "); the model with them zeroed would have the "
                "pruned model's quality at the input's size. "
                + ("It was written anyway (--keep-failed)." if output is not None and opts.keep_failed else "Nothing was written.")
            )
        cost = None
        if price:
            opts.say("measuring the price ...")
            try:
                cost = _price(proto, result.model, calibration, held_out, data, shapes, opts, meters)
            except Exception as exc:  # inputs it cannot draw, ops onnxruntime cannot run (--no-validate)
                from onnxshrink.prune.price import Price

                if isinstance(exc, ShrinkError) and held_out:
                    raise  # the user's held-out inputs the model cannot run on
                cost = Price("inputs", note=f"not measured: {first_line(exc)}")
            if cost.latency_after_ms is not None and original.macs:
                cost.macs_ratio = result.after.macs / original.macs
            clock.lap("price")
            for line in cost.lines():
                opts.say(line)
        if output is not None:
            t0 = time.perf_counter()
            save(result, Source(result.reference), output, shrink_opts)
            if source.path is not None:
                write_runtime_configs(result, source.path, proto, None, output, gset)
            result.timings["save"] = time.perf_counter() - t0
        for path, tmp in staged.items():
            with file_access(path):
                os.replace(tmp, path)
    except ValidationFailed as exc:  # its report, as a prune's (the same keys as one that passed)
        if exc.result is not None:
            exc.result.before = original
            if output is not None and opts.keep_failed:
                save(exc.result, Source(exc.result.reference), output, shrink_opts)
        shrunk_report = exc.result.to_dict() if exc.result is not None else ShrinkResult.empty_report()
        exc.report = prune_report(plans, original, slices.skipped, shrunk_report)
        raise
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    result.before = original  # what the table and the summary compare with: the input
    timings = {**clock.timings, **{f"shrink.{k}": v for k, v in result.timings.items()}}
    out = PruneResult(gset, plans, slices, result, original, slices.skipped, timings)
    out.target, out.reached, out.allocation, out.compensate = target, choice.reached, allocation, compensate
    out.price, out.families, out.weights, out.unnamed_weights = cost, families, weights, unnamed
    if families is not None:
        out.predicted = predicted_error(families, {p.layer.id: len(p.removed) for p in plans})
    return out


def _target(ratio, params, macs, latency):
    from onnxshrink.prune.targets import Target

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


def _price_feeds(proto, held_out, data, shapes, opts) -> tuple[list[Mapping[str, np.ndarray]], str]:
    """The inputs the price is measured on, and how to call them."""
    from onnxshrink.proof.inputs import make_inputs
    from onnxshrink.prune.calibrate import feed_label

    if held_out:
        return list(held_out), f"held-out inputs ({feed_label(held_out)})"
    if data:
        return list(data), f"calibration inputs ({feed_label(data)}; no held-out set given: optimistic)"
    drawn: list[Mapping[str, np.ndarray]] = list(make_inputs(proto, shapes, max(opts.draws, 1), opts.seed))
    return drawn, "random inputs (no --inputs given: a poor stand-in for your data)"


def _price(proto, pruned, calibration, held_out, data, shapes, opts, meters):
    from onnxshrink.proof.sessions import SEGMENT_BYTES, session
    from onnxshrink.prune.calibrate import run_feeds
    from onnxshrink.prune.price import Price, compare_outputs
    from onnxshrink.prune.targets import LatencyMeter

    feeds, label = _price_feeds(proto, held_out, data, shapes, opts)
    weights = sum(
        math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        for t in proto.graph.initializer
    )
    if weights > SEGMENT_BYTES:  # whole-model sessions of both would not fit where the proof's segments do
        return Price(label, note=f"not measured: the model's {weights / 2**30:.1f} GiB of weights are run "
                     "in segments by the proof, not whole")
    names = [o.name for o in proto.graph.output]
    if calibration is not None and not held_out:
        before = calibration.outputs
    else:
        before = list(run_feeds(session(proto, opts.provider), feeds, names, "inputs"))
    after = list(run_feeds(session(pruned, opts.provider), feeds, names, "inputs"))
    result = Price(label, compare_outputs(before, after))
    if opts.provider != "cpu":
        result.note = "latency measured with the CPU provider only"
    meter = meters[0] if meters else LatencyMeter(proto, feeds[0], rounds=5, budget=0.05)  # a glance
    result.latency_before_ms, result.latency_after_ms = meter.compare(pruned)
    result.threads = meter.threads
    return result


def removed_any(reference: onnx.ModelProto, shrunk: onnx.ModelProto, members: list[Member]) -> bool:
    """Did the shrink take out any of the members' slices (their weights, under the name they
    have in the reference or the analysis's copy of a shared one, hold fewer elements)?"""
    names = {n for m in members for n in (m.initializer, m.tensor)}

    def held(model: onnx.ModelProto) -> int:  # in every scope, as initializers or Constant nodes
        total = 0
        for g in ir.all_graphs(model.graph):
            total += sum(math.prod(t.dims) for t in g.initializer if t.name in names)
            for n in g.node:
                if n.op_type == "Constant" and n.output and n.output[0] in names:
                    total += sum(math.prod(a.t.dims) for a in n.attribute if a.name == "value")
        return total

    return held(shrunk) < held(reference)


def _why_kept(result: ShrinkResult) -> str:
    if result.kept_after_failed_proof:
        return f"the proof failed ({result.first_failure}) and they were kept back"
    reasons = sorted({k.reason for k in result.kept_zeroed})
    return "; ".join(reasons[:3]) if reasons else "the analysis kept them"



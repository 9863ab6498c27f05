"""`shrink`: the whole pipeline, read -> bind -> analyze -> rewrite -> validate -> report -> save."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxshrink.analyze import Analysis, analyze
from onnxshrink.analyze.keep import AxisKey
from onnxshrink.bind import BoundMasks, apply_masks, bind_masks, check_reference, weight_modules
from onnxshrink.errors import InternalError, ShrinkError, ValidationFailed, first_line
from onnxshrink.io.masks import flatten, load_masks_file
from onnxshrink.io.model import data_files, load_external, load_model, save_model
from onnxshrink.masks import MaskSet, load_maskset
from onnxshrink.ops import lookup
from onnxshrink.options import ShrinkOptions
from onnxshrink.prepare import default_opset, prepare
from onnxshrink.recover import Attempt, recover
from onnxshrink.report import (
    KeptGroup,
    ModelStats,
    Sparsity,
    model_stats,
    sparsity_left,
    to_jsonable,
)
from onnxshrink.rewrite import Fold, RewriteResult, apply, release
from onnxshrink.validate import ValidationReport, compare, resolve_shapes

ModelLike = str | Path | onnx.ModelProto
MasksLike = str | Path | Mapping | None


@dataclass
class ShrinkResult:
    """Everything a shrink produced; `to_dict()` is what `--report` writes.

    `reference` is the input model with the masks applied. When the input was a path whose
    weights live in an external data file and validation was skipped, the unmasked weights of
    `reference` still refer to that file (they were never loaded into it)."""

    model: onnx.ModelProto
    reference: onnx.ModelProto
    before: ModelStats
    after: ModelStats
    validation: ValidationReport | None
    timings: dict[str, float]
    masks_bound: int = 0
    unbound_masks: list[str] = field(default_factory=list)
    input_masked: bool | None = None  # the input already held every mask's zeros (None: no masks)
    shared_initializers: dict[str, list[str]] = field(default_factory=dict)  # untied per parameter
    folds: list[Fold] = field(default_factory=list)
    barriers: list[dict[str, str]] = field(default_factory=list)
    replayed: list[dict[str, str]] = field(default_factory=list)  # ops with no rule, replayed
    kept_zeroed: list[KeptGroup] = field(default_factory=list)
    sparsity: list[Sparsity] = field(default_factory=list)
    removed_nodes: int = 0
    written: list[str] = field(default_factory=list)
    torch_validation: ValidationReport | None = None  # export_and_shrink: against the module itself
    # When the first proof failed: what failed, and the tensor axes kept whole to pass.
    first_failure: str | None = None
    kept_after_failed_proof: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(v is None or v.passed for v in (self.validation, self.torch_validation))

    def to_dict(self) -> dict[str, Any]:
        keys = (
            "before",
            "after",
            "validation",
            "timings",
            "masks_bound",
            "unbound_masks",
            "input_masked",
            "shared_initializers",
            "folds",
            "barriers",
            "replayed",
            "kept_zeroed",
            "sparsity",
            "removed_nodes",
            "written",
            "torch_validation",
            "first_failure",
            "kept_after_failed_proof",
        )
        return {k: to_jsonable(getattr(self, k)) for k in keys} | {"passed": self.passed}

    def save(self, path: str | Path, external: bool = False) -> list[Path]:
        return save_model(self.model, path, external=external)


def shrink(
    model: ModelLike,
    masks: MasksLike = None,
    output: str | Path | None = None,
    *,
    options: ShrinkOptions | None = None,
    **option_values: Any,
) -> ShrinkResult:
    """Shrink a masked ONNX model to the channels its outputs need; prove and write it.

    `model` is a path or ModelProto; `masks` a masks file or dict in any pruner's format (see
    onnxshrink.masks), or None: the zeros already in the weights are the masks. How to shrink,
    prove and write is a `ShrinkOptions` (`options`), or its fields as keyword arguments
    (`validate=False`, `input_shapes=...`, `weights=...`, `rtol=...`; see ShrinkOptions).
    Raises ShrinkError for bad input and ValidationFailed (with `.result`) when the shrunk model
    does not match; nothing is written then unless `keep_failed`.
    """
    opts = (options or ShrinkOptions()).but(**option_values)
    if opts.validate and opts.draws < 1 and not opts.inputs:
        raise ShrinkError(
            f"nothing to validate with: draws={opts.draws} and no inputs given. Use draws >= 1 or give inputs."
        )
    clock = _Clock()
    source = read_model(model)
    maskset, values = read_masks(masks, opts)
    clock.lap("load")

    masks_name = str(masks) if isinstance(masks, str | Path) else "masks"
    bound, reference, held = bind(source, maskset, values, masks_name, opts)
    clock.lap("bind")
    _log_binding(opts, maskset, bound, held)

    opts.say(f"analyzing {len(reference.graph.node)} nodes ...")
    analysis = analyze_model(reference, source.base_dir, opts)
    clock.lap("analyze")
    opts.say(f"analyzed in {clock.timings['analyze']:.2f} s; rewriting ...")
    first = attempt_rewrite(analysis, reference, opts)
    clock.lap("rewrite")
    if opts.validate:
        opts.say("validating with onnxruntime ...")
        if source.base_dir is not None:
            load_external(reference, Path(source.base_dir), str(source.path))
        if first.rewritten is not None:
            first.report = compare(reference, first.rewritten.model, opts)
        clock.lap("validate")
    outcome, recovery = first, None
    if opts.validate and opts.recover and not first.passed:
        opts.say(f"the proof failed: {first.failure()}; finding the removals responsible ...")
        recovery = recover(first, lambda pins: attempt(reference, source.base_dir, opts, pins))
        outcome = recovery.attempt
        clock.lap("recover")
    if outcome.rewritten is None:  # the rewrite failed even keeping every channel
        raise ValidationFailed(f"{outcome.failure()}; nothing was written.", None)
    rewritten, report, analysis = outcome.rewritten, outcome.report, outcome.analysis
    shrunk = rewritten.model
    barriers = [
        {"node": r.node, "op": r.op, "reason": str(r)} for r in analysis.keep.barriers.values()
    ]
    replayed = [{"node": n, "op": op, "finding": f} for n, op, f in analysis.keep.notes.values()]
    shapes = report.input_shapes if report else resolve_shapes(reference, opts.input_shapes or {})
    result = ShrinkResult(
        model=shrunk,
        reference=reference,
        before=model_stats(reference, shapes, source.file_bytes),
        after=model_stats(shrunk, shapes),
        validation=report,
        timings=clock.timings,
        masks_bound=len(bound.masks),
        unbound_masks=bound.unbound,
        input_masked=held if maskset is not None else None,
        shared_initializers=bound.shared,
        folds=rewritten.folds,
        barriers=barriers,
        replayed=replayed,
        kept_zeroed=rewritten.kept_zeroed,
        sparsity=sparsity_left(shrunk),
        removed_nodes=rewritten.removed_nodes,
        first_failure=recovery.first_failure if recovery else None,
        kept_after_failed_proof=[
            {"tensor": t, "axis": a, "indices": n} for (t, a), n in recovery.kept.items()
        ]
        if recovery and outcome.passed
        else [],
    )
    if output is not None and (result.passed or opts.keep_failed):
        save(result, source, output, opts)
        clock.lap("save")
    if not result.passed:
        assert report is not None
        bad = [o.name for o in report.outputs if not o.passed]
        raise ValidationFailed(
            f"the shrunk model does not match the reference on output(s) {bad}"
            + ("; it was written anyway (--keep-failed)." if result.written else "; nothing was written."),
            result,
        )
    return result


# ---------------------------------------------------------------------- stages
@dataclass
class Source:
    """The input model: its proto (external weights not loaded yet), and where it came from."""

    proto: onnx.ModelProto
    path: Path | None = None
    base_dir: str | None = None  # where its external data lives
    data: list[Path] = field(default_factory=list)  # its external data files: never overwritten
    file_bytes: int | None = None


def read_model(model: ModelLike) -> Source:
    if isinstance(model, str | Path):
        path = Path(model)
        proto = load_model(path, keep_external=True)  # weights are read once, by prepare()
        data = data_files(path, proto)
        size = path.stat().st_size + sum(p.stat().st_size for p in data if p.exists())
        return Source(proto, path, str(path.parent), data, size)
    if isinstance(model, onnx.ModelProto):
        return Source(model)
    raise TypeError(f"model must be a path or onnx.ModelProto, not {type(model).__name__}")


def read_masks(
    masks: MasksLike, opts: ShrinkOptions
) -> tuple[MaskSet | None, dict[str, np.ndarray] | None]:
    """The masks in any format, and the original weights given to bind them by value."""
    maskset = masks if isinstance(masks, MaskSet) else None
    if maskset is None and masks is not None:
        maskset = load_maskset(masks, opts.masks_format)
    values = None
    if opts.weights is not None:
        w = opts.weights
        raw = load_masks_file(w) if isinstance(w, str | Path) else w
        values = flatten(raw, str(w) if isinstance(w, str | Path) else "weights")
    return maskset, values


def bind(
    source: Source,
    maskset: MaskSet | None,
    values: dict[str, np.ndarray] | None,
    masks_name: str,
    opts: ShrinkOptions,
) -> tuple[BoundMasks, onnx.ModelProto, bool]:
    """Bind the masks; the reference model (the input with them applied); whether the input
    already held them (the reference is then the input itself)."""
    bound = bind_masks(
        source.proto,
        maskset or MaskSet(),
        source=masks_name,
        allow_unbound=opts.allow_unbound,
        values=values,
        base_dir=source.base_dir,
    )
    held = check_reference(bound, opts.input_masked, masks_name)
    reference = source.proto if held else apply_masks(source.proto, bound, source.base_dir)
    bound.index = None  # its cached weight arrays: prepare() reads the reference's
    return bound, reference, held


def analyze_model(
    reference: onnx.ModelProto,
    base_dir: str | None,
    opts: ShrinkOptions,
    pins: frozenset[AxisKey] = frozenset(),
) -> Analysis:
    graph, untied = prepare(reference, base_dir)
    opset = default_opset(reference)
    return analyze(graph, opset, lookup(opset), untied, pins, opts.analysis)


def attempt_rewrite(analysis: Analysis, reference: onnx.ModelProto, opts: ShrinkOptions) -> Attempt:
    """Rewrite the analyzed graph. With validation on, a rewrite that fails (a handler's bug, a
    model onnx rejects) is a failed proof, to recover from; without, an internal error."""
    try:
        return Attempt(analysis, rewrite(analysis, reference), None)
    except (InternalError, onnx.checker.ValidationError) as exc:
        if not opts.validate:
            raise
        return Attempt(analysis, None, None, f"{type(exc).__name__}: {first_line(exc)}")


def attempt(
    reference: onnx.ModelProto, base_dir: str | None, opts: ShrinkOptions, pins: frozenset[AxisKey]
) -> Attempt:
    """A whole analysis, rewrite and proof, with some tensor axes kept whole."""
    result = attempt_rewrite(analyze_model(reference, base_dir, opts, pins), reference, opts)
    if result.rewritten is not None:
        result.report = compare(reference, result.rewritten.model, opts)
    return result


def rewrite(analysis: Analysis, reference: onnx.ModelProto) -> RewriteResult:
    rewritten = apply(analysis, reference)
    if rewritten.kept_zeroed:  # name the modules of exporter-renamed weights for --explain
        modules = weight_modules(reference)
        for g in rewritten.kept_zeroed:
            g.module = modules.get(g.tensor, "")
    release(analysis.graph)  # the shrunk weights now live in the rewritten model
    return rewritten


def save(result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions) -> None:
    protect = [source.path, *source.data] if source.path is not None else []
    external = opts.external_data if opts.external_data is not None else bool(source.data)
    written = save_model(result.model, output, external=external, protect=protect)
    result.written = [str(p) for p in written]
    result.after.file_bytes = sum(p.stat().st_size for p in written)


def _log_binding(opts: ShrinkOptions, maskset: MaskSet | None, bound: BoundMasks, held: bool) -> None:
    if maskset is None:
        opts.say("no masks file: the zeros in the weights are the masks")
        return
    ways = sorted(set(bound.how.values()))
    opts.say(
        f"{maskset.format} masks: {len(bound.how)} of {len(maskset.masks)} bound ({', '.join(ways)}) "
        f"to {len(bound.masks)} initializer(s)"
    )
    opts.say(
        "the model already holds the masks: the reference is the model as given"
        if held
        else "the masks are applied to the model: the reference is the model with them applied"
    )
    for init, params in bound.shared.items():
        opts.say(f"initializer '{init}' is shared by several parameters: untied for {', '.join(params)}")


class _Clock:
    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = now - self._t
        self._t = now

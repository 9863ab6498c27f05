"""`shrink`: the whole pipeline, read -> bind -> analyze -> rewrite -> validate -> report -> save."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze import Analysis, analyze, lookup
from onnxshrink.analyze.replay import scoped
from onnxshrink.bind import BoundMasks, apply_masks, bind_masks, check_reference, weight_modules
from onnxshrink.core.reasons import AxisKey
from onnxshrink.errors import InternalError, ShrinkError, ValidationFailed, first_line
from onnxshrink.io import dims
from onnxshrink.io.masks import imports_torch, load_masks_file
from onnxshrink.io.model import (
    Scratch,
    check_output,
    check_tensor_data,
    copy_model,
    data_files,
    load_external,
    load_model,
    save_model,
    save_streamed,
    unique_node_names,
)
from onnxshrink.io.weights import DataWriter, WeightStore
from onnxshrink.masks import MaskSet, load_maskset, weight_values
from onnxshrink.options import ShrinkOptions
from onnxshrink.prepare import default_opset, prepare
from onnxshrink.prepare.computed import fold_computed_weights, has_computed_weights
from onnxshrink.progress import PhaseClock, bar
from onnxshrink.proof.comparison import compare
from onnxshrink.proof.inputs import check_inputs, resolve_shapes
from onnxshrink.proof.recover import Attempt, Recovery, recover
from onnxshrink.proof.sessions import check_provider, check_runnable, session_threads
from onnxshrink.proof.verdict import ValidationReport, round_up
from onnxshrink.report import (
    InterfaceChange,
    KeptGroup,
    ModelStats,
    Sparsity,
    count_params,
    interface_changes,
    model_stats,
    sparsity_left,
    to_jsonable,
)
from onnxshrink.rewrite import Fold, RewriteResult, apply, release

ModelLike = str | Path | onnx.ModelProto
MasksLike = str | Path | Mapping | None


@dataclass
class ShrinkResult:
    """Everything a shrink produced; `to_dict()` is what `--report` writes.

    `reference` is the input model with the masks applied. When the input was a path whose
    weights live in an external data file, its unmasked weights still refer to that file (they
    are loaded into it only for a model under IN_MEMORY_BYTES that was validated); in a model
    past IN_MEMORY_BYTES, its masked weights refer by absolute path to a file that lives as long
    as the result.

    A model read from external data is shrunk *streamed*: its weights are mapped, not read, and
    the shrunk weights are written to an external data file as they are sliced. `model` then
    holds its weights only when they are under IN_MEMORY_BYTES; otherwise its initializers refer
    to `data_file` (`<output>.data` once saved), which `save()` copies."""

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
    barriers: list[dict[str, Any]] = field(default_factory=list)  # nodes kept whole: node, op, reason
    replayed: list[dict[str, str]] = field(default_factory=list)  # ops with no rule, replayed
    kept_zeroed: list[KeptGroup] = field(default_factory=list)
    sparsity: list[Sparsity] = field(default_factory=list)
    removed_nodes: int = 0
    written: list[str] = field(default_factory=list)
    torch_validation: ValidationReport | None = None  # export_and_shrink: against the module itself
    # When the first proof failed: what failed, and the tensor axes kept whole to pass.
    first_failure: str | None = None
    kept_after_failed_proof: list[dict[str, Any]] = field(default_factory=list)
    data_file: Path | None = None  # where `model`'s external weights are, when not in memory
    renamed_nodes: list[tuple[str, str]] = field(default_factory=list)  # (shared name, new name)
    # graph inputs and outputs whose shape changed (a KV cache's heads removed), old -> new
    interface_changes: list[InterfaceChange] = field(default_factory=list)
    # runtime configs written beside the output (genai_config.json, config.json), and notes
    runtime_configs: list[dict[str, Any]] = field(default_factory=list)
    _scratch: Any = field(default=None, repr=False)  # keeps an unsaved data file alive
    # A shrink that removed nothing from the model file as given: saved as a copy of the file
    _unchanged: Any = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return all(v is None or v.passed for v in (self.validation, self.torch_validation))

    # what --report writes (with "passed"), in this order
    REPORT_KEYS = (
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
        "renamed_nodes",
        "interface_changes",
        "runtime_configs",
    )

    def to_dict(self) -> dict[str, Any]:
        return {k: to_jsonable(getattr(self, k)) for k in self.REPORT_KEYS} | {"passed": self.passed}

    @classmethod
    def empty_report(cls) -> dict[str, Any]:
        """The report of a shrink that made no result (its rewrite failed): every key of one
        that did, empty."""
        return dict.fromkeys(cls.REPORT_KEYS) | {"passed": False}

    def save(self, path: str | Path, external: bool = False) -> list[Path]:
        if self._unchanged is not None and external == bool(self._unchanged.data):
            return copy_model(self._unchanged.path, self._unchanged.data, path)
        if self.data_file is not None:
            return save_streamed(self.model, self.data_file, path, move=False)
        return save_model(self.model, path, external=external)


def check_options(opts: ShrinkOptions, flags: bool = False) -> None:
    """Refuse option values that cannot mean anything (each named: as a keyword, or as the
    command line's flag with `flags`), before any work."""

    def named(key: str, value: object) -> str:
        return f"--{key.replace('_', '-')} {value}" if flags else f"{key}={value}"

    if opts.draws < 0:
        raise ShrinkError(f"{named('draws', opts.draws)}: give a number of random draws >= 0.")
    if opts.validate and opts.draws < 1 and not opts.inputs:
        raise ShrinkError(
            f"nothing to validate with: {named('draws', opts.draws)} and no inputs given. Use "
            "draws >= 1 or give inputs."
        )
    if opts.validate_layers is not None and opts.validate_layers < 1:
        raise ShrinkError(f"{named('validate_layers', opts.validate_layers)}: give a number of blocks >= 1.")
    if opts.seed < 0:
        raise ShrinkError(f"{named('seed', opts.seed)}: give a seed >= 0.")
    for key, tol in (("rtol", opts.rtol), ("atol", opts.atol)):
        if tol is not None and not (math.isfinite(tol) and tol >= 0):
            raise ShrinkError(
                f"{named(key, tol)}: give a finite tolerance >= 0 (a negative or NaN one fails "
                "every proof; an infinite one proves nothing)."
            )


def check_against_model(model: onnx.ModelProto, opts: ShrinkOptions, source: str = "model") -> None:
    """Refuse, before any heavy step, options the model contradicts: shapes of inputs it does not
    have or of another rank or static size, validation inputs that do not fit, a provider
    onnxruntime lacks here, ops the proof cannot run."""
    if opts.input_shapes:
        resolve_shapes(model, opts.input_shapes)
    if opts.validate:
        check_provider(opts.provider)
        session_threads()  # ONNXSHRINK_THREADS, read by every proof session
        check_runnable(model, source)
        check_inputs(model, opts.inputs)


@scoped
def shrink(
    model: ModelLike,
    masks: MasksLike = None,
    output: str | Path | None = None,
    *,
    options: ShrinkOptions | None = None,
    input_stats: ModelStats | None = None,
    **option_values: Any,
) -> ShrinkResult:
    """Shrink a masked ONNX model to the channels its outputs need; prove and write it.

    `model` is a path or ModelProto; `masks` a masks file or dict in any pruner's format (see
    onnxshrink.masks), or None: the zeros already in the weights are the masks. How to shrink,
    prove and write is a `ShrinkOptions` (`options`), or its fields as keyword arguments
    (`validate=False`, `input_shapes=...`, `weights=...`, `rtol=...`; see ShrinkOptions).
    Raises ShrinkError for bad input and ValidationFailed (with `.result`) when the shrunk model
    does not match; nothing is written then unless `keep_failed`. `input_stats`: the result's
    `before` when the caller has counted it (a prune: its unpruned input's), not counted again.
    """
    opts = (options or ShrinkOptions()).but(**option_values)
    check_options(opts)
    clock = PhaseClock()
    source = read_model(model)
    if output is not None:
        check_output(output, [source.path, *source.data] if source.path is not None else [])
    check_against_model(source.proto, opts, str(source.path or "model"))
    if source.folded:
        names = ", ".join(f"'{n}'" for n in source.folded[:4]) + (" ..." if len(source.folded) > 4 else "")
        opts.say(
            f"{len(source.folded)} weight(s) the graph computes from constants (pruning still "
            f"attached, e.g. weight_orig * weight_mask) stored as the weights they are: {names}"
        )
    maskset, values = read_masks(masks, opts)
    clock.lap("load")

    masks_name = str(masks) if isinstance(masks, str | Path) else "masks"
    scratch = Scratch(source.store, output) if source.streamed else None
    # a large model's masked weights are written to a file, not held (see apply_masks)
    large = scratch is not None and (source.file_bytes or 0) >= IN_MEMORY_BYTES
    bound, reference, held = bind(source, maskset, values, masks_name, opts, scratch if large else None)
    clock.lap("bind")
    _log_binding(opts, maskset, bound, held)

    opts.say(f"analyzing {len(reference.graph.node)} nodes ...")
    analysis = analyze_model(reference, source.base_dir, opts, store=source.store)
    clock.lap("analyze")
    opts.say(f"analyzed in {clock.timings['analyze']:.2f} s; rewriting ...")
    first = attempt_rewrite(analysis, reference, opts, scratch)
    clock.lap("rewrite")
    if opts.validate:
        opts.say("validating with onnxruntime ...")
        if first.rewritten is not None:
            first.report = prove(reference, source, first.rewritten, opts)
        clock.lap("validate")
    outcome, recovery = first, None
    rounding = first.report is not None and first.report.rounding()
    if opts.validate and opts.recover and not first.passed and not rounding:
        opts.say(f"the proof failed: {first.failure()}; finding the removals responsible ...")
        tries: list[Attempt] = []

        def one_try(pins: frozenset[AxisKey]) -> Attempt:
            tries.append(attempt(reference, source, opts, pins, scratch))
            data = tries[-1].rewritten.data_file if tries[-1].rewritten else None
            if len(tries) > 1 and not tries[-1].passed and data is not None:
                data.unlink(missing_ok=True)  # a failed try's data (the first may be the outcome)
            return tries[-1]

        recovery = recover(first, one_try)
        outcome = recovery.attempt
        if scratch is not None:  # the data of every other try
            scratch.drop_except(outcome.rewritten.data_file if outcome.rewritten else None)
        clock.lap("recover")
    if outcome.rewritten is None:  # the rewrite failed even keeping every channel
        raise ValidationFailed(f"{outcome.failure()}; nothing was written.", None)
    if recovery is not None and outcome.passed:
        _check_smaller(reference, outcome.rewritten.model, recovery, first)
    if (
        opts.validate
        and source.base_dir is not None
        and (source.file_bytes or 0) < IN_MEMORY_BYTES
    ):  # a small model's reference holds its weights, as its shrunk model does
        load_external(reference, Path(source.base_dir), str(source.path))
    rewritten, report, analysis = outcome.rewritten, outcome.report, outcome.analysis
    unchanged = (
        (report is None or report.passed)
        and (source.file_bytes or 0) < IN_MEMORY_BYTES
        and same_structure(reference, rewritten.model)
    )
    if unchanged:  # nothing was removed: the output is the reference itself, no larger than the
        # input (the rewrite's export adds the inferred shapes); the input's file itself when
        # the reference is the model as the file holds it
        if source.base_dir is not None:
            load_external(reference, Path(source.base_dir), str(source.path))
        if rewritten.data_file is not None:
            rewritten.data_file.unlink(missing_ok=True)
            rewritten.data_file = None
        rewritten.model, rewritten.arrays = reference, {}
    shrunk = rewritten.model
    barriers = [
        {"node": r.node, "op": r.op, "reason": str(r), "unsupported": r.kind == "unsupported"}
        for r in analysis.keep.barriers.values()
    ]
    replayed = [{"node": n, "op": op, "finding": f} for n, op, f in analysis.keep.notes.values()]
    shapes = report.input_shapes if report else resolve_shapes(reference, opts.input_shapes or {})
    result = ShrinkResult(
        model=shrunk,
        reference=reference,
        # the input as its file holds it (the reference may hold untied copies of a weight)
        before=input_stats or model_stats(source.proto, shapes, source.file_bytes),
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
        sparsity=sparsity_left(shrunk, arrays=rewritten.arrays, skip=rewritten.inserted),
        removed_nodes=rewritten.removed_nodes,
        first_failure=recovery.first_failure if recovery else None,
        renamed_nodes=source.renamed,
        kept_after_failed_proof=[
            {"tensor": t, "axis": a, "indices": n} for (t, a), n in recovery.kept.items()
        ]
        if recovery and outcome.passed
        else [],
    )
    if rewritten.data_file is not None:
        result.data_file, result._scratch = rewritten.data_file, scratch
    for m in {id(result.model): result.model, id(reference): reference}.values():
        dims.restore(m)  # the input's interface as it was declared (see io.dims)
    result.interface_changes = interface_changes(reference, result.model)
    if unchanged and reference is source.proto and source.as_given and source.path is not None:
        result._unchanged = source
    if output is not None and (result.passed or opts.keep_failed):
        save(result, source, output, opts)
        if source.path is not None:
            write_runtime_configs(result, source.path, reference, source.base_dir, output)
        clock.lap("save")
    if result.data_file is not None and result.data_file.stat().st_size < IN_MEMORY_BYTES:
        load_external(result.model, result.data_file.parent, "the shrunk model")
        result.data_file = None
    if not result.passed:
        assert report is not None
        bad = [o.name for o in report.outputs if not o.passed]
        raise ValidationFailed(
            f"the shrunk model does not match the reference on output(s) {bad}"
            + ("; it was written anyway (--keep-failed)." if result.written else "; nothing was written.")
            + (f" {report.tolerance_hint()}" if report.rounding() else ""),
            result,
        )
    return result


def _check_smaller(
    reference: onnx.ModelProto, recovered: onnx.ModelProto, recovery: Recovery, first: Attempt
) -> None:
    """A recovery that keeps back so much that the model is no smaller than the input is no
    outcome worth writing: ValidationFailed, saying what failed and the tolerance that would
    have passed the first proof."""
    before, after = count_params(reference), count_params(recovered)
    if after < before:
        return
    hint = ""
    report = first.report
    if report is not None and report.error is None and not any(o.rounding is False for o in report.outputs):
        needed = report.needed_rtol()  # the error was not judged in float64: rounding, maybe
        if math.isfinite(needed):
            hint = f" If that error is rounding, --rtol {round_up(needed)} would have passed the first proof."
    raise ValidationFailed(
        f"the proof failed ({recovery.first_failure}), and keeping the removals responsible "
        f"leaves a model no smaller than the input ({after} parameters, the input {before}): "
        f"nothing was written.{hint}",
        None,
    )


def same_structure(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    """The same ops and the same weight shapes, in every subgraph too: a shrink that removed
    nothing. A weight is an initializer or a Constant node (the shrink stores the latter as the
    former)."""

    def facts(m: onnx.ModelProto) -> tuple[list, list]:
        graphs = list(ir.all_graphs(m.graph))
        weights = [(t.name, tuple(t.dims)) for g in graphs for t in g.initializer]
        ops = []
        for n in (n for g in graphs for n in g.node):
            value = next((x for x in n.attribute if x.name == "value" and x.type == onnx.AttributeProto.TENSOR), None)
            if n.op_type == "Constant" and not n.domain and len(n.output) == 1 and value is not None:
                weights.append((n.output[0], tuple(value.t.dims)))
            else:
                ops.append(n.op_type)
        return sorted(weights), sorted(ops)

    return facts(a) == facts(b)


# ---------------------------------------------------------------------- stages
@dataclass
class Source:
    """The input model: its proto (external weights not loaded yet), and where it came from."""

    proto: onnx.ModelProto
    path: Path | None = None
    base_dir: str | None = None  # where its external data lives
    data: list[Path] = field(default_factory=list)  # its external data files: never overwritten
    file_bytes: int | None = None
    store: WeightStore = field(default_factory=WeightStore)  # maps the external data
    renamed: list[tuple[str, str]] = field(default_factory=list)  # nodes named apart (see io)
    folded: list[str] = field(default_factory=list)  # weights computed from constants, now stored

    @property
    def as_given(self) -> bool:
        """`proto` is the model as its file holds it (no node renamed, no weight folded)."""
        return not self.renamed and not self.folded

    @property
    def streamed(self) -> bool:
        """Weights in external data: mapped as read, written as sliced (see ShrinkResult)."""
        return bool(self.data)


def read_model(model: ModelLike) -> Source:
    """The input model, checked; nodes that share a name are named apart, and the weights it
    computes from constants only (pruning hooks and parametrizations exported as they are) are
    stored as the weights they are (prepare.computed); in a copy of a ModelProto given: the
    caller's is never changed."""
    if isinstance(model, str | Path):
        path = Path(model)
        proto = load_model(path, keep_external=True)  # weights are read once, by prepare()
        data = data_files(path, proto)
        size = path.stat().st_size + sum(p.stat().st_size for p in data if p.exists())
        ir.unique_scope_names(proto.graph)  # bodies that reuse a sibling's names: named apart
        source = Source(proto, path, str(path.parent), data, size, renamed=unique_node_names(proto))
    elif isinstance(model, onnx.ModelProto):
        check_tensor_data(model, "model")
        names = [n.name for n in model.graph.node if n.name]
        if (
            len(set(names)) == len(names)
            and not dims.needs_symbolic(model)
            and not has_computed_weights(model)
            and not ir.unique_scope_names(model.graph, apply=False)
        ):
            return Source(model)
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        dims.to_symbolic(copy)
        ir.unique_scope_names(copy.graph)
        source = Source(copy, renamed=unique_node_names(copy))
    else:
        raise TypeError(f"model must be a path or onnx.ModelProto, not {type(model).__name__}")
    source.folded = fold_computed_weights(source.proto, source.base_dir, source.store)
    return source


def read_masks(
    masks: MasksLike, opts: ShrinkOptions
) -> tuple[MaskSet | None, Mapping[str, np.ndarray] | None]:
    """The masks in any format (read a mask at a time, each reduced as it is read), and the
    original weights given to bind them by value (read only when a mask binds by value)."""
    for path in (masks, opts.weights):
        if isinstance(path, str | Path) and imports_torch(path):
            opts.say(f"reading {path}: importing torch to read it (seconds, more on a busy machine) ...")
            break
    maskset = masks if isinstance(masks, MaskSet) else None
    if maskset is None and masks is not None:
        maskset = load_maskset(masks, opts.masks_format, say=opts.say)
    values = None
    if opts.weights is not None:
        w = opts.weights
        raw = load_masks_file(w, "weights", say=opts.say) if isinstance(w, str | Path) else w
        values = weight_values(raw, str(w) if isinstance(w, str | Path) else "weights")
    return maskset, values


def bind(
    source: Source,
    maskset: MaskSet | None,
    values: Mapping[str, np.ndarray] | None,
    masks_name: str,
    opts: ShrinkOptions,
    scratch: Scratch | None = None,
) -> tuple[BoundMasks, onnx.ModelProto, bool]:
    """Bind the masks; the reference model (the input with them applied); whether the input
    already held them (the reference is then the input itself). With a `scratch`, the masked
    weights are written to a file of it rather than held in memory."""
    bound = bind_masks(
        source.proto,
        maskset or MaskSet(),
        source=masks_name,
        allow_unbound=opts.allow_unbound,
        values=values,
        base_dir=source.base_dir,
    )
    held = check_reference(bound, opts.input_masked, masks_name)
    if held:
        reference = source.proto
    else:
        spill = scratch.spill() if scratch is not None else None
        reference = apply_masks(source.proto, bound, source.base_dir, spill)
        if spill is not None:
            spill.close()
    bound.index = None  # its cached weight arrays: prepare() reads the reference's
    return bound, reference, held


# A streamed shrink's result holds its weights in memory (ShrinkResult.model) under this size.
IN_MEMORY_BYTES = 256 * 2**20


def analyze_model(
    reference: onnx.ModelProto,
    base_dir: str | None,
    opts: ShrinkOptions,
    pins: frozenset[AxisKey] = frozenset(),
    store: WeightStore | None = None,
) -> Analysis:
    graph, untied = prepare(reference, base_dir, store)
    opset = default_opset(reference)
    return analyze(graph, opset, lookup(opset), untied, pins, opts.analysis, progress=opts.progress)


def attempt_rewrite(
    analysis: Analysis, reference: onnx.ModelProto, opts: ShrinkOptions, scratch: Scratch | None = None
) -> Attempt:
    """Rewrite the analyzed graph. With validation on, a rewrite that fails (a handler's bug, a
    model onnx rejects) is a failed proof, to recover from; without, an internal error."""
    writer = scratch.writer() if scratch is not None else None
    try:
        return Attempt(analysis, rewrite(analysis, reference, writer, opts), None)
    except (InternalError, onnx.checker.ValidationError) as exc:
        if scratch is not None and writer is not None:
            scratch.discard(writer)
        if not opts.validate:
            raise
        return Attempt(analysis, None, None, f"{type(exc).__name__}: {first_line(exc)}")


def prove(
    reference: onnx.ModelProto,
    source: Source,
    rewritten: RewriteResult,
    opts: ShrinkOptions,
    pins: frozenset[AxisKey] = frozenset(),
    judge_macs: float | None = None,
) -> ValidationReport:
    """The proof of `rewritten` against `reference`; an output that fails it is judged in
    float64 against the same shrink (`pins` alike) of the reference widened to float64."""
    shrunk_dir = rewritten.data_file.parent if rewritten.data_file is not None else None

    def twin() -> onnx.ModelProto:
        from onnxshrink.proof.judge import widened

        wide = widened(reference, source.base_dir)
        quiet = opts.but(progress=False, log=None)
        return rewrite(analyze_model(wide, None, quiet, pins), wide, None, quiet).model

    if rewritten.interface:  # a KV cache lost heads: the reference called as the shrunk model is
        from onnxshrink.analyze.cache import sliced_feeds, sliced_interface, sliced_shapes

        # the dims chosen for the user's model (what its ops require of them: a fused
        # attention's cache has its head size), then sliced: the Pad and Gather in front of the
        # sliced reference hide from the ops the inputs they constrain
        whole = resolve_shapes(reference, opts.input_shapes or {})
        reference = sliced_interface(reference, rewritten.interface)
        opts = opts.but(
            input_shapes=sliced_shapes(whole, rewritten.interface),
            inputs=sliced_feeds(opts.inputs, rewritten.interface),
        )
    return compare(reference, rewritten.model, opts, source.base_dir, shrunk_dir, twin, judge_macs)


def attempt(
    reference: onnx.ModelProto,
    source: Source,
    opts: ShrinkOptions,
    pins: frozenset[AxisKey],
    scratch: Scratch | None = None,
) -> Attempt:
    """A whole analysis, rewrite and proof, with some tensor axes kept whole (a try of recovery:
    a failure is judged in float64 only when that is quick)."""
    analysis = analyze_model(reference, source.base_dir, opts, pins, source.store)
    result = attempt_rewrite(analysis, reference, opts, scratch)
    if result.rewritten is not None:
        result.report = prove(reference, source, result.rewritten, opts, pins, TRY_JUDGE_MACS)
    return result


# A recovery try's failure is judged in float64 only for models this small (each try is a whole
# shrink and proof; the judge computes both models in float64).
TRY_JUDGE_MACS = 1e8


def rewrite(
    analysis: Analysis,
    reference: onnx.ModelProto,
    writer: DataWriter | None = None,
    opts: ShrinkOptions | None = None,
) -> RewriteResult:
    total = sum(
        t.values.nbytes
        for t in analysis.keep.tensors.values()
        if isinstance(t, gs.Constant) and t.name in analysis.keep.demanded
    )
    with bar(total, "slicing and writing weights", "B", bool(opts and opts.progress)) as progress:
        rewritten = apply(analysis, reference, writer, progress)
    if writer is not None:
        writer.close()
        rewritten.data_file = writer.path
    if rewritten.kept_zeroed:  # name the modules of exporter-renamed weights for --explain
        modules = weight_modules(reference)
        for g in rewritten.kept_zeroed:
            g.module = modules.get(g.tensor, "")
    release(analysis.graph)  # the shrunk weights now live in the rewritten model
    return rewritten


def save(result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions) -> None:
    protect = [source.path, *source.data] if source.path is not None else []
    external = opts.external_data if opts.external_data is not None else bool(source.data)
    if result._unchanged is not None and external == bool(source.data):
        written = copy_model(result._unchanged.path, result._unchanged.data, output, protect=protect)
    elif result.data_file is not None:  # streamed: the data file written is moved into place
        written = save_streamed(result.model, result.data_file, output, protect=protect)
        if result._scratch is not None:
            result._scratch.saved(result.data_file)
        result.data_file = written[1]
    else:
        written = save_model(result.model, output, external=external, protect=protect)
    result.written = [str(p) for p in written]
    result.after.file_bytes = sum(p.stat().st_size for p in written)


def write_runtime_configs(
    result: ShrinkResult,
    input_path: str | Path,
    before: onnx.ModelProto,
    before_dir: str | None,
    output: str | Path,
    groups: Any = None,
) -> None:
    """Updated copies of the runtimes' configs beside the input (genai_config.json,
    config.json), written beside the output; what was done in `result.runtime_configs`.
    `before`: the input model (`groups`: its coupled groups, when a prune has found them)."""
    from onnxshrink.runtime_config import count, write_configs

    notes = write_configs(
        input_path,
        output,
        lambda: count(before, before_dir, groups),
        lambda: count(result.model, str(Path(output).absolute().parent)),
    )
    result.runtime_configs = [n.to_dict() for n in notes]
    for n in notes:  # printed with the result (cli)
        if n.written:
            result.written.append(str(Path(output).absolute().parent / n.file))


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

"""The attempt stage: analyze the reference, rewrite it smaller, and prove the rewrite against
it (an `Attempt`); a recovery's tries are attempts with some tensor axes kept whole."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze import Analysis, analyze, lookup
from onnxshrink.bind import weight_modules
from onnxshrink.core.reasons import AxisKey
from onnxshrink.errors import InternalError, first_line
from onnxshrink.io.model import Scratch
from onnxshrink.io.weights import DataWriter, WeightStore
from onnxshrink.options import ShrinkOptions
from onnxshrink.prepare import default_opset, prepare
from onnxshrink.progress import PhaseClock, bar
from onnxshrink.proof.comparison import KnownRuns, compare
from onnxshrink.proof.inputs import resolve_shapes
from onnxshrink.proof.judge import Twin
from onnxshrink.proof.recover import Attempt
from onnxshrink.proof.verdict import ValidationReport
from onnxshrink.rewrite import RewriteResult, apply, release
from onnxshrink.stages.read import Source
from onnxshrink.stages.twin import float64_twin


def first_attempt(
    reference: onnx.ModelProto, source: Source, opts: ShrinkOptions, scratch: Scratch | None, clock: PhaseClock
) -> Attempt:
    """The reference analyzed, rewritten, and (with validation on) proven, each phase timed."""
    opts.say(f"analyzing {len(reference.graph.node)} nodes ...")
    analysis = analyze_model(reference, source.base_dir, opts, store=source.store)
    if opts.check_analysis is not None:
        opts.check_analysis(analysis)
    clock.lap("analyze")
    opts.say(f"analyzed in {clock.timings['analyze']:.2f} s; rewriting ...")
    first = attempt_rewrite(analysis, reference, opts, scratch)
    clock.lap("rewrite")
    if opts.validate:
        opts.say("validating with onnxruntime ...")
        if first.rewritten is not None:
            first.known = KnownRuns()  # the reference's runs, for a recovery's tries
            first.report = prove(reference, source, first.rewritten, opts, known=first.known)
        clock.lap("validate")
    return first


def analyze_model(
    reference: onnx.ModelProto,
    base_dir: str | None,
    opts: ShrinkOptions,
    pins: frozenset[AxisKey] = frozenset(),
    store: WeightStore | None = None,
) -> Analysis:
    """The analysis of `reference` (prepared first: shapes inferred, shared weights untied),
    with the tensor axes `pins` kept whole."""
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
    known: KnownRuns | None = None,
) -> ValidationReport:
    """The proof of `rewritten` against `reference`; an output that fails it is judged in
    float64 against the same shrink (`pins` alike) of the reference widened to float64.
    `known`: the reference's runs of an earlier proof of it (comparison.KnownRuns)."""
    shrunk_dir = rewritten.data_file.parent if rewritten.data_file is not None else None
    source.store.settle()  # the reference's deferred weights written: onnxruntime reads its files

    def shrink(
        wide: onnx.ModelProto, base_dir: str | None, store: WeightStore | None, writer: DataWriter | None
    ) -> onnx.ModelProto:  # the same shrink of the reference widened (the same axes kept whole)
        quiet = opts.but(progress=False, log=None)
        return rewrite(analyze_model(wide, base_dir, quiet, pins, store), wide, writer, quiet).model

    def twin(streamed: bool) -> Twin:
        return float64_twin(reference, source.base_dir, shrink, shrunk_dir, streamed)

    if rewritten.interface:  # a KV cache lost heads: the reference called as the shrunk model is
        from onnxshrink.analyze.cache import sliced_feeds, sliced_interface, sliced_shapes

        # the dims chosen for the user's model (what its ops require of them: a fused
        # attention's cache has its head size), then sliced: the Pad and Gather in front of the
        # sliced reference hide from the ops the inputs they constrain
        whole = resolve_shapes(reference, opts.shapes())
        reference = sliced_interface(reference, rewritten.interface)
        known = None  # another reference for each interface
        opts = opts.but(
            input_shapes=sliced_shapes(whole, rewritten.interface),
            inputs=sliced_feeds(opts.inputs, rewritten.interface),
        )
    return compare(
        reference, rewritten.model, opts, source.base_dir, shrunk_dir, twin, judge_macs, rewritten.kept, known
    )


def attempt(
    reference: onnx.ModelProto,
    source: Source,
    opts: ShrinkOptions,
    pins: frozenset[AxisKey],
    scratch: Scratch | None = None,
    known: KnownRuns | None = None,
) -> Attempt:
    """A whole analysis, rewrite and proof, with some tensor axes kept whole (a try of recovery:
    a failure is judged in float64 only when that is quick; `known`: the reference's runs of
    the first proof)."""
    analysis = analyze_model(reference, source.base_dir, opts, pins, source.store)
    result = attempt_rewrite(analysis, reference, opts, scratch)
    if result.rewritten is not None:
        result.report = prove(reference, source, result.rewritten, opts, pins, TRY_JUDGE_MACS, known)
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
    """The analyzed graph rewritten smaller (its weights sliced, to `writer` when given)."""
    total = sum(
        ir.nbytes(t)
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
    kept = analysis.keep.kept_masks()
    if opts is not None and opts.validate_layers is not None:
        rewritten.kept = kept
    weights = {n for n, t in analysis.keep.tensors.items() if isinstance(t, gs.Constant)}
    rewritten.removed_slices = [
        {"tensor": n, "axis": a, "size": len(k), "kept": int(k.sum()), "removed": np.flatnonzero(~k).tolist()}
        for n, axes in sorted(kept.items())
        if n in weights
        for a, k in sorted(axes.items())
    ]
    release(analysis.graph)  # the shrunk weights now live in the rewritten model
    return rewritten

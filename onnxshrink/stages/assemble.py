"""The assemble stage: the `ShrinkResult` of a run, what the shrunk model is and what the run
found (the kept groups, the barriers, the recovery's keeps), before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from onnxshrink import ir
from onnxshrink.analyze import Analysis
from onnxshrink.io import dims
from onnxshrink.io.model import Scratch, load_external
from onnxshrink.ops import facts as registry_facts
from onnxshrink.options import ShrinkOptions
from onnxshrink.prepare import default_opset
from onnxshrink.proof.inputs import resolve_shapes
from onnxshrink.report import ModelStats, interface_changes, model_stats, sparsity_left
from onnxshrink.result import ShrinkResult, in_memory
from onnxshrink.rewrite import RewriteResult
from onnxshrink.stages.masking import Masked
from onnxshrink.stages.read import Source
from onnxshrink.stages.recovery import Run


def assemble(
    run: Run,
    masked: Masked,
    source: Source,
    opts: ShrinkOptions,
    timings: dict[str, float],
    input_stats: ModelStats | None = None,
    scratch: Scratch | None = None,
) -> ShrinkResult:
    """The result of `run`. A run that removed nothing has the reference itself as its model
    (see _as_reference); `input_stats`: its `before` when the caller counted it."""
    reference = masked.reference
    if opts.validate and source.base_dir is not None and in_memory(source.file_bytes):
        # a small model's reference holds its weights, as its shrunk model does
        load_external(reference, Path(source.base_dir), str(source.path))
    rewritten, report = run.outcome.rewritten, run.outcome.report
    assert rewritten is not None  # recovered() refuses a run without one
    unchanged = (
        (report is None or report.passed)
        and in_memory(source.file_bytes)
        and same_structure(reference, rewritten.model)
    )
    if unchanged:
        _as_reference(rewritten, reference, source)
    shrunk = rewritten.model
    shapes = report.input_shapes if report else resolve_shapes(reference, opts.shapes())
    result = ShrinkResult(
        model=shrunk,
        reference=reference,
        # the input as its file holds it (the reference may hold untied copies of a weight)
        before=input_stats or model_stats(source.proto, shapes, source.file_bytes),
        after=model_stats(shrunk, shapes),
        validation=report,
        timings=timings,
        masks_bound=len(masked.bound.masks),
        unbound_masks=masked.bound.unbound,
        input_masked=masked.input_masked,
        shared_initializers=masked.bound.shared,
        folds=rewritten.folds,
        kept_zeroed=rewritten.kept_zeroed,
        removed_slices=rewritten.removed_slices,
        sparsity=sparsity_left(shrunk, arrays=rewritten.arrays, skip=rewritten.inserted),
        removed_nodes=rewritten.removed_nodes,
        renamed_nodes=source.renamed,
        barriers=_barriers(run.outcome.analysis, None if unchanged else rewritten.left),
        replayed=[{"node": n, "op": op, "finding": f} for n, op, f in run.outcome.analysis.keep.notes.values()],
        first_failure=run.recovery.first_failure if run.recovery else None,
        first_failure_bug=run.recovery.bug if run.recovery else False,
        kept_after_failed_proof=_kept_back(run),
    )
    if rewritten.data_file is not None:
        result.data_file, result._scratch = rewritten.data_file, scratch
        result._one_file = source.mapped_in_place
    for m in {id(result.model): result.model, id(reference): reference}.values():
        dims.restore(m)  # the input's interface as it was declared (see io.dims)
    result.interface_changes = interface_changes(reference, result.model)
    if unchanged and reference is source.proto and source.as_given and source.path is not None:
        result._unchanged = source
    return result


def _as_reference(rewritten: RewriteResult, reference: onnx.ModelProto, source: Source) -> None:
    """Nothing was removed: the output is the reference itself, no larger than the input (the
    rewrite's export adds the inferred shapes); the input's file itself when the reference is
    the model as the file holds it."""
    if source.base_dir is not None:
        load_external(reference, Path(source.base_dir), str(source.path))
    if rewritten.data_file is not None:
        rewritten.data_file.unlink(missing_ok=True)
        rewritten.data_file = None
    rewritten.model, rewritten.arrays = reference, {}


def _barriers(analysis: Analysis, left: set[int] | None) -> list[dict[str, Any]]:
    """The nodes the analysis kept whole, as the report lists them: those the shrunk model
    still holds (`left`: the ids of its nodes; None: the output is the input, all of them)."""
    return [
        {"node": r.node, "op": r.op, "reason": str(r), "unsupported": r.kind == "unsupported"}
        for i, r in analysis.keep.barriers.items()
        if left is None or i in left
    ]


def _kept_back(run: Run) -> list[dict[str, Any]]:
    """When the first proof failed and the recovery passed: the tensor axes kept whole to pass."""
    recovery = run.recovery
    if recovery is None or not run.outcome.passed:
        return []
    return [{"tensor": t, "axis": a, "indices": n} for (t, a), n in recovery.kept.items()]


def same_structure(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    """The same ops and the same weight shapes, in every subgraph too: a shrink that removed
    nothing. A weight is an initializer or a Constant node (the shrink stores the latter as the
    former)."""

    def facts(m: onnx.ModelProto) -> tuple[list[tuple[str, tuple[int, ...]]], list[str]]:
        graphs = list(ir.all_graphs(m.graph))
        weights = [(t.name, tuple(t.dims)) for g in graphs for t in g.initializer]
        ops = []
        opset = default_opset(m)
        for n in (n for g in graphs for n in g.node):
            value = constant_weight(n, opset)
            if value is not None:
                weights.append((n.output[0], tuple(value.dims)))
            else:
                ops.append(n.op_type)
        return sorted(weights), sorted(ops)

    return facts(a) == facts(b)


def constant_weight(node: onnx.NodeProto, opset: int) -> onnx.TensorProto | None:
    """The weight a node holds itself (a Constant node: its value, named by its one output),
    else None."""
    if node.input or len(node.output) != 1:
        return None
    handler, op = registry_facts(node, opset)
    return handler.constant_tensor(op, node.output[0]) if handler is not None else None

"""`shrink`: the whole pipeline, read -> bind -> attempt (analyze, rewrite, prove) -> recover ->
assemble -> save; each stage lives in onnxshrink/stages/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onnxshrink.analyze.replay import scoped
from onnxshrink.options import ShrinkOptions
from onnxshrink.progress import PhaseClock
from onnxshrink.proof.sizes import with_found_shapes
from onnxshrink.report import ModelStats
from onnxshrink.result import ShrinkResult
from onnxshrink.stages.assemble import assemble
from onnxshrink.stages.attempt import first_attempt
from onnxshrink.stages.masking import bind, scratch_for
from onnxshrink.stages.read import MasksLike, ModelLike, Source, check_options, read
from onnxshrink.stages.recovery import recovered
from onnxshrink.stages.save import finished, save, write_runtime_configs

__all__ = ["MasksLike", "ModelLike", "ShrinkResult", "check_options", "shrink"]


@scoped
def shrink(
    model: ModelLike | Source,
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
    source, given = read(model, masks, output, opts)
    opts = with_found_shapes(source.proto, opts, source.base_dir, source.file_bytes)
    clock.lap("load")
    scratch = scratch_for(source, output)
    masked = bind(source, given, opts, scratch)
    clock.lap("bind")
    first = first_attempt(masked.reference, source, opts, scratch, clock)
    run = recovered(first, masked.reference, source, opts, scratch, clock)
    result = assemble(run, masked, source, opts, clock.timings, input_stats, scratch)
    if output is not None and (result.passed or opts.keep_failed):
        save(result, source, output, opts)
        if source.path is not None:
            write_runtime_configs(result, source.path, masked.reference, source.base_dir, output)
        clock.lap("save")
    return finished(result)

"""The save stage: the result written beside nothing of the input's, the runtimes' configs
updated beside it, and the run's verdict (`finished`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from onnxshrink.errors import ValidationFailed
from onnxshrink.io.model import copy_model, load_external, save_model, save_one_file, save_streamed
from onnxshrink.options import ShrinkOptions
from onnxshrink.result import ShrinkResult, in_memory
from onnxshrink.runtime_config import count, write_configs
from onnxshrink.stages.growth import no_growth
from onnxshrink.stages.read import Source


def save(
    result: ShrinkResult,
    source: Source,
    output: str | Path,
    opts: ShrinkOptions,
    input_bytes: int | None = None,
) -> None:
    """Write the result's model to `output` (never over the input's files): a copy of the input's
    file when nothing was removed from it, a streamed one's data file moved into place; the
    files written in `result.written`. Never larger than the input (`input_bytes`, default the
    source's file bytes) unless `opts.allow_growth` or the proof failed (--keep-failed writes
    it as it is): see stages.growth."""
    _write(result, source, output, opts)
    limit = input_bytes if input_bytes is not None else source.file_bytes
    if limit is None and source.path is None:
        limit = source.proto.ByteSize()  # an in-memory input: its serialized size
    if not opts.allow_growth and result.passed and limit is not None and (result.after.file_bytes or 0) > limit:
        no_growth(result, source, output, opts, limit, _write)


def _write(result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions) -> None:
    """The result's model written to `output`, as `save` says."""
    protect = source.protected
    external = opts.external_data if opts.external_data is not None else bool(source.data)
    if result._unchanged is not None and external == bool(source.data):
        written = copy_model(result._unchanged.path, result._unchanged.data, output, protect=protect)
    elif result.data_file is not None and not external and (
        one := save_one_file(result.model, result.data_file, output, protect=protect)
    ):
        written = one  # a one-file input's streamed shrink: one file again, its weights copied in
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


def finished(result: ShrinkResult) -> ShrinkResult:
    """The result, its model's weights in memory when they are small; ValidationFailed (with the
    result) when the shrunk model does not match the reference."""
    if result.data_file is not None and in_memory(result.data_file.stat().st_size):
        load_external(result.model, result.data_file.parent, "the shrunk model")
        result.data_file = None
    if not result.passed:
        report = result.validation
        assert report is not None
        bad = [o.name for o in report.outputs if not o.passed]
        raise ValidationFailed(
            f"the shrunk model does not match the reference on output(s) {bad}"
            + ("; it was written anyway (--keep-failed)." if result.written else "; nothing was written.")
            + (f" {report.tolerance_hint()}" if report.rounding() else ""),
            result,
        )
    return result

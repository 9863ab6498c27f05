"""The save stage: the result written beside nothing of the input's, the runtimes' configs
updated beside it, and the run's verdict (`finished`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from onnxshrink.errors import ValidationFailed
from onnxshrink.io.model import copy_model, load_external, save_model, save_streamed
from onnxshrink.options import ShrinkOptions
from onnxshrink.result import ShrinkResult, in_memory
from onnxshrink.runtime_config import count, write_configs
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
    source's file bytes) unless `opts.allow_growth`: see no_growth."""
    _write(result, source, output, opts)
    limit = input_bytes if input_bytes is not None else source.file_bytes
    if limit is None and source.path is None:
        limit = source.proto.ByteSize()  # an in-memory input: its serialized size
    if not opts.allow_growth and limit is not None and (result.after.file_bytes or 0) > limit:
        no_growth(result, source, output, opts, limit)


def no_growth(result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions, limit: int) -> None:
    """The shrunk model written is larger than the input (`limit` bytes, external data
    included: a weight two readers slice differently is stored twice): the reference is written
    instead (the input with the masks applied, which the proof compared with; the input's own
    files when it is the input as given; a small one in one file, whose weights lie unpadded),
    and the result becomes it, with `grew` saying why.
    ShrinkError (nothing left written) when that too is larger than the input."""
    from onnxshrink.errors import ShrinkError
    from onnxshrink.report import human_bytes, model_stats

    grown, shapes = result.after.file_bytes or 0, result.after.input_shapes
    if _in_one_file(result, source, output, opts, limit):
        result.grew = (
            f"the shrunk model with its weights in external data would be {human_bytes(grown)} "
            f"(each weight 4 KiB-aligned), larger than the input's {human_bytes(limit)}: written "
            "in one file instead (--external-data keeps them apart)"
        )
        return
    result.model, result.data_file = result.reference, None
    result._unchanged = source if result.reference is source.proto and source.as_given and source.path else None
    if result._unchanged is None and source.data and source.base_dir is not None:
        if not in_memory(limit):
            raise ShrinkError(
                f"{output}: the shrunk model would be {human_bytes(grown)}, larger than the "
                f"input's {human_bytes(limit)}; --allow-growth writes it."
            )
        load_external(result.reference, Path(source.base_dir), str(source.path))
    if result._unchanged is None and opts.external_data is None and in_memory(limit):
        opts = opts.but(external_data=False)  # one file: no alignment padding between weights
    _write(result, source, output, opts)
    written = result.after.file_bytes or 0
    result.after = model_stats(result.reference, shapes or {}, written)
    result.grew = (
        f"the shrunk model would be {human_bytes(grown)}, larger than the input's {human_bytes(limit)}: "
        "written instead is the model the proof compared it with (the input, masks applied: no "
        "larger than the input); --allow-growth writes the shrunk model"
    )
    if written > limit:
        for p in result.written:
            Path(p).unlink(missing_ok=True)
        result.written = []
        raise ShrinkError(
            f"{output}: the shrunk model would be {human_bytes(grown)} and the input with the "
            f"masks applied {human_bytes(written)}, both larger than the input's "
            f"{human_bytes(limit)}: nothing written. --allow-growth writes the shrunk model."
        )


def _in_one_file(result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions, limit: int) -> bool:
    """A small shrunk model whose weights went to external data only because the input's did:
    written again in one file (its weights unpadded); whether that is no larger than `limit`."""
    if opts.external_data is not None or not source.data or result.data_file is not None:
        return False
    if result._unchanged is not None or not in_memory(limit):
        return False
    _write(result, source, output, opts.but(external_data=False))
    data = Path(output).absolute().with_name(Path(output).name + ".data")
    data.unlink(missing_ok=True)  # the first write's, now unread
    return (result.after.file_bytes or 0) <= limit


def _write(result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions) -> None:
    """The result's model written to `output`, as `save` says."""
    protect = source.protected
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

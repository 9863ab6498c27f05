"""No output larger than its input unless asked (`--allow-growth`): a shrunk model whose files
(external data included) would take more bytes than the input's is written in the first of
these forms that is no larger: without the shapes the rewrite inferred (value_info, which
onnxruntime infers itself: a tiny model's shrink can gain more in them than it loses in
weights); in one file, when its weights went to external data only because the input's did
(each weight of 1 MiB or more there is 4 KiB-aligned); else the model the proof compared it with, the input with
the masks applied (the input's own files when it is the input as given). NotShrunk (exit 1),
nothing left written, when even that is larger."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx

from onnxshrink import ir
from onnxshrink.errors import NotShrunk, ShrinkError
from onnxshrink.io.model import load_external
from onnxshrink.options import ShrinkOptions
from onnxshrink.report import human_bytes, model_stats
from onnxshrink.result import ShrinkResult, in_memory
from onnxshrink.stages.read import Source

#: how the save stage writes a result's model (result.written, result.after.file_bytes set)
Write = Callable[[ShrinkResult, Source, "str | Path", ShrinkOptions], None]


def no_growth(
    result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions, limit: int, write: Write
) -> None:
    """`result`, written larger than `limit` bytes, written again no larger (see the module);
    `result.grew` says how, and `result.model` is what was written."""
    grown = result.after.file_bytes or 0
    said = f"the shrunk model as written would be {human_bytes(grown)}, larger than the input's {human_bytes(limit)}"
    if result.data_file is None and result._unchanged is None and in_memory(limit):
        if _without_inferred_shapes(result, source, output, opts, write) <= limit:
            result.grew = f"{said}: written without the shapes it inferred (value_info; onnxruntime infers them)"
            return
        if _in_one_file(result, source, output, opts, write) <= limit:
            result.grew = (
                f"{said} (its weights in external data, the large ones 4 KiB-aligned): written in one file "
                "instead (--external-data keeps them apart)"
            )
            return
    written = _reference(result, source, output, opts, write, limit)
    result.grew = (
        f"{said}: written instead is the model the proof compared it with (the input, masks "
        "applied: no larger than the input); --allow-growth writes the shrunk model"
    )
    if written > limit:
        for p in result.written:
            Path(p).unlink(missing_ok=True)
        result.written = []
        raise NotShrunk(
            f"{output}: the shrunk model would be {human_bytes(grown)} and the input with the "
            f"masks applied {human_bytes(written)}, both larger than the input's "
            f"{human_bytes(limit)}: nothing written. --allow-growth writes the shrunk model."
        )


def _without_inferred_shapes(
    result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions, write: Write
) -> int:
    """The shrunk model written without value_info (in every graph); the bytes written."""
    lean = onnx.ModelProto()
    lean.CopyFrom(result.model)
    for g in ir.all_graphs(lean.graph):
        del g.value_info[:]
    result.model = lean  # the same function and weights: what the next forms write too
    write(result, source, output, opts)
    return result.after.file_bytes or 0


def _in_one_file(result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions, write: Write) -> int:
    """The shrunk model (as it stands) written in one file when its weights went to external
    data only because the input's did; the bytes written (unchanged when it does not apply)."""
    if opts.external_data is not None or not source.data:
        return result.after.file_bytes or 0
    write(result, source, output, opts.but(external_data=False))
    Path(output).absolute().with_name(Path(output).name + ".data").unlink(missing_ok=True)
    return result.after.file_bytes or 0


def _reference(
    result: ShrinkResult, source: Source, output: str | Path, opts: ShrinkOptions, write: Write, limit: int
) -> int:
    """The reference written in the shrunk model's place (and made the result's model, its
    statistics counted); the bytes written."""
    shapes = result.after.input_shapes
    result.model, result.data_file = result.reference, None
    as_given = result.reference is source.proto and source.as_given and source.path is not None
    result._unchanged = source if as_given else None
    if not as_given and source.streamed and source.base_dir is not None:
        if not in_memory(limit):
            raise ShrinkError(
                f"{output}: the shrunk model would be larger than the input's "
                f"{human_bytes(limit)}; --allow-growth writes it."
            )
        load_external(result.reference, Path(source.base_dir), str(source.path))
    if not as_given and opts.external_data is None and in_memory(limit):
        opts = opts.but(external_data=False)  # one file: no alignment padding between weights
    write(result, source, output, opts)
    written = result.after.file_bytes or 0
    result.after = model_stats(result.reference, shapes or {}, written)
    return written

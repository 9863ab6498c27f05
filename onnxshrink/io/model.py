"""Read ONNX models (with or without external data) and write them atomically."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import onnx

from onnxshrink.errors import ShrinkError, first_line

TWO_GB = 2**31


def _external_locations(model: onnx.ModelProto) -> list[str]:
    locs = []
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location" and e.value not in locs:
                    locs.append(e.value)
    return locs


def uses_external_data(path: str | Path) -> bool:
    try:
        return bool(_external_locations(onnx.load(str(path), load_external_data=False)))
    except Exception:
        return False


def load_model(path: str | Path) -> onnx.ModelProto:
    p = Path(path)
    if not p.exists():
        raise ShrinkError(f"{p}: no such file. Give the path of an ONNX model (.onnx).")
    if p.is_dir():
        raise ShrinkError(f"{p}: is a directory, not an ONNX model file.")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:
        raise ShrinkError(
            f"{p}: not a valid ONNX model ({first_line(exc)}). Check that the file is complete, "
            "e.g. re-export it with torch.onnx.export."
        ) from exc
    if not model.graph.node or not model.graph.output:
        raise ShrinkError(f"{p}: not a valid ONNX model (it has no nodes or no outputs).")
    missing = [loc for loc in _external_locations(model) if not (p.parent / loc).exists()]
    if missing:
        raise ShrinkError(
            f"{p}: its weights are stored in '{missing[0]}', which is not next to the model. "
            "Keep the external data file beside the .onnx file (torch.onnx.export writes "
            "<model>.onnx.data)."
        )
    try:
        onnx.load_external_data_for_model(model, str(p.parent))
    except Exception as exc:
        raise ShrinkError(f"{p}: its external data could not be read ({first_line(exc)}).") from exc
    check_model(model, str(p))
    return model


def check_model(model: onnx.ModelProto, source: str = "model") -> None:
    """Refuse a model onnx's checker rejects (e.g. a file cut short, losing its opset)."""
    if not model.opset_import:
        raise ShrinkError(f"{source}: not a valid ONNX model (it declares no opset); re-export it.")
    from onnxshrink.prepare import skeleton

    try:
        onnx.checker.check_model(skeleton(model))  # the graph, without copying the weights
    except Exception as exc:
        raise ShrinkError(
            f"{source}: not a valid ONNX model ({first_line(exc)}). Re-export it, or run onnx.checker.check_model on it to see why."
        ) from exc


def save_model(
    model: onnx.ModelProto,
    path: str | Path,
    *,
    external: bool = False,
    protect: Iterable[str | Path] = (),
) -> list[Path]:
    """Write `model` to `path` (and `<path>.data` when external); never half-written, never
    over one of the `protect` files (the input model and its data)."""
    out = Path(path).absolute()
    data = out.with_name(out.name + ".data")
    guarded = {Path(p).absolute().resolve() for p in protect}
    for target in (out, data):
        if target.resolve() in guarded:
            raise ShrinkError(
                f"{target}: refusing to overwrite the input model or its data; choose another output path with -o."
            )
    if not out.parent.is_dir():
        raise ShrinkError(f"{out.parent}: the output directory does not exist.")
    if out.is_dir():
        raise ShrinkError(f"{out}: is a directory; give the output model's file name with -o.")
    external = external or model.ByteSize() >= TWO_GB
    written = []
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".onnxshrink-") as tmp:
        tmp_model = Path(tmp) / out.name
        if external:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)  # saving as external data rewrites the proto it is given
            onnx.save_model(
                copy,
                str(tmp_model),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=data.name,
                size_threshold=1024,
            )
            if (Path(tmp) / data.name).exists():
                os.replace(Path(tmp) / data.name, data)
                written.append(data)
        else:
            onnx.save_model(model, str(tmp_model))
        os.replace(tmp_model, out)
        written.insert(0, out)
    return written

"""Read ONNX models (with or without external data) and write them atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterable
from pathlib import Path

import onnx

from onnxshrink.errors import ShrinkError, first_line
from onnxshrink.io.weights import DataWriter, WeightStore

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


def data_files(path: str | Path, model: onnx.ModelProto | None = None) -> list[Path]:
    """The external data files the model at `path` refers to (`model`: that file, if already
    loaded without its external data, so that it is not read again)."""
    if model is None:
        model = onnx.load(str(path), load_external_data=False)
    return [Path(path).parent / loc for loc in _external_locations(model)]


def load_model(path: str | Path, keep_external: bool = False) -> onnx.ModelProto:
    """The model at `path`, checked. With `keep_external`, weights stored in external data
    files stay there (only their presence and sizes are checked): the caller reads them when it
    needs them (`onnxshrink.prepare` does, straight into numpy), so they are not held twice."""
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
    if keep_external:
        _check_external_sizes(model, p)
    else:
        load_external(model, p.parent, str(p))
    check_model(model, str(p))
    return model


def load_external(model: onnx.ModelProto, base_dir: Path, source: str = "model") -> None:
    """Read the external data of `model` into it (in place)."""
    try:
        onnx.load_external_data_for_model(model, str(base_dir))
    except Exception as exc:
        raise ShrinkError(
            f"{source}: its external data could not be read ({first_line(exc)})."
        ) from exc


def _check_external_sizes(model: onnx.ModelProto, p: Path) -> None:
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        f = p.parent / info.get("location", "")
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        if f.stat().st_size < end:
            raise ShrinkError(
                f"{p}: its external data could not be read ({f.name} is shorter than tensor "
                f"'{t.name}' needs: {f.stat().st_size} < {end} bytes)."
            )


def check_model(model: onnx.ModelProto, source: str = "model") -> None:
    """Refuse a model onnx's checker rejects (e.g. a file cut short, losing its opset)."""
    if not model.opset_import:
        raise ShrinkError(f"{source}: not a valid ONNX model (it declares no opset); re-export it.")
    from onnxshrink.prepare.shapes import checkable

    try:
        onnx.checker.check_model(checkable(model))  # the graph, without copying the weights
    except Exception as exc:
        raise ShrinkError(
            f"{source}: not a valid ONNX model ({first_line(exc)}). Re-export it, or run onnx.checker.check_model on it to see why."
        ) from exc


def check_output(path: str | Path, protect: Iterable[str | Path] = ()) -> None:
    """Refuse an output path before any work: over the input or its data, or where no file
    can be written."""
    out = Path(path).absolute()
    _check_output(out, out.with_name(out.name + ".data"), protect)


def _check_output(out: Path, data: Path, protect: Iterable[str | Path]) -> None:
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


class Scratch:
    """Where a streamed shrink writes the shrunk model's weights: one external data file per
    attempt, beside the output under a hidden name (renamed into place by `save_streamed`, so the
    weights are written once), or in a temporary directory without an output. Files not saved
    are deleted when the Scratch goes (or the process ends)."""

    def __init__(self, store: WeightStore, output: str | Path | None):
        self.store = store
        self._tmp = None if output is not None else tempfile.mkdtemp(prefix="onnxshrink-")
        self.dir = Path(self._tmp) if self._tmp else Path(output).absolute().parent  # type: ignore[arg-type]
        if not self.dir.is_dir():
            raise ShrinkError(f"{self.dir}: the output directory does not exist.")
        self.files: list[Path] = []
        self._spilled: list[Path] = []
        self._finalizer = weakref.finalize(
            self, Scratch._cleanup, self.files, self._spilled, self._tmp
        )

    @staticmethod
    def _cleanup(files: list[Path], spilled: list[Path], tmp: str | None) -> None:
        for f in [*files, *spilled]:
            f.unlink(missing_ok=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    def writer(self) -> DataWriter:
        path = self.dir / f".onnxshrink-{os.getpid()}-{uuid.uuid4().hex[:8]}.data"
        self.files.append(path)
        return self.store.writer(path)

    def spill(self) -> DataWriter:
        """A file for the reference's masked weights: it lives as long as this Scratch (the
        reference refers to it), whatever attempts are dropped."""
        path = self.dir / f".onnxshrink-{os.getpid()}-{uuid.uuid4().hex[:8]}.reference.data"
        self._spilled.append(path)
        return self.store.writer(path)

    def discard(self, writer: DataWriter) -> None:
        """An attempt's data that will not be saved (its mapped views stay valid while used)."""
        writer.close()
        writer.path.unlink(missing_ok=True)

    def drop_except(self, path: Path | None) -> None:
        """Delete every attempt's data but `path`'s (after a recovery's many tries)."""
        for f in [f for f in self.files if f != path]:
            f.unlink(missing_ok=True)
            self.files.remove(f)

    def saved(self, path: Path) -> None:
        """`path` was moved into place: no longer ours to delete."""
        if path in self.files:
            self.files.remove(path)


def external_locations(model: onnx.ModelProto) -> set[str]:
    return set(_external_locations(model))


def save_streamed(
    model: onnx.ModelProto,
    data_file: Path,
    path: str | Path,
    *,
    protect: Iterable[str | Path] = (),
    move: bool = True,
) -> list[Path]:
    """Write `model`, whose large initializers refer to `data_file` (a streamed shrink's), to
    `path` with its data as `<path>.data`: the data file is moved there (copied when `move` is
    off or it is on another file system), and the model's references renamed. Atomic as
    `save_model`; `model` is updated to refer to the saved data."""
    out = Path(path).absolute()
    data = out.with_name(out.name + ".data")
    _check_output(out, data, protect)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".onnxshrink-") as tmp:
        staged = Path(tmp) / data.name
        try:
            if not move:
                raise OSError("copy requested")
            os.replace(data_file, staged)
        except OSError:
            shutil.copyfile(data_file, staged)
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = data.name
        tmp_model = Path(tmp) / out.name
        onnx.save_model(model, str(tmp_model))
        os.replace(staged, data)
        os.replace(tmp_model, out)
    return [out, data]


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
    _check_output(out, data, protect)
    external = external or model.ByteSize() >= TWO_GB
    written = []
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".onnxshrink-") as tmp:
        tmp_model = Path(tmp) / out.name
        if external:
            if _write_external(model, tmp_model, Path(tmp) / data.name):
                os.replace(Path(tmp) / data.name, data)
                written.append(data)
        else:
            onnx.save_model(model, str(tmp_model))
        os.replace(tmp_model, out)
        written.insert(0, out)
    return written


def _write_external(
    model: onnx.ModelProto, path: Path, data_path: Path, threshold: int = 1024
) -> bool:
    """Save `model` to `path` with every initializer of `threshold` bytes or more in `data_path`
    (named relative to the model). The caller's proto is left as it was. True if data was written.

    (onnx.save_model(save_as_external_data=True) refuses when a file of the data file's name
    exists in the current directory, whatever directory the model is saved to.)"""
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)
    offset = 0
    with open(data_path, "wb") as f:
        for t in skeleton.graph.initializer:
            if not t.HasField("raw_data") or len(t.raw_data) < threshold:
                continue
            pad = -offset % 4096  # aligned, as onnx writes it (lets readers map the file)
            f.write(b"\0" * pad)
            offset += pad
            raw = t.raw_data
            f.write(raw)
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            for key, value in (
                ("location", data_path.name),
                ("offset", str(offset)),
                ("length", str(len(raw))),
            ):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            offset += len(raw)
    onnx.save_model(skeleton, str(path))
    if offset == 0:
        data_path.unlink()
    return offset > 0

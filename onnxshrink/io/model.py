"""Read ONNX models (with or without external data) and write them atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from onnxshrink.errors import ShrinkError, file_access, first_line
from onnxshrink.io import dims
from onnxshrink.io.skeleton import checkable
from onnxshrink.io.weights import DataWriter, WeightStore, pad_for
from onnxshrink.io.wire import one_file_bytes, read_mapped, write_one_file
from onnxshrink.ir import all_graphs

TWO_GB = 2**31


def _external_entries(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(tensor, location) of the first tensor stored at each external data location."""
    seen: dict[str, str] = {}
    for t in _weights(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location" and e.value not in seen:
                    seen[e.value] = t.name
    return [(name, loc) for loc, name in seen.items()]


def _weights(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The initializers of every graph: the model's and its If/Loop/Scan bodies'."""
    return [t for g in all_graphs(model.graph) for t in g.initializer]


def _external_locations(model: onnx.ModelProto) -> list[str]:
    return [loc for _, loc in _external_entries(model)]


def external_file(folder: Path, location: str, tensor: str, source: str) -> Path:
    """The file that holds a tensor's external data, which must be inside the model's folder.

    Checked on the location's text and on the folder's own entries only (lstat() of each step,
    readlink() of a link, to name its target), so that nothing outside the folder is opened or
    even stat()ed before it is refused. Symbolic links are refused wherever they point: onnx
    reads no external data through them, and onnxruntime none outside the folder."""
    where = f"{source}: tensor '{tensor}' keeps its data in '{location}'"
    fix = (
        ". onnxshrink reads external data only from the model's own folder (as onnx and "
        "onnxruntime do): put the data file beside the model, with a location relative to it."
    )
    if not location or "\0" in location or os.path.isabs(location):
        raise ShrinkError(f"{where}, which is not a path inside the model's folder{fix}")
    current, depth = folder, 0
    for part in location.replace("\\", "/").split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if depth == 0:
                raise ShrinkError(f"{where}, outside the model's folder{fix}")
            current, depth = current.parent, depth - 1
            continue
        current, depth = current / part, depth + 1
        if current.is_symlink():  # an entry inside the folder: lstat() only
            raise ShrinkError(
                f"{where}, a symbolic link to '{os.readlink(current)}', which onnx does not "
                f"follow{fix}"
            )
    if depth == 0:
        raise ShrinkError(f"{where}, which is the model's folder itself, not a file{fix}")
    return current


def uses_external_data(path: str | Path) -> bool:
    try:
        return bool(_external_locations(onnx.load(str(path), load_external_data=False)))
    except Exception:
        return False


def data_files(path: str | Path, model: onnx.ModelProto | None = None) -> list[Path]:
    """The external data files the model at `path` refers to (`model`: that file, if already
    loaded without its external data, so that it is not read again); ShrinkError for a location
    outside the model's folder (see `external_file`)."""
    return list(_data_locations(path, model).values())


def _data_locations(path: str | Path, model: onnx.ModelProto | None = None) -> dict[str, Path]:
    if model is None:  # the graph alone: a one-file model's weights are not read (io.wire)
        model = read_mapped(path, None) or onnx.load(str(path), load_external_data=False)
    folder = Path(os.path.abspath(Path(path).parent))
    return {loc: external_file(folder, loc, name, str(path)) for name, loc in _external_entries(model)}


def load_model(path: str | Path, keep_external: bool = False, map_from: int | None = None) -> onnx.ModelProto:
    """The model at `path`, checked. With `keep_external`, weights stored in external data
    files stay there (only their presence and sizes are checked): the caller reads them when it
    needs them (`onnxshrink.prepare` does, straight into numpy), so they are not held twice.
    With `map_from` too, a model file of that many bytes or more keeps its large inline weights
    where they are as well: they are named as external data in the model file itself (see
    io.wire; `mapped_in_place` tells), so that a one-file model is read as one with external
    data is, mapped tensor by tensor."""
    p = Path(path)
    if not p.exists():
        raise ShrinkError(f"{p}: no such file. Give the path of an ONNX model (.onnx).")
    if p.is_dir():
        raise ShrinkError(f"{p}: is a directory, not an ONNX model file.")
    try:
        model = None
        # (a symbolic link is read the plain way: external data is never read through one)
        if keep_external and map_from is not None and not p.is_symlink() and p.stat().st_size >= map_from:
            model = read_mapped(p, p.name)
        if model is None:
            model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:
        raise ShrinkError(
            f"{p}: not a valid ONNX model ({first_line(exc)}). Check that the file is complete, "
            "e.g. re-export it with torch.onnx.export."
        ) from exc
    if not model.graph.node or not model.graph.output:
        raise ShrinkError(f"{p}: not a valid ONNX model (it has no nodes or no outputs).")
    files = _data_locations(p, model)  # locations outside the folder: refused before any access
    missing = [loc for loc, f in files.items() if not f.is_file()]
    if missing:
        location = missing[0]
        raise ShrinkError(
            f"{p}: its weights are stored in '{location}', which is not next to the model. "
            "Keep the external data file beside the .onnx file (torch.onnx.export writes "
            "<model>.onnx.data)."
        )
    check_tensor_data(model, str(p), files)
    if not keep_external:
        load_external(model, p.parent, str(p))
    else:
        inline_small(model, files)
    check_model(model, str(p))
    dims.to_symbolic(model)  # -1 dims are dynamic (see io.dims); restored in the output
    return model


def mapped_in_place(path: str | Path, model: onnx.ModelProto) -> bool:
    """`model`, read from `path` by `load_model(..., map_from=...)`, names weights inside the
    model file itself (see io.wire)."""
    name = Path(path).name
    return any(
        e.key == "location" and e.value == name for t in model.graph.initializer for e in t.external_data
    )


def load_external(model: onnx.ModelProto, base_dir: Path, source: str = "model") -> None:
    """Read the external data of `model` into it (in place)."""
    try:
        onnx.load_external_data_for_model(model, str(base_dir))
    except Exception as exc:
        raise ShrinkError(
            f"{source}: its external data could not be read ({first_line(exc)})."
        ) from exc


# External tensors read into the model even when its weights stay on disk (`inline_small`): an
# integer tensor up to this many bytes (shapes, axes, indices), a float one up to
# io.skeleton.SMALL_FLOATS elements (an epsilon, a scale): what the skeleton keeps of a model
# that holds them inline (io.skeleton.heavy).
SMALL_INTEGER_BYTES = 64 * 1024


def inline_small(model: onnx.ModelProto, files: dict[str, Path]) -> None:
    """Read the small external tensors of `model` into it (in place; `files`: its data files by
    location, checked by `data_files`): onnx.save(save_as_external_data=True) can store every
    initializer externally, its shapes and axes too, and shape inference (on the skeleton) and
    the analysis's constant folding need their values; without them every shape after the
    first Reshape is unknown and every op keeps its channels. Read here as the weights are
    (not by onnx's loader, which refuses a data file with several hard links)."""
    from onnxshrink.io.skeleton import FLOAT_TYPES, SMALL_FLOATS
    from onnxshrink.io.weights import inline

    for g in all_graphs(model.graph):
        for t in g.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            count = int(np.prod(t.dims, dtype=np.int64))
            size = _data_bytes(t.data_type, count)
            small = count <= SMALL_FLOATS if t.data_type in FLOAT_TYPES else size is not None and size <= SMALL_INTEGER_BYTES
            location = next((e.value for e in t.external_data if e.key == "location"), "")
            if small and size is not None and location in files:
                inline(t, files[location], size)


# Bits per element of the packed sub-byte types (stored several to a byte in raw_data).
_PACKED_BITS: dict[int, int] = {
    onnx.TensorProto.INT4: 4,
    onnx.TensorProto.UINT4: 4,
    onnx.TensorProto.FLOAT4E2M1: 4,
    onnx.TensorProto.INT2: 2,
    onnx.TensorProto.UINT2: 2,
}


def _data_bytes(data_type: int, count: int) -> int | None:
    """Bytes `count` elements of `data_type` take in raw_data (None: a type not checked)."""
    if data_type in _PACKED_BITS:
        return -(-count * _PACKED_BITS[data_type] // 8)
    if data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        return count * helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except Exception:
        return None


def check_tensor_data(
    model: onnx.ModelProto, source: str, files: dict[str, Path] | None = None
) -> None:
    """Refuse initializers that hold fewer (or more) values than their shape needs, naming them:
    onnx's checker does not look at the data, and reading it would fail deep inside a stage.
    Data in external files (`files`: by location, see `data_files`) is checked against the
    files' sizes."""
    for t in _weights(model):
        count = int(np.prod(t.dims, dtype=np.int64))
        need = _data_bytes(t.data_type, count)
        shape = f"its shape {list(t.dims)} of {onnx.TensorProto.DataType.Name(t.data_type).lower()}"
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            try:
                offset, length = int(info.get("offset", 0)), int(info.get("length", need or 0))
            except ValueError:
                raise ShrinkError(
                    f"{source}: tensor '{t.name}' has an unreadable external data offset or length "
                    f"({info}); re-export the model."
                ) from None
            f = (files or {}).get(info.get("location", ""))
            if need is not None and length != need and f is not None and f.name == Path(source).name:
                raise ShrinkError(  # its data inside the model file (io.wire)
                    f"{source}: initializer '{t.name}' holds {length} bytes of data, but {shape} "
                    f"needs {need}; the model file is damaged or its exporter wrote it wrongly: re-export it."
                )
            if need is not None and length != need:
                raise ShrinkError(
                    f"{source}: tensor '{t.name}' says its external data is {length} bytes, but "
                    f"{shape} needs {need}; the model file is damaged: re-export it."
                )
            if f is not None and f.stat().st_size < offset + length:
                raise ShrinkError(
                    f"{source}: its external data could not be read ({f.name} is shorter than "
                    f"tensor '{t.name}' needs: {f.stat().st_size} < {offset + length} bytes)."
                )
            continue
        if need is None:
            continue
        if t.HasField("raw_data"):
            have, unit = len(t.raw_data), "bytes"
        elif t.data_type in _PACKED_BITS:
            continue  # packed into int32_data: onnx's own reader checks it
        else:
            field = helper.tensor_dtype_to_field(t.data_type)
            have, unit = len(getattr(t, field)), "values"
            need = count * (2 if t.data_type in _COMPLEX else 1)
        if have != need:
            raise ShrinkError(
                f"{source}: initializer '{t.name}' holds {have} {unit} of data, but {shape} needs "
                f"{need}; the model file is damaged or its exporter wrote it wrongly: re-export it."
            )


_COMPLEX = (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128)


def check_model(model: onnx.ModelProto, source: str = "model") -> None:
    """Refuse a model onnx's checker rejects (e.g. a file cut short, losing its opset)."""
    if not model.opset_import:
        raise ShrinkError(f"{source}: not a valid ONNX model (it declares no opset); re-export it.")
    try:
        onnx.checker.check_model(checkable(model))  # the graph, without copying the weights
    except Exception as exc:
        raise ShrinkError(
            f"{source}: not a valid ONNX model ({first_line(exc)}). Re-export it, or run onnx.checker.check_model on it to see why."
        ) from exc


def check_output(path: str | Path, protect: Iterable[str | Path] = ()) -> None:
    """Refuse an output path before any work: over the input or its data, over something that
    is not a regular file (a device, a pipe), or in a directory where no file can be written."""
    out = Path(path).absolute()
    _check_output(out, out.with_name(out.name + ".data"), protect)
    with file_access(out, "write"), tempfile.TemporaryDirectory(dir=out.parent, prefix=".onnxshrink-"):
        pass  # what saving does first: a hidden directory beside the output


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
    for target in (out, data):
        if target.exists() and not target.is_file():
            raise ShrinkError(
                f"{target}: exists and is not a regular file (a device or a pipe); the output is "
                "written beside it and renamed over it, which would replace it: choose a file path "
                "with -o (or no -o to analyze only)."
            )


class Scratch:
    """Where a streamed shrink writes the shrunk model's weights: one external data file per
    attempt, beside the output under a hidden name (renamed into place by `save_streamed`, so the
    weights are written once), or in a temporary directory without an output. Files not saved
    are deleted when the Scratch goes (or the process ends)."""

    def __init__(self, store: WeightStore, output: str | Path | None):
        self.store = store
        with file_access(tempfile.gettempdir(), "write a temporary directory in"):
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

    def discard_spills(self) -> None:
        """Delete the spill files (their mapped views stay valid while used)."""
        for f in self._spilled:
            self.store.forget(f)  # its reserved ranges, never written, are no one's now
            f.unlink(missing_ok=True)
        self._spilled.clear()

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
    with file_access(out), tempfile.TemporaryDirectory(dir=out.parent, prefix=".onnxshrink-") as tmp:
        staged = Path(tmp) / data.name
        try:
            if not move:
                raise OSError("copy requested")
            os.replace(data_file, staged)
        except OSError:
            shutil.copyfile(data_file, staged)
        for t in _weights(model):
            if t.data_location == onnx.TensorProto.EXTERNAL:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = data.name
        tmp_model = Path(tmp) / out.name
        onnx.save_model(model, str(tmp_model))
        os.replace(staged, data)
        os.replace(tmp_model, out)
    return [out, data]


def save_one_file(
    model: onnx.ModelProto, data_file: Path, path: str | Path, *, protect: Iterable[str | Path] = ()
) -> list[Path] | None:
    """Write `model`, whose large initializers refer to `data_file` (a streamed shrink's), to
    `path` as one file, its weights copied from `data_file` as the file is written (see
    io.wire); None when it would not fit in one file (2 GiB), so that the caller writes external
    data instead. Atomic as `save_model`; `model` and `data_file` are left as they were."""
    if one_file_bytes(model) >= TWO_GB:
        return None
    out = Path(path).absolute()
    _check_output(out, out.with_name(out.name + ".data"), protect)
    with file_access(out), tempfile.TemporaryDirectory(dir=out.parent, prefix=".onnxshrink-") as tmp:
        staged = Path(tmp) / out.name
        write_one_file(model, data_file, staged)
        os.replace(staged, out)
    return [out]


def copy_model(
    source: Path, data: list[Path], path: str | Path, *, protect: Iterable[str | Path] = ()
) -> list[Path]:
    """Write the model file `source` (with its external `data` files) to `path` unchanged: a
    one-file model byte for byte; with external data, its weights' bytes are copied as they lie
    into `<path>.data` (one file: several are laid end to end) and only the locations in the
    model change. Atomic as `save_model`."""
    out = Path(path).absolute()
    target = out.with_name(out.name + ".data")
    _check_output(out, target, protect)
    with file_access(out), tempfile.TemporaryDirectory(dir=out.parent, prefix=".onnxshrink-") as tmp:
        staged = Path(tmp) / out.name
        if not data:
            shutil.copyfile(source, staged)
            os.replace(staged, out)
            return [out]
        model = onnx.load_model(str(source), load_external_data=False)
        starts: dict[Path, int] = {}
        with open(Path(tmp) / target.name, "wb") as f:
            for d in data:
                starts[d.resolve()] = f.tell()
                with open(d, "rb") as src:
                    shutil.copyfileobj(src, f)
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            entries = {e.key: e for e in t.external_data}
            where = (source.parent / entries["location"].value).resolve()
            entries["location"].value = target.name
            if starts[where]:
                if "offset" in entries:
                    entries["offset"].value = str(int(entries["offset"].value) + starts[where])
                else:
                    e = t.external_data.add()
                    e.key, e.value = "offset", str(starts[where])
        onnx.save_model(model, str(staged))
        os.replace(Path(tmp) / target.name, target)
        os.replace(staged, out)
    return [out, target]


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
    with file_access(out), tempfile.TemporaryDirectory(dir=out.parent, prefix=".onnxshrink-") as tmp:
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
        for t in _weights(skeleton):
            if not t.HasField("raw_data") or len(t.raw_data) < threshold:
                continue
            # large tensors page-aligned (readers can map each), as onnxruntime's writer does
            pad = pad_for(offset, len(t.raw_data))
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


def unique_node_names(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """Give the nodes of the main graph that share a name with an earlier one a name of their
    own (`name_1`, ...), in place: onnx's checker accepts shared names, onnxruntime refuses the
    model, and a node's name means nothing to what it computes. Returns (old, new) names."""
    taken = {n.name for n in model.graph.node}
    seen: set[str] = set()
    renamed = []
    for n in model.graph.node:
        if not n.name:
            continue  # unnamed nodes are fine with onnxruntime
        if n.name in seen:
            k, new = 1, f"{n.name}_1"
            while new in taken:
                k += 1
                new = f"{n.name}_{k}"
            taken.add(new)
            renamed.append((n.name, new))
            n.name = new
        seen.add(n.name)
    return renamed

"""Weights that stay on disk: external data memory-mapped read-only, and tensors streamed out.

A model's external data files are mapped once each; every initializer stored there becomes a
read-only numpy array viewing its bytes (`WeightStore.array`). Nothing is read until a handler
reads it, and what was read is given back to the OS (`trim`, `release`): the pages stay in the
OS page cache, not in this process, so a 13 GB model is analysed in the memory of its largest
tensors. Handlers see ordinary numpy arrays (writing to one raises: weights are never changed in
place).

The rewrite writes the shrunk model's weights with a `DataWriter` straight into one external data
file (the output's, under a temporary name until it is saved), row blocks at a time, and gets
back read-only mapped views of what it wrote; `tensor_proto` turns such a view into the
TensorProto that refers to it, so the export never copies the weights into memory.

Derived facts that cost a pass over a weight (its non-zero pattern) are memoized per mapped
array (`memo`): mapped arrays never change, so one pass serves the whole run.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import onnx
from onnx import helper

from onnxshrink.errors import ShrinkError, file_access

T = TypeVar("T")

MADV_POPULATE_READ = 22  # Linux >= 5.14: fault a range in at once (page faults one by one cost ~10x)
# Mapped pages this process may keep resident before `trim` gives them back to the page cache.
TRIM_BYTES = 128 * 2**20
CHUNK_BYTES = 32 * 2**20  # row blocks of a streamed slice (a few are in flight at once)
ALIGN = 4096  # offsets of large written tensors: a page, so that each can be mapped on its own
# Tensors this large or larger start on an ALIGN boundary, as onnxruntime's own writer aligns
# only those of 1 MiB or more: aligning every bias and norm gain cost up to 4 KiB each, enough
# to make a lightly pruned model's data file larger than its input's.
ALIGN_FROM = 2**20


def pad_for(offset: int, nbytes: int) -> int:
    """Zero bytes to write at `offset` before a tensor of `nbytes` (see ALIGN_FROM)."""
    return -offset % ALIGN if nbytes >= ALIGN_FROM else 0

_STORES: weakref.WeakSet[WeightStore] = weakref.WeakSet()
# An array's identity in a store: its address, shape, strides and dtype (see `_key`)
_Key = tuple[int, tuple[int, ...], tuple[int, ...], str]
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Location:
    """Where a tensor's bytes are: a file (absolute), an offset and a length."""

    path: Path
    offset: int
    length: int


def _key(arr: np.ndarray) -> _Key:
    return (arr.__array_interface__["data"][0], arr.shape, arr.strides, arr.dtype.str)


def _place(arr: np.ndarray, path: Path, offset: int, length: int) -> tuple[Hashable, ...]:
    return (path, offset, length, arr.shape, arr.strides, arr.dtype.str)


class WeightStore:
    """Read-only maps of external data files, and the facts memoized on the arrays they give."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._ranges: list[tuple[int, int, mmap.mmap]] = []  # address ranges of every map
        self._where: dict[_Key, Location] = {}  # exact tensors (see `location`)
        self._memo: dict[tuple[Hashable, Hashable], Any] = {}
        # files this store's writers made (resolved), and each array viewing a tensor in one:
        # its place (path, offset, length, shape, strides, dtype), the same for every map of it
        self._written: set[Path] = set()
        self._places: dict[_Key, tuple[Hashable, ...]] = {}
        # ranges of written files reserved for a tensor and not written yet: (file, offset) ->
        # what writes it (see `DataWriter.reserve`); written when first mapped
        self._pending: dict[tuple[Path, int], Pending] = {}
        _STORES.add(self)

    # ---------------------------------------------------------------- reading
    def _map(self, path: Path, offset: int = 0, length: int = 0) -> mmap.mmap:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=offset)
        base = np.frombuffer(mm, np.uint8, count=0).__array_interface__["data"][0]
        self._ranges.append((base, base + len(mm), mm))
        return mm

    def array(self, tensor: onnx.TensorProto, base_dir: str | Path) -> np.ndarray:
        """The values of an initializer stored in an external data file, as a read-only view of
        the mapped file (shape and dtype as the TensorProto says)."""
        info = {e.key: e.value for e in tensor.external_data}
        path = (Path(base_dir) / info.get("location", "")).resolve()
        mm = self._maps.get(path)
        if mm is None:
            if not path.is_file():
                raise ShrinkError(f"tensor '{tensor.name}': its external data file {path} does not exist.")
            mm = self._maps[path] = self._map(path)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        dims = tuple(int(d) for d in tensor.dims)
        count = int(np.prod(dims, dtype=np.int64))
        offset = int(info.get("offset", 0))
        length = int(info.get("length", count * dtype.itemsize))
        if (path, offset) in self._pending:
            self.settle(path, offset)
        if length != count * dtype.itemsize or offset + length > len(mm):
            raise ShrinkError(
                f"tensor '{tensor.name}': its external data ({length} bytes at {offset} in "
                f"{path.name}) does not match its shape {list(dims)} of {dtype} or the file's size."
            )
        arr = np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(dims)
        self._where[_key(arr)] = Location(path, offset, length)
        if path in self._written:  # a tensor a writer of this store wrote, mapped again
            self._places[_key(arr)] = _place(arr, path, offset, length)
        return arr

    def pending(self, tensor: onnx.TensorProto, base_dir: str | Path) -> Pending | None:
        """What will write `tensor`'s range of a file this store's writers reserved, when it
        is not written yet (None: it is, or it was never reserved)."""
        if not self._pending:
            return None
        info = {e.key: e.value for e in tensor.external_data}
        path = (Path(base_dir) / info.get("location", "")).resolve()
        return self._pending.get((path, int(info.get("offset", 0))))

    def settle(self, path: Path | None = None, offset: int | None = None) -> None:
        """Write the reserved ranges (one, or all of them): what a reader of the file finds."""
        keys = [(path, offset)] if path is not None else list(self._pending)
        for key in keys:
            job = self._pending.pop(key, None)  # type: ignore[arg-type]
            if job is not None:
                job.write()
                # the mapped weights it read go back to the page cache: a prune's proof settles
                # every zeroed weight at once (TinyLlama's shape: 4 GiB resident before this)
                trim()

    def forget(self, path: Path) -> None:
        """Drop the reserved ranges of a file (deleted unread: see `Scratch.discard_spills`)."""
        real = Path(path).resolve()
        for key in [k for k in self._pending if k[0] == real]:
            del self._pending[key]

    def owns(self, arr: np.ndarray) -> bool:
        """Is `arr` a view of one of this store's maps (immutable for the store's life)?"""
        if not isinstance(arr, np.ndarray) or arr.flags.writeable:
            return False
        address = arr.__array_interface__["data"][0]
        return any(lo <= address < hi for lo, hi, _ in self._ranges)

    def location(self, arr: np.ndarray) -> Location | None:
        """Where `arr`'s bytes are, when it is exactly a tensor this store mapped or wrote."""
        return self._where.get(_key(arr)) if isinstance(arr, np.ndarray) else None

    def memo(self, arr: np.ndarray, kind: Hashable, compute: Callable[[], T]) -> T:
        key = (self._identity(arr), kind)
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def peek(self, arr: np.ndarray, kind: Hashable) -> Any:
        return self._memo.get((self._identity(arr), kind))

    def _identity(self, arr: np.ndarray) -> Hashable:
        """What a memo is kept under: the array's address, or, for a tensor this store wrote,
        its place in the file, so that what was derived for the writer's view of it (a zeroed
        weight's non-zero pattern) serves a later map of the file (the shrink reading it)."""
        key = _key(arr)
        return self._places.get(key, key)

    # ---------------------------------------------------------------- residency
    def populate(self, arr: np.ndarray) -> None:
        """Fault the pages of a contiguous mapped array in at once (before a pass over it)."""
        if not arr.flags.c_contiguous or arr.nbytes < CHUNK_BYTES:
            return
        address = arr.__array_interface__["data"][0]
        for lo, hi, mm in self._ranges:
            if lo <= address < hi:
                start = (address - lo) // _PAGE * _PAGE
                # an older kernel refuses: the pages then fault in one by one
                with contextlib.suppress(OSError, ValueError):
                    mm.madvise(MADV_POPULATE_READ, start, min(address - lo + arr.nbytes, hi - lo) - start)
                return

    def release(self) -> None:
        """Give every mapped page back to the page cache (they are read again when touched)."""
        for _, _, mm in self._ranges:
            if not mm.closed:
                mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Forget the maps (arrays still viewing them keep them alive until they go)."""
        self._maps.clear()
        self._ranges.clear()
        self._where.clear()
        self._memo.clear()
        self._places.clear()

    # ---------------------------------------------------------------- writing
    def writer(self, path: Path) -> DataWriter:
        return DataWriter(self, path)


class DataWriter:
    """Appends tensors to one external data file and maps each back, read-only."""

    def __init__(self, store: WeightStore, path: Path):
        self.store = store
        self.path = Path(path).absolute()
        with file_access(self.path.parent, "write the shrunk weights in"):
            self._f = open(self.path, "wb")  # noqa: SIM115 (closed by close(), after the last tensor)
        self.real = self.path.resolve()  # as WeightStore.array names it
        store._written.add(self.real)
        self.offset = 0
        self.tensors = 0
        self.made: dict[Hashable, np.ndarray] = {}  # slices written, by source and slicing (rewrite._once)

    def write(self, name: str, blocks: Iterator[np.ndarray], shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Write the row blocks of a tensor of `shape` (C order) and return the mapped view.
        Blocks that need a copy (slices) are made by a worker thread while the previous one is
        written: the copies and the writes overlap."""
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        pad = pad_for(self.offset, expected)
        if pad:
            self._f.write(b"\0" * pad)
            self.offset += pad
        start = self.offset
        with file_access(self.path.parent, "write the shrunk weights in"):
            for block in _ahead(blocks, np.dtype(dtype)):
                self._f.write(block.reshape(-1).view(np.uint8).data)
                self.offset += block.nbytes
            self._f.flush()
        length = self.offset - start
        if length != expected:
            raise RuntimeError(f"{name}: wrote {length} bytes, its shape needs {expected}")
        self.tensors += 1
        if length == 0:
            return np.zeros(shape, dtype)
        page = start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY  # maps start on one
        mm = self.store._map(self.path, page, start - page + length)
        count = int(np.prod(shape, dtype=np.int64))
        arr = np.frombuffer(mm, dtype=dtype, count=count, offset=start - page).reshape(shape)
        self.store._where[_key(arr)] = Location(self.path, start, length)
        self.store._places[_key(arr)] = _place(arr, self.real, start, length)
        return arr

    def reserve(self, name: str, shape: tuple[int, ...], dtype: np.dtype, source: Deferred) -> Location:
        """Set aside the range of a tensor of `shape`, written (from `source.blocks()`, its row
        blocks in C order) only when the store first maps it, or at `settle`: a prune's
        reference, whose zeroed weights the shrink reads through `source` (their pattern and
        kept slices), never writes them. The file is extended to hold it (a hole until written)."""
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        start = self.offset + pad_for(self.offset, expected)
        self.offset = start + expected
        self._f.truncate(self.offset)
        self.tensors += 1
        where = Location(self.path, start, expected)
        self.store._pending[(self.real, start)] = Pending(name, where, np.dtype(dtype), source)
        return where

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class Deferred(Protocol):
    """What writes a reserved range: its row blocks, in C order."""

    def blocks(self) -> Iterator[np.ndarray]: ...


@dataclass
class Pending:
    """A reserved range of a written file and what writes it (`DataWriter.reserve`)."""

    name: str
    where: Location
    dtype: np.dtype
    source: Deferred

    def write(self) -> None:
        done = 0
        with open(self.where.path, "r+b") as f:
            for block in _ahead(self.source.blocks(), self.dtype):
                os.pwrite(f.fileno(), block.reshape(-1).view(np.uint8).data, self.where.offset + done)
                done += block.nbytes
        if done != self.where.length:
            raise RuntimeError(f"{self.name}: wrote {done} bytes, its shape needs {self.where.length}")


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


def _ahead(blocks: Iterator[np.ndarray], dtype: np.dtype, depth: int = 2) -> Iterator[np.ndarray]:
    """The blocks, made contiguous (copied when they are strided views) by a worker thread at
    most `depth` blocks ahead of the caller. numpy's copies and file writes release the GIL, so
    on two cores a slice costs about the larger of its copy and its write, not their sum."""
    # blocks, a _Failed or _END: Any, as mypy cannot narrow the object() sentinel `_END` away
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for block in blocks:
                if stop.is_set():
                    return
                q.put(np.ascontiguousarray(block, dtype=dtype))
            q.put(_END)
        except BaseException as exc:  # handed to the caller, which raises it
            q.put(_Failed(exc))

    worker = threading.Thread(target=work, name="onnxshrink-slices", daemon=True)
    worker.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # unblock a worker waiting to put
            with contextlib.suppress(queue.Empty):
                q.get_nowait()
            worker.join(0.01)


def tensor_proto(
    name: str, arr: np.ndarray, where: Location, relative_to: Path | None
) -> onnx.TensorProto:
    """A TensorProto of `arr`'s shape and dtype whose data are at `where`, named relative to
    the directory the model is read from (None: by absolute path, which onnxruntime refuses:
    see `absolute` and validate.run_model)."""
    t = onnx.TensorProto(name=name, dims=list(arr.shape))
    t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (
        ("location", str(where.path) if relative_to is None else os.path.relpath(where.path, relative_to)),
        ("offset", str(where.offset)),
        ("length", str(where.length)),
    ):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t


# The dtypes of initializers a session can be handed as arrays (numpy's, which
# OrtValue.ortvalue_from_numpy takes as they are) instead of in the model's bytes (`handed`).
HANDED = frozenset(
    np.dtype(t)
    for t in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
              np.uint8, np.uint16, np.uint32, np.uint64, np.bool_)
)  # fmt: skip


def handed(name: str, arr: np.ndarray) -> onnx.TensorProto:
    """An initializer of `arr`'s shape and dtype that names its data as external: onnxruntime
    takes the data from SessionOptions.add_external_initializers instead (it reads no file),
    and treats it as any initializer (constant: prepacked once)."""
    t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype))
    t.dims.extend(arr.shape)
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "handed"), ("offset", "0"), ("length", str(arr.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def absolute(t: onnx.TensorProto) -> Path | None:
    """The file of an initializer stored by absolute path (a spilled masked weight), else None."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    location = next((e.value for e in t.external_data if e.key == "location"), "")
    return Path(location) if os.path.isabs(location) else None


def tensor_values(t: onnx.TensorProto, base_dir: str | Path | None = None) -> np.ndarray:
    """An initializer's values: held in the TensorProto, in external data relative to
    `base_dir`, or stored by absolute path (a prune's or a masks shrink's reference's spilled
    weight, which onnx's own reader refuses)."""
    from onnx import numpy_helper

    if absolute(t) is None:
        return numpy_helper.to_array(t, base_dir=str(base_dir or ""))
    held = onnx.TensorProto()
    held.CopyFrom(t)
    inline(held)
    return numpy_helper.to_array(held)


def inline(t: onnx.TensorProto, path: str | Path | None = None, length: int | None = None) -> None:
    """Read an initializer stored externally into the TensorProto itself: from `path` (its data
    file, checked by the caller), else the absolute path it is stored by; `length`: its bytes
    when the entry does not say."""
    path = path if path is not None else absolute(t)
    assert path is not None
    info = {e.key: e.value for e in t.external_data}
    with open(path, "rb") as f:
        f.seek(int(info.get("offset", 0)))
        t.raw_data = f.read(int(info.get("length", length if length is not None else -1)))
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT


def owner(arr: np.ndarray) -> WeightStore | None:
    """The live store that mapped `arr`, if any."""
    for store in list(_STORES):
        if store.owns(arr):
            return store
    return None


def memo(arr: np.ndarray, kind: Hashable, compute: Callable[[], T]) -> T:
    """`compute()`, memoized when `arr` is a mapped (immutable) array."""
    store = owner(arr)
    return compute() if store is None else store.memo(arr, kind, compute)


def peek(arr: np.ndarray, kind: Hashable) -> Any:
    """What `memo` computed for `arr`, or None."""
    store = owner(arr)
    return None if store is None else store.peek(arr, kind)


def populate(arr: np.ndarray) -> None:
    store = owner(arr)
    if store is not None:
        store.populate(arr)


def release_all() -> None:
    """Give every live store's mapped pages back to the page cache (read again when touched)."""
    global _baseline
    for store in list(_STORES):
        store.release()
    _baseline = None


def _resident_file_bytes() -> int:
    """File-backed pages resident in this process (mapped weights), from /proc/self/statm."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[2]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


_baseline: int | None = None  # file-backed bytes resident after the last release (libraries)


def trim(limit: int = TRIM_BYTES) -> None:
    """Give mapped weight pages back when more than `limit` bytes of them may be resident (the
    file-backed pages of this process grew by that much since the last release): called
    between nodes by the analysis and the rewrite, so that their memory stays bounded by the
    tensors one node reads."""
    global _baseline
    if not _STORES:
        return
    resident = _resident_file_bytes()
    if _baseline is None or resident < _baseline:
        _baseline = resident
    elif resident - _baseline > limit:
        release_all()
        _baseline = _resident_file_bytes()


def take(arr: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    """np.take(arr, index, axis) for sorted indices, by slices where the indices run in steps
    (every other neuron) or in a few ranges (whole heads): a strided copy is several times
    faster than a gather."""
    index = np.asarray(index)
    if len(index) == 0:
        return np.take(arr, index, axis=axis)
    steps = np.diff(index)
    where: list[slice | np.ndarray] = [slice(None)] * arr.ndim
    if len(index) == 1 or (steps[0] > 0 and np.all(steps == steps[0])):
        step = int(steps[0]) if len(index) > 1 else 1
        where[axis] = slice(int(index[0]), int(index[-1]) + 1, step)
        return arr[tuple(where)]
    breaks = np.flatnonzero(steps != 1)
    if len(breaks) < 64:  # a few contiguous ranges
        bounds = np.split(index, breaks + 1)
        parts = []
        for run in bounds:
            where[axis] = slice(int(run[0]), int(run[-1]) + 1)
            parts.append(arr[tuple(where)])
        return np.concatenate(parts, axis=axis)
    return np.take(arr, index, axis=axis)


def row_blocks(
    arr: np.ndarray, rows: np.ndarray | None = None, chunk: int = CHUNK_BYTES
) -> Iterator[np.ndarray]:
    """`arr` (or `arr[rows]`, rows sorted) in blocks of whole rows of at most `chunk` bytes, as
    views or small copies: a pass over a mapped weight that never holds more than a block."""
    n = arr.shape[0] if arr.ndim else 1
    if arr.ndim == 0:
        yield arr.reshape(1)
        return
    per_row = max(1, arr[:1].nbytes)
    step = max(1, chunk // per_row)
    index = np.arange(n) if rows is None else np.asarray(rows)
    for s in range(0, len(index), step):
        part = index[s : s + step]
        if rows is None:
            yield arr[int(part[0]) : int(part[-1]) + 1]
        else:
            yield take(arr, part, 0)

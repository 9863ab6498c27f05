"""The float64 twin the judge compares a shrunk model with: the same shrink (the same axes kept
whole) of the reference widened to float64 (onnxshrink.proof.judge).

A small reference's twin is made in memory. A large one's is streamed, as a large model is
shrunk: the reference widened into a float64 data file a tensor (a block of rows) at a time,
then analyzed with its weights mapped from that file and rewritten into a second one. Both
files are in a scratch directory of their own (beside the shrunk model's data when it has a
file, else in the system's temporary directory), which needs up to 4 x the reference's float32
weights on disk (its float64 copy, which the judge computes the reference in float64 from, and
the shrink of it); the directory is deleted when the judge is done with the twin, or as soon as
making it fails.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from onnxshrink.io.weights import DataWriter, WeightStore
from onnxshrink.proof.judge import Twin
from onnxshrink.proof.segment import tensor_bytes
from onnxshrink.proof.widen import NARROW, to_file, widened

# The shrink repeated on the widened reference: (model, where its external data are, the store
# that maps them, the writer of the shrunk weights) -> the shrunk model
Shrink = Callable[[onnx.ModelProto, str | None, WeightStore | None, DataWriter | None], onnx.ModelProto]


def float64_twin(
    reference: onnx.ModelProto, base_dir: str | None, shrink: Shrink, near: Path | None, streamed: bool
) -> Twin:
    """The twin of `reference` (its external data in `base_dir`), made by `shrink`: in memory,
    or `streamed` through a scratch directory (see the module doc) made in `near` (a
    directory) when given."""
    if not streamed:
        wide = widened(reference, base_dir)
        return Twin(shrink(wide, None, None, None))
    room = _room(reference, near)
    store = WeightStore()

    def close() -> None:
        store.close()
        shutil.rmtree(room, ignore_errors=True)

    try:
        copy = store.writer(room / "reference.float64.data")
        wide = widened(reference, base_dir, to_file(copy, base_dir))
        copy.close()
        made = shrink(wide, str(room), store, store.writer(room / "twin.float64.data"))
        return Twin(made, room, close, wide)  # (the judge computes the reference from its copy)
    except BaseException:
        close()
        raise


def disk_bytes(reference: onnx.ModelProto) -> int:
    """What a streamed twin of `reference` may hold on disk at once: its weights, the float
    ones widened to float64, and the shrink of that (at most as large)."""
    wide = sum(
        int(np.prod(t.dims, dtype=np.int64)) * 8 if t.data_type in NARROW else tensor_bytes(t)
        for t in reference.graph.initializer
    )
    return 2 * wide


def _room(reference: onnx.ModelProto, near: Path | None) -> Path:
    """A scratch directory with room for the twin (OSError when there is none)."""
    parent = Path(near) if near is not None and Path(near).is_dir() else Path(tempfile.gettempdir())
    need, free = disk_bytes(reference), shutil.disk_usage(parent).free
    if free < need:
        raise OSError(f"the float64 twin needs {need / 2**30:.1f} GiB in {parent}, {free / 2**30:.1f} GiB are free")
    return Path(tempfile.mkdtemp(prefix=".onnxshrink-twin-", dir=parent))

"""One-file models read and written without holding their weights: the protobuf wire format
walked by hand, just deep enough to find (or to write) each initializer's `raw_data`.

A model in one file (no external data) is a ModelProto whose large initializers hold their
bytes inline. Parsing it with protobuf copies every byte into memory, and the rest of the
pipeline then holds the weights a few times over (a 0.6 GB model peaked at 4.5 GiB). Instead,
`read_mapped` walks the file's fields (tag, length, skip), parses only the skeleton (the model
with its large `raw_data` fields left out) and points each such initializer at its own bytes
inside the model file, as external data would: from there the model is read mapped, tensor by
tensor, exactly as a model with external data is. `write_one_file` is the way back: a model
whose weights are in an external data file written as one file, each weight's bytes copied
from that file as the protobuf is written, never held in memory.

Only the main graph's initializers are mapped (a body's stay inline, as do Constant nodes'
values); a file this walk does not understand (groups, a second `graph` field) is read the plain
way, by returning None.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import BinaryIO

import onnx

# Initializers of at least this many bytes of raw_data are mapped (smaller ones stay in the
# skeleton: shapes, axes, epsilons, which shape inference and constant folding read anyway).
MAPPED_FROM = 64 * 1024

_LEN = 2  # wire type of length-delimited fields
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def _varint(buf: mmap.mmap | bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _fields(buf: mmap.mmap | bytes, start: int, end: int) -> list[tuple[int, int, int, int, int]]:
    """(field number, wire type, start of the field's tag, start of its value, end) of each
    field in buf[start:end]; ValueError for what a ModelProto never holds (groups)."""
    out = []
    pos = start
    while pos < end:
        tag_at = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, value_end = _varint(buf, pos)
        elif wire == 1:
            value_end = pos + 8
        elif wire == 5:
            value_end = pos + 4
        elif wire == _LEN:
            length, pos = _varint(buf, pos)
            value_end = pos + length
        else:
            raise ValueError(f"wire type {wire}")
        if value_end > end:
            raise ValueError("field runs past its message")
        out.append((number, wire, tag_at, pos, value_end))
        pos = value_end
    return out


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | _LEN) + _encode_varint(len(payload)) + payload


def read_mapped(path: str | Path, location: str | None) -> onnx.ModelProto | None:
    """The model at `path` with each main-graph initializer of MAPPED_FROM bytes or more of
    raw_data stored "externally" in the model file itself (`location`: that file's name as
    seen from the folder the caller reads external data from, offsets its raw_data's; None:
    such initializers are left without data, for a caller that reads only the graph); None
    when nothing is that large or the file is not a ModelProto this walk reads (the caller
    then loads it the plain way, which reports what is wrong with it)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            top = _fields(buf, 0, len(buf))
            graphs = [field for field in top if field[0] == _MODEL_GRAPH and field[1] == _LEN]
            if len(graphs) != 1:
                return None
            _, _, g_tag, g_start, g_end = graphs[0]
            graph_parts: list[bytes] = []
            mapped: list[tuple[int, int, int]] = []  # (initializer index, offset, length)
            index = 0
            for number, wire, tag_at, start, end in _fields(buf, g_start, g_end):
                if number != _GRAPH_INITIALIZER or wire != _LEN:
                    graph_parts.append(buf[tag_at:end])
                    continue
                raw = [field for field in _fields(buf, start, end) if field[0] == _TENSOR_RAW_DATA and field[1] == _LEN]
                if len(raw) == 1 and raw[0][4] - raw[0][3] >= MAPPED_FROM:
                    _, _, r_tag, r_start, r_end = raw[0]
                    tensor = buf[start:r_tag] + buf[r_end:end]
                    graph_parts.append(_field_bytes(_GRAPH_INITIALIZER, tensor))
                    mapped.append((index, r_start, r_end - r_start))
                else:
                    graph_parts.append(buf[tag_at:end])
                index += 1
        except (ValueError, IndexError):
            return None
        if not mapped:
            return None
        skeleton = buf[:g_tag] + _field_bytes(_MODEL_GRAPH, b"".join(graph_parts)) + buf[g_end:]
    try:
        model = onnx.ModelProto.FromString(skeleton)
    except Exception:
        return None
    for index, offset, length in mapped if location is not None else ():
        t = model.graph.initializer[index]
        if t.data_location == onnx.TensorProto.EXTERNAL:
            return None  # raw_data beside external entries: let onnx's loader say what it is
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = key, value
    return model


def write_one_file(model: onnx.ModelProto, data_file: Path, path: Path) -> None:
    """Write `model`, whose main-graph initializers stored externally all live in `data_file`
    (a streamed shrink's output; any other tensor is inline), to `path` as one file: each such
    initializer's bytes copied from `data_file` into its raw_data as the file is written."""
    light = onnx.ModelProto()
    light.CopyFrom(model)
    inits = list(light.graph.initializer)
    del light.graph.initializer[:]
    entries: list[tuple[bytes, int, int]] = []  # (tensor without its data, offset, length)
    for t in inits:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            entries.append((t.SerializeToString(), 0, -1))
            continue
        info = {e.key: e.value for e in t.external_data}
        offset, length = int(info.get("offset", 0)), int(info["length"])
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
        entries.append((t.SerializeToString() + _encode_varint(_TENSOR_RAW_DATA << 3 | _LEN) + _encode_varint(length), offset, length))
    graph_head = light.graph.SerializeToString()
    sizes = [len(head) + max(length, 0) for head, _, length in entries]
    graph_len = len(graph_head) + sum(len(_encode_varint(_GRAPH_INITIALIZER << 3 | _LEN)) + len(_encode_varint(n)) + n for n in sizes)
    light.ClearField("graph")
    with open(path, "wb") as out, open(data_file, "rb", buffering=0) as data:
        out.write(light.SerializeToString())
        out.write(_encode_varint(_MODEL_GRAPH << 3 | _LEN) + _encode_varint(graph_len) + graph_head)
        for (head, offset, length), size in zip(entries, sizes, strict=True):
            out.write(_encode_varint(_GRAPH_INITIALIZER << 3 | _LEN) + _encode_varint(size) + head)
            if length > 0:
                _copy(data, offset, length, out)


def _copy(data: BinaryIO, offset: int, length: int, out: BinaryIO) -> None:
    """`length` bytes of `data` from `offset` to `out`, a chunk at a time (read, not mapped:
    mapped pages would stay resident in this process, a whole model's worth)."""
    data.seek(offset)
    while length > 0:
        chunk = data.read(min(length, _CHUNK))
        if not chunk:
            raise OSError(f"{data.name}: shorter than its tensors say")
        out.write(chunk)
        length -= len(chunk)


_CHUNK = 16 * 2**20


def one_file_bytes(model: onnx.ModelProto) -> int:
    """The size `write_one_file` writes for `model` (its skeleton and its external bytes)."""
    external = 0
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            external += int(next((e.value for e in t.external_data if e.key == "length"), "0")) + 16
    return model.ByteSize() + external



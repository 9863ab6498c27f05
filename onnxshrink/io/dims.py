"""Dims as exporters write them, read as onnxruntime reads them.

paddle2onnx and other exporters store an axis of any size as `dim_value: -1`; onnxruntime takes
a negative dim as a dynamic one. A 0 in an output or a value_info entry onnxruntime only warns
about (it is a declaration, not a check); a 0 in a graph input it enforces (an empty axis), so
that one stays as it is. Read (`to_symbolic`), each such dim becomes a symbolic dim of its own,
which every step already knows as dynamic; written (`restore`), it is given back its value, so
that the output declares its interface as the input did.
"""

from __future__ import annotations

import onnx

from onnxshrink import ir

# A symbolic dim standing for a stored value: f"{PREFIX}{value}_{k}" (unique per dim, so that
# shape inference ties no two of them together).
PREFIX = "onnxshrink_dim"


def _entries(model: onnx.ModelProto):
    """(value info, is a graph input of the main graph) of every graph's inputs, outputs and
    value_info."""
    for g in ir.all_graphs(model.graph):
        main = g is model.graph
        for vi in g.input:
            yield vi, main
        for vi in [*g.output, *g.value_info]:
            yield vi, False


def stands_for_dynamic(value: int, graph_input: bool) -> bool:
    """Does a stored dim value mean "any size" to onnxruntime?"""
    return value < 0 or (value == 0 and not graph_input)


def needs_symbolic(model: onnx.ModelProto) -> bool:
    return any(
        d.HasField("dim_value") and stands_for_dynamic(d.dim_value, graph_input)
        for vi, graph_input in _entries(model)
        if vi.type.HasField("tensor_type")
        for d in vi.type.tensor_type.shape.dim
    )


def to_symbolic(model: onnx.ModelProto) -> int:
    """Every dim stored as a value onnxruntime takes for "any size" made a symbolic dim, in
    place; how many."""
    k = 0
    for vi, graph_input in _entries(model):
        if not vi.type.HasField("tensor_type"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and stands_for_dynamic(d.dim_value, graph_input):
                value = d.dim_value
                d.Clear()
                d.dim_param = f"{PREFIX}{value}_{k}"
                k += 1
    return k


def restore(model: onnx.ModelProto) -> None:
    """The dims `to_symbolic` made given back their stored values, in place (wherever shape
    inference carried them)."""
    for vi, _ in _entries(model):
        if not vi.type.HasField("tensor_type"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            value = stored_value(d.dim_param) if d.HasField("dim_param") else None
            if value is not None:
                d.Clear()
                d.dim_value = value


def stored_value(dim_param: str) -> int | None:
    """The value a symbolic dim made by `to_symbolic` stands for, or None for any other."""
    if not dim_param.startswith(PREFIX):
        return None
    value, sep, k = dim_param[len(PREFIX) :].rpartition("_")
    try:
        return int(value) if sep and k.isdigit() else None
    except ValueError:
        return None

"""The registry of op handlers, keyed by domain, op type and opset range, and the one typed
`Lookup` the analysis takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx
import onnx_graphsurgeon as gs

from onnxshrink.core.handler import Handler, OpNode


@dataclass(frozen=True)
class _Entry:
    since: int
    until: int
    handler: Handler


_REGISTRY: dict[tuple[str, str], list[_Entry]] = {}


def register(
    *op_types: str, since: int = 1, until: int = 10_000, domain: str = ""
) -> Callable[[type[Handler]], type[Handler]]:
    """Class decorator: handle `op_types` for opsets since..until (inclusive). Overlaps are refused."""

    def deco(cls: type[Handler]) -> type[Handler]:
        inst = cls()
        for op in op_types:
            entries = _REGISTRY.setdefault((domain, op), [])
            for e in entries:
                if not (until < e.since or since > e.until):
                    raise ValueError(
                        f"{op} (opsets {since}-{until}) is already handled by "
                        f"{type(e.handler).__name__} for opsets {e.since}-{e.until}"
                    )
            entries.append(_Entry(since, until, inst))
        return cls

    return deco


def handler_for_op(op: str, domain: str, opset: int) -> Handler | None:
    """The handler of `op` in `domain` ("" or "ai.onnx" for the standard ops) at `opset`."""
    domain = "" if domain == "ai.onnx" else domain
    for e in _REGISTRY.get((domain, op), ()):
        if e.since <= opset <= e.until:
            return e.handler
    return None


def handler_for(node: gs.Node, opset: int) -> Handler | None:
    return handler_for_op(node.op, node.domain or "", opset)


def facts(node: onnx.NodeProto, opset: int) -> tuple[Handler | None, OpNode]:
    """An ONNX node's handler (None when no op family handles it) and its static view."""
    return handler_for_op(node.op_type, node.domain, opset), OpNode.of(node)


def is_constant_node(node: onnx.NodeProto, opset: int) -> bool:
    """A node whose output is a value of its own, read from no input (a Constant)."""
    handler = handler_for_op(node.op_type, node.domain, opset)
    return handler is not None and handler.is_constant


#: a node's handler, as the analysis takes it: always one (an op no handler claims gets a fallback)
Lookup = Callable[[gs.Node], Handler]


def lookup(opset: int, fallback: Handler) -> Lookup:
    """Handler lookup for one model's opset: an op no handler claims gets `fallback` (the
    analysis's replay of the node, analyze/fallback.py), which keeps it whole where it cannot tell."""

    def find(node: gs.Node) -> Handler:
        return handler_for(node, opset) or fallback

    return find


def registered_ops() -> list[str]:
    return sorted(op for (_, op) in _REGISTRY)

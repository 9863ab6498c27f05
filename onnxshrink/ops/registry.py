"""Op handlers: how one op family moves channels, registered per op type and opset range."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from onnxshrink.analyze.constants import ConstContext, ConstInfo
from onnxshrink.analyze.keep import KeepState


class Handler:
    """One op family. Subclasses override what differs from "a barrier that folds nothing".

    - `constants`: forward pass; which output elements are input-independent, and their values.
    - `keep`: backward pass and coupling; grow the kept index sets of inputs and outputs.
    - `rewrite`: after initializers are sliced, fix what depends on sizes (attributes, shape
      inputs, folded constants).
    """

    #: inputs holding shape values the handler uses as sizes (it constrains what they refer to)
    size_inputs: tuple[int, ...] = ()

    def constants(self, node: gs.Node, ctx: ConstContext) -> list[ConstInfo | None] | None:
        return None

    def keep(self, node: gs.Node, ks: KeepState) -> None:
        ks.barrier(node)

    def rewrite(self, node: gs.Node, rw) -> None:
        return None

    def settle(self, node: gs.Node, ks: KeepState) -> None:
        """Structural needs decided once the closure is stable (see KeepState._repair)."""
        return None

    def may_drop_inputs(self, node: gs.Node) -> tuple[int, ...]:
        """Inputs that may lose every index along an axis (e.g. a Concat branch removed whole)."""
        return ()


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


def handler_for(node: gs.Node, opset: int) -> Handler | None:
    domain = node.domain or ""
    if domain == "ai.onnx":
        domain = ""
    for e in _REGISTRY.get((domain, node.op), ()):
        if e.since <= opset <= e.until:
            return e.handler
    return None


def registered_ops() -> list[str]:
    return sorted(op for (_, op) in _REGISTRY)

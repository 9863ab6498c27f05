"""Why an index is kept (`Reason`), and the key of a whole tensor axis (`AxisKey`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    """Why an index is kept; the root cause, carried along couplings."""

    # interface | live | meets-live | normalization | unsupported (no handler) | barrier (a
    # handled op kept whole) | not-absorbable | structure | shape | replay | proof
    kind: str
    node: str = ""
    op: str = ""
    detail: str = ""

    def __str__(self) -> str:
        where = f"{self.op} node {self.node!r}" if self.node else f"an unnamed {self.op} node"
        text = {
            "interface": "it is part of a graph input or output",
            "live": "a live output depends on it",
            "meets-live": f"it is combined elementwise with a live value by {where}",
            "normalization": f"{where} normalizes over this axis"
            + ("" if self.detail else " (its statistics see every channel)"),
            "unsupported": f"{where} is not supported for shrinking; its channels are kept",
            "barrier": f"{where} keeps all its channels",
            "not-absorbable": f"{where} cannot absorb this constant channel",
            "structure": f"{where} needs it to keep a valid structure",
            "shape": f"its size is read by {where} in a way that cannot be rewritten",
            "replay": f"replaying {where} shows that a kept output depends on it",
            "proof": "kept after a failed proof: removing it made the shrunk model differ "
            "(a bug in onnxshrink's analysis; please report it with the model)",
        }.get(self.kind, self.kind)
        return f"{text}{': ' + self.detail if self.detail else ''}"


LIVE = Reason("live")


INTERFACE = Reason("interface")


PROOF = Reason("proof")


# A whole tensor axis, by tensor name: what a failed proof pins back.
AxisKey = tuple[str, int]

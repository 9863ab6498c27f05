"""The data binding produces: which initializer a mask applies to, at which readers, in what layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from onnxshrink.bind.graph import ModelIndex, Site


@dataclass
class Binding:
    """One mask laid on one initializer.

    `values` is 0/1 in the initializer's own layout. `sites` are the readers the mask's parameter
    stands for (None: every reader); when an exporter merged equal parameters into one
    initializer, the others keep their values (the initializer is untied for them). `replace`
    gives new values for some indices along axis 0 (a folded BatchNorm whose masked statistics
    change the fused weights); `attach` is where a bias the model lacks is added."""

    mask: str
    initializer: str
    values: np.ndarray
    sites: tuple[Site, ...] | None
    how: str
    replace: tuple[np.ndarray, np.ndarray] | None = None
    attach: Site | None = None

    def __post_init__(self) -> None:
        if self.values.dtype != np.uint8:
            self.values = np.asarray(self.values, dtype=np.uint8)

    def masked(self, array: np.ndarray, zero: np.ndarray | None = None) -> np.ndarray:
        """`array` with this binding applied (masked entries exactly 0, even where inf or nan;
        `zero`: what 0 is instead, a quantized weight's zero point broadcast against it, so that
        its masked entries dequantize to 0: `ModelIndex.zero_of`)."""
        out = np.array(array, copy=True)
        if self.replace is not None:
            idx, rows = self.replace
            out[idx] = rows.astype(out.dtype)
        fill = np.zeros((), out.dtype) if zero is None else np.asarray(zero).astype(out.dtype)
        return np.where(self.values != 0, out, fill).astype(out.dtype)


@dataclass
class BoundMasks:
    bindings: list[Binding] = field(default_factory=list)
    how: dict[str, str] = field(default_factory=dict)  # mask name -> how it was bound
    unbound: list[str] = field(default_factory=list)  # mask names that bound nowhere
    hints: dict[str, str] = field(default_factory=dict)  # unbound mask name -> why / what to do
    ambiguous: set[str] = field(default_factory=set)  # unbound because nothing settles their axes
    # initializer -> the parameters it was untied for (the exporter merged equal parameters)
    shared: dict[str, list[str]] = field(default_factory=dict)
    input_masked: bool | None = None  # the model already held every mask's zeros
    index: ModelIndex | None = field(default=None, repr=False)

    @property
    def masks(self) -> dict[str, np.ndarray]:
        """Initializer -> the product of the masks bound to it (whichever of its readers)."""
        out: dict[str, np.ndarray] = {}
        for b in self.bindings:
            if b.attach is not None:
                continue
            out[b.initializer] = (
                out[b.initializer] * b.values if b.initializer in out else b.values
            )
        return out

"""Bind masks to the model's initializers (`binder`), and build the reference model (`apply`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from onnxshrink.bind.apply import UNMASKED_FLAG, apply_masks, check_reference
from onnxshrink.bind.binder import Binder
from onnxshrink.bind.binding import Binding, BoundMasks
from onnxshrink.bind.graph import ModelIndex, is_fused_batchnorm, module_of
from onnxshrink.errors import ShrinkError
from onnxshrink.masks import Chain, MaskSet

__all__ = [
    "UNMASKED_FLAG",
    "Binding",
    "BoundMasks",
    "apply_masks",
    "bind_masks",
    "check_reference",
    "module_of",
    "weight_modules",
]


def bind_masks(
    model: onnx.ModelProto,
    maskset: MaskSet | dict[str, np.ndarray],
    source: str = "masks",
    allow_unbound: bool = False,
    values: Mapping[str, np.ndarray] | None = None,
    base_dir: str | None = None,
) -> BoundMasks:
    """Bind every mask; refuse (ShrinkError naming them) masks that bind nowhere or whose axes
    nothing settles, unless `allow_unbound`."""
    if not isinstance(maskset, MaskSet):
        maskset = MaskSet(masks=dict(maskset))
    index = ModelIndex(model, base_dir)
    # looked up, not merged: each value is read from its file only when a mask binds by it
    both = Chain(values or {}, maskset.values)
    bound = Binder(index, both, source).bind(maskset)
    if bound.unbound and not allow_unbound:
        names = ", ".join(f"'{n}'" for n in bound.unbound[:10])
        more = f" and {len(bound.unbound) - 10} more" if len(bound.unbound) > 10 else ""
        specific = sorted({bound.hints[n] for n in bound.unbound[:10] if n in bound.hints})
        sample = ", ".join(f"'{n}'" for n in index.weight_names()[:6]) or "no weights"
        only_ambiguous = set(bound.unbound) <= bound.ambiguous
        what = "cannot be bound to the model" if bound.ambiguous else "match no initializer of the model"
        raise ShrinkError(
            f"{source}: {len(bound.unbound)} mask(s) {what}: {names}{more}. "
            + "".join(h[0].upper() + h[1:] + ". " for h in specific)
            + (
                ""
                if only_ambiguous
                else "Mask names must be the model's weight names (initializers, or the outputs "
                "of Constant nodes that hold weights) or the framework's parameter names (for "
                f"torch.onnx.export, the state_dict names); the model has e.g. {sample}. "
            )
            + "Pass --allow-unbound to go on without them."
        )
    return bound


def weight_modules(model: onnx.ModelProto) -> dict[str, str]:
    """Initializers the exporter named apart from their module (`val_10`, `onnx::MatMul_12`,
    often a transposed copy) -> the module whose node reads them, for reports. A conv the
    exporter fused with the BatchNorm after it carries the BatchNorm's scope, not the conv's:
    its weights are not attributed (their names are the conv's parameters)."""
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, str] = {}
    for n in model.graph.node:
        module = module_of(n)
        if not module or is_fused_batchnorm(n):
            continue
        for name in n.input:
            if name in inits and not name.startswith(module + ".") and name not in out:
                out[name] = module
    return out

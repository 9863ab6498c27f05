"""Bind masks to the model's initializers, and apply them to make the reference model."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.errors import ShrinkError


@dataclass
class BoundMasks:
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # initializer name -> 0/1 array
    unbound: list[str] = field(default_factory=list)  # mask names that matched nothing


def _initializer_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(d) for d in t.dims) for t in model.graph.initializer}


def _identity_aliases(model: onnx.ModelProto) -> dict[str, str]:
    """Output name of Identity(initializer) -> initializer name (older exporters add these)."""
    inits = {t.name for t in model.graph.initializer}
    return {
        n.output[0]: n.input[0]
        for n in model.graph.node
        if n.op_type == "Identity" and n.input and n.input[0] in inits
    }


def bind_masks(
    model: onnx.ModelProto,
    masks: dict[str, np.ndarray],
    source: str = "masks",
    allow_unbound: bool = False,
) -> BoundMasks:
    shapes = _initializer_shapes(model)
    aliases = _identity_aliases(model)
    bound = BoundMasks()
    for name, mask in masks.items():
        target = name if name in shapes else aliases.get(name)
        if target is None:
            bound.unbound.append(name)
            continue
        mask = np.asarray(mask)
        if mask.dtype == bool:
            mask = mask.astype(np.uint8)
        if mask.size and not np.isin(mask, (0, 1)).all():
            bad = mask[~np.isin(mask, (0, 1))].reshape(-1)[0]
            raise ShrinkError(
                f"{source}: mask '{name}' holds {bad.item()!r}; masks must be 0/1 (or boolean). If these "
                "are weights, not masks, pass the masked model instead and no masks file."
            )
        want = shapes[target]
        if mask.shape != want:
            if mask.ndim == 1 and want and mask.shape[0] == want[0]:
                mask = mask.reshape((-1,) + (1,) * (len(want) - 1))  # one flag per output channel
            else:
                raise ShrinkError(
                    f"{source}: mask '{name}' has shape {list(mask.shape)} but initializer "
                    f"'{target}' has shape {list(want)}. Give a mask of the weight's shape, or one "
                    "flag per output channel."
                )
        bound.masks[target] = (
            np.broadcast_to(mask, want) if target not in bound.masks else bound.masks[target] * mask
        )
    if bound.unbound and not allow_unbound:
        sample = ", ".join(f"'{n}'" for n in list(shapes)[:6])
        names = ", ".join(f"'{n}'" for n in bound.unbound[:10])
        more = f" and {len(bound.unbound) - 10} more" if len(bound.unbound) > 10 else ""
        raise ShrinkError(
            f"{source}: {len(bound.unbound)} mask(s) match no initializer of the model: {names}{more}. "
            "Mask names must be ONNX initializer names (for torch.onnx.export these are the "
            f"state_dict names); the model has e.g. {sample}. Pass --allow-unbound to go on without them."
        )
    return bound


def apply_masks(model: onnx.ModelProto, bound: BoundMasks) -> onnx.ModelProto:
    """The reference model: every masked initializer multiplied by its mask."""
    if not bound.masks:
        return model
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    for t in ref.graph.initializer:
        mask = bound.masks.get(t.name)
        if mask is None:
            continue
        values = numpy_helper.to_array(t)
        masked = np.where(mask != 0, values, np.zeros((), values.dtype)).astype(values.dtype)
        t.CopyFrom(numpy_helper.from_array(masked, t.name))
    return ref

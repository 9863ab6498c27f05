"""The bind stage: the masks bound to the model's weights, and the reference they make (the
input with them applied), against which the shrunk model is proven."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from onnxshrink.bind import BoundMasks, apply_masks, bind_masks, check_reference
from onnxshrink.io.model import Scratch
from onnxshrink.masks import MaskSet
from onnxshrink.options import ShrinkOptions
from onnxshrink.result import in_memory
from onnxshrink.stages.read import GivenMasks, Source


@dataclass
class Masked:
    """The masks bound (`bound`), the reference model, and whether the input already held the
    masks (`held`: the reference is then the input itself)."""

    bound: BoundMasks
    reference: onnx.ModelProto
    held: bool
    given: bool = True  # masks were given (else the zeros in the weights are the masks)

    @property
    def input_masked(self) -> bool | None:
        """What the report says of the input: it already held every mask's zeros (None: no
        masks were given)."""
        return self.held if self.given else None


def scratch_for(source: Source, output: str | Path | None) -> Scratch | None:
    """Where a streamed shrink writes its data files (beside the output), None when the input's
    weights are in memory."""
    return Scratch(source.store, output) if source.streamed else None


def bind(source: Source, given: GivenMasks, opts: ShrinkOptions, scratch: Scratch | None = None) -> Masked:
    """Bind the masks and make the reference. A large model's masked weights are written to a
    file of `scratch` rather than held in memory (see apply_masks)."""
    bound = bind_masks(
        source.proto,
        given.maskset or MaskSet(),
        source=given.name,
        allow_unbound=opts.allow_unbound,
        values=given.values,
        base_dir=source.base_dir,
    )
    held = check_reference(bound, opts.input_masked, given.name)
    if held:
        reference = source.proto
    else:
        large = scratch is not None and not in_memory(source.file_bytes)
        spill = scratch.spill() if scratch is not None and large else None
        reference = apply_masks(source.proto, bound, source.base_dir, spill)
        if spill is not None:
            spill.close()
    bound.index = None  # its cached weight arrays: prepare() reads the reference's
    masked = Masked(bound, reference, held, given.maskset is not None)
    _log_binding(opts, given.maskset, masked)
    return masked


def _log_binding(opts: ShrinkOptions, maskset: MaskSet | None, masked: Masked) -> None:
    bound = masked.bound
    if maskset is None:
        opts.say("no masks file: the zeros in the weights are the masks")
        return
    ways = sorted(set(bound.how.values()))
    opts.say(
        f"{maskset.format} masks: {len(bound.how)} of {len(maskset.masks)} bound ({', '.join(ways)}) "
        f"to {len(bound.masks)} initializer(s)"
    )
    opts.say(
        "the model already holds the masks: the reference is the model as given"
        if masked.held
        else "the masks are applied to the model: the reference is the model with them applied"
    )
    for init, params in bound.shared.items():
        opts.say(f"initializer '{init}' is shared by several parameters: untied for {', '.join(params)}")

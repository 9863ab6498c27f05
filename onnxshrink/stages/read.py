"""The read stage: the options checked, the input model read into a `Source`, the masks given
read into `GivenMasks`; everything the model contradicts refused before any heavy step."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxshrink import ir
from onnxshrink.errors import ShrinkError
from onnxshrink.io import dims
from onnxshrink.io.masks import imports_torch, load_masks_file
from onnxshrink.io.model import (
    check_output,
    check_tensor_data,
    data_files,
    load_model,
    mapped_in_place,
    unique_node_names,
)
from onnxshrink.io.weights import WeightStore
from onnxshrink.masks import MaskSet, load_maskset, weight_values
from onnxshrink.options import ShrinkOptions
from onnxshrink.prepare.computed import fold_computed_weights, has_computed_weights
from onnxshrink.proof.inputs import check_inputs, resolve_shapes
from onnxshrink.proof.sessions import check_provider, check_runnable, session_threads
from onnxshrink.result import IN_MEMORY_BYTES

ModelLike = str | Path | onnx.ModelProto
MasksLike = str | Path | Mapping[str, Any] | None


def check_options(opts: ShrinkOptions, flags: bool = False) -> None:
    """Refuse option values that cannot mean anything (each named: as a keyword, or as the
    command line's flag with `flags`), before any work."""

    def named(key: str, value: object) -> str:
        return f"--{key.replace('_', '-')} {value}" if flags else f"{key}={value}"

    if opts.draws < 0:
        raise ShrinkError(f"{named('draws', opts.draws)}: give a number of random draws >= 0.")
    if opts.validate and opts.draws < 1 and not opts.inputs:
        raise ShrinkError(
            f"nothing to validate with: {named('draws', opts.draws)} and no inputs given. Use "
            "draws >= 1 or give inputs."
        )
    if opts.validate_layers is not None and opts.validate_layers < 1:
        raise ShrinkError(f"{named('validate_layers', opts.validate_layers)}: give a number of blocks >= 1.")
    if opts.seed < 0:
        raise ShrinkError(f"{named('seed', opts.seed)}: give a seed >= 0.")
    for key, tol in (("rtol", opts.rtol), ("atol", opts.atol)):
        if tol is not None and not (math.isfinite(tol) and tol >= 0):
            raise ShrinkError(
                f"{named(key, tol)}: give a finite tolerance >= 0 (a negative or NaN one fails "
                "every proof; an infinite one proves nothing)."
            )


def check_against_model(model: onnx.ModelProto, opts: ShrinkOptions, source: str = "model") -> None:
    """Refuse, before any heavy step, options the model contradicts: shapes of inputs it does not
    have or of another rank or static size, validation inputs that do not fit, a provider
    onnxruntime lacks here, ops the proof cannot run."""
    if opts.input_shapes:
        resolve_shapes(model, opts.input_shapes)
    if opts.validate:
        check_provider(opts.provider)
        session_threads()  # ONNXSHRINK_THREADS, read by every proof session
        check_runnable(model, source)
        check_inputs(model, opts.inputs)


@dataclass
class Source:
    """The input model: its proto (external weights not loaded yet), and where it came from."""

    proto: onnx.ModelProto
    path: Path | None = None
    base_dir: str | None = None  # where its external data lives
    data: list[Path] = field(default_factory=list)  # its external data files: never overwritten
    file_bytes: int | None = None
    store: WeightStore = field(default_factory=WeightStore)  # maps the external data
    renamed: list[tuple[str, str]] = field(default_factory=list)  # nodes named apart (see io)
    folded: list[str] = field(default_factory=list)  # weights computed from constants, now stored
    # a one-file model's large weights named as external data in the model file itself (io.wire)
    mapped_in_place: bool = False

    @property
    def as_given(self) -> bool:
        """`proto` is the model as its file holds it (no node renamed, no weight folded)."""
        return not self.renamed and not self.folded

    @property
    def streamed(self) -> bool:
        """Weights on disk (external data, or a large one-file model's own): mapped as read,
        written as sliced (see ShrinkResult)."""
        return bool(self.data) or self.mapped_in_place

    @property
    def protected(self) -> list[Path]:
        """The input's files, which no output may overwrite."""
        return [self.path, *self.data] if self.path is not None else []


def read_model(model: ModelLike | Source) -> Source:
    """The input model, checked; nodes that share a name are named apart, and the weights it
    computes from constants only (pruning hooks and parametrizations exported as they are) are
    stored as the weights they are (prepare.computed); in a copy of a ModelProto given: the
    caller's is never changed. A `Source` is a model read already (a prune's reference, its
    weights still on disk where the input's were): taken as it is."""
    if isinstance(model, Source):
        return model
    if isinstance(model, str | Path):
        path = Path(model)
        # weights are read once, by prepare(); a large one-file model's stay in its file
        proto = load_model(path, keep_external=True, map_from=IN_MEMORY_BYTES)
        in_place = mapped_in_place(path, proto)
        itself = Path(os.path.abspath(path))
        data = [f for f in data_files(path, proto) if not (in_place and f == itself)]
        size = path.stat().st_size + sum(p.stat().st_size for p in data if p.exists())
        ir.unique_scope_names(proto.graph)  # bodies that reuse a sibling's names: named apart
        source = Source(
            proto, path, str(path.parent), data, size, renamed=unique_node_names(proto), mapped_in_place=in_place
        )
    elif isinstance(model, onnx.ModelProto):
        check_tensor_data(model, "model")
        names = [n.name for n in model.graph.node if n.name]
        if (
            len(set(names)) == len(names)
            and not dims.needs_symbolic(model)
            and not has_computed_weights(model)
            and not ir.unique_scope_names(model.graph, apply=False)
        ):
            return Source(model)
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        dims.to_symbolic(copy)
        ir.unique_scope_names(copy.graph)
        source = Source(copy, renamed=unique_node_names(copy))
    else:
        raise TypeError(f"model must be a path or onnx.ModelProto, not {type(model).__name__}")
    source.folded = fold_computed_weights(source.proto, source.base_dir, source.store)
    return source


def read_masks(
    masks: MasksLike, opts: ShrinkOptions
) -> tuple[MaskSet | None, Mapping[str, np.ndarray] | None]:
    """The masks in any format (read a mask at a time, each reduced as it is read), and the
    original weights given to bind them by value (read only when a mask binds by value)."""
    for path in (masks, opts.weights):
        if isinstance(path, str | Path) and imports_torch(path):
            opts.say(f"reading {path}: importing torch to read it (seconds, more on a busy machine) ...")
            break
    maskset = masks if isinstance(masks, MaskSet) else None
    if maskset is None and masks is not None:
        maskset = load_maskset(masks, opts.masks_format, say=opts.say)
    values = None
    if opts.weights is not None:
        w = opts.weights
        raw = load_masks_file(w, "weights", say=opts.say) if isinstance(w, str | Path) else w
        values = weight_values(raw, str(w) if isinstance(w, str | Path) else "weights")
    return maskset, values


@dataclass
class GivenMasks:
    """The masks as given, read: none (the zeros in the weights are the masks), and the original
    weights to bind them by value (None: not given); `name` says where they came from."""

    maskset: MaskSet | None = None
    values: Mapping[str, np.ndarray] | None = None
    name: str = "masks"


def read(model: ModelLike | Source, masks: MasksLike, output: str | Path | None, opts: ShrinkOptions) -> tuple[Source, GivenMasks]:
    """The input model and the masks, each checked: an output that would overwrite the input,
    options the model contradicts, refused first."""
    source = read_model(model)
    if output is not None:
        check_output(output, source.protected)
    check_against_model(source.proto, opts, str(source.path or "model"))
    if source.folded:
        names = ", ".join(f"'{n}'" for n in source.folded[:4]) + (" ..." if len(source.folded) > 4 else "")
        opts.say(
            f"{len(source.folded)} weight(s) the graph computes from constants (pruning still "
            f"attached, e.g. weight_orig * weight_mask) stored as the weights they are: {names}"
        )
    maskset, values = read_masks(masks, opts)
    return source, GivenMasks(maskset, values, str(masks) if isinstance(masks, str | Path) else "masks")

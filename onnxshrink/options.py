"""Everything a run can be told, in one place: `ShrinkOptions` (a shrink: `shrink`,
`export_and_shrink`, and the shrink inside every prune) and `PruneOptions` (what `prune` adds),
and every choice list, each a `Literal` whose values the command line and the checks read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:  # kept light: the CLI builds its parser from this module
    import numpy as np

# ---------------------------------------------------------------------- the choice lists
#: how each node's needs are found: its handler's rules, or a replay of the node in onnxruntime
Analysis = Literal["rules", "replay"]
#: how a masks file is read (see onnxshrink.masks); "auto" detects it from the content
MasksFormat = Literal[
    "auto", "flat", "nni", "nni-wrapped", "torch-prune", "torch-ao", "ao-data", "dpu", "state-dict"
]
#: onnxruntime's execution provider for the proof
Provider = Literal["cpu", "cuda"]
#: what a group's importance is measured by (onnxshrink.prune.importance)
Criterion = Literal["l1", "l2", "random", "activation", "wanda", "fluctuation"]
#: where a prune removes groups (onnxshrink.prune.allocate)
Allocation = Literal["uniform", "global", "sensitivity"]
#: what replaces a removed channel (onnxshrink.prune.compensate)
Compensation = Literal["none", "bias", "refit"]
#: the kinds of unit a prune may remove (onnxshrink.prune.groups)
Unit = Literal["channel", "neuron", "gated_neuron", "head", "kv_group", "conv_group", "width", "block"]


def choices(kind: Any) -> tuple[str, ...]:
    """The values of a choice list (a Literal above), in order."""
    return tuple(get_args(kind))


ANALYSES = choices(Analysis)
MASKS_FORMATS = choices(MasksFormat)
PROVIDERS = choices(Provider)
CRITERIA = choices(Criterion)
#: the criteria measured on the calibration inputs
DATA_CRITERIA: tuple[Criterion, ...] = ("activation", "wanda", "fluctuation")
ALLOCATIONS = choices(Allocation)
COMPENSATIONS = choices(Compensation)
UNITS = choices(Unit)
#: the unit kinds a prune removes unless told (blocks only when asked)
DEFAULT_UNITS: tuple[Unit, ...] = ("channel", "neuron", "gated_neuron", "head", "kv_group", "conv_group", "width")


@dataclass(frozen=True)
class ShrinkOptions:
    """How to shrink, prove and write.

    validate: prove the result against the reference with onnxruntime (default on).
    input_shapes: concrete shapes for inputs with dynamic dims, {name: [d0, d1, ...]}.
    inputs: validation inputs besides the random ones.
    draws, seed: random validation inputs.
    rtol, atol: tolerance per output: max |shrunk - reference| <= atol + rtol * max |reference|
        (rtol None: twice the reference's own noise, its outputs with onnxruntime's graph
        optimizations on vs off, at least ten machine epsilons of the least precise float type
        the model computes in: 1e-5 for fp32, 9.8e-3 for fp16, 7.8e-2 for bf16; above that
        floor the float64 judge decides, see onnxshrink.proof.judge). A given rtol wins:
        rounding above it fails, naming the smallest rtol that would have passed.
    validate_layers: prove only the first N repeated blocks of the model (its layers), by their
        outputs: a quicker check of a large model (None: prove the whole model).
    provider: onnxruntime execution provider for validation ("cpu" or "cuda").
    keep_failed: write the output even when validation fails.
    analysis: "rules" (each op's handler says what its outputs need) or "replay" (every node is
        replayed in onnxruntime to find what its kept outputs depend on; handlers give only
        the structure: slower, a cross-check of the rules).
    recover: when the proof fails, keep the removals responsible and prove again (see
        onnxshrink.proof.recover); off: the run fails.
    allow_unbound: go on when some masks bind nowhere.
    masks_format: how to read the masks ("auto": detected; see onnxshrink.masks).
    weights: the original weights (a state dict, file or dict), to bind masks by value.
    input_masked: whether the model already holds the masks' zeros (None: told by its weights,
        and masks they contradict are refused; False: apply the masks whatever it holds).
    external_data: write the weights to `<output>.data` (None: when the input did, or > 2 GB).
    log: called with each progress line.
    progress: show progress bars on stderr for the long phases (when it is a terminal).
    """

    validate: bool = True
    input_shapes: Mapping[str, list[int]] | None = None
    inputs: list[dict[str, np.ndarray]] | None = None
    draws: int = 3
    seed: int = 0
    rtol: float | None = None
    atol: float = 0.0
    provider: Provider = "cpu"
    validate_layers: int | None = None
    keep_failed: bool = False
    analysis: Analysis = "rules"
    recover: bool = True
    allow_unbound: bool = False
    masks_format: MasksFormat = "auto"
    weights: str | Path | Mapping[str, Any] | None = None
    input_masked: bool | None = None
    external_data: bool | None = None
    log: Callable[[str], None] | None = None
    progress: bool = False

    def but(self, **changes: Any) -> ShrinkOptions:
        """A copy with `changes`; unknown names are refused (a TypeError naming them)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown shrink option(s): {', '.join(unknown)}")
        out = replace(self, **changes)
        if out.analysis not in ANALYSES:
            raise ValueError(f"analysis={out.analysis!r}: choose one of {', '.join(ANALYSES)}")
        return out

    def say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)


@dataclass(frozen=True)
class PruneOptions:
    """What to prune and how (the shrink that follows takes a `ShrinkOptions`).

    ratio, params, macs, latency: the target, exactly one of them: `ratio` of every layer's
        groups (of all groups, ranked together, with allocation "global" or "sensitivity"); or
        as much as keeps that fraction of the input's parameters, MACs or latency (measured
        with onnxruntime).
    criterion: importance ("l1", "l2", "random"; or on the calibration inputs `data`:
        "activation", "wanda", "fluctuation").
    allocation: where to prune: "uniform" (`ratio` of every layer), "global" (all layers ranked
        together), "sensitivity" (where the measured sensitivity says it costs least, on
        `data`); None: "global" with `global_ranking`, else "uniform".
    global_ranking: the same as allocation "global".
    compensate: "bias" folds each removed channel's mean on `data` into its consumers' biases;
        "refit" also refits their weights on the kept channels (ridge least squares, `ridge` x
        the channels' mean variance).
    ignore: fnmatch patterns of layers (weights, parameters, nodes, op types) left alone.
    round_to: keep channel counts multiples of this.
    max_layer_ratio: remove at most this fraction of any layer (a layer keeps one group).
    units: the unit kinds that may go (None: every kind but "block"; see UNITS).
    data: the calibration inputs ({input name: array}, a batch along the batch axis).
    held_out: the inputs the price is measured on (default: `data`, labelled so).
    sensitivity: write the measured curves there (a self-contained HTML page).
    masks_out, weights_out: write the masks chosen, and the values the compensation changed,
        as framework state dicts (.pt, .npz, .safetensors).
    price: measure what the prune cost on `held_out` (else `data`, else random inputs).
    """

    ratio: float | None = None
    params: float | None = None
    macs: float | None = None
    latency: float | None = None
    criterion: Criterion = "l1"
    allocation: Allocation | None = None
    global_ranking: bool = False
    compensate: Compensation = "none"
    ridge: float = 1.0
    ignore: Sequence[str] = ()
    round_to: int | None = None
    max_layer_ratio: float = 1.0
    units: Sequence[Unit] | None = None
    data: list[Mapping[str, np.ndarray]] | None = None
    held_out: list[Mapping[str, np.ndarray]] | None = None
    sensitivity: str | Path | None = None
    masks_out: str | Path | None = None
    weights_out: str | Path | None = None
    price: bool = True

    def but(self, **changes: Any) -> PruneOptions:
        """A copy with `changes`; unknown names are refused (a TypeError naming them)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown prune option(s): {', '.join(unknown)}")
        return replace(self, **changes)

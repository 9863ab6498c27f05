"""Everything a run can be told, in one place: `ShrinkOptions` (a shrink: `shrink`,
`export_and_shrink`, and the shrink inside every prune) and `PruneOptions` (what `prune` adds),
and every choice list, each a `Literal` whose values the command line and the checks read.

Each option the command line offers carries its `Flag` (its flags, help and metavar) on its
field; its default, value type and choices are read from the field itself, so that an option
is declared once and the CLI builds its parser from the fields (see onnxshrink.cli.flags).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

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
Unit = Literal[
    "channel", "neuron", "gated_neuron", "head", "kv_group", "conv_group", "recurrent_unit", "width", "block"
]


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
DEFAULT_UNITS: tuple[Unit, ...] = (
    "channel", "neuron", "gated_neuron", "head", "kv_group", "conv_group", "recurrent_unit", "width"
)


# ---------------------------------------------------------------------- the command line's flags
@dataclass(frozen=True)
class Flag:
    """How an option is given on the command line (the field holds its default and type).

    names: its flag(s), e.g. ("--draws",).
    help: its help text, defaults and all.
    metavar: what its value is called in the help (None: argparse's own, or its choices).
    several: it takes one or more values.
    extend: each time it is given, its values are added to the earlier ones.
    gives: for a yes/no option, its value when the flag is given (None: not its default).
    reads: what the given value is read as before it becomes the option ("shapes": the
        `name:d0,d1` shapes; "inputs": the inputs in a .npz file, one batch).
    """

    names: tuple[str, ...]
    help: str
    metavar: str | None = None
    several: bool = False
    extend: bool = False
    gives: bool | None = None
    reads: Literal["shapes", "inputs"] | None = None


def flagged(default: Any, *names: str, help: str, **how: Any) -> Any:
    """A dataclass field with `default` that the command line offers as `names` (see Flag)."""
    return field(default=default, metadata={"flag": Flag(names, help, **how)})


def flag_of(option: Field[Any]) -> Flag | None:
    """The flag an option is given by on the command line, or None when it has none."""
    return option.metadata.get("flag")


def _annotation(option: Field[Any]) -> list[str]:
    """The alternatives of an option's annotation (`float | None` -> ["float", "None"])."""
    return [part.strip() for part in str(option.type).split("|")]


def choices_of(option: Field[Any]) -> tuple[str, ...] | None:
    """The values an option chooses from: its choice list's, when its type is one (a Literal
    above, or None); None for any other option."""
    for name in _annotation(option):
        kind = globals().get(name)
        if get_origin(kind) is Literal:
            return choices(kind)
    return None


def number_of(option: Field[Any]) -> type | None:
    """int or float when an option is a number (or None), else None."""
    numbers: dict[str, type] = {"int": int, "float": float}
    return next((numbers[name] for name in _annotation(option) if name in numbers), None)


def is_switch(option: Field[Any]) -> bool:
    """Whether an option is a yes/no one (a flag given or not)."""
    return "bool" in _annotation(option)


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
    allow_growth: write the shrunk model even when it is larger than the input (file bytes,
        external data included); by default the reference is written instead (see
        onnxshrink.stages.save.no_growth).
    log: called with each progress line.
    progress: show progress bars on stderr for the long phases (when it is a terminal).
    found_shapes: the shapes found for the inputs whose dynamic dims no shape was given for,
        the first sizes at which the input model runs (set by the run, see
        onnxshrink.proof.sizes; None: not searched yet).
    check_analysis: called with the analysis of the reference before it is rewritten; what it
        raises ends the shrink (a prune checks there that every group it chose goes).
    """

    validate: bool = flagged(
        True, "--no-validate", help="skip the onnxruntime proof (not recommended)"
    )
    input_shapes: Mapping[str, list[int]] | None = flagged(
        None,
        "--input-shapes",
        several=True,
        extend=True,
        metavar="NAME:D0,D1",
        reads="shapes",
        help="shapes for validation inputs with dynamic dims, e.g. input:1,3,224,224",
    )
    inputs: list[dict[str, np.ndarray]] | None = flagged(
        None,
        "--inputs",
        metavar="FILE.npz",
        reads="inputs",
        help="validation inputs to use besides the random ones; with --prune, also the "
        "calibration inputs of --criterion activation/wanda/fluctuation, --compensate and "
        "--allocation sensitivity (a batch of samples along the batch axis)",
    )
    draws: int = flagged(3, "--draws", help="random input draws for validation (default 3)")
    seed: int = flagged(0, "--seed", help="seed of the random inputs (default 0)")
    rtol: float | None = flagged(
        None,
        "--rtol",
        help="allowed error relative to the output's magnitude: max |shrunk - reference| <= "
        "atol + rtol * max |reference| (default: twice the reference's own noise, its outputs "
        "with onnxruntime's graph optimizations on vs off, at least ten machine epsilons of the "
        "dtype the model computes in: 1e-5 for fp32, 9.8e-3 for fp16, 7.8e-2 for bf16; above "
        "that floor the float64 judge decides). A given rtol wins: rounding above it fails "
        "(exit 1), naming the smallest rtol that would have passed",
    )
    atol: float = flagged(
        0.0, "--atol", help="allowed absolute error on top of --rtol (default 0)"
    )
    provider: Provider = flagged(
        "cpu", "--provider", help="onnxruntime execution provider (default cpu)"
    )
    validate_layers: int | None = flagged(
        None,
        "--validate-layers",
        metavar="N",
        help="prove only the first N repeated blocks (layers) of the model, by their outputs: a "
        "quicker check of a large model (default: prove the whole model)",
    )
    keep_failed: bool = flagged(
        False, "--keep-failed", help="write the output even when validation fails"
    )
    analysis: Analysis = flagged(
        "rules",
        "--analysis",
        help="rules: each op's handler says what its outputs need (default); replay: every node "
        "is replayed in onnxruntime to find it (slower; a cross-check of the rules)",
    )
    recover: bool = flagged(
        True,
        "--no-recover",
        help="when the proof fails, fail (exit 1) instead of keeping the removals responsible",
    )
    allow_unbound: bool = flagged(
        False, "--allow-unbound", help="go on when some masks match no initializer"
    )
    masks_format: MasksFormat = flagged(
        "auto",
        "--masks-format",
        help="how to read the masks file (default: detected from its content)",
    )
    weights: str | Path | Mapping[str, Any] | None = flagged(
        None,
        "--weights",
        metavar="STATE_DICT",
        help="the original weights (.pt/.npz/.safetensors state dict): masks whose weights the "
        "exporter renamed or folded (legacy exporter, BatchNorm) then bind by value",
    )
    input_masked: bool | None = flagged(
        None,
        "--unmasked-input",
        gives=False,
        help="the model was exported before (some of) the masks were applied: apply them all "
        "(by default masks that the model's zeros contradict are refused)",
    )
    external_data: bool | None = flagged(
        None, "--external-data", gives=True, help="write the weights to <output>.data"
    )
    allow_growth: bool = flagged(
        False,
        "--allow-growth",
        help="write the shrunk model even when its files are larger than the input's (by default "
        "the input, masks applied, is written instead, no larger, and the run says so)",
    )
    log: Callable[[str], None] | None = None
    progress: bool = False
    found_shapes: Mapping[str, list[int]] | None = None
    check_analysis: Callable[[Any], None] | None = None

    def shapes(self) -> dict[str, list[int]]:
        """The shapes the proof draws its inputs at, where known: those given (input_shapes)
        over those found (found_shapes)."""
        return {**(self.found_shapes or {}), **(self.input_shapes or {})}

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

    ratio: float | None = flagged(
        None,
        "--prune",
        metavar="RATIO",
        help="remove this fraction of each layer's groups (e.g. 0.5), the least important first. "
        "Layers in a row compound (0.3 of each layer's channels can be half the parameters): "
        "the parameter and MAC fractions RATIO means are printed before the work, and "
        "--allocation global or sensitivity removes the same fraction of the parameters as "
        "uniform does, placed elsewhere. To keep a given fraction of the parameters, use "
        "--prune-to-params",
    )
    params: float | None = flagged(
        None,
        "--prune-to-params",
        metavar="F",
        help="prune until F of the input's parameters are left (e.g. 0.5), counted exactly",
    )
    macs: float | None = flagged(
        None,
        "--prune-to-macs",
        metavar="F",
        help="prune until F of the input's MACs are left (e.g. 0.5), counted exactly",
    )
    latency: float | None = flagged(
        None,
        "--prune-to-latency",
        metavar="F",
        help="prune until the model runs in F of the input's latency (e.g. 0.6), measured with "
        "onnxruntime on this machine (ONNXSHRINK_THREADS threads; one per core when unset)",
    )
    criterion: Criterion = flagged(
        "l1",
        "--criterion",
        help="importance (default l1). Needs: l1, l2 (group L1/L2 magnitude, Torch-Pruning's): "
        "the weights alone; random: --seed; activation (mean |x| x sum |w|), wanda (Wanda: RMS of x "
        "x sum |w|), fluctuation (FLAP: variance of x x sum w^2; pairs with --compensate): --inputs",
    )
    allocation: Allocation | None = flagged(
        None,
        "--allocation",
        help="where to prune: uniform (RATIO of every layer; the default), global (all layers "
        "ranked together, importance divided by the layer's mean), sensitivity (each layer's "
        "channels, heads or neurons pruned alone at several ratios on --inputs, and the target "
        "met where the output changes least; needs --inputs)",
    )
    global_ranking: bool = flagged(
        False, "--global-ranking", help="the same as --allocation global"
    )
    compensate: Compensation = flagged(
        "none",
        "--compensate",
        help="bias (FLAP): replace each removed channel by its mean on --inputs, folded into the "
        "bias of every layer that read it; refit: also refit those layers' weights on the kept "
        "channels (ridge least squares, see --ridge). The pruned model is then proven against the "
        "input with the groups zeroed and these values changed (--weights-out writes them). "
        "Needs --inputs (default none)",
    )
    ridge: float = flagged(
        1.0,
        "--ridge",
        metavar="R",
        help="--compensate refit: the regularization, R x the kept channels' mean variance "
        "(default 1; small calibration sets need it large)",
    )
    ignore: Sequence[str] = flagged(
        (),
        "--ignore",
        several=True,
        extend=True,
        metavar="PATTERN",
        help="leave alone the layers whose weights, parameters, nodes or op types match (fnmatch)",
    )
    round_to: int | None = flagged(
        None, "--round-to", metavar="N", help="keep channel counts multiples of N (e.g. 8)"
    )
    max_layer_ratio: float = flagged(
        1.0,
        "--max-layer-ratio",
        help="remove at most this fraction of any layer (a layer always keeps one group)",
    )
    units: Sequence[Unit] | None = flagged(
        None,
        "--units",
        several=True,
        metavar="KIND",
        help="the unit kinds --prune may remove: channel, neuron, gated_neuron, head (with "
        "grouped-query attention and without kv_group: the query heads of one rank in every K/V "
        "group), kv_group, "
        "conv_group, recurrent_unit (an LSTM, GRU or RNN hidden unit, in every direction), width (a residual stream's channel), block (a repeated block's residual "
        "branches; with --criterion activation ranked by their influence on --inputs); "
        "default: all but block",
    )
    # given on the command line by --inputs, the shrink's validation inputs
    data: list[Mapping[str, np.ndarray]] | None = None
    held_out: list[Mapping[str, np.ndarray]] | None = flagged(
        None,
        "--held-out",
        metavar="FILE.npz",
        reads="inputs",
        help="inputs the price of the prune is measured on (error, cosine, top-1, against the "
        "input model); default: the --inputs (calibration) ones, labelled so",
    )
    sensitivity: str | Path | None = flagged(
        None,
        "--sensitivity",
        metavar="FILE.html",
        help="write each family's measured sensitivity (output error against the ratio pruned): "
        "a self-contained HTML page with the picture and the table (needs --inputs)",
    )
    masks_out: str | Path | None = flagged(
        None,
        "--masks-out",
        metavar="FILE",
        help="write the chosen masks (.pt, .npz, .safetensors), named by framework parameter",
    )
    weights_out: str | Path | None = flagged(
        None,
        "--weights-out",
        metavar="FILE",
        help="with --compensate: write the values it changed (.pt, .npz, .safetensors), named by "
        "framework parameter: loaded into the original model with --masks-out applied, they make "
        "the pruned model (those with no framework parameter under onnx/NAME)",
    )
    price: bool = flagged(
        True,
        "--no-price",
        help="do not measure what the prune cost (its outputs on --held-out or --inputs against the "
        "input's, and the latency before and after), printed and reported by default",
    )

    def but(self, **changes: Any) -> PruneOptions:
        """A copy with `changes`; unknown names are refused (a TypeError naming them)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown prune option(s): {', '.join(unknown)}")
        return replace(self, **changes)

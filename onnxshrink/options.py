"""Everything a shrink can be told, in one place (the CLI, `shrink` and `export_and_shrink` share it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # kept light: the CLI builds its parser from this module
    import numpy as np

ANALYSES = ("rules", "replay")

# How a masks file can be read (see onnxshrink.masks); "auto" detects it from the content.
MASKS_FORMATS = ("auto", "flat", "nni", "nni-wrapped", "torch-prune", "torch-ao", "ao-data", "dpu", "state-dict")


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
        floor the float64 judge decides, see onnxshrink.judge). A given rtol wins: rounding
        above it fails, naming the smallest rtol that would have passed.
    validate_layers: prove only the first N repeated blocks of the model (its layers), by their
        outputs: a quicker check of a large model (None: prove the whole model).
    provider: onnxruntime execution provider for validation ("cpu" or "cuda").
    keep_failed: write the output even when validation fails.
    analysis: "rules" (each op's handler says what its outputs need) or "replay" (every node is
        replayed in onnxruntime to find what its kept outputs depend on; handlers give only
        the structure: slower, a cross-check of the rules).
    recover: when the proof fails, keep the removals responsible and prove again (see
        onnxshrink.recover); off: the run fails.
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
    provider: str = "cpu"
    validate_layers: int | None = None
    keep_failed: bool = False
    analysis: str = "rules"
    recover: bool = True
    allow_unbound: bool = False
    masks_format: str = "auto"
    weights: str | Path | Mapping | None = None
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

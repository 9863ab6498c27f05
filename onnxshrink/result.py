"""`ShrinkResult`: what a shrink produced, and what `--report` writes of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from onnxshrink.io.model import copy_model, save_model, save_one_file, save_streamed
from onnxshrink.proof.verdict import ValidationReport
from onnxshrink.report import InterfaceChange, KeptGroup, ModelStats, Sparsity, to_jsonable
from onnxshrink.rewrite import Fold

# A streamed shrink's result holds its weights in memory (ShrinkResult.model) under this size.
IN_MEMORY_BYTES = 256 * 2**20


def in_memory(size: int | None) -> bool:
    """A model (or data file) of `size` bytes is held in memory (None: no file, in memory)."""
    return (size or 0) < IN_MEMORY_BYTES


@dataclass
class ShrinkResult:
    """Everything a shrink produced; `to_dict()` is what `--report` writes.

    `reference` is the input model with the masks applied. When the input was a path whose
    weights live in an external data file, its unmasked weights still refer to that file (they
    are loaded into it only for a model under IN_MEMORY_BYTES that was validated); in a model
    past IN_MEMORY_BYTES, its masked weights refer by absolute path to a file that lives as long
    as the result.

    A model read from external data is shrunk *streamed*: its weights are mapped, not read, and
    the shrunk weights are written to an external data file as they are sliced. `model` then
    holds its weights only when they are under IN_MEMORY_BYTES; otherwise its initializers refer
    to `data_file` (`<output>.data` once saved), which `save()` copies."""

    model: onnx.ModelProto
    reference: onnx.ModelProto
    before: ModelStats
    after: ModelStats
    validation: ValidationReport | None
    timings: dict[str, float]
    masks_bound: int = 0
    unbound_masks: list[str] = field(default_factory=list)
    input_masked: bool | None = None  # the input already held every mask's zeros (None: no masks)
    shared_initializers: dict[str, list[str]] = field(default_factory=dict)  # untied per parameter
    folds: list[Fold] = field(default_factory=list)
    barriers: list[dict[str, Any]] = field(default_factory=list)  # nodes kept whole: node, op, reason
    replayed: list[dict[str, str]] = field(default_factory=list)  # ops with no rule, replayed
    kept_zeroed: list[KeptGroup] = field(default_factory=list)
    # what went: per weight and axis that lost indices, its size, how many kept, and the
    # removed indices ({tensor, axis, size, kept, removed})
    removed_slices: list[dict[str, Any]] = field(default_factory=list)
    sparsity: list[Sparsity] = field(default_factory=list)
    removed_nodes: int = 0
    written: list[str] = field(default_factory=list)
    torch_validation: ValidationReport | None = None  # export_and_shrink: against the module itself
    # When the first proof failed: what failed, and the tensor axes kept whole to pass.
    first_failure: str | None = None
    # it was a wrong model for sure (the float64 judge found another function, or the shrunk
    # model did not run), not a failure float64 could not judge
    first_failure_bug: bool = False
    kept_after_failed_proof: list[dict[str, Any]] = field(default_factory=list)
    data_file: Path | None = None  # where `model`'s external weights are, when not in memory
    renamed_nodes: list[tuple[str, str]] = field(default_factory=list)  # (shared name, new name)
    # graph inputs and outputs whose shape changed (a KV cache's heads removed), old -> new
    interface_changes: list[InterfaceChange] = field(default_factory=list)
    # runtime configs written beside the output (genai_config.json, config.json), and notes
    runtime_configs: list[dict[str, Any]] = field(default_factory=list)
    # why the model written is the reference, not the shrunk model: that one would be larger
    # than the input (see stages.save.no_growth); None: the shrunk model was written
    grew: str | None = None
    _scratch: Any = field(default=None, repr=False)  # keeps an unsaved data file alive
    # A shrink that removed nothing from the model file as given: saved as a copy of the file
    _unchanged: Any = field(default=None, repr=False)
    # the input was one file whose weights were mapped where they lie (io.wire): save() writes
    # a streamed result as one file too, as the shrink of it in memory was
    _one_file: bool = field(default=False, repr=False)

    @property
    def passed(self) -> bool:
        return all(v is None or v.passed for v in (self.validation, self.torch_validation))

    # what --report writes (with "passed"), in this order
    REPORT_KEYS = (
        "before",
        "after",
        "validation",
        "timings",
        "masks_bound",
        "unbound_masks",
        "input_masked",
        "shared_initializers",
        "folds",
        "barriers",
        "replayed",
        "kept_zeroed",
        "removed_slices",
        "sparsity",
        "removed_nodes",
        "written",
        "torch_validation",
        "first_failure",
        "first_failure_bug",
        "kept_after_failed_proof",
        "renamed_nodes",
        "interface_changes",
        "runtime_configs",
        "grew",
    )

    def to_dict(self) -> dict[str, Any]:
        return {k: to_jsonable(getattr(self, k)) for k in self.REPORT_KEYS} | {"passed": self.passed}

    @classmethod
    def empty_report(cls) -> dict[str, Any]:
        """The report of a shrink that made no result (its rewrite failed): every key of one
        that did, empty."""
        return dict.fromkeys(cls.REPORT_KEYS) | {"passed": False}

    def save(self, path: str | Path, external: bool = False) -> list[Path]:
        if self._unchanged is not None and external == bool(self._unchanged.data):
            return copy_model(self._unchanged.path, self._unchanged.data, path)
        if self.data_file is not None and self._one_file and not external:
            written = save_one_file(self.model, self.data_file, path)
            if written is not None:
                return written
        if self.data_file is not None:
            return save_streamed(self.model, self.data_file, path, move=False)
        return save_model(self.model, path, external=external)

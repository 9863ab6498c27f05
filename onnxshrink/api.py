"""`shrink`: the whole pipeline, read -> bind -> analyze -> rewrite -> validate -> report -> save."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnxshrink.analyze import analyze
from onnxshrink.bind import apply_masks, bind_masks, check_reference, weight_modules
from onnxshrink.errors import ShrinkError, ValidationFailed
from onnxshrink.io.masks import flatten, load_masks_file
from onnxshrink.io.model import data_files, load_external, load_model, save_model
from onnxshrink.masks import MaskSet, load_maskset
from onnxshrink.prepare import default_opset, prepare
from onnxshrink.report import (
    KeptGroup,
    ModelStats,
    Sparsity,
    model_stats,
    sparsity_left,
    to_jsonable,
)
from onnxshrink.rewrite import Fold, apply, release
from onnxshrink.validate import ValidationReport, compare, resolve_shapes

ModelLike = str | Path | onnx.ModelProto
MasksLike = str | Path | Mapping | None


@dataclass
class ShrinkResult:
    """Everything a shrink produced; `to_dict()` is what `--report` writes.

    `reference` is the input model with the masks applied. When the input was a path whose
    weights live in an external data file and validation was skipped, the unmasked weights of
    `reference` still refer to that file (they were never loaded into it)."""

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
    barriers: list[dict] = field(default_factory=list)
    kept_zeroed: list[KeptGroup] = field(default_factory=list)
    sparsity: list[Sparsity] = field(default_factory=list)
    removed_nodes: int = 0
    written: list[str] = field(default_factory=list)
    torch_validation: ValidationReport | None = None  # export_and_shrink: against the module itself

    @property
    def passed(self) -> bool:
        return all(v is None or v.passed for v in (self.validation, self.torch_validation))

    def to_dict(self) -> dict:
        keys = (
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
            "kept_zeroed",
            "sparsity",
            "removed_nodes",
            "written",
            "torch_validation",
        )
        return {k: to_jsonable(getattr(self, k)) for k in keys} | {"passed": self.passed}

    def save(self, path: str | Path, external: bool = False) -> list[Path]:
        return save_model(self.model, path, external=external)


def shrink(
    model: ModelLike,
    masks: MasksLike = None,
    output: str | Path | None = None,
    *,
    validate: bool = True,
    input_shapes: dict[str, list[int]] | None = None,
    inputs: list[dict[str, np.ndarray]] | None = None,
    draws: int = 3,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 0.0,
    provider: str = "cpu",
    keep_failed: bool = False,
    allow_unbound: bool = False,
    masks_format: str = "auto",
    weights: str | Path | Mapping | None = None,
    input_masked: bool | None = None,
    external_data: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> ShrinkResult:
    """Shrink a masked ONNX model to the channels its outputs need; prove and write it.

    `model` is a path or ModelProto; `masks` a masks file or dict in any pruner's format (see
    onnxshrink.masks; `masks_format` overrides detection), or None: the zeros already in the
    weights are the masks. `weights` (the original state dict, a file or dict) lets masks bind
    by value when the exporter renamed their weights. `input_masked`: whether the model already
    holds the masks' zeros (None: told by its weights, and masks that disagree with them are
    refused; False: the masks are applied whatever the model holds). Raises ShrinkError for bad input and
    ValidationFailed (with `.result`) when the shrunk model does not match; nothing is written
    then unless `keep_failed`.
    """
    log = log or (lambda _msg: None)
    if validate and draws < 1 and not inputs:
        raise ShrinkError(
            f"nothing to validate with: draws={draws} and no inputs given. Use draws >= 1 or give inputs."
        )
    timings: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        timings[name] = now - t
        t = now

    src: Path | None = None
    base_dir = None
    in_bytes = None
    src_data: list[Path] = []  # the input's external data files: never overwritten
    if isinstance(model, str | Path):
        src = Path(model)
        proto = load_model(src, keep_external=True)  # weights are read once, by prepare()
        base_dir = str(src.parent)
        src_data = data_files(src, proto)
        in_bytes = src.stat().st_size + sum(p.stat().st_size for p in src_data if p.exists())
    elif isinstance(model, onnx.ModelProto):
        proto = model
    else:
        raise TypeError(f"model must be a path or onnx.ModelProto, not {type(model).__name__}")
    source = str(masks) if isinstance(masks, str | Path) else "masks"
    maskset = None
    if isinstance(masks, MaskSet):
        maskset = masks
    elif masks is not None:
        maskset = load_maskset(masks, masks_format)
    values = None
    if weights is not None:
        raw = load_masks_file(weights) if isinstance(weights, str | Path) else weights
        values = flatten(raw, str(weights) if isinstance(weights, str | Path) else "weights")
    lap("load")

    bound = bind_masks(
        proto,
        maskset or MaskSet(),
        source=source,
        allow_unbound=allow_unbound,
        values=values,
        base_dir=base_dir,
    )
    held = check_reference(bound, input_masked, source)
    reference = proto if held else apply_masks(proto, bound, base_dir)
    lap("bind")
    if maskset is None:
        log("no masks file: the zeros in the weights are the masks")
    else:
        ways = sorted(set(bound.how.values()))
        log(
            f"{maskset.format} masks: {len(bound.how)} of {len(maskset.masks)} bound ({', '.join(ways)}) "
            f"to {len(bound.masks)} initializer(s)"
        )
        log(
            "the model already holds the masks: the reference is the model as given"
            if held
            else "the masks are applied to the model: the reference is the model with them applied"
        )
        for init, params in bound.shared.items():
            log(f"initializer '{init}' is shared by several parameters: untied for {', '.join(params)}")

    log(f"analyzing {len(reference.graph.node)} nodes ...")
    graph, untied = prepare(reference, base_dir)
    analysis = analyze(graph, default_opset(reference), untied)
    barriers = [
        {"node": r.node, "op": r.op, "reason": str(r)} for r in analysis.keep.barriers.values()
    ]
    lap("analyze")
    log(f"analyzed in {timings['analyze']:.2f} s; rewriting ...")

    rewritten = apply(analysis, reference)
    if rewritten.kept_zeroed:  # name the modules of exporter-renamed weights for --explain
        modules = weight_modules(reference)
        for g in rewritten.kept_zeroed:
            g.module = modules.get(g.tensor, "")
    shrunk = rewritten.model
    release(graph)  # the shrunk weights now live in `shrunk`
    del analysis, graph
    lap("rewrite")

    report = None
    if validate:
        log("validating with onnxruntime ...")
        if base_dir is not None:
            load_external(reference, Path(base_dir), str(src))
        report = compare(
            reference,
            shrunk,
            input_shapes=input_shapes,
            inputs=inputs,
            draws=draws,
            seed=seed,
            rtol=rtol,
            atol=atol,
            provider=provider,
        )
        lap("validate")
    shapes = report.input_shapes if report else resolve_shapes(reference, input_shapes or {})
    before = model_stats(reference, shapes, in_bytes)
    after = model_stats(shrunk, shapes)
    result = ShrinkResult(
        model=shrunk,
        reference=reference,
        before=before,
        after=after,
        validation=report,
        timings=timings,
        masks_bound=len(bound.masks),
        unbound_masks=bound.unbound,
        input_masked=held if maskset is not None else None,
        shared_initializers=bound.shared,
        folds=rewritten.folds,
        barriers=barriers,
        kept_zeroed=rewritten.kept_zeroed,
        sparsity=sparsity_left(shrunk),
        removed_nodes=rewritten.removed_nodes,
    )
    if output is not None and (result.passed or keep_failed):
        protect = [src, *src_data] if src is not None else []
        external = external_data if external_data is not None else bool(src_data)
        written = save_model(shrunk, output, external=external, protect=protect)
        result.written = [str(p) for p in written]
        after.file_bytes = sum(p.stat().st_size for p in written)
        lap("save")
    if not result.passed:
        bad = [o.name for o in report.outputs if not o.passed]
        raise ValidationFailed(
            f"the shrunk model does not match the reference on output(s) {bad}"
            + (
                "; it was written anyway (--keep-failed)."
                if result.written
                else "; nothing was written."
            ),
            result,
        )
    return result

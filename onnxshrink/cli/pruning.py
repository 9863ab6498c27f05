"""The command line's groups and prune: `--groups FILE.json` writes the model's coupled channel
groups; `--prune` (or a --prune-to-* target) prunes, and says what it removed and wrote."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from onnxshrink.cli.checks import prune_targets
from onnxshrink.cli.flags import options_from
from onnxshrink.cli.result import Say
from onnxshrink.errors import file_access
from onnxshrink.options import PruneOptions, ShrinkOptions


def write_groups(args: argparse.Namespace, say: Say) -> None:
    """Write the model's coupled channel groups to --groups, and say them layer by layer."""
    from onnxshrink.io.model import load_model
    from onnxshrink.prune import find_groups
    from onnxshrink.result import IN_MEMORY_BYTES

    path = Path(args.model)
    # external weights stay on disk, mapped as the analysis reads them (a 1.1 B-parameter
    # model's 4.4 GB were read into memory before the groups were found); a large one-file
    # model's stay in its file (io.wire)
    model = load_model(path, keep_external=True, map_from=IN_MEMORY_BYTES)
    groups = find_groups(model, str(path.parent), name=args.model, progress=not args.quiet)
    with file_access(args.groups):
        Path(args.groups).write_text(json.dumps(groups.to_dict()))
    exact = groups.exact()
    say(
        f"[I] {len(groups.groups)} coupled group(s) in {len(groups.layers)} layer(s), "
        f"{len(exact)} removable exactly; written to {args.groups}"
    )
    say(f"[I] {_how_checked(groups, model)}")
    for layer in groups.layers:
        n = sum(groups.groups[i].exact for i in layer.groups)
        first = groups.groups[layer.groups[0]]
        not_exact = [groups.groups[i] for i in layer.groups if not groups.groups[i].exact]
        why = f" ({len(not_exact)} not exact: {not_exact[0].reason})" if not_exact else ""
        say(f"[I]     {layer.name}: {len(layer.groups)} {first.unit.kind}(s), {n} exact{why}")


def _how_checked(groups: Any, model: Any) -> str:
    """What "removable exactly" was checked by: each group zeroed alone, or (a large model) half
    of each layer zeroed together."""
    from onnxshrink.prune.groups import ALONE_BUDGET, alone_cost

    if groups.checked == "alone":
        return "each exact group was zeroed alone and the shrink's analysis removes all of it"
    n, nodes = alone_cost(groups, model)
    return (
        f"exact groups were checked half of each layer at a time, zeroed together (not each alone: "
        f"{n} groups x {nodes} nodes is over {ALONE_BUDGET:,} node analyses); --prune checks the "
        "groups it chooses, zeroed together as it removes them"
    )


def run_prune(args: argparse.Namespace, options: ShrinkOptions, say: Say) -> Any:
    """Prune the model as the command line says (calibrating on the shrink's --inputs), say
    what was removed and written, and return the prune's result."""
    from onnxshrink.prune import prune

    told = options_from(args, PruneOptions, data=options.inputs)
    try:
        result = prune(args.model, output=args.output, how=told, options=options)
    except Exception as exc:
        failed = getattr(exc, "result", None)
        if failed is not None:
            say("[E] the pruned model does not match the model with the chosen groups zeroed")
        raise
    say(
        f"[I] pruned {len(result.removed())} group(s) ({told.criterion}, {result.allocation} "
        f"allocation, compensation {result.compensate}); per layer:"
    )
    if not result.removed():
        say(f"[W] nothing was pruned ({_why_nothing(result, args)}): the output is the input, shrunk as it is")
    _say_sizes(result, say)
    return result


def _why_nothing(result: Any, args: argparse.Namespace) -> str:
    """Why a prune removed no group."""
    flag, value = (prune_targets(args) or [("--prune", args.ratio)])[0]
    layers = [p for p in result.plans if p.total]
    if layers and all(p.ignored for p in layers):
        return f"every layer matched --ignore {' '.join(args.ignore)}"
    if not layers:
        return "no layer has an exact group to remove"
    return f"{flag} {value} of each layer rounds to none"


def _say_sizes(result: Any, say: Say) -> None:
    """What each layer lost, and the sizes and target reached."""
    from onnxshrink.report import human

    for plan in result.plans:
        if plan.total:
            note = " (ignored)" if plan.ignored else ""
            say(f"[I]     {plan.layer.name}: {len(plan.removed)} of {plan.total} {plan.layer.kind}(s){note}")
    after = result.shrink.after
    say(
        f"[I] parameters {human(result.original.params)} -> {human(after.params)}, "
        f"MACs {human(result.original.macs)} -> {human(after.macs)} (the unpruned input -> pruned)"
    )
    if result.target is not None and result.target.kind != "ratio":
        what = {"params": "parameters", "macs": "MACs", "latency": "measured latency"}[result.target.kind]
        say(
            f"[I] {result.target.flag()} {result.target.value:g}: {result.reached:.3f} of the "
            f"input's {what}"
        )
    if result.predicted is not None:
        say(f"[I] relative output error the sensitivity predicts: {result.predicted:.4g}")


def say_prune_written(result: Any, args: argparse.Namespace, say: Say) -> None:
    """The files the prune wrote besides the model (--sensitivity, --masks-out, --weights-out):
    said after the proof, which they were written after."""
    if args.sensitivity:
        say(f"[I] sensitivity of {len(result.families or [])} family(ies) written to {args.sensitivity}")
    if args.masks_out and not result.masks:
        say(f"[W] no masks written to {args.masks_out}: nothing was pruned")
    elif args.masks_out:
        from onnxshrink.masks import ONNX_SECTION

        onnx_only = sum(name.startswith(ONNX_SECTION) for name in result.masks)
        say(
            f"[I] masks written to {args.masks_out} ({len(result.masks) - onnx_only} parameter(s)"
            + (
                f"; {onnx_only} ONNX tensor(s) with no framework name, under '{ONNX_SECTION}'"
                if onnx_only
                else ""
            )
            + ")"
        )
    if args.weights_out and not result.weights:
        say(f"[W] nothing written to {args.weights_out}: the compensation changed no value")
    elif args.weights_out:
        say(
            f"[I] changed values written to {args.weights_out} ({len(result.weights)} tensor(s)"
            + (
                f"; {len(result.unnamed_weights)} with no framework parameter of that value, "
                "under onnx/NAME"
                if result.unnamed_weights
                else ""
            )
            + ")"
        )
    for name in result.skipped_masks:
        say(f"[W] no mask written for shared initializer {name!r}: no parameter name recorded")
    for note in result.slices.notes if args.masks_out else []:
        say(f"[W] --masks-out: {note}")

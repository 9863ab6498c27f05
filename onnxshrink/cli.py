"""`onnxshrink model.onnx [masks] -o small.onnx`: the command line."""

from __future__ import annotations

import argparse
import json
import re
import sys
import traceback
from collections import Counter
from pathlib import Path

from onnxshrink import __version__
from onnxshrink.errors import (
    ShrinkError,
    ValidationFailed,
    file_access,
    first_line,
    os_error_message,
)
from onnxshrink.options import (
    ALLOCATIONS,
    ANALYSES,
    COMPENSATIONS,
    CRITERIA,
    MASKS_FORMATS,
    PROVIDERS,
)

EXIT_INTERNAL = 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="onnxshrink",
        description="Shrink a masked (pruned) ONNX model to a physically smaller one that computes "
        "exactly the same function, proven with onnxruntime.",
        epilog="Exit codes: 0 done, 1 validation failed (nothing written), 2 bad input, 3 internal error.",
    )
    p.add_argument("model", help="ONNX model (.onnx); external data beside it is read")
    p.add_argument(
        "masks",
        nargs="?",
        help="masks file (.pt, .npz, .safetensors) of {initializer name: 0/1 mask}; "
        "omit it to use the zeros already in the weights",
    )
    p.add_argument(
        "-o",
        "--output",
        help="where to write the shrunk model (weights go to <output>.data "
        "when the input used external data, with --external-data, or past 2 GB)",
    )
    p.add_argument(
        "--input-shapes",
        nargs="+",
        action="extend",
        metavar="NAME:D0,D1",
        default=[],
        help="shapes for validation inputs with dynamic dims, e.g. input:1,3,224,224",
    )
    p.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="validation inputs to use besides the random ones; with --prune, also the "
        "calibration inputs of --criterion activation/wanda/fluctuation, --compensate and "
        "--allocation sensitivity (a batch of samples along the batch axis)",
    )
    p.add_argument(
        "--no-validate", action="store_true", help="skip the onnxruntime proof (not recommended)"
    )
    p.add_argument(
        "--draws", type=int, default=3, help="random input draws for validation (default 3)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="allowed error relative to the output's magnitude (default: 1e-5 for fp32 models, "
        "9.8e-3 when the model computes in fp16, 7.8e-2 in bf16: ten machine epsilons)",
    )
    p.add_argument(
        "--validate-layers",
        type=int,
        metavar="N",
        help="prove only the first N repeated blocks (layers) of the model, by their outputs: a "
        "quicker check of a large model (default: prove the whole model)",
    )
    p.add_argument(
        "--atol",
        type=float,
        default=0.0,
        help="allowed absolute error on top of --rtol (default 0)",
    )
    p.add_argument(
        "--provider",
        choices=PROVIDERS,
        default="cpu",
        help="onnxruntime execution provider (default cpu)",
    )
    p.add_argument(
        "--keep-failed", action="store_true", help="write the output even when validation fails"
    )
    p.add_argument(
        "--analysis",
        choices=ANALYSES,
        default="rules",
        help="rules: each op's handler says what its outputs need (default); replay: every node "
        "is replayed in onnxruntime to find it (slower; a cross-check of the rules)",
    )
    p.add_argument(
        "--no-recover",
        action="store_true",
        help="when the proof fails, fail (exit 1) instead of keeping the removals responsible",
    )
    p.add_argument(
        "--masks-format",
        default="auto",
        choices=MASKS_FORMATS,
        help="how to read the masks file (default: detected from its content)",
    )
    p.add_argument(
        "--weights",
        metavar="STATE_DICT",
        help="the original weights (.pt/.npz/.safetensors state dict): masks whose weights the "
        "exporter renamed or folded (legacy exporter, BatchNorm) then bind by value",
    )
    p.add_argument(
        "--unmasked-input",
        action="store_true",
        help="the model was exported before (some of) the masks were applied: apply them all "
        "(by default masks that the model's zeros contradict are refused)",
    )
    p.add_argument(
        "--allow-unbound", action="store_true", help="go on when some masks match no initializer"
    )
    p.add_argument(
        "--external-data", action="store_true", help="write the weights to <output>.data"
    )
    p.add_argument(
        "--report", metavar="FILE.json", help="write everything printed, as data, to this JSON file"
    )
    p.add_argument(
        "--explain", action="store_true", help="list every zeroed slice that was kept, and why"
    )
    g = p.add_argument_group(
        "groups and pruning",
        "the coupled channel groups of the model (no masks file), and pruning whole groups by "
        "importance, shrunk exactly against the model with the chosen groups zeroed",
    )
    g.add_argument(
        "--groups", metavar="FILE.json", help="write every coupled channel group (schema in the README)"
    )
    g.add_argument(
        "--prune",
        type=float,
        metavar="RATIO",
        help="remove this fraction of each layer's groups (e.g. 0.5), the least important first "
        "(of all groups with --allocation global or sensitivity)",
    )
    g.add_argument(
        "--prune-to-params",
        type=float,
        metavar="F",
        help="prune until F of the input's parameters are left (e.g. 0.5), counted exactly",
    )
    g.add_argument(
        "--prune-to-macs",
        type=float,
        metavar="F",
        help="prune until F of the input's MACs are left (e.g. 0.5), counted exactly",
    )
    g.add_argument(
        "--prune-to-latency",
        type=float,
        metavar="F",
        help="prune until the model runs in F of the input's latency (e.g. 0.6), measured with "
        "onnxruntime on this machine (ONNXSHRINK_THREADS threads; one per core when unset)",
    )
    g.add_argument(
        "--criterion",
        choices=CRITERIA,
        default="l1",
        help="importance (default l1). Needs: l1, l2 (group L1/L2 magnitude, Torch-Pruning's): "
        "the weights alone; random: --seed; activation (mean |x| x sum |w|), wanda (Wanda: RMS of x "
        "x sum |w|), fluctuation (FLAP: variance of x x sum w^2; pairs with --compensate): --inputs",
    )
    g.add_argument(
        "--allocation",
        choices=ALLOCATIONS,
        help="where to prune: uniform (RATIO of every layer; the default), global (all layers "
        "ranked together, importance divided by the layer's mean), sensitivity (each layer's "
        "channels, heads or neurons pruned alone at several ratios on --inputs, and the target "
        "met where the output changes least; needs --inputs)",
    )
    g.add_argument(
        "--global-ranking", action="store_true", help="the same as --allocation global"
    )
    g.add_argument(
        "--compensate",
        choices=COMPENSATIONS,
        default="none",
        help="bias (FLAP): replace each removed channel by its mean on --inputs, folded into the "
        "bias of every layer that read it; refit: also refit those layers' weights on the kept "
        "channels (ridge least squares, see --ridge). The pruned model is then proven against the "
        "input with the groups zeroed and these values changed (--weights-out writes them). "
        "Needs --inputs (default none)",
    )
    g.add_argument(
        "--ridge",
        type=float,
        default=1.0,
        metavar="R",
        help="--compensate refit: the regularization, R x the kept channels' mean variance "
        "(default 1; small calibration sets need it large)",
    )
    g.add_argument(
        "--held-out",
        metavar="FILE.npz",
        help="inputs the price of the prune is measured on (error, cosine, top-1, against the "
        "input model); default: the --inputs (calibration) ones, labelled so",
    )
    g.add_argument(
        "--no-price",
        action="store_true",
        help="do not measure what the prune cost (its outputs on --held-out or --inputs against the "
        "input's, and the latency before and after), printed and reported by default",
    )
    g.add_argument(
        "--sensitivity",
        metavar="FILE.html",
        help="write each family's measured sensitivity (output error against the ratio pruned): "
        "a self-contained HTML page with the picture and the table (needs --inputs)",
    )
    g.add_argument(
        "--ignore",
        nargs="+",
        action="extend",
        default=[],
        metavar="PATTERN",
        help="leave alone the layers whose weights, parameters, nodes or op types match (fnmatch)",
    )
    g.add_argument(
        "--units",
        nargs="+",
        metavar="KIND",
        help="the unit kinds --prune may remove: channel, neuron, gated_neuron, head (with "
        "grouped-query attention and without kv_group: the query heads of one rank in every K/V "
        "group), kv_group, "
        "conv_group, width (a residual stream's channel), block (a repeated block's residual "
        "branches; with --criterion activation ranked by their influence on --inputs); "
        "default: all but block",
    )
    g.add_argument(
        "--round-to", type=int, metavar="N", help="keep channel counts multiples of N (e.g. 8)"
    )
    g.add_argument(
        "--max-layer-ratio",
        type=float,
        default=1.0,
        help="remove at most this fraction of any layer (a layer always keeps one group)",
    )
    g.add_argument(
        "--masks-out",
        metavar="FILE",
        help="write the chosen masks (.pt, .npz, .safetensors), named by framework parameter",
    )
    g.add_argument(
        "--weights-out",
        metavar="FILE",
        help="with --compensate: write the values it changed (.pt, .npz, .safetensors), named by "
        "framework parameter: loaded into the original model with --masks-out applied, they make "
        "the pruned model (those with no framework parameter under onnx/NAME)",
    )
    p.add_argument(
        "-q", "--quiet", action="store_true", help="print errors only (no progress bars either)"
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print more (and tracebacks on errors)"
    )
    p.add_argument("--version", action="version", version=f"onnxshrink {__version__}")
    return p


_SHAPE = re.compile(r"^[\[(]?\s*(-?\d+\s*(,\s*-?\d+\s*)*,?)?[\])]?$")
# Options that take several values: what each value looks like (the rest is a positional).
_LISTS = {
    "--input-shapes": lambda v: bool(v.rpartition(":")[0]) and bool(_SHAPE.match(v.rpartition(":")[2])),
    "--ignore": lambda v: not Path(v).is_file(),  # a pattern, not the model or masks file
}


def order_free(argv: list[str]) -> list[str]:
    """`argv` with each value of a several-valued option attached to it (`--input-shapes=x:1,3`):
    argparse gives such an option every word up to the next option, so the model and masks
    given after it were taken as its values. A value is its option's while it looks like one
    (a `name:dims` shape; an --ignore pattern that is not a file): options go in any order."""
    out: list[str] = []
    k = 0
    while k < len(argv):
        word = argv[k]
        option, sep, value = word.partition("=")
        k += 1
        if option not in _LISTS:
            out.append(word)
            continue
        values = [value] if sep else []
        while not sep and k < len(argv) and not argv[k].startswith("-") and (
            not values or _LISTS[option](argv[k])
        ):
            values.append(argv[k])
            k += 1
        out += [f"{option}={v}" for v in values] or [option]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = order_free(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_intermixed_args(argv)
    say = (lambda _m: None) if args.quiet else (lambda m: print(m, flush=True))
    try:
        from onnxshrink.logs import show_library_logs

        show_library_logs(args.verbose and not args.quiet)
        from onnxshrink.api import ShrinkResult, check_options, shrink
        from onnxshrink.options import ShrinkOptions
        from onnxshrink.proof.inputs import load_inputs, parse_shapes

        report = _report_path(args)
        shapes = parse_shapes(args.input_shapes)
        inputs = [load_inputs(args.inputs)] if args.inputs else None
        say(
            f"[I] onnxshrink {__version__} | model {args.model}"
            + (f" | masks {args.masks}" if args.masks else "")
        )
        options = ShrinkOptions(
            validate=not args.no_validate,
            input_shapes=shapes,
            inputs=inputs,
            draws=args.draws,
            seed=args.seed,
            rtol=args.rtol,
            atol=args.atol,
            provider=args.provider,
            keep_failed=args.keep_failed,
            recover=not args.no_recover,
            analysis=args.analysis,
            allow_unbound=args.allow_unbound,
            masks_format=args.masks_format,
            weights=args.weights,
            input_masked=False if args.unmasked_input else None,
            external_data=True if args.external_data else None,
            validate_layers=args.validate_layers,
            log=lambda m: say(f"[I] {m}"),
            progress=not args.quiet,  # shown only when stderr is a terminal
        )
        pruning_to = _prune_target(args)
        groups_only = args.groups is not None and pruning_to is None  # validates nothing
        check_options(options.but(validate=False) if groups_only else options, flags=True)
        failure = None
        pruning = args.groups is not None or pruning_to is not None
        if pruning and args.masks:
            raise ShrinkError(
                f"{args.masks}: --groups and --prune read the model alone (its groups, and the "
                "masks --prune chooses); drop the masks file."
            )
        for flag, value in _PRUNE_ONLY:
            if getattr(args, value) and pruning_to is None:
                raise ShrinkError(
                    f"{flag} {getattr(args, value)}: it goes with --prune (or --prune-to-params, "
                    f"-macs, -latency); add one, or drop {flag}."
                )
        if args.groups is not None and pruning_to is None and args.output:
            raise ShrinkError(
                f"-o {args.output}: --groups alone writes only the groups, no model; add --prune "
                "RATIO to write a pruned model, or drop -o."
            )
        if args.groups is not None:
            _write_groups(args, say)
            if pruning_to is None:
                return 0
        try:
            pruned = None
            if pruning_to is not None:
                pruned = _prune(args, options, inputs, say)
                result = pruned.shrink
            else:
                result = shrink(args.model, args.masks, args.output, options=options)
        except ValidationFailed as exc:
            result, failure = exc.result, exc
        if result is not None:
            _print_result(result, args, say)
        if report is not None:  # the same keys whether the run passed or not
            if pruned is not None:
                data = pruned.to_dict()
            elif failure is not None and failure.report is not None:
                data = failure.report
            else:
                data = result.to_dict() if result is not None else ShrinkResult.empty_report()
            data["error"] = str(failure) if failure is not None else None
            with file_access(report):
                report.write_text(json.dumps(data, indent=2))
        if failure is not None:
            print(f"[E] {failure}", file=sys.stderr)
            return failure.exit_code
        return 0
    except ShrinkError as exc:
        print(f"[E] {exc}", file=sys.stderr)
        if args.verbose:
            traceback.print_exc()
        return exc.exit_code
    except OSError as exc:  # the user's disk or files (full, read-only, no permission), not a bug
        print(f"[E] {os_error_message(exc, what='read or write')}", file=sys.stderr)
        if args.verbose:
            traceback.print_exc()
        return ShrinkError.exit_code
    except MemoryError as exc:  # the machine's memory, as a full disk is the disk's: not a bug
        print(
            f"[E] out of memory ({first_line(exc)}): the model, or the validation inputs of "
            f"{' '.join(args.input_shapes) if args.input_shapes else 'its shapes'}, need more than "
            "this machine has; give smaller --input-shapes, or run where there is more memory. "
            "Nothing was written.",
            file=sys.stderr,
        )
        if args.verbose:
            traceback.print_exc()
        return ShrinkError.exit_code
    except KeyboardInterrupt:
        print("[E] interrupted; nothing was written.", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: say so plainly, keep the traceback for -v
        print(
            f"[E] internal error: {type(exc).__name__}: {exc}. Nothing was written. Please report this "
            "with the model (or run with -v for the traceback).",
            file=sys.stderr,
        )
        if args.verbose:
            traceback.print_exc()
        return EXIT_INTERNAL


# Options that only a prune reads: (flag, attribute).
_PRUNE_ONLY = (
    ("--masks-out", "masks_out"),
    ("--weights-out", "weights_out"),
    ("--held-out", "held_out"),
    ("--sensitivity", "sensitivity"),
)


def _prune_target(args) -> str | None:
    """The prune's target flag, or None when the run does not prune; two targets are refused."""
    given = [
        flag
        for flag, value in (
            ("--prune", args.prune),
            ("--prune-to-params", args.prune_to_params),
            ("--prune-to-macs", args.prune_to_macs),
            ("--prune-to-latency", args.prune_to_latency),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ShrinkError(f"{' and '.join(given)}: give one target to prune to.")
    return given[0] if given else None


def _write_groups(args, say) -> None:
    from onnxshrink.io.model import load_model
    from onnxshrink.prune import find_groups

    model = load_model(Path(args.model))
    groups = find_groups(model, name=args.model)
    with file_access(args.groups):
        Path(args.groups).write_text(json.dumps(groups.to_dict()))
    exact = groups.exact()
    say(
        f"[I] {len(groups.groups)} coupled group(s) in {len(groups.layers)} layer(s), "
        f"{len(exact)} removable exactly; written to {args.groups}"
    )
    for layer in groups.layers:
        n = sum(groups.groups[i].exact for i in layer.groups)
        first = groups.groups[layer.groups[0]]
        why = "" if n else f" (not exact: {first.reason})"
        say(f"[I]     {layer.name}: {len(layer.groups)} {first.unit.kind}(s), {n} exact{why}")


def _prune(args, options, inputs, say):
    from onnxshrink.proof.inputs import load_inputs
    from onnxshrink.prune import prune
    from onnxshrink.report import human

    try:
        result = prune(
            args.model,
            args.prune,
            args.output,
            criterion=args.criterion,
            global_ranking=args.global_ranking,
            allocation=args.allocation,
            compensate=args.compensate,
            ridge=args.ridge,
            params=args.prune_to_params,
            macs=args.prune_to_macs,
            latency=args.prune_to_latency,
            ignore=args.ignore,
            round_to=args.round_to,
            max_layer_ratio=args.max_layer_ratio,
            units=args.units,
            data=inputs,
            held_out=[load_inputs(args.held_out)] if args.held_out else None,
            sensitivity=args.sensitivity,
            masks_out=args.masks_out,
            weights_out=args.weights_out,
            price=not args.no_price,
            options=options,
        )
    except Exception as exc:
        failed = getattr(exc, "result", None)
        if failed is not None:
            say("[E] the pruned model does not match the model with the chosen groups zeroed")
        raise
    say(
        f"[I] pruned {len(result.removed())} group(s) ({args.criterion}, {result.allocation} "
        f"allocation, compensation {result.compensate}); per layer:"
    )
    if not result.removed():
        flag = _prune_target(args) or "--prune"
        layers = [p for p in result.plans if p.total]
        why = (
            f"every layer matched --ignore {' '.join(args.ignore)}"
            if layers and all(p.ignored for p in layers)
            else "no layer has an exact group to remove"
            if not layers
            else f"{flag} {getattr(args, flag[2:].replace('-', '_'))} of each layer rounds to none"
        )
        say(f"[W] nothing was pruned ({why}): the output is the input, shrunk as it is")
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
    return result


def _report_path(args) -> Path | None:
    """Where --report goes, checked before any work (see _check_side_files)."""
    _check_side_files(args)
    return Path(args.report).absolute() if args.report else None


# The files a run writes besides its model: (option, attribute, what to choose instead).
_SIDE_FILES = (
    ("--report", "report", "another report file"),
    ("--groups", "groups", "another groups file"),
    ("--masks-out", "masks_out", "another masks file"),
    ("--weights-out", "weights_out", "another weights file"),
    ("--sensitivity", "sensitivity", "another page"),
)


def _check_side_files(args) -> None:
    """Each file written besides the model (--report, --groups, --masks-out) goes in an existing
    directory and never over an input (the model, its data, the masks, weights or inputs) or
    another output."""
    others: list[tuple[str, object]] = [
        ("model", args.model), ("masks", args.masks), ("--inputs", args.inputs),
        ("--held-out", args.held_out),
        ("--weights", args.weights), ("-o", args.output),
        ("-o", args.output + ".data" if args.output else None),
    ]  # fmt: skip
    try:
        from onnxshrink.io.model import data_files

        others += [("model", f) for f in data_files(Path(args.model))]
    except Exception:
        pass  # an unreadable model is reported by the shrink itself
    others += [(option, getattr(args, attr)) for option, attr, _ in _SIDE_FILES]
    for option, attr, instead in _SIDE_FILES:
        value = getattr(args, attr)
        if not value:
            continue
        path = Path(value).absolute()
        if path.is_dir() or not path.parent.is_dir():
            raise ShrinkError(f"{option} {value}: give a file in an existing directory.")
        for label, other in others:
            if other and label != option and Path(str(other)).absolute().resolve() == path.resolve():
                raise ShrinkError(f"{option} {value}: that is also {other}; choose {instead}.")


def _print_result(result, args, say) -> None:
    from onnxshrink.report import STATISTICS, human, human_bytes, stats_table, summary

    if result.renamed_nodes:
        (old, new), n = result.renamed_nodes[0], len(result.renamed_nodes)
        say(
            f"[W] {n} node(s) had the name of another node (e.g. '{old}'), which onnxruntime "
            f"refuses: the output names them apart (e.g. '{new}')"
        )
    if result.validation is not None:
        for line in result.validation.lines():
            say(line)
    else:
        say("[W] validation skipped (--no-validate): the output is not proven equivalent")
    for line in stats_table(result.before, result.after, result.timings):
        say(line)
    say(f"[I] {summary(result.before, result.after, Counter(f.into for f in result.folds))}")
    if result.interface_changes:
        say(
            f"[W] {len(result.interface_changes)} graph input(s)/output(s) changed shape (a state "
            "the runtime feeds back, e.g. a KV cache whose heads were removed): the runtime must "
            "feed the new shapes"
        )
        for change in result.interface_changes:
            say(f"[W]     {change.text()}")
    for note in result.runtime_configs:
        say(f"[{'I' if note.get('written') else 'W'}] {note['text']}")
    if result.kept_after_failed_proof:
        kept = result.kept_after_failed_proof
        say(
            f"[W] the first proof failed ({result.first_failure}); {len(kept)} tensor axis/axes "
            f"were kept whole to pass, {sum(k['indices'] for k in kept)} index(es) in all. "
            "This is a bug in onnxshrink's analysis (or in onnxruntime, where it refused the "
            "shrunk model): please report it with the model."
        )
        for k in kept[: 10 if not args.explain else None]:
            say(f"[W]     {k['tensor']} (axis {k['axis']}): {k['indices']} kept back")
    if result.unbound_masks:
        names = ", ".join(f"'{n}'" for n in result.unbound_masks[:10])
        say(
            f"[W] {len(result.unbound_masks)} mask(s) matched no initializer and were ignored (--allow-unbound): {names}"
        )
    folds = [f for f in result.folds if f.into not in STATISTICS]
    if folds:
        n = sum(f.channels for f in folds)
        kinds = Counter(f.into for f in folds if f.into != "bias")
        how = ", ".join(f"{k} as {kind}s" for kind, k in sorted(kinds.items()))
        say(
            f"[I] folded {n} constant channel(s) into {len(folds)} consumer(s)"
            + (f" ({how}, for zero padding at the borders)" if how else "")
        )
    statistics = Counter(f.into for f in result.folds if f.into in STATISTICS)
    if statistics:
        how = ", ".join(f"{k} {kind}" for kind, k in sorted(statistics.items()))
        say(
            f"[I] {sum(statistics.values())} normalization(s) lost zero channels and keep the "
            f"statistics of their original width: {how}"
        )
    if result.replayed:
        ops = sorted({r["op"] for r in result.replayed})
        say(
            f"[I] {len(result.replayed)} node(s) with no rule were replayed in onnxruntime "
            f"({', '.join(ops)}); --explain says what each passes through"
        )
        if args.explain:
            for r in result.replayed:
                say(f"[I]     node {r['node']!r} ({r['op']}): {r['finding']}")
    if result.barriers:
        unsupported = sorted({b["op"] for b in result.barriers if b["unsupported"]})
        whole = sorted({b["op"] for b in result.barriers if not b["unsupported"]})
        what = ([f"unsupported: {', '.join(unsupported)}"] if unsupported else []) + (
            [f"kept whole by their handler: {', '.join(whole)}"] if whole else []
        )
        say(
            f"[W] {len(result.barriers)} node(s) keep all their channels ({'; '.join(what)}); "
            "--explain says why"
        )
    kept = sum(g.count for g in result.kept_zeroed)
    in_slices = sum(s.in_zero_slices for s in result.sparsity)
    if kept:
        say(
            f"[I] {kept} zeroed slice(s) had to be kept"
            + (f" ({human(in_slices)} zero weights)" if in_slices else "")
            + ("" if args.explain else "; --explain says why")
        )
    if args.explain:
        for g in result.kept_zeroed:
            where = f" in {g.module}" if g.module else ""
            say(f"[I]     {g.tensor}{where} (axis {g.axis}): {g.count} kept: {g.reason}")
        for b in result.barriers:
            say(f"[I]     node {b['node'] or '(unnamed)'!r} ({b['op']}): {b['reason']}")
    unstructured = [s for s in result.sparsity if s.zeros > 0]
    zeros = sum(s.zeros * s.elements for s in unstructured)
    if zeros:
        say(
            f"[I] {human(zeros)} zero weights remain inside kept channels (unstructured sparsity shrinking cannot remove)"
        )
        if args.explain or args.verbose:
            for s in unstructured:
                say(f"[I]     {s.tensor}: {s.zeros:.1%} zeros of {human(s.elements)}")
    if result.written:
        say(f"[I] saved {', '.join(result.written)} ({human_bytes(result.after.file_bytes)})")
    elif args.output is None:
        say("[W] no -o given: nothing written")
    elif not result.passed:
        say(f"[E] {args.output} not written: validation failed")


if __name__ == "__main__":
    sys.exit(main())

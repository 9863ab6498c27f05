"""What a command line may not combine, refused before any work: two prune targets, a prune's
flags without a prune, a masks file with --groups or --prune, and a file written over another."""

from __future__ import annotations

import argparse
from pathlib import Path

from onnxshrink.cli.flags import flag_name
from onnxshrink.errors import ShrinkError
from onnxshrink.options import PruneOptions

# The options of a prune that say what to prune to: a prune has exactly one.
_TARGETS = ("ratio", "params", "macs", "latency")
# The options that only a prune reads.
_PRUNE_ONLY = ("masks_out", "weights_out", "held_out", "sensitivity")


def prune_targets(args: argparse.Namespace) -> list[tuple[str, float]]:
    """The prune targets given: (flag, value) each."""
    return [
        (flag_name(PruneOptions, name), getattr(args, name))
        for name in _TARGETS
        if getattr(args, name) is not None
    ]


def prune_target(args: argparse.Namespace) -> str | None:
    """The prune's target flag, or None when the run does not prune; two targets are refused."""
    given = [flag for flag, _ in prune_targets(args)]
    if len(given) > 1:
        raise ShrinkError(f"{' and '.join(given)}: give one target to prune to.")
    return given[0] if given else None


def check_command(args: argparse.Namespace, pruning_to: str | None) -> None:
    """Refuse what --groups and the prune's flags cannot mean with the rest of the command line
    (`pruning_to`: the prune's target flag, None when the run does not prune)."""
    if (args.groups is not None or pruning_to is not None) and args.masks:
        raise ShrinkError(
            f"{args.masks}: --groups and --prune read the model alone (its groups, and the "
            "masks --prune chooses); drop the masks file."
        )
    for name in _PRUNE_ONLY:
        if getattr(args, name) and pruning_to is None:
            flag = flag_name(PruneOptions, name)
            raise ShrinkError(
                f"{flag} {getattr(args, name)}: it goes with --prune (or --prune-to-params, "
                f"-macs, -latency); add one, or drop {flag}."
            )
    if args.groups is not None and pruning_to is None and args.output:
        raise ShrinkError(
            f"-o {args.output}: --groups alone writes only the groups, no model; add --prune "
            "RATIO to write a pruned model, or drop -o."
        )


def report_path(args: argparse.Namespace) -> Path | None:
    """Where --report goes, checked before any work (see check_side_files)."""
    check_side_files(args)
    return Path(args.report).absolute() if args.report else None


# The files a run writes besides its model: (option, attribute, what to choose instead).
_SIDE_FILES = (
    ("--report", "report", "another report file"),
    ("--groups", "groups", "another groups file"),
    ("--masks-out", "masks_out", "another masks file"),
    ("--weights-out", "weights_out", "another weights file"),
    ("--sensitivity", "sensitivity", "another page"),
)


def check_side_files(args: argparse.Namespace) -> None:
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

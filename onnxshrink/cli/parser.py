"""The command line's parser: the run's inputs and outputs, the options of a shrink and of a
prune (built from their fields, see onnxshrink.cli.flags) and what to print."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from onnxshrink import __version__
from onnxshrink.cli.flags import add_flags
from onnxshrink.options import PruneOptions, ShrinkOptions


def build_parser() -> argparse.ArgumentParser:
    """The parser of `onnxshrink model.onnx [masks] -o small.onnx [options]`."""
    p = argparse.ArgumentParser(
        prog="onnxshrink",
        description="Shrink a masked (pruned) ONNX model to a physically smaller one that computes "
        "exactly the same function, proven with onnxruntime.",
        epilog="Exit codes: 0 done, 1 validation failed (nothing written), 2 bad input, 3 internal error.",
    )
    _add_files(p)
    add_flags(p, ShrinkOptions)
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
        "--groups", metavar="FILE.json", help="write every coupled channel group (schema in docs/pruning.md)"
    )
    add_flags(g, PruneOptions)
    p.add_argument(
        "-q", "--quiet", action="store_true", help="print errors only (no progress bars either)"
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print more (and tracebacks on errors)"
    )
    p.add_argument("--version", action="version", version=f"onnxshrink {__version__}")
    return p


def _add_files(p: argparse.ArgumentParser) -> None:
    """The model read, its masks, and the model written."""
    p.add_argument("model", help="ONNX model (.onnx); external data beside it is read")
    p.add_argument(
        "masks",
        nargs="?",
        help="masks file (.pt, .npz, .safetensors) of 0/1 masks named by the framework's "
        "parameters (the state_dict names, e.g. layer1.0.conv1.weight; the model's initializer "
        "names bind too), in any format of --masks-format; omit it to use the zeros already in "
        "the weights",
    )
    p.add_argument(
        "-o",
        "--output",
        help="where to write the shrunk model (weights go to <output>.data "
        "when the input used external data, with --external-data, or past 2 GB)",
    )


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

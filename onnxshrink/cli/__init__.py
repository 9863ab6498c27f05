"""`onnxshrink model.onnx [masks] -o small.onnx`: the command line.

parser: the flags (the options' own from their fields, see flags); run: `main`, a run from its
arguments to its exit code; checks: what a command line may not combine; pruning: the groups
and prune commands; result: what a shrink prints.
"""

from onnxshrink.cli.parser import build_parser
from onnxshrink.cli.run import main

__all__ = ["build_parser", "main"]

"""Pruning from the ONNX graph: the coupled groups (`groups`), importance criteria
(`importance`), choosing whole groups at a ratio (`select`), and `prune` (`run`), which zeroes
the chosen groups and shrinks exactly."""

from onnxshrink.options import CRITERIA
from onnxshrink.prune.groups import GroupSet, find_groups
from onnxshrink.prune.importance import scores
from onnxshrink.prune.run import PruneResult, prune

__all__ = ["CRITERIA", "GroupSet", "PruneResult", "find_groups", "prune", "scores"]

"""A weight several nodes read is stored once per distinct slicing of it.

`prepare.tie` gives each reader of a shared initializer its own copy, so that each can be sliced
for what its reader needs, and `retie` merges the copies that end up alike. Two readers that
need different slices would store two copies: more than the weight itself when their slices
overlap enough (a CRNN whose LSTM weight two nodes read, one of which could drop a few input
features: 0.3% fewer multiply-adds, the weight stored twice). Then the closure is run a second
time with every such weight's copies keeping the union of what they keep (one slicing, stored
once), and the analysis that stores fewer elements in all is kept (`analyze.analyze`): a small
shared vector sliced two ways (two layers' scales, merged by an exporter because they are
equal) is better stored twice than holding both layers' weights whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def union_if_larger(copies: Sequence[Sequence[np.ndarray | None]]) -> list[np.ndarray] | None:
    """Each copy's kept indices per axis (None: an axis of unknown size) -> the union per axis
    when the copies' distinct slicings together hold more elements than the weight; else None
    (each copy is sliced for its own reader)."""
    if len(copies) < 2 or any(k is None for c in copies for k in c):
        return None
    masks = [[np.asarray(k, bool) for k in c] for c in copies]
    rank = len(masks[0])
    if any(len(c) != rank for c in masks) or any(m[a].shape != masks[0][a].shape for m in masks for a in range(rank)):
        return None
    distinct = {tuple(np.packbits(k).tobytes() + bytes([len(k) % 8]) for k in c): c for c in masks}
    if len(distinct) < 2:
        return None
    held = sum(math.prod(int(k.sum()) for k in c) for c in distinct.values())
    if held <= math.prod(len(k) for k in masks[0]):
        return None
    return [np.logical_or.reduce([c[a] for c in masks]) for a in range(rank)]

"""Bind masks (named after the framework's parameters) to the model's initializers.

A mask binds, in order, by:
1. exact initializer name, or an Identity alias of one: the initializer is the parameter;
2. a folded BatchNorm's parameters and statistics, bound together (see `batchnorm`);
3. the module scope the exporter recorded on nodes (dynamo's `pkg.torch.onnx.name_scopes`,
   legacy node names like `/layer1/layer1.0/conv1/Conv`): the op in that module that reads the
   parameter, with the op's layout (a Linear weight stored transposed for MatMul); or, where no
   scope names the module, the op that reads another of its parameters by its exact name in
   that parameter's slot (`by_sibling`: a conv fused with its BatchNorm);
4. value, when the original weights are known (in the masks file, or `--weights`): the
   original values or the masked ones (a model exported masked, e.g. with torch.nn.utils.prune's
   hooks attached), equal, transposed, or scaled per output channel (a folded BatchNorm).

Nothing is decided by a shape coincidence: the axes come from the op reading the initializer
(`graph.ModelIndex.layout`), and a mask whose axes nothing settles is refused by name. A mask
applies to the readers its parameter stands for: when an exporter merged equal parameters into
one initializer, only the readers in the mask's module.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from onnxshrink.bind import batchnorm
from onnxshrink.bind.binding import Binding, BoundMasks
from onnxshrink.bind.graph import (
    Layout,
    ModelIndex,
    Site,
    inside,
    is_fused_batchnorm,
)
from onnxshrink.errors import ShrinkError
from onnxshrink.masks import MaskSet, check_binary


class Ambiguous(Exception):
    """Nothing in the graph or the values settles where a mask goes: it is refused by name."""


class Binder:
    def __init__(self, index: ModelIndex, values: Mapping[str, np.ndarray], source: str):
        self.index = index
        self.values = values
        self.source = source
        self._zeroed: list[str] | None = None  # see zeroed_weights
        self.masks: dict[str, np.ndarray] = {}  # all the masks being bound (see shift_masked)

    # ------------------------------------------------------------------ laying a mask
    def fit(self, name: str, mask: np.ndarray, init: str, layout: Layout | None) -> np.ndarray:
        """The mask in the initializer's layout: as given (transposed when the graph says the
        initializer is a transposed copy of the parameter), or one flag per output channel,
        broadcast along the output axis the reading op gives."""
        shape = self.index.shapes[init]
        if layout is not None and layout.transposed and mask.ndim == 2:
            mask = mask.T
        if mask.shape == shape:  # a compacted mask stays a broadcast view of its flags
            # (np.ascontiguousarray would make a scalar's 0-d mask 1-d)
            return mask if 0 in mask.strides else np.asarray(mask, order="C")
        if mask.ndim == 1 and shape:
            axis = 0 if len(shape) == 1 else (layout.out if layout is not None else None)
            if axis is None:
                raise Ambiguous(
                    f"it has one flag per channel, but no op reading '{init}' (shape "
                    f"{list(shape)}) says which axis holds its output channels; give a mask of "
                    "the weight's full shape"
                )
            if shape[axis] == mask.shape[0]:
                return np.broadcast_to(
                    mask.reshape([-1 if a == axis else 1 for a in range(len(shape))]), shape
                )
        raise ShrinkError(
            f"{self.source}: mask '{name}' has shape {list(mask.shape)} but initializer '{init}' "
            f"has shape {list(shape)}"
            + (" (stored transposed for the op reading it)" if layout and layout.transposed else "")
            + ". Give a mask of the weight's shape, or one flag per output channel."
        )

    def out_layout(self, init: str, sites: tuple[Site, ...] | None) -> Layout | None:
        """The initializer as its readers see it, stored as the parameter is (for a mask bound by
        name): the output axis all readers agree on, or None."""
        found = {self.index.layout(s) for s in (sites or self.index.sites[init])}
        outs = {lay.out for lay in found if lay is not None}
        if None in found or len(outs) != 1:
            return None
        return Layout(outs.pop(), None, False)

    # ------------------------------------------------------------------ whose readers
    def attribute(self, init: str, module: str) -> tuple[Site, ...] | None:
        """The readers of `init` that a parameter of `module` stands for: all of them when they
        are all one module's, else those inside `module` (the exporter merged equal
        parameters of several modules into this initializer)."""
        sites = self.index.sites[init]
        if len({self.index.module(s) for s in sites}) <= 1:
            return None
        mine = tuple(s for s in sites if inside(self.index.module(s), module))
        if not mine:
            modules = sorted({self.index.module(s) or "?" for s in sites})
            raise Ambiguous(
                f"initializer '{init}' is read by several modules ({', '.join(modules[:6])}): "
                "the exporter merged equal parameters into it, and no reader is in this mask's "
                "module"
            )
        return None if len(mine) == len(sites) else mine

    def shift_masked(self, site: Site, mask: np.ndarray) -> bool:
        """Masking the fused shift (b - mean) * s + beta of a conv fused with its BatchNorm is
        masking b when the masks zero that BatchNorm's weight (so s) and bias (beta) wherever
        `mask` does (as --masks-out writes them): the shift is zero there either way."""
        module = self.index.module(site)
        flags = np.asarray(mask).reshape(-1)
        zero = flags == 0
        for param in ("weight", "bias"):
            given = self.masks.get(f"{module}.{param}")
            if given is None or given.size != flags.size or (given.reshape(-1)[zero] != 0).any():
                return False
        return module is not None and bool(zero.any())

    # ------------------------------------------------------------------ routes
    def by_name(self, name: str, mask: np.ndarray) -> list[Binding] | None:
        init = self.index.resolve(name)
        if init is None:
            return None
        sites = self.attribute(init, name.rpartition(".")[0]) if "." in name else None
        if not all(
            batchnorm.mask_commutes(self.index, s) or self.shift_masked(s, mask)
            for s in sites or self.index.sites[init]
        ):
            raise Ambiguous(f"initializer '{init}' keeps its name, but {batchnorm.FUSED_SHIFT}")
        laid = self.fit(name, mask, init, self.out_layout(init, sites))
        return [Binding(name, init, laid, sites, "name" if init == name else "alias")]

    def by_scope(self, name: str, mask: np.ndarray) -> list[Binding] | None:
        module, _, param = name.rpartition(".")
        found: dict[str, tuple[list[Site], Layout | None]] = {}
        for k in self.index.scopes.get(module, []):
            n = self.index.nodes[k]
            if is_fused_batchnorm(n):
                continue  # holds the BatchNorm's parameters folded: bound by `batchnorm`
            slot = self.index.param_slot(k, param)
            if slot is None or slot >= len(n.input):
                continue
            init = self.index.resolve(n.input[slot])
            if init is None:
                continue
            site = Site(k, slot)
            layout = self.index.layout(site)
            if layout is None and len(self.index.shapes[init]) > 1:
                continue  # an op that gives a matrix's axes no roles: not bound by scope
            _add_site(found, init, site, layout)
        return self._bindings(name, mask, found, "scope")

    def by_sibling(self, name: str, mask: np.ndarray) -> list[Binding] | None:
        """The op of a module no node scope records, found by another parameter of the module
        that it reads under its exact name in that parameter's slot: a conv the exporter fused
        with the BatchNorm after it records only the BatchNorm's scope, but reads `conv1.bias`
        as its bias, so its weight slot holds `conv1.weight` (scaled per output channel by the
        fold, which a mask commutes with; see batchnorm.mask_commutes)."""
        module, _, param = name.rpartition(".")
        found: dict[str, tuple[list[Site], Layout | None]] = {}
        for other in self.index.inits:
            sibling = other.rpartition(".")
            if other == name or sibling[0] != module:
                continue
            for s in self.index.sites[other]:
                if self.index.param_slot(s.node, sibling[2]) != s.input:
                    continue  # not read as that parameter
                slot = self.index.param_slot(s.node, param)
                inputs = self.index.nodes[s.node].input
                if slot is None or slot >= len(inputs):
                    continue
                init, site = self.index.resolve(inputs[slot]), Site(s.node, slot)
                if init is None or not batchnorm.mask_commutes(self.index, site):
                    continue
                _add_site(found, init, site, self.index.layout(site))
        return self._bindings(name, mask, found, "its op, by a sibling parameter")

    def _bindings(
        self, name: str, mask: np.ndarray, found: dict[str, tuple[list[Site], Layout | None]], how: str
    ) -> list[Binding] | None:
        """One binding per initializer found, owning only its sites when other readers remain."""
        out = []
        for init, (sites, layout) in found.items():
            own = None if set(self.index.sites[init]) <= set(sites) else tuple(sites)
            out.append(Binding(name, init, self.fit(name, mask, init, layout), own, how))
        return out or None

    def bias_absent(self, name: str) -> bool:
        """The mask's module computes ops that have a slot for this parameter (a Conv's or a
        Gemm's bias) but leave it empty: the exporter dropped a parameter that is zero (the
        dynamo exporter's optimizer does), and masking it changes nothing."""
        module, _, param = name.rpartition(".")
        slots = []
        for k in self.index.scopes.get(module, []):
            i = self.index.param_slot(k, param)
            if i is not None:
                slots.append(not self.index.facts[k][1].has_input(i))
        return bool(slots) and all(slots)

    def by_value(self, name: str, mask: np.ndarray) -> list[Binding] | None:
        """The initializer holding the parameter's original values, or those values with this
        mask applied (a model exported masked: torch.nn.utils.prune's hooks compute weight_orig *
        weight_mask, which the exporter folds into one initializer such as `mul`): equal,
        transposed, or scaled per output channel (a BatchNorm folded into it)."""
        orig = self.values.get(name)
        if orig is None or not np.issubdtype(orig.dtype, np.floating) or orig.size < 2:
            return None
        if np.all(orig == orig.reshape(-1)[0]):
            raise Ambiguous(
                "its original values are all equal, so they cannot tell which initializer holds it"
            )
        forms = [orig]
        if mask.shape == orig.shape and not mask.all():
            forms.append(np.where(mask != 0, orig, np.zeros((), orig.dtype)))
        candidates: dict[str, set[bool]] = {}
        for init, shape in self.index.shapes.items():
            if shape == orig.shape:
                arr = self.index.array(init)
                if any(np.array_equal(arr, f) or _row_proportional(arr, f) for f in forms):
                    candidates.setdefault(init, set()).add(False)
            if orig.ndim == 2 and shape == orig.T.shape:
                arr = self.index.array(init)
                if any(np.array_equal(arr, f.T) for f in forms):
                    candidates.setdefault(init, set()).add(True)
        if not candidates:
            return None
        module = name.rpartition(".")[0]
        if len(candidates) > 1:  # equal parameters: the one read in this mask's module
            mine = {
                i: t
                for i, t in candidates.items()
                if any(inside(self.index.module(s), module) for s in self.index.sites[i])
            }
            if len(mine) != 1:
                raise Ambiguous(
                    f"its original values equal {len(candidates)} initializers "
                    f"({', '.join(sorted(candidates)[:4])}) and the graph does not say which is its own"
                )
            candidates = mine
        [(init, ways)] = candidates.items()
        sites = self.attribute(init, module)
        if len(ways) == 2:  # a symmetric matrix: its values cannot say which way the mask goes
            ways_read = {
                lay.transposed if lay is not None else None
                for lay in (self.index.layout(s) for s in (sites or self.index.sites[init]))
            }
            if None in ways_read or len(ways_read) != 1:
                raise Ambiguous(
                    f"initializer '{init}' is symmetric, so its values cannot say which way the "
                    "mask goes, and no op reading it says"
                )
            transposed = bool(ways_read.pop())
        else:
            transposed = ways.pop()
        layout = self.out_layout(init, sites)
        layout = Layout(layout.out if layout else 0, None, transposed)
        return [Binding(name, init, self.fit(name, mask, init, layout), sites, "value")]

    # ------------------------------------------------------------------ all together
    def bind(self, maskset: MaskSet) -> BoundMasks:
        bound = BoundMasks(index=self.index)
        masks = {k: np.asarray(v) for k, v in maskset.masks.items()}
        self.masks = masks
        done: set[str] = set()
        for name, mask in masks.items():
            check_binary(name, mask, self.source)
            if name in done:
                continue
            module, _, param = name.rpartition(".")
            try:
                found = self.by_name(name, mask)
                if found is None and param in batchnorm.PARAMS:
                    folded = batchnorm.bind_folded(self.index, self.values, module, masks)
                    if isinstance(folded, list):
                        group = [f"{module}.{p}" for p in batchnorm.PARAMS if f"{module}.{p}" in masks]
                        bound.bindings += folded
                        for g in group:
                            bound.how[g] = "folded BatchNorm"
                        done |= set(group)
                        continue
                    if isinstance(folded, str):
                        raise Ambiguous(folded)
                found = (
                    found
                    or self.by_scope(name, mask)
                    or self.by_sibling(name, mask)
                    or self.by_value(name, mask)
                )
            except Ambiguous as why:
                if mask.all():
                    bound.how[name] = "nothing masked"
                else:
                    bound.unbound.append(name)
                    bound.hints[name] = str(why)
                    bound.ambiguous.add(name)
                continue
            if found:
                bound.bindings += found
                bound.how[name] = found[0].how
            elif mask.all() and maskset.format == "state-dict":
                bound.how[name] = "nothing masked"  # e.g. BN statistics of a masked state dict
            elif name in maskset.optional:
                continue  # e.g. the bias of a layer that has none
            elif self.bias_absent(name):
                bound.how[name] = "absent (a zero bias the exporter dropped)"
            else:
                bound.unbound.append(name)
                bound.hints[name] = self.hint(name)
        return bound

    GENERIC = (
        "no initializer, node scope or value matches it (if the exporter folded or renamed it, "
        "e.g. a BatchNorm with the legacy exporter, pass the original weights with --weights)"
    )
    WITHOUT_VALUES = (
        "If the model was exported with the pruning applied (e.g. with torch.nn.utils.prune's "
        "hooks still attached: the exporter computes weight_orig * weight_mask, or folds it into "
        "one weight such as 'mul'), omit the masks file: the zeros in the model are the masks{held}. "
        "Or bind it by value: give the pruner's state dict (model.state_dict(), which carries "
        "weight_orig and weight_mask) as the masks file, or the original weights with --weights"
    )

    def hint(self, name: str) -> str:
        module = name.rpartition(".")[0]
        if name in self.values:
            return self.GENERIC
        if module in self.index.scopes:
            why = (
                "its module is in the graph, but the weight its op reads is not an initializer of "
                "that name (the exporter renamed, folded or computed it)"
            )
        else:
            why = (
                "no node records its module (a BatchNorm that the exporter folded into a conv "
                "records only the BatchNorm's scope on the conv)"
            )
        held = self.zeroed_weights()
        return f"{why}. " + self.WITHOUT_VALUES.format(
            held=f" (its weights {', '.join(repr(n) for n in held)} hold zeroed output channels)"
            if held
            else ""
        )

    def zeroed_weights(self, most: int = 3) -> list[str]:
        """Up to `most` initializers read as weights (an op gives their output axis) holding a
        whole zero slice along it: the mark of a model exported masked."""
        if self._zeroed is None:
            self._zeroed = []
            for init, sites in self.index.sites.items():
                layout = self.out_layout(init, tuple(sites))
                if layout is None or len(self.index.shapes[init]) < 2:
                    continue
                arr = self.index.array(init)
                flat = np.moveaxis(arr, layout.out, 0).reshape(arr.shape[layout.out], -1)
                if not (flat != 0).any(axis=1).all():
                    self._zeroed.append(init)
                    if len(self._zeroed) == most:
                        break
        return self._zeroed


def _row_proportional(a: np.ndarray, b: np.ndarray) -> bool:
    """a[o] == s[o] * b[o] for some per-output-channel s (a folded BatchNorm)."""
    if a.ndim < 2:
        return False
    a2 = a.reshape(a.shape[0], -1).astype(np.float64)
    b2 = b.reshape(b.shape[0], -1).astype(np.float64)
    if not np.array_equal(a2 == 0, b2 == 0):
        return False
    with np.errstate(all="ignore"):
        ratio = np.where(b2 != 0, a2 / b2, np.nan)
    lo, hi = np.nanmin(ratio, axis=1, initial=np.inf), np.nanmax(ratio, axis=1, initial=-np.inf)
    rows = np.isfinite(lo)
    return bool(rows.any()) and bool(np.allclose(lo[rows], hi[rows], rtol=1e-5, atol=0))


def _add_site(
    found: dict[str, tuple[list[Site], Layout | None]], init: str, site: Site, layout: Layout | None
) -> None:
    """Record that the mask's module reads `init` at `site` in `layout` (one layout per init)."""
    sites, lay = found.setdefault(init, ([], layout))
    if lay != layout:
        raise Ambiguous(f"its module reads initializer '{init}' in two different layouts")
    if site not in sites:
        sites.append(site)

"""Bind masks (named after the framework's parameters) to the model's initializers, and apply them.

Exporters rename and reshape weights: the default torch exporter folds BatchNorm into the
conv (same weight name, fused values, a new `<weight>_bias`) and stores Linear weights of rank-3
inputs pre-transposed under anonymous names; the legacy exporter names folded weights
`onnx::Conv_N`. A mask binds, in order, by:
1. exact initializer name; 2. Identity alias; 3. the module scope recorded on nodes (dynamo's
`pkg.torch.onnx.name_scopes`, legacy node names like `/layer1/layer1.0/conv1/Conv`) with the
op's weight layout (transposed for MatMul, folded for BatchNorm); 4. value, when the original
weights are known (in the masks file itself, or given separately): equal, transposed, or
scaled per output channel (a folded BatchNorm).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.errors import ShrinkError
from onnxshrink.masks import MaskSet, check_binary

WEIGHT_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Gather")
BN_EPS = 1e-5


@dataclass
class BoundMasks:
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # initializer name -> 0/1 array
    how: dict[str, str] = field(default_factory=dict)  # mask name -> how it was bound
    unbound: list[str] = field(default_factory=list)  # mask names that matched nothing
    hints: dict[str, str] = field(default_factory=dict)  # unbound mask name -> what to do


def module_of_legacy_name(node_name: str) -> str | None:
    """'/layer1/layer1.0/conv1/Conv' -> 'layer1.0.conv1' (the legacy exporter's scopes)."""
    parts = [p for p in node_name.split("/") if p]
    if len(parts) < 2:
        return None
    rel: list[str] = []
    for comp in parts[:-1]:
        if rel and comp.startswith(rel[-1] + "."):
            rel[-1] = comp
        else:
            rel.append(comp)
    return ".".join(rel)


def module_of_dynamo_node(node: onnx.NodeProto) -> str | None:
    """The innermost module scope the dynamo exporter recorded on a node."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                return None
            mods = [s for s in scopes[1:-1] if s]
            return mods[-1] if mods else None
    return None


def module_of(node: onnx.NodeProto) -> str | None:
    """The module a node was exported from, as either exporter records it."""
    return module_of_dynamo_node(node) or module_of_legacy_name(node.name)


def weight_modules(model: onnx.ModelProto) -> dict[str, str]:
    """Initializers the exporter named apart from their module (`val_10`, `onnx::MatMul_12`,
    often a transposed copy) -> the module whose node reads them, for reports."""
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, str] = {}
    for n in model.graph.node:
        module = module_of(n)
        if not module:
            continue
        for name in n.input:
            if name in inits and not name.startswith(module + ".") and name not in out:
                out[name] = module
    return out


def _is_fused_bn(node: onnx.NodeProto) -> bool:
    return any(
        p.key == "pkg.onnxscript.rewriter.rule_name" and "FuseBatchNorm" in p.value
        for p in node.metadata_props
    )


class Binder:
    def __init__(
        self,
        model: onnx.ModelProto,
        values: dict[str, np.ndarray] | None = None,
        base_dir: str | None = None,
    ):
        self.model = model
        self.base_dir = base_dir
        self.inits = {t.name: t for t in model.graph.initializer}
        self.shapes = {n: tuple(int(d) for d in t.dims) for n, t in self.inits.items()}
        self.values = values or {}
        self.aliases = {
            n.output[0]: n.input[0]
            for n in model.graph.node
            if n.op_type == "Identity" and n.input and n.input[0] in self.inits
        }
        self.scopes: dict[str, list[onnx.NodeProto]] = {}
        for n in model.graph.node:
            mod = module_of(n)
            if mod:
                self.scopes.setdefault(mod, []).append(n)
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(
                self.inits[name], base_dir=self.base_dir or ""
            )
        return self._arrays[name]

    # ------------------------------------------------------------------ strategies
    def by_scope(self, name: str, mask: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        module, _, param = name.rpartition(".")
        for node in self.scopes.get(module, []):
            if node.op_type not in WEIGHT_OPS and node.op_type != "Add":
                continue
            if node.op_type == "Conv" and _is_fused_bn(node):
                return None  # a BatchNorm parameter: bound in pairs by bind_batchnorm
            idx = {"weight": 0 if node.op_type == "Gather" else 1, "bias": 2}.get(param)
            if node.op_type == "Add" and param == "bias":
                idx = next((i for i, t in enumerate(node.input) if t in self.inits), None)
            if idx is None or idx >= len(node.input) or node.input[idx] not in self.inits:
                continue
            target = node.input[idx]
            fitted = self.fit(mask, self.shapes[target])
            if fitted is not None:
                return [(target, fitted)]
        return None

    def bind_batchnorm(
        self, module: str, masks: dict[str, np.ndarray]
    ) -> list[tuple[str, np.ndarray]] | str | None:
        """Masks on a BatchNorm folded into the conv before it: a channel whose scale and shift
        are both masked is zero, i.e. the fused conv's filter and bias are zero there."""
        w, b = masks.get(f"{module}.weight"), masks.get(f"{module}.bias")
        conv = next(
            (n for n in self.scopes.get(module, []) if n.op_type == "Conv" and _is_fused_bn(n)),
            None,
        )
        if conv is None:
            conv = self.fused_conv_by_value(module)
        if conv is None:
            return None
        if w is None or b is None or not np.array_equal(w.reshape(-1) != 0, b.reshape(-1) != 0):
            return (
                "the BatchNorm is folded into the conv before it: mask its weight and bias "
                "together (a channel is removable when both are zero), or export with optimize=False"
            )
        keep = w.reshape(-1) != 0
        out = []
        wname = conv.input[1]
        out.append(
            (
                wname,
                np.broadcast_to(
                    keep.reshape((-1,) + (1,) * (len(self.shapes[wname]) - 1)), self.shapes[wname]
                ),
            )
        )
        if len(conv.input) > 2 and conv.input[2] in self.inits:
            out.append((conv.input[2], keep.astype(np.uint8)))
        return out

    def fused_conv_by_value(self, module: str) -> onnx.NodeProto | None:
        """With the original weights: the conv whose weights are some conv's scaled per channel
        by this BatchNorm's gamma / sqrt(var + eps)."""
        g, v = self.values.get(f"{module}.weight"), self.values.get(f"{module}.running_var")
        if g is None or v is None:
            return None
        scale = g.astype(np.float64) / np.sqrt(v.astype(np.float64) + BN_EPS)
        for n in self.model.graph.node:
            if n.op_type != "Conv" or len(n.input) < 2 or n.input[1] not in self.inits:
                continue
            fused = self.array(n.input[1])
            if fused.shape[0] != scale.shape[0]:
                continue
            for orig in self.values.values():
                if orig.shape == fused.shape and np.allclose(
                    orig * scale.reshape((-1,) + (1,) * (orig.ndim - 1)),
                    fused,
                    rtol=1e-4,
                    atol=1e-6,
                ):
                    return n
        return None

    def by_value(self, name: str, mask: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        orig = self.values.get(name)
        if orig is None:
            return None
        for target, shape in self.shapes.items():
            if shape == orig.shape and np.issubdtype(orig.dtype, np.floating):
                arr = self.array(target)
                if np.array_equal(arr, orig) or _row_proportional(arr, orig):
                    fitted = self.fit(mask, shape)
                    if fitted is not None:
                        return [(target, fitted)]
            if (
                orig.ndim == 2
                and shape == orig.T.shape
                and np.array_equal(self.array(target), orig.T)
            ):
                return [(target, np.ascontiguousarray(np.broadcast_to(mask, orig.shape).T))]
        return None

    @staticmethod
    def fit(mask: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
        """The mask laid on an initializer of `shape`: same shape, transposed (a Linear weight
        stored as MatMul's [in, out]), or one flag per output channel."""
        if mask.shape == shape:
            return mask
        if mask.ndim == 2 and mask.T.shape == shape:
            return np.ascontiguousarray(mask.T)
        if mask.ndim == 1 and shape and mask.shape[0] == shape[0]:
            return np.broadcast_to(mask.reshape((-1,) + (1,) * (len(shape) - 1)), shape)
        return None

    # ------------------------------------------------------------------ all together
    def bind(self, maskset: MaskSet, source: str = "masks") -> BoundMasks:
        bound = BoundMasks()
        masks = maskset.masks

        def add(mask_name: str, targets: list[tuple[str, np.ndarray]], how: str) -> None:
            for target, m in targets:
                m = np.asarray(m).astype(np.uint8)
                bound.masks[target] = bound.masks[target] * m if target in bound.masks else m
            bound.how[mask_name] = how

        done: set[str] = set()
        for name, mask in masks.items():
            mask = np.asarray(mask)
            check_binary(name, mask, source)
            if name in done:
                continue
            target = name if name in self.inits else self.aliases.get(name)
            if target is not None:
                fitted = self.fit(mask, self.shapes[target])
                if fitted is None:
                    raise ShrinkError(
                        f"{source}: mask '{name}' has shape {list(mask.shape)} but initializer "
                        f"'{target}' has shape {list(self.shapes[target])}. Give a mask of the "
                        "weight's shape, or one flag per output channel."
                    )
                add(name, [(target, fitted)], "name" if target == name else "alias")
                continue
            module, _, param = name.rpartition(".")
            if param in ("weight", "bias"):
                bn = self.bind_batchnorm(module, masks)
                if isinstance(bn, list):
                    add(f"{module}.weight", bn, "folded BatchNorm")
                    bound.how[f"{module}.bias"] = "folded BatchNorm"
                    done |= {f"{module}.weight", f"{module}.bias"}
                    continue
                if isinstance(bn, str):
                    if mask.all():
                        bound.how[name] = "nothing masked"
                    else:
                        bound.unbound.append(name)
                        bound.hints[name] = bn
                    continue
            found = self.by_scope(name, mask)
            how = "scope"
            if not found:
                found, how = self.by_value(name, mask), "value"
            if found:
                add(name, found, how)
            elif mask.all() and maskset.format == "state-dict":
                bound.how[name] = "nothing masked"  # e.g. BN statistics of a masked state dict
            elif name in maskset.optional:
                continue  # e.g. the bias of a layer that has none
            else:
                bound.unbound.append(name)
                bound.hints[name] = self.hint(name)
        return bound

    GENERIC = (
        "no initializer, node scope or value matches it (if the exporter folded or renamed it, "
        "e.g. a BatchNorm with the legacy exporter, pass the original weights with --weights)"
    )

    def hint(self, name: str) -> str:
        module = name.rpartition(".")[0]
        if module in self.scopes:
            return (
                "its module is in the graph but its weight was renamed or transformed by the "
                "exporter; pass the original weights (--weights state_dict.pt) to match it by value"
            )
        return self.GENERIC


def _row_proportional(a: np.ndarray, b: np.ndarray) -> bool:
    """a[o] == s[o] * b[o] for some per-output-channel s (a folded BatchNorm)."""
    if a.ndim < 2:
        return False
    a2, b2 = (
        a.reshape(a.shape[0], -1).astype(np.float64),
        b.reshape(b.shape[0], -1).astype(np.float64),
    )
    if not np.array_equal(a2 == 0, b2 == 0):
        return False
    with np.errstate(all="ignore"):
        ratio = np.where(b2 != 0, a2 / b2, np.nan)
    lo, hi = np.nanmin(ratio, axis=1, initial=np.inf), np.nanmax(ratio, axis=1, initial=-np.inf)
    rows = np.isfinite(lo)
    return bool(rows.any()) and bool(np.allclose(lo[rows], hi[rows], rtol=1e-5, atol=0))


def bind_masks(
    model: onnx.ModelProto,
    maskset: MaskSet | dict[str, np.ndarray],
    source: str = "masks",
    allow_unbound: bool = False,
    values: dict[str, np.ndarray] | None = None,
    base_dir: str | None = None,
) -> BoundMasks:
    if not isinstance(maskset, MaskSet):
        maskset = MaskSet(masks=dict(maskset))
    binder = Binder(model, {**maskset.values, **(values or {})}, base_dir)
    bound = binder.bind(maskset, source)
    if bound.unbound and not allow_unbound:
        names = ", ".join(f"'{n}'" for n in bound.unbound[:10])
        more = f" and {len(bound.unbound) - 10} more" if len(bound.unbound) > 10 else ""
        specific = sorted({bound.hints[n] for n in bound.unbound[:10] if n in bound.hints})
        sample = ", ".join(f"'{n}'" for n in list(binder.shapes)[:6])
        raise ShrinkError(
            f"{source}: {len(bound.unbound)} mask(s) match no initializer of the model: {names}{more}. "
            + "".join(h[0].upper() + h[1:] + ". " for h in specific)
            + f"Mask names must be initializer names or the framework's parameter names (for "
            f"torch.onnx.export, the state_dict names); the model has e.g. {sample}. Pass "
            "--allow-unbound to go on without them."
        )
    return bound


def apply_masks(
    model: onnx.ModelProto, bound: BoundMasks, base_dir: str | None = None
) -> onnx.ModelProto:
    """The reference model: every masked initializer multiplied by its mask (external weights
    are read from `base_dir`; the masked ones are then held in the model)."""
    if not bound.masks:
        return model
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    for t in ref.graph.initializer:
        mask = bound.masks.get(t.name)
        if mask is None:
            continue
        values = numpy_helper.to_array(t, base_dir=base_dir or "")
        masked = np.where(mask != 0, values, np.zeros((), values.dtype)).astype(values.dtype)
        t.CopyFrom(numpy_helper.from_array(masked, t.name))
    return ref

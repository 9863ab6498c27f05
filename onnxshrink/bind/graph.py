"""What the graph says about an initializer: who reads it (sites), from which module, and how.

A *site* is one (node, input) that reads an initializer, directly or through Identity aliases.
Shape and Size readers are not sites: they read sizes, which masks do not change.

The *layout* of a site says which axis of the initializer is the output axis and which the
input axis of the op reading it (a MatMul's B is [.., in, out]; Gemm's B is [out, in] with
transB; a Conv weight is [out, in/group, ..]; a ConvTranspose weight [in, out/group, ..]),
following Transpose nodes between the initializer and the op. A framework parameter's own
layout is torch's: Linear weights are [out, in] (F.linear), conv weights as ONNX stores them.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

# Sizes only: a mask does not change what these read.
SIZE_READERS = ("Shape", "Size")


@dataclass(frozen=True)
class Site:
    node: int  # index in graph.node
    input: int


@dataclass(frozen=True)
class Layout:
    """Axes of an initializer as one site reads it."""

    out: int
    inp: int | None
    transposed: bool  # stored transposed relative to the framework parameter (torch layout)


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


def _metadata(node: onnx.NodeProto, key: str) -> str | None:
    for p in node.metadata_props:
        if p.key == key:
            return p.value
    return None


def module_of_dynamo_node(node: onnx.NodeProto) -> str | None:
    """The innermost module scope the dynamo exporter recorded on a node."""
    value = _metadata(node, "pkg.torch.onnx.name_scopes")
    if value is None:
        return None
    try:
        scopes = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    mods = [s for s in scopes[1:-1] if s]
    return mods[-1] if mods else None


def module_of(node: onnx.NodeProto) -> str | None:
    """The module a node was exported from, as either exporter records it."""
    return module_of_dynamo_node(node) or module_of_legacy_name(node.name)


def is_fused_batchnorm(node: onnx.NodeProto) -> bool:
    """A Conv the dynamo exporter's optimizer made by folding a BatchNorm into it."""
    rule = _metadata(node, "pkg.onnxscript.rewriter.rule_name")
    return rule is not None and "FuseBatchNorm" in rule


def inside(module: str | None, scope: str) -> bool:
    """Is a node of `module` part of `scope` (the module itself or a submodule)?"""
    return module is not None and (module == scope or module.startswith(scope + "."))


class ModelIndex:
    """Read-only facts about a model's initializers and their readers."""

    def __init__(self, model: onnx.ModelProto, base_dir: str | None = None):
        self.model = model
        self.nodes = list(model.graph.node)
        self.base_dir = base_dir or ""
        self.inits = {t.name: t for t in model.graph.initializer}
        self.shapes = {n: tuple(int(d) for d in t.dims) for n, t in self.inits.items()}
        # Identity outputs that stand for an initializer (older exporters read weights so).
        self.aliases: dict[str, str] = {}
        for n in self.nodes:
            if n.op_type == "Identity" and n.input:
                src = self.aliases.get(n.input[0], n.input[0])
                if src in self.inits:
                    self.aliases[n.output[0]] = src
        self.consumers: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.sites: dict[str, list[Site]] = defaultdict(list)
        for k, n in enumerate(self.nodes):
            for i, name in enumerate(n.input):
                self.consumers[name].append((k, i))
                if n.op_type in SIZE_READERS or (
                    n.op_type == "Identity" and n.output[0] in self.aliases
                ):
                    continue  # sizes only, or an alias: its readers are the sites
                init = self.aliases.get(name, name)
                if init in self.inits:
                    self.sites[init].append(Site(k, i))
        self.modules = [module_of(n) for n in self.nodes]
        self.scopes: dict[str, list[int]] = defaultdict(list)
        for k, m in enumerate(self.modules):
            if m:
                self.scopes[m].append(k)
        self._arrays: dict[str, np.ndarray] = {}

    def resolve(self, name: str) -> str | None:
        """The initializer a tensor name stands for (itself or through Identity aliases)."""
        name = self.aliases.get(name, name)
        return name if name in self.inits else None

    def array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.inits[name], base_dir=self.base_dir)
        return self._arrays[name]

    def node(self, site: Site) -> onnx.NodeProto:
        return self.nodes[site.node]

    def module(self, site: Site) -> str | None:
        return self.modules[site.node]

    # ------------------------------------------------------------------ layouts
    def layout(self, site: Site) -> Layout | None:
        """How `site` reads its initializer; None when the op gives its axes no roles."""
        init = self.resolve(self.node(site).input[site.input])
        if init is None:
            return None
        rank = len(self.shapes[init])
        axes = self._axes(site.node, site.input, rank, depth=0)
        if axes is None:
            return None
        out, inp, family = axes
        # torch stores a Linear weight [out, in]: read the other way, it is a transposed copy.
        # Conv, ConvTranspose, embedding and per-channel vectors are stored as torch has them.
        return Layout(out, inp, family == "linear" and inp is not None and out > inp)

    def _axes(self, k: int, i: int, rank: int, depth: int) -> tuple[int, int | None, str] | None:
        """(output axis, input axis, op family) of input i of node k, in that input's axes."""
        n = self.nodes[k]
        op = n.op_type
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if op in ("Identity", "Cast", "Transpose") and i == 0 and depth < 8:
            perm = list(attrs.get("perm", range(rank)[::-1])) if op == "Transpose" else None
            found = set()
            for ck, ci in self.consumers.get(n.output[0], []):
                if self.nodes[ck].op_type in SIZE_READERS:
                    continue
                got = self._axes(ck, ci, rank, depth + 1)
                if got is None:
                    return None
                o, p, fam = got
                if perm is not None:
                    o, p = perm[o], (perm[p] if p is not None else None)
                found.add((o, p, fam))
            return found.pop() if len(found) == 1 else None
        if rank == 1 and op in PER_CHANNEL_READERS:
            return 0, None, "vector"
        if op == "Conv" and i == 1:
            return 0, 1, "conv"
        if op == "ConvTranspose" and i == 1:
            return 1, 0, "conv"
        if op == "Gemm" and i in (0, 1) and rank == 2:
            if i == 1:
                return (0, 1, "linear") if attrs.get("transB", 0) else (1, 0, "linear")
            return (1, 0, "linear") if attrs.get("transA", 0) else (0, 1, "linear")
        if op == "MatMul" and i in (0, 1) and rank >= 2:
            return (rank - 1, rank - 2, "linear") if i == 1 else (rank - 2, rank - 1, "linear")
        if op == "Gather" and i == 0 and rank == 2 and int(attrs.get("axis", 0)) == 0:
            return 1, 0, "embedding"  # rows are looked up; each row's features are the output
        return None


# Ops that read a 1-D initializer as one value per channel (biases, norm scales and shifts).
PER_CHANNEL_READERS = (
    "Conv",
    "ConvTranspose",
    "Gemm",
    "Add",
    "Mul",
    "BatchNormalization",
    "InstanceNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "RMSNormalization",
    "PRelu",
)

# Where a framework parameter sits among the inputs of the ops that read it.
PARAM_INPUTS: dict[str, dict[str, int]] = {
    "Conv": {"weight": 1, "bias": 2},
    "ConvTranspose": {"weight": 1, "bias": 2},
    "Gemm": {"weight": 1, "bias": 2},
    "MatMul": {"weight": 1},
    "Gather": {"weight": 0},
    "BatchNormalization": {"weight": 1, "bias": 2, "running_mean": 3, "running_var": 4},
    "InstanceNormalization": {"weight": 1, "bias": 2},
    "LayerNormalization": {"weight": 1, "bias": 2},
    "GroupNormalization": {"weight": 1, "bias": 2},
    "RMSNormalization": {"weight": 1},
    "PRelu": {"weight": 1},
}
# Elementwise ops a module computes its own parameter with (F.linear's bias Add after a MatMul,
# an RMSNorm's scale Mul): the parameter is their one initializer operand.
ELEMENTWISE_PARAM = {"Add": "bias", "Mul": "weight"}

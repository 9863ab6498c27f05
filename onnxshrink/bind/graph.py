"""What the graph says about an initializer: who reads it (sites), from which module, and how.

A *site* is one (node, input) that reads an initializer, directly or through Identity aliases.
Shape and Size readers are not sites: they read sizes, which masks do not change.

The *layout* of a site says which axis of the initializer is the output axis and which the
input axis of the op reading it (each op's handler says: a MatMul's B is [.., in, out]; Gemm's
B is [out, in] with transB; a Conv weight is [out, in/group, ..]), following Transpose nodes
between the initializer and the op. A framework parameter's own layout is torch's: Linear
weights are [out, in] (F.linear), conv weights as ONNX stores them.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from onnxshrink.core.handler import Handler, OpNode, WeightAxes
from onnxshrink.io.weights import WeightStore
from onnxshrink.ir import all_graphs
from onnxshrink.ops import facts
from onnxshrink.quantized import Moved, Readers, readings, same_zero


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
    """A node the dynamo exporter's optimizer made by folding a BatchNorm into a Conv."""
    rule = _metadata(node, "pkg.onnxscript.rewriter.rule_name")
    return rule is not None and "FuseBatchNorm" in rule


_CALL = re.compile(r"^(.+)_(\d+)$")


def framework_modules(modules: list[str | None], names: Iterable[str]) -> list[str | None]:
    """The framework's path of each node's module, read against the parameter names the model
    records (`names`: torch's exporters keep a parameter's state_dict name where they read it as
    it is). Two things the legacy exporter's scopes say differently: a module called again is
    scoped `cell_1`, `cell_2`, ... (one module, one parameter: `cell`), and the root module's own
    attribute on the way to a submodule (a wrapper's `m.`) is not in the scope. Each is read as
    the framework's only where the recorded names say so: `cell_1` is `cell` when the model
    records parameters under `cell` and none under `cell_1`; a scope whose first part the model
    records under exactly one prefix (`m.combine.bias` for scope `combine`) takes that prefix.
    Elsewhere the scope stays as it is."""
    owners = _owners(names)
    under = _under(owners)
    prefix = {first: _prefix(first, owners, under) for first in {m.split(".")[0] for m in modules if m}}
    out: list[str | None] = []
    for m in modules:
        if not m:
            out.append(m)
            continue
        path = prefix[m.split(".")[0]].rstrip(".")
        for part in m.split("."):
            at = f"{path}.{part}" if path else part
            call = _CALL.match(part)
            base = (f"{path}.{call.group(1)}" if path else call.group(1)) if call else at
            path = base if at not in owners and base in owners else at
        out.append(path)
    return out


def _under(owners: set[str]) -> dict[str, set[str]]:
    """Each owner's last part -> the paths it is recorded under (`a.b.c`: `c` -> `a.b.`), for
    owners below the top level: what `_prefix` asks of every scope's first part, looked up
    rather than searched (each search a pass over every owner: 1.8 s of SmolLM-135M's groups
    phase under cProfile, 1824 first parts)."""
    out: dict[str, set[str]] = defaultdict(set)
    for o in owners:
        _, dot, last = o.rpartition(".")
        if dot:
            out[last].add(o[: -len(last)])  # (as the search sliced it, an empty last part too)
    return out


def _prefix(first: str, owners: set[str], under: Mapping[str, set[str]]) -> str:
    """The path the model records a scope's first part under, when it is not a top-level
    module of its own: the one recorded owner that ends in it (called again: in its base).
    `under`: `_under(owners)` (a part holds no dot: an owner ends in `.part` where its last
    part is `part`)."""
    call = _CALL.match(first)
    for part in (first, call.group(1)) if call else (first,):
        found = set(under.get(part, ()))
        if part in owners or len(found) > 1:
            return ""
        if found:
            return found.pop()
    return ""


def _owners(names: Iterable[str]) -> set[str]:
    """Every module path a recorded parameter name is under (`a.b.weight`: `a`, `a.b`); names
    the exporter made (`onnx::MatMul_12`, `/conv/Constant_output_0`) are none."""
    owners: set[str] = set()
    for name in names:
        parts = name.split(".")
        if "/" not in name and "::" not in name and len(parts) > 1:
            owners.update(".".join(parts[:k]) for k in range(1, len(parts)))
    return owners


def inside(module: str | None, scope: str) -> bool:
    """Is a node of `module` part of `scope` (the module itself or a submodule)?"""
    return module is not None and (module == scope or module.startswith(scope + "."))


class ModelIndex:
    """Read-only facts about a model's initializers and their readers (each op's handler says
    what its inputs are)."""

    def __init__(self, model: onnx.ModelProto, base_dir: str | None = None):
        from onnxshrink.prepare import default_opset

        self.model = model
        self._zeros: dict[str, np.ndarray | None] = {}  # zero_of, by initializer
        self._readers: _ModelReaders | None = None
        graphs = list(all_graphs(model.graph))  # weights read or held in If/Loop/Scan bodies too
        self.nodes = [n for g in graphs for n in g.node]
        self.opset = default_opset(model)
        self.facts = [facts(n, self.opset) for n in self.nodes]
        self.base_dir = base_dir or ""
        self.inits = {t.name: t for g in graphs for t in g.initializer}
        # Weights held by Constant nodes (paddle2onnx, spox and converters write them so) are
        # weights too, named by their output: graph node index of each
        self.constant_nodes: dict[str, int] = {}
        outputs = {o.name for g in graphs for o in g.output}  # a constant output stays as it is
        for k, (n, (h, op)) in enumerate(zip(self.nodes, self.facts, strict=True)):
            alone = h is not None and not n.input and len(n.output) == 1 and n.output[0] not in outputs
            held = h.constant_tensor(op, n.output[0]) if alone else None  # type: ignore[union-attr]
            if held is not None and n.output[0] not in self.inits:
                self.inits[n.output[0]] = held
                self.constant_nodes[n.output[0]] = k
        self.shapes = {n: tuple(int(d) for d in t.dims) for n, t in self.inits.items()}
        # Identity outputs that stand for an initializer (older exporters read weights so).
        self.aliases: dict[str, str] = {}
        for n, (h, _) in zip(self.nodes, self.facts, strict=True):
            if h is not None and h.is_alias and n.input:
                src = self.aliases.get(n.input[0], n.input[0])
                if src in self.inits:
                    self.aliases[n.output[0]] = src
        self.consumers: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.sites: dict[str, list[Site]] = defaultdict(list)
        for k, (n, (h, _)) in enumerate(zip(self.nodes, self.facts, strict=True)):
            sizes = h.sizes_only if h is not None else ()
            alias = h is not None and h.is_alias and n.output[0] in self.aliases
            for i, name in enumerate(n.input):
                self.consumers[name].append((k, i))
                if i in sizes or alias:
                    continue  # sizes only, or an alias: its readers are the sites
                init = self.aliases.get(name, name)
                if init in self.inits:
                    self.sites[init].append(Site(k, i))
        self.modules = [module_of(n) for n in self.nodes]
        # the modules as the framework names them (see `framework_modules`)
        self.framework = framework_modules(self.modules, self.inits)
        self.scopes: dict[str, list[int]] = defaultdict(list)
        for k, (m, f) in enumerate(zip(self.modules, self.framework, strict=True)):
            if m:
                self.scopes[m].append(k)
            if f and f != m:
                self.scopes[f].append(k)  # a module's parameter binds at every call of it
        self._arrays: dict[str, np.ndarray] = {}
        self._store: WeightStore | None = None

    def weight_names(self) -> list[str]:
        """Initializers and Constant-node weights, float ones (weights rather than shape
        arithmetic) first, for messages that name some."""
        from onnxshrink.prepare import FLOAT_TYPES

        return sorted(self.inits, key=lambda n: self.inits[n].data_type not in FLOAT_TYPES)

    def resolve(self, name: str) -> str | None:
        """The initializer a tensor name stands for (itself or through Identity aliases)."""
        name = self.aliases.get(name, name)
        return name if name in self.inits else None

    def array(self, name: str) -> np.ndarray:
        """The initializer's values (read-only and mapped, when stored as external data)."""
        if name not in self._arrays:
            t = self.inits[name]
            if t.data_location == onnx.TensorProto.EXTERNAL:
                self._store = self._store or WeightStore()
                self._arrays[name] = self._store.array(t, self.base_dir or ".")
            else:
                self._arrays[name] = numpy_helper.to_array(t)
        return self._arrays[name]

    def node(self, site: Site) -> onnx.NodeProto:
        return self.nodes[site.node]

    def module(self, site: Site) -> str | None:
        """The framework module whose parameter the site reads (every call of a module is it)."""
        return self.framework[site.node]

    def constant_inputs(self, k: int) -> list[bool]:
        return [self.resolve(x) is not None for x in self.nodes[k].input]

    def param_slot(self, k: int, param: str) -> int | None:
        """The input of node k that holds framework parameter `param` (e.g. "bias"), if any."""
        handler, op = self.facts[k]
        if handler is None:
            return None
        return handler.param_inputs(op, self.constant_inputs(k)).get(param)

    # ------------------------------------------------------------------ quantized weights
    def zero_of(self, name: str) -> np.ndarray | None:
        """What "zero" is for initializer `name`: its zero point (broadcast against it: per
        tensor, channel or block, as the ops that read it say) when it is an integer constant
        its readers dequantize, else None (0). A mask on it removes its dequantized values
        (`quantized`). Readers that disagree on the zero point, or some that dequantize it and
        some that do not, leave no one meaning: a ShrinkError naming it."""
        from onnxshrink.errors import ShrinkError
        from onnxshrink.prepare import FLOAT_TYPES

        if name in self._zeros:  # (each binding of a weight asks again)
            return self._zeros[name]
        if name not in self.inits or self.inits[name].data_type in FLOAT_TYPES:
            return None
        sites = [(s.node, s.input) for s in self.sites.get(name, [])]
        got = readings(self.readers, sites, self.shapes[name], set())
        found = got.found
        plain = [self.nodes[k].name or self.nodes[k].op_type for k in got.plain]
        if not found:
            self._zeros[name] = None
            return None
        if plain or not same_zero(found):
            why = f"{', '.join(plain[:3])} read(s) it as plain integers" if plain else "its readers' zero points differ"
            raise ShrinkError(
                f"initializer '{name}' is a quantized weight but {why}: a mask on it has no one "
                "meaning (its elements at the zero point). Mask the layers that read it apart, or "
                "leave it out of the masks."
            )
        self._zeros[name] = found[0].fill()
        return self._zeros[name]

    @property
    def readers(self) -> Readers[int]:
        """The model's nodes, by index, as `quantized.dequant_reads` walks them."""
        if self._readers is None:
            self._readers = _ModelReaders(self)
        return self._readers

    # ------------------------------------------------------------------ layouts
    def axes(self, site: Site) -> WeightAxes | None:
        """The roles of the initializer's axes as `site` reads it; None when the op gives none."""
        init = self.resolve(self.node(site).input[site.input])
        if init is None:
            return None
        return self._axes(site.node, site.input, len(self.shapes[init]), depth=0)

    def layout(self, site: Site) -> Layout | None:
        """How `site` reads its initializer; None when the op gives its axes no roles."""
        axes = self.axes(site)
        if axes is None:
            return None
        # torch stores a Linear weight [out, in]: read the other way, it is a transposed copy.
        # Conv, ConvTranspose, embedding and per-channel vectors are stored as torch has them.
        return Layout(axes.out, axes.inp, axes.family == "linear" and axes.inp is not None and axes.out > axes.inp)

    def _axes(self, k: int, i: int, rank: int, depth: int) -> WeightAxes | None:
        """How input i of node k is read, in that input's own axes: by the op itself, or by the
        ops after a chain of axis permutations (Identity, Cast, Transpose)."""
        handler, op = self.facts[k]
        if handler is None:
            return None
        perm = handler.passes_axes(op, i, rank) if depth < 8 else None
        if perm is None:
            return handler.weight_axes(op, i, rank)
        found = set()
        for ck, ci in self.consumers.get(self.nodes[k].output[0], []):
            h, _ = self.facts[ck]
            if h is not None and ci in h.sizes_only:
                continue
            got = self._axes(ck, ci, rank, depth + 1)
            if got is None:
                return None
            found.add(WeightAxes(perm[got.out], perm[got.inp] if got.inp is not None else None, got.family))
        return found.pop() if len(found) == 1 else None


class _ProtoInputs:
    """A NodeProto's inputs, as `quantized.dequant_of` reads them (constants: initializers,
    Constant-node weights and their Identity aliases)."""

    def __init__(self, index: ModelIndex, node: onnx.NodeProto):
        self.index, self.node = index, node

    def given(self, slot: int) -> bool:
        return slot < len(self.node.input) and self.node.input[slot] != ""

    def constant(self, slot: int) -> tuple[str, np.ndarray] | None:
        name = self.index.resolve(self.node.input[slot]) if self.given(slot) else None
        return (name, np.asarray(self.index.array(name))) if name is not None else None


class _ModelReaders:
    """A model's nodes (by index in `ModelIndex.nodes`), as `quantized.dequant_reads` walks
    them. Element types are the ones the model records (initializers, value_info, a graph's
    inputs and outputs); the scale a graph applies after an integer op is not read (a mask
    needs only the zero point)."""

    def __init__(self, index: ModelIndex):
        self.index = index
        graphs = list(all_graphs(index.model.graph))
        self.outputs = {o.name for g in graphs for o in g.output}
        self.types = {
            v.name: v.type.tensor_type.elem_type for g in graphs for v in [*g.input, *g.value_info, *g.output]
        }
        self.types |= {name: t.data_type for name, t in index.inits.items()}

    def facts(self, node: int) -> tuple[Handler | None, OpNode]:
        return self.index.facts[node]

    def inputs(self, node: int) -> _ProtoInputs:
        return _ProtoInputs(self.index, self.index.nodes[node])

    def applied_scale(self, node: int, i: int) -> np.ndarray | None:
        return None

    def moved(self, node: int, i: int) -> Moved[int] | None:
        proto = self.index.nodes[node]
        if len(proto.output) != 1 or proto.output[0] in self.outputs:
            return None  # (a graph output: the graph gives the integers out as they are)
        x, y = self.types.get(proto.input[i]), self.types.get(proto.output[0])
        if x and y and x != y:
            return None
        return Moved(self.index.consumers.get(proto.output[0], []), None)

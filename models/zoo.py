"""Small CNNs for tests and benchmarks, with named channel groups.

Every model is built from a `widths` dict: {group name: channel count}. A group is a set of
channels that must be removed together (a conv's filters with its BatchNorm; the residual
stream of a stage; a DenseNet layer's growth channels together with the BatchNorms that read
them). `whole_group_masks` zeroes a random part of every group, and building the same class
with the kept counts gives the natively smaller model those masks describe.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

# (parameter name, axis, the indices along that axis that channel i of the group owns)
Member = tuple[str, int, Callable[[int], np.ndarray]]


class Grouped(nn.Module):
    """A module that records which parameter slices belong to which channel group."""

    def __init__(self, widths: dict[str, int], defaults: dict[str, int]):
        super().__init__()
        unknown = set(widths) - set(defaults)
        if unknown:
            raise KeyError(f"unknown groups {sorted(unknown)}")
        self.widths = {**defaults, **widths}
        self.divisible: dict[
            str, int
        ] = {}  # group -> number of conv groups it must stay divisible by
        self._members: list[tuple[str, nn.Module, str, int, Callable[[int], np.ndarray]]] = []

    def w(self, group: str) -> int:
        return self.widths[group]

    def produce(self, group: str, module: nn.Module, offset: int = 0, block: int = 1) -> None:
        """`module`'s output channels (weight rows, bias; BN scale and shift) belong to `group`:
        channel i owns `block` of them from offset + i * block (a head owns head_dim rows)."""
        for param in ("weight", "bias"):
            if getattr(module, param, None) is not None:
                self.claim(
                    group,
                    module,
                    param,
                    0,
                    lambda i, o=offset, b=block: np.arange(o + i * b, o + (i + 1) * b),
                )

    def claim(
        self,
        group: str,
        module: nn.Module,
        param: str,
        axis: int,
        indices: Callable[[int], np.ndarray],
    ) -> None:
        """Channel i of `group` owns `indices(i)` along `axis` of `module.param`."""
        self._members.append((group, module, param, axis, indices))

    def group_members(self) -> dict[str, list[Member]]:
        names = {id(m): n for n, m in self.named_modules()}
        out: dict[str, list[Member]] = defaultdict(list)
        for group, module, param, axis, indices in self._members:
            prefix = names[id(module)]
            out[group].append((f"{prefix}.{param}" if prefix else param, axis, indices))
        return dict(out)


def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)
    )


# ------------------------------------------------------------------ ResNet family
class BasicBlock(nn.Module):
    def __init__(self, owner: Grouped, cin: int, mid: str, out: str, stride: int, se: str | None):
        super().__init__()
        self.c1 = conv_bn(cin, owner.w(mid), 3, stride)
        self.c2 = conv_bn(owner.w(mid), owner.w(out), 3)
        self.se = SqueezeExcite(owner, owner.w(out), se) if se else None
        self.down = (
            conv_bn(cin, owner.w(out), 1, stride) if stride != 1 or cin != owner.w(out) else None
        )
        owner.produce(mid, self.c1[0])
        owner.produce(mid, self.c1[1])
        owner.produce(out, self.c2[0])
        owner.produce(out, self.c2[1])
        if self.down is not None:
            owner.produce(out, self.down[0])
            owner.produce(out, self.down[1])

    def forward(self, x):
        y = self.c2(torch.relu(self.c1(x)))
        if self.se is not None:
            y = self.se(y)
        return torch.relu(y + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    def __init__(
        self, owner: Grouped, cin: int, mid: str, out: str, stride: int, se: str | None, groups: int
    ):
        super().__init__()
        a, b = f"{mid}a", f"{mid}b"
        self.c1 = conv_bn(cin, owner.w(a), 1)
        self.c2 = conv_bn(owner.w(a), owner.w(b), 3, stride, groups=groups)
        self.c3 = conv_bn(owner.w(b), owner.w(out), 1)
        self.se = SqueezeExcite(owner, owner.w(out), se) if se else None
        self.down = (
            conv_bn(cin, owner.w(out), 1, stride) if stride != 1 or cin != owner.w(out) else None
        )
        if groups > 1:
            owner.divisible[a] = owner.divisible[b] = groups
        for g, m in ((a, self.c1), (b, self.c2), (out, self.c3)):
            owner.produce(g, m[0])
            owner.produce(g, m[1])
        if self.down is not None:
            owner.produce(out, self.down[0])
            owner.produce(out, self.down[1])

    def forward(self, x):
        y = self.c3(torch.relu(self.c2(torch.relu(self.c1(x)))))
        if self.se is not None:
            y = self.se(y)
        return torch.relu(y + (x if self.down is None else self.down(x)))


class SqueezeExcite(nn.Module):
    """GlobalAveragePool -> FC -> ReLU -> FC -> Sigmoid -> Mul."""

    def __init__(self, owner: Grouped, channels: int, group: str):
        super().__init__()
        self.fc1 = nn.Linear(channels, owner.w(group))
        self.fc2 = nn.Linear(owner.w(group), channels)
        owner.produce(group, self.fc1)

    def forward(self, x):
        s = torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3))))))
        return x * s[:, :, None, None]


class ResNet(Grouped):
    """ResNet / ResNeXt / SE-ResNet: `layers` blocks per stage; stage k's stream is group s{k}."""

    def __init__(
        self,
        widths: dict[str, int] | None = None,
        *,
        block: str = "basic",
        layers: tuple[int, ...] = (2, 1, 1),
        base: int = 8,
        expansion: int | None = None,
        groups: int = 1,
        group_width: int | None = None,
        se: bool = False,
        num_classes: int = 10,
        stem_stride: int = 1,
    ):
        expansion = expansion if expansion is not None else (1 if block == "basic" else 4)
        defaults: dict[str, int] = {"stem": base}
        plan = []
        prev = "stem"
        for k, n in enumerate(layers):
            width = base * 2**k
            stream = f"s{k}"
            out_c = width * expansion
            first_has_down = k > 0 or base != out_c
            if not first_has_down:
                stream = prev  # no projection: the stage adds onto the stem's channels
            defaults.setdefault(stream, out_c)
            for i in range(n):
                mid = f"l{k}.{i}."
                if block == "basic":
                    defaults[mid + "m"] = width
                else:
                    inner = group_width * groups if group_width else width
                    defaults[mid + "a"] = defaults[mid + "b"] = inner
                if se:
                    defaults[mid + "se"] = max(out_c // 4, 2)
                plan.append((k, i, mid, stream))
            prev = stream
        super().__init__(widths or {}, defaults)
        self.stem = conv_bn(3, self.w("stem"), 3, stem_stride)
        self.produce("stem", self.stem[0])
        self.produce("stem", self.stem[1])
        self.pool = nn.MaxPool2d(3, 2, 1) if stem_stride > 1 else nn.Identity()
        blocks = []
        cin = self.w("stem")
        for k, i, mid, stream in plan:
            stride = 2 if (k > 0 and i == 0) else 1
            sek = mid + "se" if se else None
            if block == "basic":
                blocks.append(BasicBlock(self, cin, mid + "m", stream, stride, sek))
            else:
                blocks.append(Bottleneck(self, cin, mid, stream, stride, sek, groups))
            cin = self.w(stream)
        self.blocks_ = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        y = self.blocks_(self.pool(torch.relu(self.stem(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


# ------------------------------------------------------------------ MobileNetV2
class InvertedResidual(nn.Module):
    def __init__(
        self, owner: Grouped, cin: int, cin_group: str, hidden: str | None, out: str, stride: int
    ):
        super().__init__()
        h = owner.w(hidden) if hidden else cin
        self.expand = conv_bn(cin, h, 1) if hidden else None
        self.dw = conv_bn(h, h, 3, stride, groups=h)
        self.project = conv_bn(h, owner.w(out), 1)
        self.residual = stride == 1 and cin == owner.w(out) and out == cin_group
        hg = hidden or cin_group
        if hidden:
            owner.produce(hg, self.expand[0])
            owner.produce(hg, self.expand[1])
        owner.produce(hg, self.dw[0])
        owner.produce(hg, self.dw[1])
        owner.produce(out, self.project[0])
        owner.produce(out, self.project[1])

    def forward(self, x):
        y = x if self.expand is None else nn.functional.relu6(self.expand(x))
        y = self.project(nn.functional.relu6(self.dw(y)))
        return x + y if self.residual else y


class MobileNetV2(Grouped):
    CFG = (
        (1, 8, 1, 1),
        (4, 12, 2, 2),
        (4, 16, 2, 2),
        (4, 24, 1, 1),
    )  # (expand, out, repeats, stride)

    def __init__(self, widths: dict[str, int] | None = None, num_classes: int = 10):
        defaults = {"stem": 8, "last": 64}
        plan, prev = [], "stem"
        cin = 8
        for r, (t, c, n, s) in enumerate(self.CFG):
            for i in range(n):
                hidden = f"h{r}.{i}" if t != 1 else None
                if hidden:
                    defaults[hidden] = cin * t
                out = prev if (i > 0) else f"c{r}"
                defaults.setdefault(out, c)
                plan.append((prev, hidden, out, s if i == 0 else 1))
                prev, cin = out, c
        super().__init__(widths or {}, defaults)
        self.stem = conv_bn(3, self.w("stem"), 3, 2)
        self.produce("stem", self.stem[0])
        self.produce("stem", self.stem[1])
        layers, cin = [], self.w("stem")
        for cin_group, hidden, out, stride in plan:
            layers.append(InvertedResidual(self, cin, cin_group, hidden, out, stride))
            cin = self.w(out)
        self.features = nn.Sequential(*layers)
        self.last = conv_bn(cin, self.w("last"), 1)
        self.produce("last", self.last[0])
        self.produce("last", self.last[1])
        self.fc = nn.Linear(self.w("last"), num_classes)

    def forward(self, x):
        y = nn.functional.relu6(self.stem(x))
        y = nn.functional.relu6(self.last(self.features(y)))
        return self.fc(y.mean((2, 3)))


# ------------------------------------------------------------------ DenseNet
class DenseNet(Grouped):
    """Pre-activation dense blocks: BN -> ReLU -> conv, outputs concatenated onto the input."""

    def __init__(
        self,
        widths: dict[str, int] | None = None,
        layers: tuple[int, ...] = (3, 3),
        growth: int = 6,
        num_classes: int = 10,
    ):
        defaults = {"stem": 12}
        for k, n in enumerate(layers):
            for j in range(n):
                defaults[f"d{k}.{j}"] = growth
            if k < len(layers) - 1:
                defaults[f"t{k}"] = 12
        super().__init__(widths or {}, defaults)
        self.stem = conv_bn(3, self.w("stem"), 3)
        self.produce("stem", self.stem[0])
        self.produce("stem", self.stem[1])
        parts: list[tuple[str, int]] = [("stem", self.w("stem"))]  # groups laid along the channels
        self.dense = nn.ModuleList()
        self.transitions = nn.ModuleList()
        for k, n in enumerate(layers):
            block = nn.ModuleList()
            for j in range(n):
                g = f"d{k}.{j}"
                cin = sum(w for _, w in parts)
                layer = nn.ModuleDict(
                    {
                        "bn": nn.BatchNorm2d(cin),
                        "conv": nn.Conv2d(cin, self.w(g), 3, 1, 1, bias=False),
                    }
                )
                self._reads(layer["bn"], parts)
                self.produce(g, layer["conv"])
                parts.append((g, self.w(g)))
                block.append(layer)
            self.dense.append(block)
            if k < len(layers) - 1:
                cin = sum(w for _, w in parts)
                t = nn.ModuleDict(
                    {
                        "bn": nn.BatchNorm2d(cin),
                        "conv": nn.Conv2d(cin, self.w(f"t{k}"), 1, bias=False),
                    }
                )
                self._reads(t["bn"], parts)
                self.produce(f"t{k}", t["conv"])
                self.transitions.append(t)
                parts = [(f"t{k}", self.w(f"t{k}"))]
        cin = sum(w for _, w in parts)
        self.final_bn = nn.BatchNorm2d(cin)
        self._reads(self.final_bn, parts)
        self.fc = nn.Linear(cin, num_classes)

    def _reads(self, bn: nn.BatchNorm2d, parts: list[tuple[str, int]]) -> None:
        off = 0
        for g, w in parts:
            self.produce(
                g, bn, offset=off
            )  # zeroing the BN too makes the removed channel exactly 0
            off += w

    def forward(self, x):
        y = torch.relu(self.stem(x))
        for k, block in enumerate(self.dense):
            for layer in block:
                y = torch.cat([y, layer["conv"](torch.relu(layer["bn"](y)))], 1)
            if k < len(self.transitions):
                t = self.transitions[k]
                y = nn.functional.avg_pool2d(t["conv"](torch.relu(t["bn"](y))), 2)
        y = torch.relu(self.final_bn(y))
        return self.fc(y.mean((2, 3)))


# ------------------------------------------------------------------ VGG
class VGG(Grouped):
    """Conv stages, then flatten into Linear layers (a removed channel drops H*W columns)."""

    CFG = (8, "M", 16, "M", 24, 24, "M")

    def __init__(self, widths: dict[str, int] | None = None, num_classes: int = 10, side: int = 32):
        defaults = {f"conv{i}": c for i, c in enumerate(c for c in self.CFG if c != "M")}
        defaults |= {"fc1": 32, "fc2": 32}
        super().__init__(widths or {}, defaults)
        layers, cin, i = [], 3, 0
        for c in self.CFG:
            if c == "M":
                layers.append(nn.MaxPool2d(2))
                side //= 2
                continue
            cb = conv_bn(cin, self.w(f"conv{i}"), 3)
            self.produce(f"conv{i}", cb[0])
            self.produce(f"conv{i}", cb[1])
            layers += [cb, nn.ReLU()]
            cin = self.w(f"conv{i}")
            i += 1
        self.features = nn.Sequential(*layers)
        self.fc1 = nn.Linear(cin * side * side, self.w("fc1"))
        self.fc2 = nn.Linear(self.w("fc1"), self.w("fc2"))
        self.fc3 = nn.Linear(self.w("fc2"), num_classes)
        self.produce("fc1", self.fc1)
        self.produce("fc2", self.fc2)

    def forward(self, x):
        y = torch.flatten(self.features(x), 1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(y)))))


# ------------------------------------------------------------------ Inception
class InceptionBlock(nn.Module):
    """1x1 | 1x1 -> 3x3 | 1x1 -> 3x3 -> 3x3 | maxpool -> 1x1, concatenated."""

    def __init__(self, owner: Grouped, cin: int, p: str):
        super().__init__()
        g = {k: f"{p}.{k}" for k in ("b1", "b2r", "b2", "b3r", "b3a", "b3", "b4")}
        self.b1 = conv_bn(cin, owner.w(g["b1"]), 1)
        self.b2 = nn.Sequential(
            conv_bn(cin, owner.w(g["b2r"]), 1),
            nn.ReLU(),
            conv_bn(owner.w(g["b2r"]), owner.w(g["b2"]), 3),
        )
        self.b3 = nn.Sequential(
            conv_bn(cin, owner.w(g["b3r"]), 1),
            nn.ReLU(),
            conv_bn(owner.w(g["b3r"]), owner.w(g["b3a"]), 3),
            nn.ReLU(),
            conv_bn(owner.w(g["b3a"]), owner.w(g["b3"]), 3),
        )
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), conv_bn(cin, owner.w(g["b4"]), 1))
        for key, cb in (
            ("b1", self.b1),
            ("b2r", self.b2[0]),
            ("b2", self.b2[2]),
            ("b3r", self.b3[0]),
            ("b3a", self.b3[2]),
            ("b3", self.b3[4]),
            ("b4", self.b4[1]),
        ):
            owner.produce(g[key], cb[0])
            owner.produce(g[key], cb[1])
        self.out = sum(owner.w(g[k]) for k in ("b1", "b2", "b3", "b4"))

    def forward(self, x):
        return torch.relu(torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1))


class Inception(Grouped):
    def __init__(self, widths: dict[str, int] | None = None, num_classes: int = 10):
        defaults = {"stem": 12}
        for p in ("i0", "i1"):
            defaults |= {
                f"{p}.b1": 8,
                f"{p}.b2r": 6,
                f"{p}.b2": 8,
                f"{p}.b3r": 4,
                f"{p}.b3a": 6,
                f"{p}.b3": 6,
                f"{p}.b4": 4,
            }
        super().__init__(widths or {}, defaults)
        self.stem = conv_bn(3, self.w("stem"), 3, 2)
        self.produce("stem", self.stem[0])
        self.produce("stem", self.stem[1])
        self.i0 = InceptionBlock(self, self.w("stem"), "i0")
        self.i1 = InceptionBlock(self, self.i0.out, "i1")
        self.fc = nn.Linear(self.i1.out, num_classes)

    def forward(self, x):
        y = self.i1(nn.functional.max_pool2d(self.i0(torch.relu(self.stem(x))), 2))
        return self.fc(y.mean((2, 3)))


# ------------------------------------------------------------------ the zoo
@dataclass(frozen=True)
class Entry:
    build: Callable[[dict[str, int] | None], Grouped]
    input_shape: tuple[int, ...] = (1, 3, 32, 32)
    example: Callable[[], tuple] | None = None  # example inputs, when not one float tensor

    def inputs(self) -> tuple:
        return self.example() if self.example else (torch.randn(*self.input_shape),)


ZOO: dict[str, Entry] = {
    "resnet_basic": Entry(lambda w=None: ResNet(w, block="basic", layers=(2, 1, 1))),
    "resnet_bottleneck": Entry(lambda w=None: ResNet(w, block="bottleneck", layers=(1, 2))),
    "resnext": Entry(
        lambda w=None: ResNet(w, block="bottleneck", layers=(1, 1), groups=4, group_width=4)
    ),
    "se_resnet": Entry(lambda w=None: ResNet(w, block="basic", layers=(1, 1), se=True)),
    "mobilenetv2": Entry(lambda w=None: MobileNetV2(w)),
    "densenet": Entry(lambda w=None: DenseNet(w)),
    "vgg": Entry(lambda w=None: VGG(w)),
    "inception": Entry(lambda w=None: Inception(w)),
}

# Benchmark-sized: torchvision's ResNet-50 layout (25.5 M parameters).
BENCH: dict[str, Entry] = {
    "resnet50": Entry(
        lambda w=None: ResNet(
            w, block="bottleneck", layers=(3, 4, 6, 3), base=64, num_classes=1000, stem_stride=2
        ),
        (1, 3, 224, 224),
    ),
}


# ------------------------------------------------------------------ parameters and masks
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random values for every parameter and buffer (BN statistics included): exporters merge
    equal initializers, and default-initialised models make tests lie."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bn.weight") or (p.ndim == 1 and _is_bn(model, name)):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / fan_in) ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)
            elif name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    return model.eval()


def default_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """The initialization libraries give a fresh model (HuggingFace's `_init_weights`): weights
    normal(0, 0.02), biases zero, norms' scales one and shifts zero, BatchNorm statistics at
    their defaults. Equal parameters (every zero bias, every unit scale) are what exporters
    merge into one initializer; users export such models, so tests must too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear | nn.Conv2d | nn.Embedding):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.02)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.LayerNorm | nn.BatchNorm2d):
                m.weight.fill_(1.0)
                m.bias.zero_()
                if isinstance(m, nn.BatchNorm2d):
                    m.reset_running_stats()
            elif hasattr(m, "weight") and isinstance(m.weight, nn.Parameter) and m.weight.dim() == 1:
                m.weight.fill_(1.0)  # RMSNorm
        for name, p in model.named_parameters(recurse=True):
            if "." not in name and p.dim() >= 2:  # a model's own tensors (ViT's cls and positions)
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def distinct_params(model) -> int:
    """Float parameters of an ONNX model with equal initializers counted once: unlike the stored
    count, it does not depend on which equal tensors an exporter merged (default-initialized
    models have many: every zero bias, every unit scale), so a shrunk model and a natively built
    one compare. Constant nodes are weights too (a shrink that removes nothing keeps them so;
    one that does stores them as initializers)."""
    import onnx
    from onnx import numpy_helper

    from onnxshrink.ir import all_graphs
    from onnxshrink.prepare import FLOAT_TYPES

    seen = set()
    graphs = list(all_graphs(model.graph))
    tensors = [t for g in graphs for t in g.initializer]
    tensors += [
        a.t
        for g in graphs
        for n in g.node
        if n.op_type == "Constant"
        for a in n.attribute
        if a.name == "value" and a.type == onnx.AttributeProto.TENSOR
    ]
    for t in tensors:
        if t.data_type in FLOAT_TYPES:
            a = numpy_helper.to_array(t)
            seen.add((a.dtype.str, a.shape, a.tobytes()))
    return sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in seen)


def _is_bn(model: nn.Module, param_name: str) -> bool:
    owner = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    return isinstance(owner, nn.BatchNorm2d) and param_name.endswith(".weight")


def choose_kept(model: Grouped, fraction: float, seed: int = 0) -> dict[str, np.ndarray]:
    """Per group, the indices kept when `fraction` of its channels are pruned (at least one per
    conv group; the same count in every conv group, as grouped convolutions need)."""
    rng = np.random.default_rng(seed)
    kept = {}
    for group, n in model.widths.items():
        blocks = model.divisible.get(group, 1)
        per = n // blocks
        k = max(1, round(per * (1 - fraction)))
        kept[group] = np.sort(
            np.concatenate([b * per + rng.choice(per, k, replace=False) for b in range(blocks)])
        )
    return kept


def zero_groups(model: Grouped, kept: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Zero every parameter slice of the channels not kept; returns the masks applied
    ({parameter name: 0/1 tensor of its shape})."""
    params = dict(model.named_parameters())
    masks: dict[str, torch.Tensor] = {}
    for group, members in model.group_members().items():
        n = model.widths[group]
        drop = np.setdiff1d(np.arange(n), kept[group])
        for name, axis, indices in members:
            m = masks.setdefault(name, torch.ones_like(params[name]))
            if len(drop):
                idx = torch.as_tensor(np.concatenate([indices(i) for i in drop]), dtype=torch.long)
                m.index_fill_(axis, idx, 0.0)
    with torch.no_grad():
        for name, m in masks.items():
            params[name].mul_(m)
    return masks


def native_widths(kept: dict[str, np.ndarray]) -> dict[str, int]:
    return {g: len(k) for g, k in kept.items()}


def export(
    model: nn.Module,
    path,
    input_shape: tuple[int, ...] | tuple,
    dynamic_batch: bool = False,
    dynamic: dict[int, str] | None = None,
    **kwargs,
) -> None:
    """torch.onnx.export with its defaults (the dynamo exporter), quietly. `input_shape` is one
    float input's shape or a tuple of example tensors; `dynamic` ({axis: name}, applied to every
    input; `dynamic_batch` is {0: "batch"}) makes those axes dynamic."""
    import contextlib
    import io
    import warnings

    args = (
        input_shape
        if input_shape and isinstance(input_shape[0], torch.Tensor)
        else (torch.randn(*input_shape),)
    )
    dynamic = dynamic or ({0: "batch"} if dynamic_batch else None)
    extra = dict(kwargs)
    if dynamic and extra.get("dynamo", True):
        dims = {a: torch.export.Dim(n, min=2 if n != "batch" else 1) for a, n in dynamic.items()}
        extra["dynamic_shapes"] = tuple({a: dims[a] for a in dynamic if a < t.dim()} for t in args)
    elif dynamic:
        names = [f"input{k}" if k else "x" for k in range(len(args))]
        extra |= {"input_names": names, "dynamic_axes": {n: dict(dynamic) for n in names}}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), **extra)

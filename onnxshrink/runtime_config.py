"""The runtimes' configs beside a model: written again for the shrunk model.

A runtime that feeds a decoder reads its sizes from a file beside it, not from the graph:
onnxruntime-genai its `genai_config.json` (`model.decoder`: head counts, head size, hidden
size), optimum's `ORTModelForCausalLM` a HuggingFace `config.json` (the KV cache it makes for
the first token is `[batch, num_key_value_heads, 0, head_dim]`). When the shrink removed heads,
KV groups, MLP neurons or hidden channels, the copy written beside the output says so.

Every value is counted in the graphs, never read from names: the coupled groups of the input and
of the shrunk model (`prune.groups`: a layer of `kv_group` units is one attention's KV heads,
each with its query heads; of `head` units, heads; of `gated_neuron` units, or of `neuron` units
read by a next layer's matrix, an MLP's neurons; the residual stream's channels, which the
embedding table's columns belong to, the hidden size), or the head counts of fused attention
nodes (`num_heads`, `kv_num_heads`). A value is written only when the input's own count agrees
with the config's (so the config's field is what was counted), and every layer of the shrunk
model has the same count (a config holds one value); otherwise the file is not written and the
note says which value could not be derived. The input's files are never overwritten.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from onnxshrink import ir
from onnxshrink.ops import facts
from onnxshrink.prepare import default_opset

GENAI = "genai_config.json"
HF = "config.json"
NAMES = (GENAI, HF)

# HuggingFace config keys per counted quantity (the first present is the one written)
HF_KEYS: dict[str, tuple[str, ...]] = {
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "head_dim": ("head_dim",),
    "layers": ("num_hidden_layers", "n_layer"),
}
GENAI_KEYS: dict[str, tuple[str, ...]] = {
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",),
    "hidden": ("hidden_size",),
    "head_dim": ("head_size",),
    "layers": ("num_hidden_layers",),
}


@dataclass
class Counts:
    """What the graph holds, per layer: one value per quantity when every layer agrees; the
    quantities that differ between layers, and those not found, with why."""

    values: dict[str, int] = field(default_factory=dict)
    uneven: dict[str, list[int | None]] = field(default_factory=dict)
    unknown: set[str] = field(default_factory=set)  # found in some layer, not countable there
    layers: int | None = None  # attention layers counted
    # per quantity, in how many layers it was counted (an MLP or attention removed whole by a
    # block removal leaves a layer without it)
    found: dict[str, int] = field(default_factory=dict)


def count(model: onnx.ModelProto, base_dir: str | Path | None = None, groups: Any = None) -> Counts:
    """Heads, KV heads, head size, MLP neurons and hidden size of `model`, counted in its graph
    (`groups`: its coupled groups, when already found)."""
    fused = _fused_attention(model)
    if fused is not None:
        return fused
    from onnxshrink.prune.groups import find_groups

    return count_groups(groups if groups is not None else find_groups(model, base_dir, verify=False))


def count_groups(gset: Any) -> Counts:
    """`count` from a model's coupled groups (prune.groups.GroupSet)."""
    per: dict[str, list[int | None]] = {"heads": [], "kv_heads": [], "head_dim": [], "intermediate": []}
    hidden: list[int | None] = []
    for layer in gset.layers:
        groups = [gset.groups[i] for i in layer.groups]
        if not groups:
            continue
        unit = groups[0].unit
        if layer.kind == "kv_group":
            per["kv_heads"].append(len(groups))
            per["heads"].append(sum(g.unit.query_heads or 0 for g in groups))
            per["head_dim"].append(int(unit.head_dim or unit.channels))
        elif layer.kind == "head":
            per["heads"].append(len(groups))
            # each head owns its keys and values when the head's unit slices more than one
            # projection's outputs; a query head alone reads shared ones (one KV head, or KV
            # heads not found as units): not counted
            outs = {m.tensor for m in groups[0].members if m.side == "out" and m.matrix}
            per["kv_heads"].append(len(groups) if len(outs) > 1 else None)
            per["head_dim"].append(int(unit.head_dim or unit.channels))
        elif layer.kind == "gated_neuron" or (
            layer.kind == "neuron" and any(m.side == "in" and m.matrix for m in groups[0].members)
        ):
            per["intermediate"].append(len(groups))
        if layer.kind in ("channel", "width") and any(
            m.family == "embedding" and m.axis == 1 for m in groups[0].members
        ):  # the residual stream: the embedding table's columns
            hidden.append(sum(g.unit.channels for g in groups))
    out = Counts(layers=len(per["kv_heads"]) or None)
    if out.layers:
        out.values["layers"] = out.layers
    for key, vals in per.items():
        _settle(out, key, vals)
        if key != "head_dim":
            out.found[key] = len(vals)
    _settle(out, "hidden", hidden)
    return out


def _layers_lost(before: Counts, after: Counts) -> list[str]:
    """The problem of a shrunk model some of whose layers have no MLP or no attention while
    others have (a block removal, or masks, that took a layer's MLP or attention whole): a config
    gives every layer the same sizes, and the runtimes read no per-layer form of them."""
    layers = max(after.found.values(), default=0)
    for q, noun in (("intermediate", "an MLP"), ("kv_heads", "attention"), ("heads", "attention")):
        n = after.found.get(q, 0)
        if n < layers and (n or before.found.get(q, 0)):
            return [
                f"{n} of the shrunk model's {layers} layers have {noun} (the rest lost it whole), "
                "and a config gives every layer the same sizes: the runtime reads no per-layer "
                "form of them"
            ]
    return []


def _settle(out: Counts, key: str, vals: list[int | None]) -> None:
    if not vals:
        return
    known = [v for v in vals if v is not None]
    if len(known) < len(vals):
        out.unknown.add(key)
        return
    if len(set(known)) == 1:
        out.values[key] = known[0]
    else:
        out.uneven[key] = vals


def _fused_attention(model: onnx.ModelProto) -> Counts | None:
    """Head counts from fused attention nodes' attributes (GroupQueryAttention: num_heads and
    kv_num_heads; MultiHeadAttention and Attention: num_heads; ONNX Attention: q_num_heads and
    kv_num_heads), and the head size from the
    query's width; None when the model has none."""
    opset = default_opset(model)
    declared = [
        (n, handler.head_attrs)
        for g in ir.all_graphs(model.graph)
        for n in g.node
        if (handler := facts(n, opset)[0]) is not None and handler.head_attrs is not None
    ]
    if not declared:
        return None
    heads: list[int | None] = []
    kv: list[int | None] = []
    for n, (q_attr, kv_attr) in declared:
        attrs = {a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT}
        q = attrs.get(q_attr)  # ONNX Attention's 4-D form declares none: its heads are an axis
        if q is None:
            continue
        heads.append(q)
        kv.append(attrs.get(kv_attr, q))
    out = Counts(layers=len(heads) or None)
    _settle(out, "heads", heads)
    _settle(out, "kv_heads", kv)
    hidden = _embedding_width(model)
    if hidden is not None:
        out.values["hidden"] = hidden
    return out


def _embedding_width(model: onnx.ModelProto) -> int | None:
    """The columns of the table the input ids are looked up in (a Gather of a 2-D initializer by
    a graph input): the hidden size."""
    inits = {t.name: t for t in model.graph.initializer}
    inputs = {i.name for i in model.graph.input}
    opset = default_opset(model)
    widths = {
        int(inits[n.input[0]].dims[1])
        for n in model.graph.node
        if _looks_up_rows(n, opset)
        and len(n.input) > 1
        and n.input[0] in inits
        and len(inits[n.input[0]].dims) == 2
        and n.input[1] in inputs
    }
    return widths.pop() if len(widths) == 1 else None


def _looks_up_rows(node: onnx.NodeProto, opset: int) -> bool:
    """Input 1 holds indices into input 0 (Gather)."""
    handler, op = facts(node, opset)
    return handler is not None and handler.index_inputs(op).get(1, (None, 0))[0] == 0


# ---------------------------------------------------------------------- the configs
@dataclass
class Note:
    """What happened to one config beside the input: written (with the values changed), or
    not, and why."""

    file: str
    written: bool
    text: str
    changed: dict[str, list[Any]] = field(default_factory=dict)  # key -> [old, new]

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "written": self.written, "text": self.text, "changed": self.changed}


def configs_beside(model_path: str | Path) -> list[Path]:
    folder = Path(model_path).parent
    return [folder / n for n in NAMES if (folder / n).is_file()]


def write_configs(
    input_path: str | Path,
    output_path: str | Path,
    before: Callable[[], Counts],
    after: Callable[[], Counts],
) -> list[Note]:
    """For each runtime config beside `input_path`, an updated copy beside `output_path` (the
    counts made on first use: `before` of the input, `after` of the shrunk model)."""
    found = configs_beside(input_path)
    if not found:
        return []
    out_dir = Path(output_path).absolute().parent
    if out_dir.resolve() == Path(input_path).absolute().parent.resolve():
        return [
            Note(
                p.name,
                False,
                f"{p.name} beside the input not updated: the output is in the same folder, and "
                "the input's config is never overwritten; write the output (-o) to another folder",
            )
            for p in found
        ]
    try:
        counts_before, counts_after = before(), after()
    except Exception as exc:  # a graph the groups cannot be found in: no config rather than none
        return [Note(p.name, False, f"{p.name} not written: the graph's sizes could not be counted ({exc})") for p in found]
    notes = []
    for path in found:
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            notes.append(Note(path.name, False, f"{path} not updated: it cannot be read as JSON ({exc})"))
            continue
        if path.name == GENAI:
            section = config.get("model", {}).get("decoder") if isinstance(config.get("model"), dict) else None
            if not isinstance(section, dict):
                notes.append(Note(path.name, False, f"{path} not updated: it has no model.decoder section"))
                continue
            note = _update(path.name, section, GENAI_KEYS, counts_before, counts_after, norm_eps=None)
        else:
            note = _update(path.name, config, HF_KEYS, counts_before, counts_after, norm_eps=config)
        if note.written:
            target = out_dir / path.name
            _write_json(target, config)
            note.text = f"wrote {target}" + (
                ": " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in note.changed.items()) if note.changed else " (unchanged)"
            )
        notes.append(note)
    return notes


def _update(
    name: str,
    section: dict[str, Any],
    keys: dict[str, tuple[str, ...]],
    before: Counts,
    after: Counts,
    norm_eps: dict[str, Any] | None,
) -> Note:
    """Set each counted quantity's key in `section` (in place) when it can be derived; a Note
    not written naming what cannot."""
    changed: dict[str, list[Any]] = {}
    problems: list[str] = _layers_lost(before, after)
    for quantity, candidates in keys.items():
        change = _change(quantity, candidates, section, before, after)
        if isinstance(change, str):
            problems.append(change)
        elif change is not None:
            changed[change[0]] = [section[change[0]], change[1]]
    if not problems:
        problems += _follow_width(name, section, keys, after, changed)
    if not problems and any(k in changed for k in keys["hidden"]) and norm_eps is not None:
        problems += _rescale_eps(norm_eps, before.values["hidden"], after.values["hidden"], changed)
    if problems:
        return Note(name, False, f"{name} not written: " + "; ".join(problems))
    for key, (_, new) in changed.items():
        section[key] = new
    return Note(name, True, "", changed)


def _change(
    quantity: str, candidates: tuple[str, ...], section: dict[str, Any], before: Counts, after: Counts
) -> tuple[str, int] | str | None:
    """One quantity's change: (its key, the shrunk model's value), None when it has none to
    write, or the problem (a string) that keeps the config from being written."""
    key = next((k for k in candidates if k in section), None)
    old_b, new_a = before.values.get(quantity), after.values.get(quantity)
    unknown = [label for label, c in (("input", before), ("shrunk model", after)) if quantity in c.unknown]
    if unknown and (key is not None or old_b is not None or new_a is not None):
        return (
            f"{key or quantity.replace('_', ' ')}: not countable in the {' and the '.join(unknown)} "
            "(the attention's key/value heads are not units there)"
        )
    if quantity in after.uneven:
        return (
            f"{quantity.replace('_', ' ')} differs between layers in the shrunk model "
            f"({', '.join(str(v) for v in after.uneven[quantity])}): a config holds one value"
        )
    if old_b is not None and new_a is not None and old_b == new_a:
        return None  # unchanged
    if key is None:
        if quantity == "head_dim" and new_a is not None and "heads" in before.values:
            return None  # written by _follow_width when the heads changed
        if old_b is not None or new_a is not None:
            return f"{quantity.replace('_', ' ')} changed, and the config has no key for it"
        return None
    if old_b is None or new_a is None:
        if old_b is None and new_a is None:
            return None  # not in the graph in a form counted: unchanged by the shrink
        return f"{key}: not counted in the {'input' if old_b is None else 'shrunk'} model"
    if section[key] != old_b:
        return (
            f"{key}: the config says {section[key]}, the input's graph holds {old_b}: not the "
            "same quantity, so the shrunk model's count cannot be written for it"
        )
    return key, new_a


def _follow_width(
    name: str, section: dict[str, Any], keys: dict[str, tuple[str, ...]], after: Counts, changed: dict[str, list[Any]]
) -> list[str]:
    """A HuggingFace config without head_dim, whose heads or hidden size changed: the head size
    written out (transformers takes hidden_size // num_attention_heads when head_dim is not
    given), or the problem when it was not counted."""
    heads_changed = any(k in changed for k in keys["heads"])
    hidden_changed = any(k in changed for k in keys["hidden"])
    if not (heads_changed or hidden_changed) or name != HF or "head_dim" in section:
        return []
    head_dim = after.values.get("head_dim")
    if head_dim is None:
        return ["head_dim: not counted, and hidden_size // num_attention_heads would change"]
    changed["head_dim"] = [None, head_dim]
    return []


def _rescale_eps(config: dict[str, Any], old: int, new: int, changed: dict[str, list[Any]]) -> list[str]:
    """The shrunk graph's RMSNorms keep the statistics of the original width (epsilon x old/new,
    the gain rescaled in the weights): the config's rms_norm_eps says the same. A LayerNorm over
    the zero-padded input has no config form."""
    if "rms_norm_eps" in config:
        changed["rms_norm_eps"] = [config["rms_norm_eps"], float(config["rms_norm_eps"]) * old / new]
        return []
    for key in ("layer_norm_eps", "layer_norm_epsilon", "norm_eps"):
        if key in config:
            return [
                f"hidden size {old} -> {new}: the shrunk graph's LayerNorms normalize over the "
                f"original width, which {key} cannot express"
            ]
    return []


def _write_json(target: Path, config: dict[str, Any]) -> None:
    """Atomically: a config is never left half written."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

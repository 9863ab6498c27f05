"""`export_and_shrink`: a masked PyTorch module in, a smaller ONNX model proven against it out."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxshrink.api import ShrinkResult, check_options, shrink
from onnxshrink.errors import ShrinkError, ValidationFailed, first_line
from onnxshrink.options import ShrinkOptions
from onnxshrink.proof.verdict import ValidationReport


def pruning_masks(module) -> dict[str, np.ndarray]:
    """Masks a module carries itself: torch.nn.utils.prune hooks (`<param>_mask` buffers) and
    torch.ao.pruning parametrizations (FakeSparsity's `mask`), by parameter name."""
    from torch.nn.utils import parametrize

    masks: dict[str, np.ndarray] = {}
    for path, m in module.named_modules():
        prefix = f"{path}." if path else ""
        for name, buf in m.named_buffers(recurse=False):
            if name.endswith("_mask") and hasattr(m, name[: -len("_mask")] + "_orig"):
                masks[prefix + name[: -len("_mask")]] = _numpy(buf)
        if parametrize.is_parametrized(m):
            for param, plist in m.parametrizations.items():
                for p in plist:
                    if hasattr(p, "mask"):
                        mask = _numpy(p.mask)
                        key = prefix + param
                        masks[key] = masks[key] * mask if key in masks else mask
    return masks


def masked_copy(module, masks: Mapping[str, np.ndarray]):
    """A copy of `module` with its pruning made permanent and `masks` multiplied in."""
    import torch
    from torch.nn.utils import parametrize, prune

    with torch.no_grad():  # a pruned weight is recomputed by a hook; make it a leaf so it copies
        for m in module.modules():
            for hook in m._forward_pre_hooks.values():
                if isinstance(hook, prune.BasePruningMethod):
                    setattr(m, hook._tensor_name, hook.apply_mask(m))
    mod = copy.deepcopy(module)
    for _, m in mod.named_modules():
        for hook in list(m._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                prune.remove(m, hook._tensor_name)
        if parametrize.is_parametrized(m):
            # deepcopy keeps classes, and the parametrized class is the user's module's too:
            # removing a parametrization deletes its property from that class (the user's
            # module then has no `weight`). The copy gets a class of its own first.
            cls = type(m)
            own = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
            m.__class__ = type(cls.__name__, cls.__bases__, own)
            for param in list(m.parametrizations):
                parametrize.remove_parametrizations(m, param, leave_parametrized=True)
    params = dict(mod.named_parameters())
    unknown = [n for n in masks if n not in params]
    if unknown:
        raise ShrinkError(
            f"masks name {len(unknown)} parameter(s) the module does not have: "
            f"{', '.join(repr(n) for n in unknown[:8])}. Use the module's parameter names "
            f"(e.g. {', '.join(repr(n) for n in list(params)[:4])})."
        )
    with torch.no_grad():
        for name, mask in masks.items():
            p = params[name]
            m = torch.as_tensor(np.ascontiguousarray(mask), dtype=p.dtype)  # a compacted mask: a writable copy
            if m.dim() == 1 and p.dim() > 1 and m.shape[0] == p.shape[0]:
                m = m.reshape((-1,) + (1,) * (p.dim() - 1))
            elif m.shape != p.shape:  # as the ONNX binding: never a broadcast guessed from shapes
                raise ShrinkError(
                    f"masks: mask '{name}' has shape {list(m.shape)} but parameter '{name}' has "
                    f"shape {list(p.shape)}. Give a mask of the parameter's shape, or one flag per "
                    "output channel."
                )
            p.mul_(m)
    return mod.eval()


def _flat_outputs(out) -> list[Any]:
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _flat_outputs(v)]
    if isinstance(out, list | tuple):
        return [t for v in out for t in _flat_outputs(v)]
    return [out]


def _random_like(args: Sequence[Any], rng: np.random.Generator) -> tuple[Any, ...]:
    import torch

    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            out.append(
                torch.from_numpy(rng.standard_normal(tuple(a.shape)).astype(np.float32)).to(a.dtype)
            )
        else:
            out.append(a)
    return tuple(out)


def _numpy(t) -> np.ndarray:
    """A torch tensor as numpy; bfloat16 (which numpy lacks) as float32 holding its values, as
    the emulated model takes and gives them (onnxshrink.emulate)."""
    import torch

    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def torch_compare(
    module: Any,
    shrunk: onnx.ModelProto,
    example_args: Sequence[Any],
    opts: ShrinkOptions,
    data_dir: Path | None = None,
) -> ValidationReport:
    """Outputs of the PyTorch module itself vs the shrunk ONNX model, on random inputs
    (`data_dir`: where the shrunk model's external weights are, when not in memory)."""
    import torch

    from onnxshrink.progress import bar
    from onnxshrink.proof.emulate import emulated, needs_emulation
    from onnxshrink.proof.sessions import session
    from onnxshrink.proof.verdict import ErrorTally, arithmetic, default_tolerance

    draws, seed, atol = opts.draws, opts.seed, opts.atol
    dtype, eps = arithmetic(shrunk)
    rtol = opts.rtol if opts.rtol is not None else default_tolerance(eps)
    detail = [f"rtol {rtol:g} for {dtype} arithmetic"] if opts.rtol is None else []
    if needs_emulation(shrunk):
        shrunk = emulated(shrunk)
        detail.append("bfloat16 arithmetic emulated in float32 (onnxruntime has few bfloat16 kernels)")
    t0 = time.perf_counter()
    sess = session(shrunk, "cpu", data_dir)
    names = [i.name for i in sess.get_inputs()]
    rng = np.random.default_rng(seed)
    tally = ErrorTally([o.name for o in sess.get_outputs()])
    with bar(max(draws, 1), "proof: against PyTorch", "run", opts.progress) as progress:
        for k in range(max(draws, 1)):
            args = tuple(example_args) if k == 0 else _random_like(example_args, rng)
            with torch.no_grad():
                ref = [_numpy(t) for t in _flat_outputs(module(*args))]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            feeds = {n: _numpy(a) for n, a in zip(names, tensors, strict=False)}
            got = sess.run(None, feeds)
            tally.add(ref[: len(got)], got)
            progress.update(1)
    checks = tally.checks(rtol, atol)
    shapes = {
        n: list(a.shape)
        for n, a in zip(names, [a for a in example_args if hasattr(a, "shape")], strict=False)
    }
    return ValidationReport(
        all(c.passed for c in checks),
        rtol,
        atol,
        max(draws, 1),
        "cpu (vs PyTorch)",
        shapes,
        checks,
        time.perf_counter() - t0,
        detail="; ".join(detail),
        dtype=dtype,
        eps=eps,
    )


class _NoTorchvisionNotice(logging.Filter):
    """torch.onnx's registry logs a warning per torchvision op it cannot register when
    torchvision is not installed (four per export); a module that uses torchvision ops needs it
    installed anyway, and the export then says so itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "torchvision is not installed" not in record.getMessage()


REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Around our export call only: the exporter's progress prints (stdout), its warnings, and
    its registry's torchvision notices."""
    notice = _NoTorchvisionNotice()
    logger = logging.getLogger(REGISTRY_LOGGER)
    logger.addFilter(notice)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.removeFilter(notice)


def _export(
    module,
    args: tuple[Any, ...],
    path: Path,
    exporter: str,
    opts: ShrinkOptions,
    dynamic_shapes=None,
    input_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str] | Sequence[int]] | None = None,
    opset_version: int | None = None,
) -> float:
    """`module` exported to `path` with torch.onnx.export, quietly; the seconds it took."""
    import torch

    kwargs: dict[str, Any] = {"dynamo": exporter == "dynamo"}
    if opset_version is not None:
        kwargs["opset_version"] = opset_version
    if exporter == "dynamo" and dynamic_shapes is not None:
        kwargs["dynamic_shapes"] = dynamic_shapes
    if exporter == "legacy":
        if input_names is not None:
            kwargs["input_names"] = list(input_names)
        if dynamic_axes is not None:
            kwargs["dynamic_axes"] = dict(dynamic_axes)
    opts.say(
        f"exporting {type(module).__name__} with torch.onnx.export ({exporter} exporter"
        + ("; its first export in a process loads the exporter, which takes seconds" if exporter == "dynamo" else "")
        + ") ..."
    )
    t0 = time.perf_counter()
    with _quiet_export():
        try:
            torch.onnx.export(module, args, str(path), **kwargs)
        except Exception as exc:
            raise ShrinkError(
                f"torch.onnx.export failed on the module ({type(exc).__name__}: {first_line(exc)})."
            ) from exc
    exported = time.perf_counter() - t0
    opts.say(f"exported in {exported:.1f} s")
    return exported


def _prove_against_module(masked, args: tuple[Any, ...], result: ShrinkResult, opts: ShrinkOptions) -> None:
    """The shrunk model proven against the masked module's own outputs (`torch_validation`);
    ValidationFailed when it does not match."""
    data_dir = result.data_file.parent if result.data_file is not None else None
    opts.say("validating against the PyTorch module ...")
    result.torch_validation = torch_compare(masked, result.model, args, opts, data_dir)
    result.timings["validate vs PyTorch"] = result.torch_validation.seconds
    if not result.torch_validation.passed:
        report = result.torch_validation
        bad = [o.name for o in report.outputs if not o.passed]
        raise ValidationFailed(
            f"the shrunk model does not match the PyTorch module on output(s) {bad}; nothing was written."
            + (f" {report.tolerance_hint()}" if report.rounding() else ""),
            result,
        )


def export_and_shrink(
    module,
    example_args: Sequence[Any],
    masks: str | Path | Mapping[str, Any] | None = None,
    output: str | Path | None = None,
    *,
    exporter: str = "dynamo",
    dynamic_shapes=None,
    input_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str] | Sequence[int]] | None = None,
    opset_version: int | None = None,
    options: ShrinkOptions | None = None,
    **option_values: Any,
) -> ShrinkResult:
    """Export a masked PyTorch module to ONNX, shrink it, and prove it against the module.

    Masks come from `masks` (a dict or masks file of any pruner's format, by parameter name),
    from the module's own pruning state (torch.nn.utils.prune hooks, torch.ao.pruning
    parametrizations), or both. They are applied in PyTorch before export, so every exporter
    (`exporter="dynamo"` or `"legacy"`) carries them; the shrunk model is validated against
    the exported masked model and against the module's own outputs. Returns the ShrinkResult,
    with `torch_validation` set; raises ValidationFailed (nothing written) on a mismatch. How to
    shrink, prove and write: a ShrinkOptions, or its fields as keyword arguments.
    """
    opts = (options or ShrinkOptions()).but(**option_values)
    import torch

    check_options(opts)  # before the export, which takes the longest
    if not isinstance(module, torch.nn.Module):
        raise ShrinkError(f"module: expected a torch.nn.Module, got {type(module).__name__}.")
    from onnxshrink.masks import load_maskset

    if exporter not in ("dynamo", "legacy"):
        raise ShrinkError(f"exporter={exporter!r}: choose 'dynamo' (torch's default) or 'legacy'.")
    own = pruning_masks(module)
    given = load_maskset(masks, opts.masks_format).masks if masks is not None else {}
    masked = masked_copy(module, given)
    args = tuple(example_args) if isinstance(example_args, list | tuple) else (example_args,)
    with tempfile.TemporaryDirectory(prefix="onnxshrink-export-") as tmp:
        path = Path(tmp) / "model.onnx"
        exported = _export(masked, args, path, exporter, opts, dynamic_shapes, input_names, dynamic_axes, opset_version)
        result = shrink(path, None, None, options=opts)
    result.timings = {"export": exported, **result.timings}
    result.masks_bound = len(set(own) | set(given))
    _prove_against_module(masked, args, result, opts)
    if output is not None:
        written = result.save(output, external=bool(opts.external_data))
        result.written = [str(p) for p in written]
        result.after.file_bytes = sum(p.stat().st_size for p in written)
    return result

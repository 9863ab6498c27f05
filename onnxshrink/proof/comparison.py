"""The proof: the shrunk model against the reference, run as users run them, each output against
its tolerance, the float64 judge where float32 cannot decide."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from onnxshrink.errors import ShrinkError
from onnxshrink.options import ShrinkOptions
from onnxshrink.proof.inputs import compared_values, graph_inputs, make_inputs, resolve_shapes
from onnxshrink.proof.sessions import (
    OFF,
    RunFailed,
    default_level,
    levels,
    refusals,
    run_model,
    segment_bytes,
)
from onnxshrink.proof.verdict import (
    NOISE_FACTOR,
    ErrorTally,
    OutputCheck,
    ValidationReport,
    arithmetic,
    default_tolerance,
    output_tolerance,
)


def _not_run(
    tally: ErrorTally,
    opts: ShrinkOptions,
    rtol: float,
    shapes: dict[str, list[int]],
    draws: int,
    error: str,
    t0: float,
) -> ValidationReport:
    checks = [OutputCheck(n, [], float("inf"), float("inf"), False) for n in tally.names]
    return ValidationReport(
        False, rtol, opts.atol, draws, opts.provider, shapes, checks,
        time.perf_counter() - t0, error,
    )  # fmt: skip


def _reference_failed(
    reference: onnx.ModelProto, opts: ShrinkOptions, shapes: dict[str, list[int]], exc: RunFailed
) -> str:
    """Why the proof could not even run the reference, and what to do about it."""
    text = f"the reference model (the input, masks applied) {exc}"
    if exc.loading:
        return (
            f"{text}, so the proof cannot run. Check the model with onnxruntime, or pass "
            "--no-validate to shrink it without the proof."
        )
    given = len(opts.inputs or [])
    if exc.feed is not None and exc.feed < given:
        return f"{text} on the arrays given with --inputs. Check them against the model's inputs."
    text += " on random inputs" + (
        " (the arrays given with --inputs run: --draws 0 proves it on those alone)" if given else ""
    )
    guessed = [
        i.name
        for i in graph_inputs(reference)
        if np.issubdtype(helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type), np.integer)
        and i.name not in compared_values(reference)
    ]
    if guessed:
        text += (
            f" (integer input(s) {', '.join(repr(n) for n in guessed)} drawn at random: the graph "
            "compares them with no constant to draw instead)"
        )
    dynamic = {
        i.name: shapes[i.name]
        for i in graph_inputs(reference)
        if any(not d.HasField("dim_value") for d in i.type.tensor_type.shape.dim)
        and i.name not in (opts.input_shapes or {})
    }
    if dynamic:
        chosen = ", ".join(f"{n}:{','.join(map(str, d))}" for n, d in dynamic.items())
        return (
            f"{text}, of the shapes chosen for its dynamic dims ({chosen}). "
            "Give the shapes it runs on with --input-shapes name:d0,d1,..., or real inputs with --inputs."
        )
    return f"{text}. Give real inputs it runs on with --inputs."


def compare(
    reference: onnx.ModelProto,
    shrunk: onnx.ModelProto,
    opts: ShrinkOptions | None = None,
    reference_dir: str | Path | None = None,
    shrunk_dir: str | Path | None = None,
    twin: Callable[[], onnx.ModelProto] | None = None,
    judge_macs: float | None = None,
) -> ValidationReport:
    """Run both models on the given and random inputs as users run them (onnxruntime's default
    graph optimizations), one after the other (the reference's outputs kept, its session freed
    before the shrunk model's is made); the worst error per output, against a tolerance per
    output derived from the reference's own noise (the reference run again with the
    optimizations off) unless one is given. The shrunk model must load at every optimization
    level the reference loads at. An output off by more than the dtype's floor (or the rtol
    given) is judged in float64 (onnxshrink.judge; `twin()` makes the shrink of the reference
    widened to float64; `judge_macs` bounds the model size judged): another function fails,
    rounding passes, or under a given rtol fails as rounding. `*_dir`: where each model's
    external data are. With `opts.validate_layers`, only the first blocks are compared (see
    onnxshrink.segment.prefix)."""
    from onnxshrink.progress import bar
    from onnxshrink.proof.emulate import emulated, needs_emulation
    from onnxshrink.proof.qdq import float_activations, integer_products
    from onnxshrink.proof.segment import blocks, prefix, split

    opts = opts or ShrinkOptions()
    atol = opts.atol
    detail = []
    dtype, eps = arithmetic(reference)
    base = opts.rtol if opts.rtol is not None else default_tolerance(eps)
    t0 = time.perf_counter()
    shapes = resolve_shapes(reference, opts.input_shapes or {})
    feeds = list(opts.inputs or []) + make_inputs(reference, shapes, opts.draws, opts.seed)
    outputs = [o.name for o in reference.graph.output]
    kind, ref_model, new_model = "full", reference, shrunk
    if opts.validate_layers is not None:
        found = blocks(reference)
        if found is None:
            raise ShrinkError(
                "--validate-layers: the model's node order has no repeated blocks to count; "
                "validate it whole (omit --validate-layers)."
            )
        n = opts.validate_layers
        if n < found.count:  # else the whole model is proven
            head = prefix(reference, found.end(n))
            tail = prefix(shrunk, 0, head.outputs) if head is not None else None
            if head is None or tail is None:
                raise ShrinkError(
                    f"--validate-layers {n}: the tensors after block {n} are not all in the shrunk "
                    "model (or their types are unknown); validate it whole (omit --validate-layers)."
                )
            ref_model, new_model, outputs = head.model, tail.model, head.outputs
            kind = f"first {n} of {found.count} repeated blocks"
            detail.append(f"{head.nodes} of {len(reference.graph.node)} nodes; compared: {', '.join(outputs)}")
    if needs_emulation(ref_model):
        ref_model, new_model = emulated(ref_model), emulated(new_model)
        detail.append(
            "bfloat16 arithmetic emulated in float32, each bfloat16 tensor rounded to bfloat16: "
            "onnxruntime has few bfloat16 kernels"
        )
    integer = integer_products(ref_model, reference_dir)
    if integer is not None:  # both alike: the reference's products, and the shrunk model's
        ref_model, new_model = integer, integer_products(new_model, shrunk_dir) or new_model
        detail.append(
            "products of dequantized operands accumulated in integers, as quantized kernels do: "
            "in float32 a QuantizeLinear after them can round differently when zero terms are removed"
        )
    floats = float_activations(ref_model)
    if floats is not None:
        ref_model, new_model = floats, float_activations(new_model) or new_model
        detail.append(
            "MatMulNBits with float32 activations (accuracy_level 0): at run time int8 activations "
            "can round differently when float rounding moves a value by an ulp"
        )
    tally = ErrorTally(outputs)
    ref_parts = split(ref_model, segment_bytes(ref_model))
    new_parts = split(new_model, segment_bytes(new_model))
    counts = [len(p) if p else 1 for p in (ref_parts, new_parts)]
    level = default_level()
    if integer is not None:
        # The emulated products are what quantized kernels compute; at the default level
        # onnxruntime fuses the model's remaining Q/DQ pairs into int8 kernels that requantize
        # each step on their own, and a deep network's output then moves by whole quantization
        # steps with any change of float order (ResNet-50, QDQ: 0.1 between the levels for the
        # reference itself). Both models run with optimizations off; each still loads at every level.
        level = OFF

    def run_reference(at: str, what: str) -> list[list[np.ndarray]]:
        with bar(len(feeds) * counts[0], what, "run", opts.progress) as progress:
            return run_model(ref_model, feeds, outputs, opts.provider, reference_dir, progress, ref_parts, at)

    try:  # as users run it
        ref_out = run_reference(level, "proof: reference")
    except RunFailed as exc:
        if not exc.loading or level == OFF:
            raise ShrinkError(_reference_failed(reference, opts, shapes, exc)) from exc
        detail.append(
            f"the reference does not load at onnxruntime's default optimizations ({level}: "
            f"{exc}): both models run with them off"
        )
        level = OFF
        try:
            ref_out = run_reference(OFF, "proof: reference")
        except RunFailed as exc2:
            raise ShrinkError(_reference_failed(reference, opts, shapes, exc2)) from exc2
    noise: dict[str, float | None] = dict.fromkeys(outputs)
    noise_out = None
    if level != OFF:  # the reference's own noise: the same inputs, another valid float order
        try:
            noise_out = run_reference(OFF, "proof: reference's noise")
        except RunFailed as exc:
            detail.append(f"the reference's noise not measured: with optimizations off it {exc}")
        else:
            spread = ErrorTally(outputs)
            for r_run, o_run in zip(ref_out, noise_out, strict=True):
                spread.add(r_run, o_run)
            noise = {n: spread.relative(n) for n in outputs}
    floor = f"rtol {default_tolerance(eps):g} for {dtype} arithmetic"
    if level != OFF:
        how = f"onnxruntime's default graph optimizations ({level}), as users run it"
        if opts.rtol is None:
            how += f"; tolerance per output: {NOISE_FACTOR:g} x the reference's own noise (its outputs with them off), and at least {floor}"
    else:
        how = f"onnxruntime with graph optimizations off ({OFF})" + ("" if opts.rtol is not None else f"; {floor}")
    detail.append(how)
    detail.append(
        "reference, then shrunk model"
        + (f", in {counts[0]} and {counts[1]} segments" if max(counts) > 1 else "")
    )

    def finish(report: ValidationReport) -> ValidationReport:
        report.kind, report.detail, report.dtype, report.eps = kind, "; ".join(detail), dtype, eps
        report.level, report.rtol_given = level, opts.rtol is not None
        report.seconds = time.perf_counter() - t0
        return report

    try:
        with bar(len(feeds) * counts[1], "proof: shrunk", "run", opts.progress) as progress:
            new_out = run_model(
                new_model, feeds, outputs, opts.provider, shrunk_dir, progress, new_parts, level
            )
    except RunFailed as exc:
        at = f" at {level}" if exc.loading and level != OFF else ""
        return finish(_not_run(tally, opts, base, shapes, len(feeds), f"{exc}{at}", t0))
    if kind != "full":
        for name, r, s in zip(outputs, ref_out[0], new_out[0], strict=True):
            if r.shape != s.shape:
                raise ShrinkError(
                    f"--validate-layers: tensor '{name}' after the blocks has shape {list(s.shape)} "
                    f"in the shrunk model, {list(r.shape)} in the reference: not comparable there; "
                    "validate it whole (omit --validate-layers)."
                )
    refused = _refused_levels(ref_model, new_model, opts.provider, reference_dir, shrunk_dir, level, max(counts))
    if refused is not None:
        failure, note = refused
        if failure:
            return finish(_not_run(tally, opts, base, shapes, len(feeds), failure, t0))
        detail.append(note)
    for k, (r_run, s_run) in enumerate(zip(ref_out, new_out, strict=True)):
        tally.add(r_run, s_run, noise_out[k] if noise_out is not None else None)
    tolerances = {n: output_tolerance(opts.rtol, eps, dtype, noise[n]) for n in outputs}
    checks = tally.checks({n: t[0] for n, t in tolerances.items()}, atol)
    for c in checks:
        c.tolerance, c.noise = tolerances[c.name][1], noise[c.name]
    report = finish(
        ValidationReport(
            all(c.passed for c in checks), base, atol, len(feeds), opts.provider, shapes, checks
        )
    )
    # Above the floor, float32 cannot tell rounding from a wrong model of the same size (a
    # weight changed by 1e-4 moves a noisy model's outputs as much as its own rounding does):
    # the float64 judge decides, where it can (a model past GRAY_MACS passes within the noise).
    undecided = [
        c
        for c in checks
        if (tally.exact[c.name] and c.max_abs_error > atol + base * tally.mag[c.name])
        or c.name in tally.values_differ
    ]
    if undecided:
        _judge(reference, shrunk, twin, feeds, tally, ref_out, new_out, undecided, eps, dtype, shapes,
               reference_dir, shrunk_dir, kind, judge_macs)  # fmt: skip
        for c in undecided:
            if c.rounding is True and opts.rtol is None:
                c.passed = True  # the same function: rounding
            elif c.rounding is False:
                c.passed = False  # another function, within the noise or not
        report.passed = all(c.passed for c in checks)
        report.seconds = time.perf_counter() - t0
    return report


# Multiply-adds of a model whose outputs above the floor but within the reference's noise are
# judged in float64 (about 0.5 s in onnx's reference evaluator); a larger one passes on its noise.
GRAY_MACS = 5e7


def _judge(
    reference: onnx.ModelProto,
    shrunk: onnx.ModelProto,
    twin: Callable[[], onnx.ModelProto] | None,
    feeds: list[dict[str, np.ndarray]],
    tally: ErrorTally,
    ref_out: list[list[np.ndarray]],
    new_out: list[list[np.ndarray]],
    outputs: list[OutputCheck],
    eps: float,
    dtype: str,
    shapes: dict[str, list[int]],
    reference_dir: str | Path | None,
    shrunk_dir: str | Path | None,
    kind: str,
    judge_macs: float | None,
) -> None:
    """The float64 judge on `outputs` (see onnxshrink.judge): up to judge_macs (default
    judge.MACS) when one of them failed its float32 tolerance, GRAY_MACS when all are within it."""
    if kind != "full":
        for c in outputs:
            c.judged = "a partial proof (--validate-layers) is not judged in float64"
        return
    from onnxshrink.proof.judge import MACS, Case, judge

    limit = MACS if judge_macs is None else judge_macs
    if all(c.passed for c in outputs):
        limit = min(limit, GRAY_MACS)
    case = Case(reference, shrunk, feeds, ref_out, new_out, eps, dtype, shapes, reference_dir, shrunk_dir)
    judge(case, twin, tally, outputs, limit)


def _refused_levels(
    ref_model: onnx.ModelProto,
    new_model: onnx.ModelProto,
    provider: str,
    reference_dir: str | Path | None,
    shrunk_dir: str | Path | None,
    ran_at: str,
    segments: int,
) -> tuple[str, str] | None:
    """Whether onnxruntime loads the shrunk model at every optimization level it loads the
    reference at: (the failure, or "" ; a note for the report). A model run in segments is
    loaded at the level it ran at only (a segment is not the model the optimizer would see)."""
    if segments > 1:
        return "", f"loaded at {ran_at} only (run in segments)"
    others = [lv for lv in levels() if lv != ran_at]
    refused = refusals(new_model, provider, shrunk_dir, others)
    if not refused:
        return None
    by_reference = refusals(ref_model, provider, reference_dir, list(refused))
    ours = [lv for lv in refused if lv not in by_reference]
    if ours:
        lv = ours[0]
        return (
            f"onnxruntime refuses to load it with graph optimization level {lv} "
            f"({refused[lv]}), where it loads the reference: users running it so could not",
            "",
        )
    return "", f"neither model loads at {', '.join(refused)} (onnxruntime refuses the reference there too)"

"""The proof: the shrunk model against the reference, run as users run them, each output against
its tolerance, the float64 judge where float32 cannot decide."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper

from onnxshrink.errors import ShrinkError
from onnxshrink.options import ShrinkOptions
from onnxshrink.proof.inputs import compared_values, graph_inputs, make_inputs, resolve_shapes
from onnxshrink.proof.sessions import (
    OFF,
    RunFailed,
    Serialized,
    default_level,
    levels,
    refusals,
    run_model,
    segment_bytes,
)

if TYPE_CHECKING:  # (the judge is imported where an output needs it)
    from onnxshrink.proof.judge import Twin
from onnxshrink.proof.verdict import (
    NOISE_FACTOR,
    ROUNDING_STEPS,
    ErrorTally,
    OutputCheck,
    ValidationReport,
    arithmetic,
    default_tolerance,
    output_tolerance,
)


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


@dataclass
class _Proof:
    """What one proof is given: both models (`*_dir`: where their external data are), the
    options, the arithmetic its tolerance follows, the inputs it runs on."""

    reference: onnx.ModelProto
    shrunk: onnx.ModelProto
    opts: ShrinkOptions
    reference_dir: str | Path | None
    shrunk_dir: str | Path | None
    dtype: str
    eps: float
    base: float  # the rtol given, or the dtype's floor
    t0: float
    shapes: dict[str, list[int]] = field(default_factory=dict)
    feeds: list[dict[str, np.ndarray]] = field(default_factory=list)

    @staticmethod
    def of(
        reference: onnx.ModelProto,
        shrunk: onnx.ModelProto,
        opts: ShrinkOptions,
        reference_dir: str | Path | None,
        shrunk_dir: str | Path | None,
    ) -> _Proof:
        """The proof of `shrunk` against `reference`: its clock started, its inputs drawn."""
        dtype, eps = arithmetic(reference)
        base = opts.rtol if opts.rtol is not None else default_tolerance(eps)
        t0 = time.perf_counter()
        proof = _Proof(reference, shrunk, opts, reference_dir, shrunk_dir, dtype, eps, base, t0)
        proof.shapes = resolve_shapes(reference, opts.shapes())
        proof.feeds = list(opts.inputs or []) + make_inputs(reference, proof.shapes, opts.draws, opts.seed)
        return proof

    def report(self, checks: list[OutputCheck]) -> ValidationReport:
        """The report of these checks: passed when every one did."""
        passed, opts = all(c.passed for c in checks), self.opts
        return ValidationReport(
            passed, self.base, opts.atol, len(self.feeds), opts.provider, self.shapes, checks
        )

    def not_run(self, tally: ErrorTally, error: str) -> ValidationReport:
        """The report of a shrunk model that did not load or run (`error`: why)."""
        checks = [OutputCheck(n, [], float("inf"), float("inf"), False) for n in tally.names]
        return ValidationReport(
            False, self.base, self.opts.atol, len(self.feeds), self.opts.provider, self.shapes, checks,
            time.perf_counter() - self.t0, error,
        )  # fmt: skip


@dataclass
class _ReferenceRuns:
    """The reference's outputs on `feeds` at `level`, its noise and the outputs that measured
    it, and the notes they left for the report."""

    feeds: list[dict[str, np.ndarray]]
    outputs: list[str]
    ref_out: list[list[np.ndarray]]
    level: str
    noise: dict[str, float | None]
    noise_out: list[list[np.ndarray]] | None
    notes: list[str]


class KnownRuns:
    """The reference's runs of one proof, for the next proof of the same reference (a
    recovery's tries: the reference and its inputs are the same, only the shrunk model
    differs), reused when the feeds and outputs are the same arrays; held by its caller, and
    let go with it."""

    def __init__(self) -> None:
        self.runs: _ReferenceRuns | None = None

    def of(self, feeds: list[dict[str, np.ndarray]], outputs: list[str]) -> _ReferenceRuns | None:
        runs = self.runs
        if runs is None or runs.outputs != outputs or len(runs.feeds) != len(feeds):
            return None
        same = all(
            a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
            for a, b in zip(runs.feeds, feeds, strict=True)
        )
        return runs if same else None


@dataclass
class _Compared:
    """The two models as the proof runs them, `kind` the part ("full": whole), with `outputs`
    compared; `integer`: their quantized products computed in integers; `detail`: how, for the
    report."""

    reference: onnx.ModelProto
    shrunk: onnx.ModelProto
    outputs: list[str]
    kind: str = "full"
    integer: bool = False
    detail: list[str] = field(default_factory=list)


def compare(
    reference: onnx.ModelProto,
    shrunk: onnx.ModelProto,
    opts: ShrinkOptions | None = None,
    reference_dir: str | Path | None = None,
    shrunk_dir: str | Path | None = None,
    twin: Callable[[bool], Twin] | None = None,
    judge_macs: float | None = None,
    kept: Mapping[str, Mapping[int, np.ndarray]] | None = None,
    known: KnownRuns | None = None,
) -> ValidationReport:
    """Run both models on the given and random inputs as users run them (onnxruntime's default
    graph optimizations), one after the other (the reference's outputs kept, its session freed
    before the shrunk model's is made); the worst error per output, against a tolerance per
    output derived from the reference's own noise (the reference run again with the
    optimizations off) unless one is given. The shrunk model must load at every optimization
    level the reference loads at. An output off by more than the dtype's floor (or the rtol
    given) is judged in float64 (onnxshrink.proof.judge; `twin(streamed)` makes the shrink of the
    reference widened to float64; `judge_macs` bounds the model size judged): another function fails,
    rounding passes, or under a given rtol fails as rounding. `*_dir`: where each model's
    external data are. With `opts.validate_layers`, only the first blocks are compared (see
    onnxshrink.proof.segment.prefix), each on the indices the shrink kept (`kept`: per tensor
    that lost indices, the kept mask of each such axis). `known`: the reference's runs of an
    earlier proof of the same reference, reused by a whole proof on the same inputs (its runs
    kept there for the next)."""
    proof = _Proof.of(reference, shrunk, opts or ShrinkOptions(), reference_dir, shrunk_dir)
    models = _compared(proof, kept or {})
    runs = _Runs(proof, models)
    # The emulated products are what quantized kernels compute; at the default level
    # onnxruntime fuses the model's remaining Q/DQ pairs into int8 kernels that requantize
    # each step on their own, and a deep network's output then moves by whole quantization
    # steps with any change of float order (ResNet-50, QDQ: 0.1 between the levels for the
    # reference itself). Both models run with optimizations off; each still loads at every level.
    level = OFF if models.integer else default_level()
    ref = _reference_runs(proof, models, runs, level, known)
    ref_out, level, noise, noise_out = ref.ref_out, ref.level, ref.noise, ref.noise_out
    models.detail += [_how_run(proof, level), runs.order()]
    tally = ErrorTally(models.outputs)
    new_out, failure = _run_shrunk(proof, models, runs, level, ref_out)
    if new_out is None:
        return _finished(proof.not_run(tally, failure), proof, models, level)
    checks = _checks(proof, tally, ref_out, new_out, noise_out, noise)
    _finite_where_failed(proof, checks, ref_out)
    report = _finished(proof.report(checks), proof, models, level)
    _judge_undecided(proof, models.kind, report, tally, ref_out, new_out, twin, judge_macs)
    return report


def _reference_runs(
    proof: _Proof, models: _Compared, runs: _Runs, level: str, known: KnownRuns | None
) -> _ReferenceRuns:
    """The reference's outputs as users run it and its noise: `known`'s when on the same
    inputs (the same model, run again, gives the same arrays: deterministic compute), else run.
    Not for a partial proof: its reference is narrowed to the indices each shrink kept."""
    known = known if models.kind == "full" else None
    ref = known.of(proof.feeds, models.outputs) if known is not None else None
    if ref is None:
        notes: list[str] = []
        ref_out, level = _reference_outputs(proof, runs, level, notes)
        noise, noise_out = _reference_noise(runs, level, models.outputs, ref_out, notes)
        ref = _ReferenceRuns(proof.feeds, models.outputs, ref_out, level, noise, noise_out, notes)
        if known is not None:
            known.runs = ref
    runs.release(0)
    models.detail += ref.notes
    return ref


def _finished(report: ValidationReport, proof: _Proof, models: _Compared, level: str) -> ValidationReport:
    """`report` with what was proven and how, and the time it took."""
    report.kind, report.detail = models.kind, "; ".join(models.detail)
    report.dtype, report.eps = proof.dtype, proof.eps
    report.level, report.rtol_given = level, proof.opts.rtol is not None
    report.seconds = time.perf_counter() - proof.t0
    return report


def _compared(proof: _Proof, kept: Mapping[str, Mapping[int, np.ndarray]]) -> _Compared:
    """The models the proof runs: the first blocks with `--validate-layers`, else the whole
    models; each computed as its kernels compute it where onnxruntime would not (both alike)."""
    from onnxshrink.proof.emulate import emulated, needs_emulation
    from onnxshrink.proof.qdq import float_activations, integer_products

    opts = proof.opts
    models = _Compared(proof.reference, proof.shrunk, [o.name for o in proof.reference.graph.output])
    if opts.validate_layers is not None:
        _first_blocks(models, opts.validate_layers, kept)
    if needs_emulation(models.reference):
        models.reference, models.shrunk = emulated(models.reference), emulated(models.shrunk)
        models.detail.append(
            "bfloat16 arithmetic emulated in float32, each bfloat16 tensor rounded to bfloat16: "
            "onnxruntime has few bfloat16 kernels"
        )
    integer = integer_products(models.reference, proof.reference_dir)
    if integer is not None:  # both alike: the reference's products, and the shrunk model's
        models.reference = integer
        models.shrunk = integer_products(models.shrunk, proof.shrunk_dir) or models.shrunk
        models.integer = True
        models.detail.append(
            "products of dequantized operands accumulated in integers, as quantized kernels do: "
            "in float32 a QuantizeLinear after them can round differently when zero terms are removed"
        )
    floats = float_activations(models.reference)
    if floats is not None:
        models.reference, models.shrunk = floats, float_activations(models.shrunk) or models.shrunk
        models.detail.append(
            "MatMulNBits with float32 activations (accuracy_level 0): at run time int8 activations "
            "can round differently when float rounding moves a value by an ulp"
        )
    return models


def _first_blocks(models: _Compared, n: int, kept: Mapping[str, Mapping[int, np.ndarray]]) -> None:
    """`models` cut to their first `n` repeated blocks (`--validate-layers n`), compared on the
    tensors after them, the reference's on the indices the shrink kept (`kept`: a pruned hidden
    width leaves them narrower); left whole when the model has no more than `n`."""
    from onnxshrink.proof.segment import blocks, on_kept, prefix

    reference, shrunk = models.reference, models.shrunk
    found = blocks(reference)
    if found is None:
        raise ShrinkError(
            "--validate-layers: the model's node order has no repeated blocks to count; "
            "validate it whole (omit --validate-layers)."
        )
    if n >= found.count:  # the whole model is proven
        return
    head = prefix(reference, found.end(n))
    tail = prefix(shrunk, 0, head.outputs) if head is not None else None
    if head is None or tail is None:
        raise ShrinkError(
            f"--validate-layers {n}: the tensors after block {n} are not all in the shrunk "
            "model (or their types are unknown); validate it whole (omit --validate-layers)."
        )
    narrowed = {o: kept[o] for o in head.outputs if o in kept}
    models.reference, models.shrunk, models.outputs = on_kept(head.model, narrowed), tail.model, head.outputs
    models.kind = f"first {n} of {found.count} repeated blocks"
    compared = ", ".join(
        o + (f" (on its kept {_kept_text(narrowed[o])})" if o in narrowed else "") for o in head.outputs
    )
    models.detail.append(f"{head.nodes} of {len(reference.graph.node)} nodes; compared: {compared}")


def _kept_text(axes: Mapping[int, np.ndarray]) -> str:
    return ", ".join(f"{int(k.sum())} of {len(k)} along axis {a}" for a, k in sorted(axes.items()))


class _Runs:
    """Both models run on the proof's feeds, one session at a time, each whole or in segments
    (split by weight bytes), with a progress bar."""

    def __init__(self, proof: _Proof, models: _Compared):
        from onnxshrink.proof.segment import pieces

        self.proof, self.models = proof, models
        self.parts = [pieces(m, segment_bytes(m)) for m in (models.reference, models.shrunk)]
        self.counts = [len(p) if p else 1 for p in self.parts]
        # each model run whole is serialized once for all its sessions, its large weights apart
        # (sessions.Serialized: the reference's are inline, 100 MB for ResNet-50's), and dropped
        # after its last one
        self.data: list[Serialized | None] = [None, None]

    def bytes_of(self, k: int) -> Serialized | None:
        """Model k's bytes for a session of it whole (made on first use); None in segments."""
        if self.parts[k] or self.data[k] is not None:
            return self.data[k]
        from onnxshrink.proof.sessions import weights_apart

        self.data[k] = weights_apart((self.models.reference, self.models.shrunk)[k])
        return self.data[k]

    def release(self, k: int) -> None:
        """Model k has had its last session: its bytes are dropped."""
        self.data[k] = None

    def reference(self, at: str, what: str) -> list[list[np.ndarray]]:
        """The reference's outputs on every feed, at graph optimization level `at`."""
        return self._run(0, self.models.reference, self.proof.reference_dir, at, what)

    def shrunk(self, at: str) -> list[list[np.ndarray]]:
        """The shrunk model's outputs on every feed, at graph optimization level `at`."""
        return self._run(1, self.models.shrunk, self.proof.shrunk_dir, at, "proof: shrunk")

    def order(self) -> str:
        """How they ran, for the report."""
        segments = f", in {self.counts[0]} and {self.counts[1]} segments" if max(self.counts) > 1 else ""
        return "reference, then shrunk model" + segments

    def _run(
        self, k: int, model: onnx.ModelProto, data_dir: str | Path | None, at: str, what: str
    ) -> list[list[np.ndarray]]:
        from onnxshrink.progress import bar

        opts, feeds, outputs = self.proof.opts, self.proof.feeds, self.models.outputs
        with bar(len(feeds) * self.counts[k], what, "run", opts.progress) as progress:
            parts, data = self.parts[k], self.bytes_of(k)
            return run_model(model, feeds, outputs, opts.provider, data_dir, progress, parts, at, data)


def _reference_outputs(
    proof: _Proof, runs: _Runs, level: str, detail: list[str]
) -> tuple[list[list[np.ndarray]], str]:
    """The reference's outputs as users run it (at `level`), and the level they ran at: with the
    optimizations off where it does not load at `level`. ShrinkError when it does not run."""
    try:
        return runs.reference(level, "proof: reference"), level
    except RunFailed as exc:
        if not exc.loading or level == OFF:
            raise ShrinkError(_reference_failed(proof.reference, proof.opts, proof.shapes, exc)) from exc
        detail.append(
            f"the reference does not load at onnxruntime's default optimizations ({level}: "
            f"{exc}): both models run with them off"
        )
        try:
            return runs.reference(OFF, "proof: reference"), OFF
        except RunFailed as exc2:
            raise ShrinkError(_reference_failed(proof.reference, proof.opts, proof.shapes, exc2)) from exc2


def _reference_noise(
    runs: _Runs, level: str, outputs: list[str], ref_out: list[list[np.ndarray]], detail: list[str]
) -> tuple[dict[str, float | None], list[list[np.ndarray]] | None]:
    """The reference's own noise per output (None: not measured), and its outputs that measured
    it: the same inputs in another valid float order (optimizations off, when it ran with them)."""
    noise: dict[str, float | None] = dict.fromkeys(outputs)
    if level == OFF:
        return noise, None
    try:
        noise_out = runs.reference(OFF, "proof: reference's noise")
    except RunFailed as exc:
        detail.append(f"the reference's noise not measured: with optimizations off it {exc}")
        return noise, None
    spread = ErrorTally(outputs)
    for r_run, o_run in zip(ref_out, noise_out, strict=True):
        spread.add(r_run, o_run)
    return {n: spread.relative(n) for n in outputs}, noise_out


def _how_run(proof: _Proof, level: str) -> str:
    """How the models ran and what their tolerance is, for the report."""
    floor = f"rtol {default_tolerance(proof.eps):g} for {proof.dtype} arithmetic"
    given = proof.opts.rtol is not None
    if level == OFF:
        return f"onnxruntime with graph optimizations off ({OFF})" + ("" if given else f"; {floor}")
    how = f"onnxruntime's default graph optimizations ({level}), as users run it"
    if not given:
        how += (
            f"; tolerance per output: {NOISE_FACTOR:g} x the reference's own noise (its outputs with "
            f"them off), and at least {floor}"
        )
    return how


def _run_shrunk(
    proof: _Proof, models: _Compared, runs: _Runs, level: str, ref_out: list[list[np.ndarray]]
) -> tuple[list[list[np.ndarray]] | None, str]:
    """The shrunk model's outputs at `level`, or None and why it failed: it did not run there,
    or onnxruntime refuses it at a level it loads the reference at."""
    try:
        new_out = runs.shrunk(level)
    except RunFailed as exc:
        at = f" at {level}" if exc.loading and level != OFF else ""
        return None, f"{exc}{at}"
    if models.kind != "full":
        _same_frontier_shapes(models.outputs, ref_out[0], new_out[0])
    refused = _refused_levels(
        models.reference, models.shrunk, proof.opts.provider, proof.reference_dir, proof.shrunk_dir, level,
        max(runs.counts), runs.bytes_of(1),
    )  # fmt: skip
    runs.release(1)
    if refused is not None:
        failure, note = refused
        if failure:
            return None, failure
        models.detail.append(note)
    return new_out, ""


def _same_frontier_shapes(outputs: list[str], ref_out: list[np.ndarray], new_out: list[np.ndarray]) -> None:
    """A partial proof compares the tensors after the blocks: ShrinkError when one's shape differs."""
    for name, r, s in zip(outputs, ref_out, new_out, strict=True):
        if r.shape != s.shape:
            raise ShrinkError(
                f"--validate-layers: tensor '{name}' after the blocks has shape {list(s.shape)} "
                f"in the shrunk model, {list(r.shape)} in the reference: not comparable there; "
                "validate it whole (omit --validate-layers)."
            )


def _checks(
    proof: _Proof,
    tally: ErrorTally,
    ref_out: list[list[np.ndarray]],
    new_out: list[list[np.ndarray]],
    noise_out: list[list[np.ndarray]] | None,
    noise: dict[str, float | None],
) -> list[OutputCheck]:
    """Each output's worst error over the feeds against its tolerance."""
    for k, (r_run, s_run) in enumerate(zip(ref_out, new_out, strict=True)):
        tally.add(r_run, s_run, noise_out[k] if noise_out is not None else None)
    tolerances = {n: output_tolerance(proof.opts.rtol, proof.eps, proof.dtype, noise[n]) for n in tally.names}
    checks = tally.checks({n: t[0] for n, t in tolerances.items()}, proof.opts.atol)
    for c in checks:
        c.tolerance, c.noise = tolerances[c.name][1], noise[c.name]
    return checks


def _finite_where_failed(proof: _Proof, checks: list[OutputCheck], ref_out: list[list[np.ndarray]]) -> None:
    """ShrinkError when an output that failed is not finite in the reference itself (NaN or Inf
    on some feed): the inputs, not the shrink, are what to change. NaN where both models give
    NaN, and the same infinity in both, are equal (verdict.float_error): this is a NaN or an
    infinity in one only."""
    names = [c.name for c in checks]
    for c in checks:
        if c.passed:
            continue
        k = names.index(c.name)
        for f, run in enumerate(ref_out):
            value = np.asarray(run[k])
            if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
                given = len(proof.opts.inputs or [])
                where = f"the arrays given with --inputs (#{f + 1})" if f < given else "the random inputs"
                shapes = " ".join(f"{n}:{','.join(map(str, d))}" for n, d in proof.shapes.items())
                raise ShrinkError(
                    f"the reference model (the input, masks applied) is not finite on {where} "
                    f"(output '{c.name}' holds {int((~np.isfinite(value)).sum())} NaN or Inf "
                    f"value(s), inputs at {shapes}), and the shrunk model differs there, so the "
                    "proof cannot tell whether they compute the same function. Give real inputs "
                    "the model is finite on with --inputs FILE.npz (--draws 0 proves it on those "
                    "alone)."
                )


def _judge_undecided(
    proof: _Proof,
    kind: str,
    report: ValidationReport,
    tally: ErrorTally,
    ref_out: list[list[np.ndarray]],
    new_out: list[list[np.ndarray]],
    twin: Callable[[bool], Twin] | None,
    judge_macs: float | None,
) -> None:
    """Above ROUNDING_STEPS epsilons (the floor, or a given rtol), float32 cannot tell rounding
    from a wrong model of the same size (a weight changed by 1e-4 moves a noisy model's outputs
    as much as its own rounding does; one weight element off by 1e-4 moves an LLM's by 3e-6):
    the float64 judge decides the outputs there, where it can (a model past GRAY_MACS passes
    within the noise), and `report` follows its verdicts."""
    atol, base = proof.opts.atol, proof.base
    if proof.opts.rtol is None and kind == "full":
        base = min(base, ROUNDING_STEPS * proof.eps)
    undecided = [
        c
        for c in report.outputs
        if (tally.exact[c.name] and c.max_abs_error > atol + base * tally.mag[c.name])
        or c.name in tally.values_differ
    ]
    if not undecided:
        return
    if kind != "full":
        for c in undecided:
            c.judged = "a partial proof (--validate-layers) is not judged in float64"
    else:
        _judge(proof, twin, tally, ref_out, new_out, undecided, judge_macs, base)
    for c in undecided:
        if c.rounding is True and proof.opts.rtol is None:
            c.passed = True  # the same function: rounding
        elif c.rounding is False:
            c.passed = False  # another function, within the noise or not
    report.passed = all(c.passed for c in report.outputs)
    report.seconds = time.perf_counter() - proof.t0


# Multiply-adds computed by onnx's reference evaluator (ops onnxruntime has no float64 kernel
# for: Conv, ...) of a model whose outputs above the floor but within the reference's noise are
# judged in float64 (a few seconds); a model past it passes on its noise there. Outputs past
# their tolerance are judged whatever the model (onnxshrink.proof.judge, in pieces).
GRAY_MACS = 5e8


def _judge(
    proof: _Proof,
    twin: Callable[[bool], Twin] | None,
    tally: ErrorTally,
    ref_out: list[list[np.ndarray]],
    new_out: list[list[np.ndarray]],
    outputs: list[OutputCheck],
    judge_macs: float | None,
    past: float,
) -> None:
    """The float64 judge on `outputs` (off by more than `past`; see onnxshrink.proof.judge):
    always when one of them failed its float32 tolerance (up to `judge_macs` when given: a
    recovery's try), when all are within it up to GRAY_MACS of the reference evaluator's work."""
    from onnxshrink.proof.judge import Case, judge
    from onnxshrink.proof.widen import evaluator_macs

    case = Case(
        proof.reference, proof.shrunk, proof.feeds, ref_out, new_out, proof.eps, proof.dtype, proof.shapes,
        proof.reference_dir, proof.shrunk_dir,
    )  # fmt: skip
    if all(c.passed for c in outputs):
        slow = evaluator_macs(proof.reference, proof.shapes)
        if slow > GRAY_MACS:
            for c in outputs:
                c.judged = (
                    f"within the reference's noise; {slow / 1e9:.2g} G multiply-adds with no float64 "
                    "kernel in onnxruntime are not judged there"
                )
            return
    proof.opts.say(f"judging {len(outputs)} output(s) in float64 (their float32 error is past {past:.2g}) ...")
    judge(case, twin, tally, outputs, judge_macs)


def _refused_levels(
    ref_model: onnx.ModelProto,
    new_model: onnx.ModelProto,
    provider: str,
    reference_dir: str | Path | None,
    shrunk_dir: str | Path | None,
    ran_at: str,
    segments: int,
    data: Serialized | None = None,
) -> tuple[str, str] | None:
    """Whether onnxruntime loads the shrunk model at every optimization level it loads the
    reference at: (the failure, or "" ; a note for the report). A model run in segments is
    loaded at the level it ran at only (a segment is not the model the optimizer would see).
    `data`: the shrunk model's bytes, as its run had them."""
    if segments > 1:
        return "", f"loaded at {ran_at} only (run in segments)"
    others = [lv for lv in levels() if lv != ran_at]
    refused = refusals(new_model, provider, shrunk_dir, others, data)
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

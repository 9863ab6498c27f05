"""What a shrink prints: its proof, its sizes, what it changed beyond the masks, what it kept
and why (--explain), and what it wrote."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from typing import Any

#: how the command line says a line (print, or nothing under -q)
Say = Callable[[str], None]


def print_result(
    result: Any, args: argparse.Namespace, say: Say, timings: dict[str, float] | None = None
) -> None:
    """Say everything a shrink's `result` holds, in the order a reader needs it (`timings`: a
    prune's phases, its shrink's inside, instead of the shrink's alone)."""
    from onnxshrink.report import stats_table, summary

    if result.renamed_nodes:
        (old, new), n = result.renamed_nodes[0], len(result.renamed_nodes)
        say(
            f"[W] {n} node(s) had the name of another node (e.g. '{old}'), which onnxruntime "
            f"refuses: the output names them apart (e.g. '{new}')"
        )
    if result.validation is not None:
        for line in result.validation.lines():
            say(line)
    else:
        say("[W] validation skipped (--no-validate): the output is not proven equivalent")
    for line in stats_table(result.before, result.after, timings or result.timings):
        say(line)
    say(f"[I] {summary(result.before, result.after, Counter(f.into for f in result.folds))}")
    _say_interface(result, say)
    _say_recovery(result, args, say)
    _say_folds(result, say)
    _say_removed(result, args, say)
    _say_kept(result, args, say)
    _say_sparsity(result, args, say)
    _say_written(result, args, say)


def _say_interface(result: Any, say: Say) -> None:
    """Graph inputs and outputs whose shapes changed, and the runtime configs that follow them."""
    if result.interface_changes:
        say(
            f"[W] {len(result.interface_changes)} graph input(s)/output(s) changed shape (a state "
            "the runtime feeds back, e.g. a KV cache whose heads were removed): the runtime must "
            "feed the new shapes"
        )
        for change in result.interface_changes:
            say(f"[W]     {change.text()}")
    for note in result.runtime_configs:
        say(f"[{'I' if note.get('written') else 'W'}] {note['text']}")


def _say_recovery(result: Any, args: argparse.Namespace, say: Say) -> None:
    """What a failed first proof kept back, and the masks that bound nowhere."""
    if result.kept_after_failed_proof:
        kept = result.kept_after_failed_proof
        why = (
            "This is a bug in onnxshrink's analysis (or in onnxruntime, where it refused the "
            "shrunk model): please report it with the model."
            if result.first_failure_bug
            else "The float64 judge could not decide it: it may be rounding, which no removal "
            "causes (a larger --rtol would keep them); if it is not, please report it with the model."
        )
        say(
            f"[W] the first proof failed ({result.first_failure}); {len(kept)} tensor axis/axes "
            f"were kept whole to pass, {sum(k['indices'] for k in kept)} index(es) in all. {why}"
        )
        for k in kept[: 10 if not args.explain else None]:
            say(f"[W]     {k['tensor']} (axis {k['axis']}): {k['indices']} kept back")
    if result.unbound_masks:
        names = ", ".join(f"'{n}'" for n in result.unbound_masks[:10])
        say(
            f"[W] {len(result.unbound_masks)} mask(s) matched no initializer and were ignored (--allow-unbound): {names}"
        )


def _say_folds(result: Any, say: Say) -> None:
    """The constant channels folded into their consumers, and the normalizations that lost
    channels but keep their statistics."""
    from onnxshrink.report import STATISTICS

    folds = [f for f in result.folds if f.into not in STATISTICS]
    if folds:
        n = sum(f.channels for f in folds)
        kinds = Counter(f.into for f in folds if f.into != "bias")
        how = ", ".join(f"{k} as {kind}s" for kind, k in sorted(kinds.items()))
        say(
            f"[I] folded {n} constant channel(s) into {len(folds)} consumer(s)"
            + (f" ({how}, for zero padding at the borders)" if how else "")
        )
    statistics = Counter(f.into for f in result.folds if f.into in STATISTICS)
    if statistics:
        how = ", ".join(f"{k} {kind}" for kind, k in sorted(statistics.items()))
        say(
            f"[I] {sum(statistics.values())} normalization(s) lost zero channels and keep the "
            f"statistics of their original width: {how}"
        )


def _say_removed(result: Any, args: argparse.Namespace, say: Say) -> None:
    """Which indices of which weights went: counted per weight, each listed under --explain."""
    gone = result.removed_slices
    if not gone:
        return
    say(
        f"[I] {sum(len(r['removed']) for r in gone)} slice(s) removed from {len(gone)} weight "
        "axis/axes" + (":" if args.explain else "; the report lists them, --explain too")
    )
    if args.explain:
        for r in gone:
            say(
                f"[I]     {r['tensor']} (axis {r['axis']}): {len(r['removed'])} of {r['size']} "
                f"removed ({_indices(r['removed'])}), {r['kept']} kept"
            )


def _indices(idx: list[int]) -> str:
    """Indices as runs: 0-3, 7, 9-10."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _say_kept(result: Any, args: argparse.Namespace, say: Say) -> None:
    """The nodes replayed, the nodes that keep every channel and the zeroed slices kept (each
    with its reason under --explain)."""
    from onnxshrink.report import human

    if result.replayed:
        ops = sorted({r["op"] for r in result.replayed})
        say(
            f"[I] {len(result.replayed)} node(s) with no rule were replayed in onnxruntime "
            f"({', '.join(ops)}); --explain says what each passes through"
        )
        if args.explain:
            for r in result.replayed:
                say(f"[I]     node {r['node']!r} ({r['op']}): {r['finding']}")
    if result.barriers:
        unsupported = sorted({b["op"] for b in result.barriers if b["unsupported"]})
        whole = sorted({b["op"] for b in result.barriers if not b["unsupported"]})
        what = ([f"unsupported: {', '.join(unsupported)}"] if unsupported else []) + (
            [f"kept whole by their handler: {', '.join(whole)}"] if whole else []
        )
        say(
            f"[W] {len(result.barriers)} node(s) keep all their channels ({'; '.join(what)}); "
            "--explain says why"
        )
    kept = sum(g.count for g in result.kept_zeroed)
    in_slices = sum(s.in_zero_slices for s in result.sparsity)
    if kept:
        say(
            f"[I] {kept} zeroed slice(s) had to be kept"
            + (f" ({human(in_slices)} zero weights)" if in_slices else "")
            + ("" if args.explain else "; --explain says why")
        )
    if args.explain and not kept and not result.barriers:
        say("[I] --explain: no zeroed slice was kept back: every one was removed")
    if args.explain:
        for g in result.kept_zeroed:
            where = f" in {g.module}" if g.module else ""
            say(f"[I]     {g.tensor}{where} (axis {g.axis}): {g.count} kept: {g.reason}")
        for b in result.barriers:
            say(f"[I]     node {b['node'] or '(unnamed)'!r} ({b['op']}): {b['reason']}")


def _say_sparsity(result: Any, args: argparse.Namespace, say: Say) -> None:
    """The zero weights left inside kept channels."""
    from onnxshrink.report import human

    unstructured = [s for s in result.sparsity if s.zeros > 0]
    zeros = sum(s.zeros * s.elements for s in unstructured)
    if zeros:
        say(
            f"[I] {human(zeros)} zero weights remain inside kept channels (unstructured sparsity shrinking cannot remove)"
        )
        if args.explain or args.verbose:
            for s in unstructured:
                say(f"[I]     {s.tensor}: {s.zeros:.1%} zeros of {human(s.elements)}")


def _say_written(result: Any, args: argparse.Namespace, say: Say) -> None:
    """What was written, or why nothing was."""
    from onnxshrink.report import human_bytes

    if result.written and result.grew:
        say(f"[W] {result.grew}")
    if result.written:
        say(f"[I] saved {', '.join(result.written)} ({human_bytes(result.after.file_bytes)})")
    elif args.output is None:
        say("[W] no -o given: nothing written")
    elif not result.passed:
        say(f"[E] {args.output} not written: validation failed")

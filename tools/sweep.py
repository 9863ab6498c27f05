"""Shrink thousands of random graphs (models/randgraph.py) and count what goes wrong.

Each seed: build, `shrink(model, validate=False)`, then an independent onnxruntime check (as in
tests/test_random_graphs.py): outputs within 1e-5 of max |ref| on 2 draws (dynamic dims 2 and
3) — or, where not, within 10x the reference's own float32 rounding on that output (its distance
from the graph computed in float64: an output that is a small remainder of cancellation cannot
be judged closer; counted apart) —, the shrunk model loads and runs, float parameters do not
grow. Prints the counts per failure
class (wrong outputs; does not load/run in onnxruntime; exception in shrink, by type, first
line and where in onnxshrink it was raised; parameters grew; input model modified; generator),
the seeds of each, and the time per graph. A wrong output's seed shows its max relative error
and, as a diagnosis only, the reference's own rounding noise (float32 onnxruntime against the
graph computed in float64): an error far above it is not rounding.

With --validate, each seed is also shrunk with validation on (no recovery): the proof must pass
on the first try. A first proof that fails is counted by what the tests' own float64 judge
(models.randgraph.rounding_only, on the inputs the proof ran) calls it: rounding (the proof
called rounding a failure) or not (a wrong model, or a judge that disagrees).

    python tools/sweep.py --seeds 5000 --start 0 [--validate] [--save DIR] [-v]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.randgraph import (  # noqa: E402  (the repository root)
    BATCHES,
    check,
    feeds,
    reference_noise,
    rounding_only,
    save_failure,
)


def first_proof(model, info) -> tuple[str, str]:
    """Shrink with validation on and no recovery: ("passed" | "judged" (passed by the float64
    judge) | "rounding" | "failed" | "exception", detail)."""
    from onnxshrink import ValidationFailed, shrink
    from onnxshrink.proof.inputs import make_inputs, resolve_shapes

    # the first draw's sizes, as the independent check's: symbolic H and W have their own
    sizes = info.get("sizes", {})
    shapes = {"input": [sizes.get(d, BATCHES[0]) if isinstance(d, str) else d for d in info["input_shape"]]}
    try:
        result = shrink(model, input_shapes=shapes, recover=False)
    except ValidationFailed as exc:
        if exc.result is None or exc.result.validation is None:
            return "failed", str(exc)[:160]
        v = exc.result.validation
        bad = {o.name for o in v.outputs if not o.passed}
        worst = max((o.max_rel_error for o in v.outputs if not o.passed), default=0.0)
        if v.error is None:
            inputs = make_inputs(model, resolve_shapes(model, shapes), v.draws, 0)
            if any(bad & rounding_only(model, exc.result.model, feed) for feed in inputs):
                return "rounding", f"error {worst:.2g}: {[o.judged for o in v.outputs if not o.passed]}"
        return "failed", v.error or f"error {worst:.2g}: {[o.judged for o in v.outputs if not o.passed]}"
    except Exception as exc:  # a generator's or a shrink's fault: counted, shown
        return "exception", f"{type(exc).__name__}: {str(exc)[:160]}"
    judged = any(o.rounding for o in result.validation.outputs) if result.validation else False
    return ("judged" if judged else "passed"), ""


def subclass(failure: str, detail: str) -> str:
    """What to group a failure by beside its class: an exception's type and first line, with
    numbers and node names generalized; for wrong outputs, nothing."""
    if failure in ("wrong outputs", "parameters grew"):
        return ""
    line = detail.splitlines()[0] if detail else ""
    line, at, where = line.partition(" [at ")
    line = re.sub(r"\b([a-z_]+)_\d+(_o\d+)?\b", r"\1_#", line)  # node / tensor names
    line = re.sub(r"\d+", "#", line)
    return re.sub(r"\[#(, #)*\]", "[#, ...]", line) + at + where  # index lists of any length


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=1000, help="how many seeds")
    ap.add_argument("--start", type=int, default=0, help="the first seed")
    ap.add_argument("--save", metavar="DIR", help="write each failing model there as seed_N.onnx")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per failing seed")
    ap.add_argument("--validate", action="store_true", help="also shrink with validation on: the first proof must pass")
    args = ap.parse_args(argv)
    proofs: dict[str, list[int]] = defaultdict(list)
    proof_detail: dict[int, str] = {}
    proof_times: list[float] = []

    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    times, shrink_times, rel = [], [], {}
    rounding: list[int] = []  # passed, some output off by the reference's own rounding only
    t0 = time.perf_counter()
    for seed in range(args.start, args.start + args.seeds):
        out = check(seed)
        times.append(out.seconds)
        shrink_times.append(out.shrink_seconds)
        if args.validate and out.model is not None and out.failure != "generator":
            t1 = time.perf_counter()
            verdict, detail = first_proof(out.model, out.info)
            proof_times.append(time.perf_counter() - t1)
            proofs[verdict].append(seed)
            if detail:
                proof_detail[seed] = detail
            if args.verbose and verdict in ("rounding", "failed", "exception"):
                print(f"seed {seed}: first proof {verdict}: {detail}", flush=True)
        if out.failure is None:
            if out.rounding:
                rounding.append(seed)
            continue
        groups[out.failure][subclass(out.failure, out.detail)].append(seed)
        if out.failure == "wrong outputs":
            try:
                noise = reference_noise(out.reference, feeds(out.info, seed)[-1])
            except Exception:
                noise = float("nan")
            rel[seed] = (out.max_rel_err, noise)
        if args.save:
            save_failure(out, args.save)
        if args.verbose:
            print(out.summary(), flush=True)
    wall = time.perf_counter() - t0

    failed = sum(len(s) for g in groups.values() for s in g.values())
    print(f"{args.seeds} seeds ({args.start}..{args.start + args.seeds - 1}): {args.seeds - failed} passed, {failed} failed")
    if rounding:
        print(f"passed, some output off by rounding only (a remainder of cancellation; same in float64): "
              f"{len(rounding)}, seeds {', '.join(map(str, rounding))}")
    order = ["wrong outputs", "does not load/run in onnxruntime", "exception in shrink",
             "parameters grew", "input model modified", "generator"]
    for cls in order:
        subs = groups.get(cls, {})
        print(f"\n{cls}: {sum(len(s) for s in subs.values())}")
        for sub, seeds in sorted(subs.items(), key=lambda kv: -len(kv[1])):
            if sub:
                print(f"  {len(seeds):5d}  {sub}")
            shown = ", ".join(
                str(s) + (f" (err {rel[s][0]:.2g}, ref noise {rel[s][1]:.1g})" if s in rel else "") for s in seeds
            )
            print(f"         seeds: {shown}")
    if args.validate:
        n = sum(len(v) for v in proofs.values())
        print(f"\nvalidation on ({n} seeds, no recovery): first proof passed {len(proofs['passed'])}, "
              f"passed by the float64 judge {len(proofs['judged'])}")
        for verdict, what in (("rounding", "failed, and float64 (rounding_only) calls it rounding"),
                              ("failed", "failed, not rounding"), ("exception", "raised")):
            seeds = proofs.get(verdict, [])
            print(f"  {what}: {len(seeds)}" + (f", seeds {', '.join(map(str, seeds))}" if seeds else ""))
            for seed in seeds[:20]:
                print(f"    seed {seed}: {proof_detail.get(seed, '')}")
        if proof_times:
            print(f"  time per proved shrink: mean {statistics.mean(proof_times) * 1e3:.1f} ms, "
                  f"max {max(proof_times) * 1e3:.1f} ms")
    if args.save and failed:
        print(f"\nfailing models written to {args.save}/seed_N.onnx")
    print(
        f"\ntime per graph: mean {statistics.mean(times) * 1e3:.1f} ms, median "
        f"{statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms (build + shrink + "
        f"onnxruntime); shrink alone: mean {statistics.mean(shrink_times) * 1e3:.1f} ms, max "
        f"{max(shrink_times) * 1e3:.1f} ms; wall {wall:.1f} s"
    )
    bad_proofs = args.validate and any(proofs.get(v) for v in ("rounding", "failed", "exception"))
    return 1 if failed or bad_proofs else 0


if __name__ == "__main__":
    sys.exit(main())

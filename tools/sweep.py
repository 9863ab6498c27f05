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

    python tools/sweep.py --seeds 5000 --start 0 [--save DIR] [-v]
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
from models.randgraph import check, feeds, reference_noise, save_failure  # noqa: E402  (the repository root)


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
    args = ap.parse_args(argv)

    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    times, shrink_times, rel = [], [], {}
    rounding: list[int] = []  # passed, some output off by the reference's own rounding only
    t0 = time.perf_counter()
    for seed in range(args.start, args.start + args.seeds):
        out = check(seed)
        times.append(out.seconds)
        shrink_times.append(out.shrink_seconds)
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
    if args.save and failed:
        print(f"\nfailing models written to {args.save}/seed_N.onnx")
    print(
        f"\ntime per graph: mean {statistics.mean(times) * 1e3:.1f} ms, median "
        f"{statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms (build + shrink + "
        f"onnxruntime); shrink alone: mean {statistics.mean(shrink_times) * 1e3:.1f} ms, max "
        f"{max(shrink_times) * 1e3:.1f} ms; wall {wall:.1f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The replay oracle over many seeds: per registered op, how often its rule keeps more input
indices than the replay finds needed (imprecision), and whether it ever keeps fewer (a bug).

    python tools/oracle.py --seeds 50            # every op with a case
    python tools/oracle.py --seeds 200 --ops Conv,Gemm
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.oracle import compare  # noqa: E402
from onnxshrink.ops.oracle import case_ops, excluded_ops, oracle_case  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=50, help="cases per op")
    ap.add_argument("--ops", default="", help="comma-separated ops (default: all with a case)")
    args = ap.parse_args(argv)
    ops = args.ops.split(",") if args.ops else case_ops()
    print(f"{'op':26s} {'cases':>5s} {'judged':>6s} {'rule kept more':>14s} {'extra idx':>9s} {'bugs':>4s} {'ms/case':>7s}")
    bugs = 0
    for op in ops:
        t = time.perf_counter()
        judged = more = extra = missing = 0
        for seed in range(args.seeds):
            found = compare(oracle_case(op, seed))
            judged += found.judged
            more += found.extra > 0
            extra += found.extra
            if found.missing:
                missing += 1
                print(f"  BUG {op} seed {seed}: rule drops {found.missing}")
        bugs += missing
        ms = 1000 * (time.perf_counter() - t) / args.seeds
        print(f"{op:26s} {args.seeds:5d} {judged:6d} {more:14d} {extra:9d} {missing:4d} {ms:7.1f}")
    print(f"{len(ops)} ops, {len(ops) * args.seeds} cases, {bugs} with a bug; no case (reason): "
          + ", ".join(f"{k} ({v})" for k, v in sorted(excluded_ops().items())))
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())

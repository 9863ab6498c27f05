"""Is every group `--groups` lists as exact removable on its own? A measurement, not a test.

For each model (random graphs from models/randgraph.py by seed, or ONNX files), the groups are
found as `--groups` finds them (checked each zeroed alone, or half of each layer at a time above
groups.ALONE_BUDGET; `--unchecked`: as the prune finds them, before it checks those it chooses),
and up to `--per` groups listed exact are drawn; each is zeroed alone (prune.reference.zeroed, as the prune's
reference zeroes it) and the shrink's analysis of that reference is asked which of its indices
it keeps (groups.kept_when_zeroed, the check the prune runs on the groups it chose). Prints the
count kept, by reason (names blanked), with a few seeds or files each.

    python tools/audit_exact.py --seeds 200 --start 0 --per 5
    python tools/audit_exact.py --per 25 model.onnx other.onnx
    python tools/audit_exact.py --seeds 200 --unchecked

A group kept here is listed as exact by `--groups` but would be chosen again by `--prune` (which
checks its chosen groups in its shrink's analysis): the listing is then wrong, not the prune.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from onnxshrink.options import ShrinkOptions  # noqa: E402
from onnxshrink.prune.groups import find_groups, kept_when_zeroed  # noqa: E402
from onnxshrink.prune.reference import zeroed as zeroed_reference  # noqa: E402
from onnxshrink.stages.attempt import analyze_model  # noqa: E402


def kept_alone(
    model: onnx.ModelProto, per: int, seed: int, base_dir: str | None = None, verify: bool = True
) -> tuple[int, list[str], str]:
    """(groups checked, the reasons each kept one gives, how the listing checked them) for up
    to `per` exact groups."""
    opts = ShrinkOptions(validate=False, progress=False)
    gset = find_groups(model, base_dir, verify=verify)
    exact = [g for g in gset.groups if g.exact]
    reasons: list[str] = []
    picked = np.random.default_rng(seed).permutation(len(exact))[:per]
    for i in picked:
        group = exact[int(i)]
        reference = zeroed_reference(model, gset, gset.zeroed_members([group]))
        analysis = analyze_model(reference, base_dir, opts)
        for why in kept_when_zeroed(analysis, [group]).values():  # names blanked: kinds of reason
            reasons.append(re.sub(r"^\S+ \(axis \d+\)", "T", re.sub(r"'[^']*'", "'N'", why)))
    return len(picked), reasons, getattr(gset, "checked", "?")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="ONNX models (else random graphs by seed)")
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--per", type=int, default=5, help="exact groups checked per model")
    p.add_argument("--unchecked", action="store_true", help="the groups as the prune finds them (unchecked)")
    a = p.parse_args(argv)
    from onnxshrink.io.model import load_model

    cases: list[tuple[str, object]] = [(f, f) for f in a.files] or [(str(s), s) for s in range(a.start, a.start + a.seeds)]
    counts: collections.Counter[str] = collections.Counter()
    where: dict[str, list[str]] = collections.defaultdict(list)
    checked = failed = 0
    how: collections.Counter[str] = collections.Counter()
    for label, what in cases:
        try:
            if isinstance(what, str):
                model, base_dir, seed = load_model(what), str(Path(what).parent), 0
            else:
                from models.randgraph import build

                model, _ = build(int(what))  # type: ignore[call-overload]
                base_dir, seed = None, int(what)  # type: ignore[call-overload]
            n, reasons, listed = kept_alone(model, a.per, seed, base_dir, verify=not a.unchecked)
        except Exception as exc:  # a model the tool refuses: counted, not audited
            failed += 1
            print(f"{label}: not audited ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
            continue
        checked += n
        how[listed or "unchecked"] += 1
        for r in reasons:
            counts[r[:150]] += 1
            where[r[:150]].append(label)
    print(
        f"models {len(cases) - failed} (not audited {failed}; listing checked {dict(how)}), exact groups "
        f"checked {checked}, kept when zeroed alone {sum(counts.values())}"
    )
    for reason, n in counts.most_common(15):
        print(f"  {n:4d}  {reason}  [{', '.join(where[reason][:5])}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

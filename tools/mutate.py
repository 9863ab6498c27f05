"""Break the rewrite on purpose and run the tests: each mutation must fail some of them.

A mutation is a small, plausible bug put into onnxshrink for one pytest run (and the command
lines its tests start: a `sitecustomize` on PYTHONPATH installs it in every Python process):

    nan_channel       one output channel of the shrunk model's last weight set to NaN
    scaled_fold       every folded constant (bias, Gemm C, constant map, border correction) x1.001
    off_by_one        every sliced weight keeps its neighbour instead of its last kept index
    wrong_axis        a weight sliced along another axis (one of the same size when there is one)
    no_border         constants folded through zero padding as if the padding were not there
    transposed_mask   a square mask applied transposed (binding: the reference is wrong too)
    dropped_fold      removed constant channels folded nowhere (their contribution lost)

Prints, per mutation, how many of the tests run failed and which, then the table
mutation -> tests failed. A run without mutation comes first and must fail none.

    python tools/mutate.py [--mutations nan_channel,scaled_fold] [--list] [PYTEST ARGS ...]

Without test paths among the pytest arguments it runs the tests that check shrunk models
(DEFAULT_TESTS).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ENV = "ONNXSHRINK_MUTATION"

# The tests that shrink and check small models (no zoo export: each pytest run would export them
# again); `tests` as the pytest argument runs the whole suite (about 5 CPU minutes a run).
DEFAULT_TESTS = [
    "tests/ops",
    "tests/io",
    "tests/test_bind.py",
    "tests/test_readme.py",
    "tests/test_large.py",
    "tests/test_dtypes.py",
    "tests/test_old_models.py",
    "tests/test_regressions.py",
    "tests/test_random_graphs.py",
    "--deselect",  # its zoo exports
    "tests/ops/test_fused.py::test_optimized_zoo_transformers_reach_the_optimized_native_size",
]
RANDOM_GRAPHS = "60"  # tests/test_random_graphs.py's graphs per run (the suite's default: 300)


# ---------------------------------------------------------------------------- the mutations
def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace owner.name by make(original), and every module's binding of the same function."""
    original = getattr(owner, name)
    replacement = make(original)
    setattr(owner, name, replacement)
    for module in list(sys.modules.values()):
        if module is not None and module.__name__.startswith("onnxshrink") and getattr(module, name, None) is original:
            setattr(module, name, replacement)


def _channel_axis(op: str, attrs: dict, index: int, ndim: int) -> int:
    """The axis of a weight input that is its node's output channels."""
    if op == "Conv":
        return 0 if index == 1 else ndim - 1
    if op == "ConvTranspose":
        return 1 if index == 1 and ndim > 1 else ndim - 1
    if op == "Gemm" and index == 1:
        return 0 if attrs.get("transB", 0) else 1
    return ndim - 1  # MatMul's B [in, out], a bias


def nan_channel() -> None:
    import onnx
    from onnx import numpy_helper

    from onnxshrink import rewrite  # noqa: F401
    from onnxshrink.stages import attempt  # noqa: F401  (binds apply: replaced too)

    def make(apply):
        def mutated(*args, **kwargs):
            result = apply(*args, **kwargs)
            g = result.model.graph
            inits = {t.name: t for t in g.initializer}
            for node in reversed(g.node):  # the weight read last: nearest the outputs
                for k, name in enumerate(node.input):
                    t = inits.get(name)
                    if t is None or t.data_type != onnx.TensorProto.FLOAT or not t.dims or t.data_location == 1:
                        continue
                    w = numpy_helper.to_array(t).copy()
                    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                    index = [slice(None)] * w.ndim
                    index[_channel_axis(node.op_type, attrs, k, w.ndim)] = 0
                    w[tuple(index)] = np.nan
                    t.CopyFrom(numpy_helper.from_array(w, t.name))
                    return result
            return result

        return mutated

    _wrap(rewrite, "apply", make)  # api's binding too


def scaled_fold(factor: float = 1.001) -> None:
    from onnxshrink.ops import conv, linear
    from onnxshrink.rewrite import Rewriter

    _wrap(conv, "fold_into_bias", lambda f: lambda rw, node, i, contrib, *a: f(rw, node, i, contrib * factor, *a))
    _wrap(linear, "fold_into_c", lambda f: lambda rw, node, delta, n: f(rw, node, delta * factor, n))
    _wrap(Rewriter, "add_constant", lambda f: lambda self, node, i, values, *a, **k: f(self, node, i, values * factor, *a, **k))
    _wrap(conv._ConvBase, "border_correction", lambda f: lambda self, node, rw, kernel, n: f(self, node, rw, kernel * factor, n))


def dropped_fold() -> None:
    scaled_fold(0.0)


def no_border() -> None:
    """The removed constants' contribution folded into the bias as its value inside the map, as
    if zero padding did not cut it at the borders."""
    from onnxshrink.ops import conv

    def border_as_bias(self, node, rw, kernel, n_channels):
        contrib = kernel.reshape(kernel.shape[0], -1).sum(axis=1)[None, :]
        conv.fold_into_bias(rw, node, 2, contrib, 1, n_channels)

    conv._ConvBase.border_correction = border_as_bias


class _Keep:
    """The keep closure as _slice_constant reads it, with `kept` changed."""

    def __init__(self, ks: Any, kept: Callable):
        self._ks, self._kept = ks, kept

    def kept(self, t: Any, axis: int) -> Any:
        return self._kept(self._ks, t, axis)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ks, name)


def _slicing(kept: Callable) -> None:
    from onnxshrink import rewrite

    _wrap(rewrite, "_slice_constant", lambda f: lambda t, ks, *a: f(t, _Keep(ks, kept), *a))


def off_by_one() -> None:
    def kept(ks, t, axis):
        k = ks.kept(t, axis)
        if k is None or k.all() or not k.any():
            return k
        last = int(np.flatnonzero(k)[-1])
        neighbour = last + 1 if last + 1 < len(k) else int(np.flatnonzero(~k)[-1])
        k = k.copy()
        k[last], k[neighbour] = False, True
        return k

    _slicing(kept)


def wrong_axis() -> None:
    def kept(ks, t, axis):
        n = np.asarray(t.values).shape if hasattr(t, "values") else ()
        masks = [ks.kept(t, a) for a in range(len(n))]
        sliced = [a for a, k in enumerate(masks) if k is not None and len(k) == n[a] and not k.all()]
        if len(sliced) != 1 or len(n) < 2:
            return ks.kept(t, axis)
        a = sliced[0]
        same = [b for b in range(len(n)) if b != a and n[b] == n[a]]
        b = same[0] if same else (a + 1) % len(n)
        if axis == a:
            return None
        if axis == b:
            k = np.zeros(n[b], bool)
            k[np.flatnonzero(masks[a])[np.flatnonzero(masks[a]) < n[b]]] = True
            return k
        return ks.kept(t, axis)

    _slicing(kept)


def transposed_mask() -> None:
    from onnxshrink.bind.binding import Binding

    original = Binding.masked

    def masked(self, array):
        v = self.values
        if v.ndim == 2 and v.shape[0] == v.shape[1]:
            self.values = np.ascontiguousarray(v.T)
            try:
                return original(self, array)
            finally:
                self.values = v
        return original(self, array)

    Binding.masked = masked


MUTATIONS: dict[str, Callable[[], None]] = {
    "nan_channel": nan_channel,
    "scaled_fold": scaled_fold,
    "off_by_one": off_by_one,
    "wrong_axis": wrong_axis,
    "no_border": no_border,
    "transposed_mask": transposed_mask,
    "dropped_fold": dropped_fold,
}


def install() -> None:
    """Called by the sitecustomize this tool writes: the mutation named in the environment."""
    name = os.environ.get(ENV)
    if name:
        MUTATIONS[name]()


SITECUSTOMIZE = f"""
import os, sys
if os.environ.get({ENV!r}):
    sys.path.insert(0, {str(ROOT)!r})
    from tools.mutate import install
    install()
"""


# ---------------------------------------------------------------------------- running them
def run(mutation: str | None, pytest_args: list[str], site: Path) -> tuple[int, list[str], float, str]:
    """(tests run, tests failed, seconds, pytest's summary line) of one pytest run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("ONNXSHRINK_RANDOM_GRAPHS", RANDOM_GRAPHS)
    env.pop(ENV, None)
    if mutation:
        env[ENV] = mutation
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no", "-rfE", *pytest_args],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    seconds = time.perf_counter() - t0
    failed = sorted({m.group(1) for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)})
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-300:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?)", summary)}
    total = sum(counts.values())
    return total, failed, seconds, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mutations", default=",".join(MUTATIONS), help="comma-separated, of: " + ", ".join(MUTATIONS))
    parser.add_argument("--list", action="store_true", help="list every failed test, not only counts per file")
    args, pytest_args = parser.parse_known_args(argv)
    names = [m for m in args.mutations.split(",") if m]
    unknown = [m for m in names if m not in MUTATIONS]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; known: {list(MUTATIONS)}")
    if all(a.startswith("-") for a in pytest_args):  # options only: the default tests
        pytest_args = [*pytest_args, *DEFAULT_TESTS]
    rows = []
    with tempfile.TemporaryDirectory(prefix="onnxshrink-mutate-") as site:
        Path(site, "sitecustomize.py").write_text(SITECUSTOMIZE)
        for name in [None, *names]:
            total, failed, seconds, summary = run(name, pytest_args, Path(site))
            label = name or "(none)"
            print(f"{label}: {len(failed)} of {total} failed ({seconds:.0f} s): {summary}", flush=True)
            per_file = Counter(f.split("::")[0] for f in failed)
            for test in failed if args.list else [f"{f}: {n}" for f, n in sorted(per_file.items())]:
                print(f"    {test}")
            rows.append((label, total, failed))
    print("\n| mutation | tests failed | of | files |")
    print("| --- | --- | --- | --- |")
    for label, total, failed in rows:
        files = ", ".join(f"{Path(f).stem} {n}" for f, n in sorted(Counter(x.split('::')[0] for x in failed).items()))
        print(f"| {label} | {len(failed)} | {total} | {files} |")
    baseline_failed = rows[0][2]
    missed = [label for label, _, failed in rows[1:] if not failed]
    if baseline_failed:
        print(f"\nwithout mutation {len(baseline_failed)} test(s) failed: the table means nothing", file=sys.stderr)
    if missed:
        print(f"\nno test failed for: {', '.join(missed)}", file=sys.stderr)
    return 1 if baseline_failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())

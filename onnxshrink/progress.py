"""Progress bars for the long phases of a large model (tqdm, imported only when shown)."""

from __future__ import annotations

import sys
import time
from typing import Any


class _Silent:
    def update(self, n: float = 1) -> None:
        return None

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def enabled() -> bool:
    """Bars are for a person watching: only when stderr is a terminal."""
    return sys.stderr.isatty()


def bar(total: float | None, desc: str, unit: str = "it", show: bool = False) -> Any:
    """A context manager with `update(n)`: a tqdm bar on stderr when `show` and stderr is a
    terminal, else one that does nothing (and imports nothing). `total` None: work of no known
    size, counted as it goes."""
    if not show or not enabled() or (total is not None and total <= 0):
        return _Silent()
    from tqdm import tqdm

    scale = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
    )


def process_seconds() -> float | None:
    """Seconds since this process started (Linux: from /proc; None elsewhere): the start-up a
    command line spends before its first phase (the interpreter, the imports)."""
    import os

    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class PhaseClock:
    """Seconds per phase of a run: `lap(name)` ends the phase begun at the last lap (a phase
    run again, a prune choosing again, adds to its time)."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._t = self.started = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - self._t
        self._t = now

"""Memory figures of this process, for the benchmarks (Linux /proc)."""

from __future__ import annotations


def proc_status() -> dict[str, int]:
    """VmRSS / VmHWM / ... of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Vm") and line.rstrip().endswith("kB"):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Make VmHWM restart from the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False

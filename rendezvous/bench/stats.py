"""Numbers for the benchmark: sizes, percentiles, per-cell summaries, ratios.

Pure functions of their inputs (no clocks, no I/O), so they are unit-tested
on their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["parse_size", "format_size", "percentile", "summarize", "ratio", "samples_for"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"64K"``, ``"16MiB"``, ``"1024"`` -> bytes (binary units). ValueError if unreadable."""
    raw = text.strip().upper()
    digits = raw.rstrip("KMGIB")
    unit = raw[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 1024, 64K, 16M, 1G)")
    value = int(digits) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """The shortest exact binary form: 1024 -> "1 KiB", 1536 -> "1536 B"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, linearly
    interpolated between the two nearest ranks (numpy's default method)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def summarize(samples_ns: Sequence[int], nbytes: int) -> dict[str, float | int]:
    """One cell of the results: latency statistics in microseconds and the
    bandwidth the median latency gives (GB/s, 10**9 bytes per second)."""
    if not samples_ns:
        raise ValueError("no samples")
    ordered = sorted(samples_ns)
    median_ns = percentile(ordered, 50)
    return {
        "samples": len(ordered),
        "median_us": median_ns / 1e3,
        "p99_us": percentile(ordered, 99) / 1e3,
        "min_us": ordered[0] / 1e3,
        "mean_us": sum(ordered) / len(ordered) / 1e3,
        "gbps": nbytes / median_ns if median_ns > 0 else math.inf,
    }


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or None when either is missing or the reference is 0."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def samples_for(nbytes: int, *, budget_bytes: int, least: int, most: int) -> int:
    """How many transfers to time at one size: enough to move ``budget_bytes``,
    clamped to [least, most]."""
    if least > most:
        raise ValueError("least > most")
    return max(least, min(most, budget_bytes // max(1, nbytes)))

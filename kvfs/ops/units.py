"""Byte sizes and durations as people type and read them: the one parser and formatter
of sizes (``parse_size``, ``format_size``, ``size_arg``) and durations
(``parse_duration``) for every tool and for the profiles. Pure Python, no kvfs import.
"""

from __future__ import annotations

import re

DAY = 24 * 3600.0

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTP]?)(?:I?B)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
                   "d": DAY, "w": 7 * DAY}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|min|m|h|d|w)?\s*$", re.IGNORECASE)



def parse_size(text: str | int) -> int:
    """Bytes from ``"512M"``, ``"1.2T"``, ``"64KiB"``, ``"4096"`` (binary units, 1K = 1024).

    Raises ``ValueError`` on anything else; fractional results round down to whole bytes.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"negative size: {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 512M, 1.2T)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def parse_duration(text: str | float) -> float:
    """Seconds from ``"600"``, ``"30s"``, ``"10m"``, ``"2h"``, ``"7d"``, ``"250ms"``."""
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, int | float):
        return float(text)
    m = _DURATION_RE.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30, 30s, 10m, 7d)")
    return float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "").lower()]


def format_size(n: float) -> str:
    """``1319413953331`` -> ``"1.2 TiB"`` (for tables and messages)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def size_arg(n: int, up: bool = False) -> str:
    """``n`` bytes as a size to type on a command line, in whole units of the largest unit
    that fits: rounded down (``1610612736`` -> ``"1G"``) or, with ``up``, up (``"2G"``).
    :func:`parse_size` reads the result back."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"not a byte count: {n!r}")
    for unit in ("P", "T", "G", "M", "K"):
        mult = _SIZE_UNITS[unit]
        if n >= mult:
            return f"{-(-n // mult) if up else n // mult}{unit}"
    return str(n)

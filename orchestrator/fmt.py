"""Numbers as people read them in plans, progress and status."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.0f}s" if seconds >= 1 else f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))}


def printable(text: object) -> str:
    """Text from a host or a service (history reasons quote a server's answer, log lines) made safe
    for a terminal: control characters (ESC, BEL, the C1 range with CSI) shown as `\\x1b`, never
    sent as such."""
    return str(text).translate(_CONTROL)

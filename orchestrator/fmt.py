"""Numbers as people read them in plans, progress and status, an address with its port, and the
one sanitiser of host and service text on its way to the terminal."""

from __future__ import annotations

import re

from rich.markup import escape as markup_escape


def hostport(address: str, port: int) -> str:
    """`10.0.0.1:8000`, `[fd00::1]:8000`: an IPv6 address in brackets (URLs, HAProxy binds, targets)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


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


# Terminal escape sequences (ECMA-48, 7-bit and 8-bit forms): removed whole, so a service's log or
# answer can neither move the cursor, rewrite a line, set the title or the clipboard (OSC 52), nor
# leave half a sequence behind. Strings (OSC, DCS, SOS, PM, APC) end at BEL or ST (ESC \\ or U+009C),
# or at the end of the text when unterminated; CSI ends at its final byte.
_SEQUENCE = re.compile(
    r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c|(?=\x1b)|$)"   # OSC DCS SOS PM APC
    r"|(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"                             # CSI
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]")                                                   # ESC + final byte
# What is left of the C0 and C1 ranges (a lone ESC, BEL, BS, CR that lets a line overwrite itself,
# NUL, DEL, U+0080-U+009F) is shown as `\x0d`, never sent; a tab is a space (one-line fields).
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))} | {0x09: " "}


def printable(text: object) -> str:
    """The one sanitiser for text from a host or a service on its way to a terminal (log lines,
    root-cause lines, history reasons quoting a server's answer, status, error details): escape
    sequences removed, every other control character (C0 but none kept, DEL, C1) shown as `\\x1b`.
    Newlines too: each result is one line."""
    return _SEQUENCE.sub("", str(text)).translate(_CONTROL)


def escape(text: object) -> str:
    """Host or service text inside rich markup: `printable`, then no `[...]` read as markup."""
    return markup_escape(printable(text))

"""vLLM and package versions, compared without `packaging` (the host reports them as text)."""

from __future__ import annotations

import re


def version_key(v: str) -> tuple:
    """Orderable key for PEP 440-ish versions without `packaging`: 0.33.0rc1 < 0.33.0 < 0.33.0.post1;
    a local part (+cu130) is ignored."""
    v = v.split("+", 1)[0].strip().lower()
    m = re.match(r"v?(\d+(?:\.\d+)*)(.*)", v)
    if not m:
        return ((0,), 0, v)
    release = tuple(int(x) for x in m.group(1).split("."))
    release = release + (0,) * (4 - len(release))
    rest = m.group(2)
    if not rest:
        rank = 2
    elif re.match(r"[.-]?post", rest):
        rank = 3
    elif re.match(r"[.-]?dev", rest):
        rank = 0
    else:                                   # a, b, rc
        rank = 1
    return (release, rank, rest)


def public_version(v: str) -> str:
    return v.split("+", 1)[0]

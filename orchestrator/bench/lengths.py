"""Output lengths per request: fixed, a uniform range, or a clipped normal distribution.

Why: with one fixed max_tokens (and ignore_eos), the C streams of a closed-loop level finish
together and start together again, so every cycle sends C requests within a few milliseconds.
Spread lengths break that lock-step, as real traffic does.

    parse_lengths("512")            -> every request 512
    parse_lengths("256:768")        -> uniform integers in [256, 768]
    parse_lengths("normal:512:128") -> normal, mean 512, std 128, clipped to [max(1, m-3s), m+3s]
Lengths come from a table drawn once with the run's seed: request i asks for table[i % size],
so a run is reproducible and the hot path does a list lookup.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TABLE_SIZE = 4096


@dataclass(frozen=True)
class Lengths:
    kind: str           # fixed | uniform | normal
    a: int              # fixed value, uniform low, or normal mean
    b: int = 0          # uniform high, or normal std

    @property
    def fixed(self) -> bool:
        return self.kind == "fixed"

    @property
    def bounds(self) -> tuple[int, int]:
        if self.kind == "fixed":
            return self.a, self.a
        if self.kind == "uniform":
            return self.a, self.b
        return max(1, self.a - 3 * self.b), self.a + 3 * self.b

    @property
    def mean(self) -> float:
        lo, hi = self.bounds
        return float(self.a) if self.kind != "uniform" else (lo + hi) / 2

    def table(self, seed: int, size: int = TABLE_SIZE) -> list[int]:
        if self.fixed:
            return [self.a]
        rng = random.Random(f"lengths:{seed}")
        lo, hi = self.bounds
        if self.kind == "uniform":
            return [rng.randint(lo, hi) for _ in range(size)]
        return [min(hi, max(lo, round(rng.gauss(self.a, self.b)))) for _ in range(size)]

    def __str__(self) -> str:
        return {"fixed": f"{self.a}", "uniform": f"{self.a}:{self.b}",
                "normal": f"normal:{self.a}:{self.b}"}[self.kind]


def parse_lengths(spec: int | str) -> Lengths:
    """A Lengths from N, "A:B", "uniform:A:B" or "normal:MEAN:STD"; ValueError says what is wrong."""
    text = str(spec).strip().lower()
    parts = text.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            if n < 1:
                raise ValueError(f"must be >= 1, got {n}")
            return Lengths("fixed", n)
        if parts[0] == "uniform":
            parts = parts[1:]
        if parts[0] == "normal":
            if len(parts) != 3:
                raise ValueError("normal needs MEAN:STD, e.g. normal:512:128")
            mean, std = int(parts[1]), int(parts[2])
            if mean < 1 or std < 0:
                raise ValueError(f"normal needs MEAN >= 1 and STD >= 0, got {mean}:{std}")
            return Lengths("normal", mean, std)
        if len(parts) != 2:
            raise ValueError("expected N, A:B, uniform:A:B or normal:MEAN:STD")
        lo, hi = int(parts[0]), int(parts[1])
    except ValueError as exc:
        if "invalid literal" in str(exc):
            raise ValueError(f"{spec!r} is not N, A:B or normal:MEAN:STD") from None
        raise
    if not 1 <= lo <= hi:
        raise ValueError(f"range needs 1 <= A <= B, got {lo}:{hi}")
    return Lengths("uniform", lo, hi)

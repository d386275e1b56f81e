"""Find the highest concurrency (or request rate) that still meets the SLO, in a few levels.

Assumes the SLO is met below some knee and missed above it (latency grows with load). Runs the
lower bound, then the upper bound, then bisects geometrically (the midpoint of lo and hi on a log
scale, since load levels span orders of magnitude) until hi/lo <= 1 + precision, or hi - lo <= 1
for concurrencies, or the level budget is spent. From 1..128 that is 2 + about 5 levels.

    s = Search(1, 128, integer=True)
    while (x := s.next()) is not None:
        s.record(x, run_level(x).meets_slo)
    s.result()   # {"best": 46, "first_failing": 48, "levels": [...], "note": ...}
"""

from __future__ import annotations

import math


class Search:
    def __init__(self, lo: float, hi: float, *, integer: bool, precision: float = 0.1,
                 max_levels: int = 8):
        if not 0 < lo < hi:
            raise ValueError(f"search needs 0 < low < high, got {lo:g} and {hi:g}")
        self.lo, self.hi = lo, hi
        self.integer = integer
        self.precision = precision
        self.max_levels = max(2, max_levels)
        self.tried: list[tuple[float, bool]] = []
        self.best: float | None = None          # highest value that met the SLO
        self.fail: float | None = None          # lowest value that missed it
        self.note = ""

    def next(self) -> float | None:
        if self.note:
            return None
        if not self.tried:
            return self.lo
        if len(self.tried) == 1:
            if self.best is None:
                self.note = f"the lowest level ({self._fmt(self.lo)}) already misses the SLO"
                return None
            return self._budget(self.hi)
        if self.fail is None:
            self.note = f"the highest level ({self._fmt(self.hi)}) meets the SLO: try a higher bound"
            return None
        lo, hi = self.best, self.fail
        assert lo is not None        # the lower bound met the SLO, or the search ended above
        if lo > hi:
            self.note = (f"not monotonic: {self._fmt(lo)} met the SLO but {self._fmt(hi)} did not "
                         "(noisy levels? try a longer --duration)")
            return None
        if (self.integer and hi - lo <= 1) or hi / lo <= 1 + self.precision:
            self.note = "converged"
            return None
        mid = math.sqrt(lo * hi)
        if self.integer:
            mid = min(hi - 1, max(lo + 1, round(mid)))
        return self._budget(mid)

    def _budget(self, value: float) -> float | None:
        if len(self.tried) >= self.max_levels:
            self.note = f"stopped after {self.max_levels} levels"
            return None
        return value

    def record(self, value: float, met: bool) -> None:
        self.tried.append((value, met))
        if met and (self.best is None or value > self.best):
            self.best = value
        if not met and (self.fail is None or value < self.fail):
            self.fail = value

    def result(self) -> dict:
        return {"best": self.best, "first_failing": self.fail, "levels_run": len(self.tried),
                "tried": [{"value": v, "met": m} for v, m in self.tried], "note": self.note}

    def _fmt(self, v: float) -> str:
        return str(int(v)) if self.integer else f"{v:g}/s"

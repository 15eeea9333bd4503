"""Prometheus text exposition: histograms and metric family headers, shared by the engines' /metrics."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


class Histogram:
    """Cumulative-bucket histogram; `observe` is one bisect."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        """`name`'s bucket, sum and count samples; `labels` is the rendered label list (may be empty)."""
        sep = "," if labels else ""
        out: list[str] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        wrap = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{wrap} {self.sum}")
        out.append(f"{name}_count{wrap} {self.count}")
        return out


def family(out: list[str], name: str, kind: str, help_text: str) -> None:
    """The HELP and TYPE lines that open a metric family."""
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")

"""Prometheus text exposition: histograms and metric family headers, shared by the engines' /metrics;
and the parser the worker reads them back with."""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass


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


@dataclass(frozen=True, slots=True)
class MetricSample:
    """One sample line of the text exposition: `name{labels} value`."""

    name: str
    labels: dict[str, str]
    value: float


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+\S+)?[ \t]*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def parse_samples(text: str) -> list[MetricSample]:
    """The samples of a Prometheus text exposition; comments and lines that are not samples are skipped."""
    samples: list[MetricSample] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)  # also "+Inf", "-Inf", "NaN"
        except ValueError:
            continue
        found = {k: _ESCAPE.sub(_unescape, v) for k, v in _LABEL.findall(labels or "")}
        samples.append(MetricSample(name, found, number))
    return samples


def _unescape(match: re.Match[str]) -> str:
    """A label value's escapes: \\\\, \\" and \\n."""
    return "\n" if match.group(1) == "n" else match.group(1)

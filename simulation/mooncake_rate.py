"""The Mooncake conversation trace's arrival rate over its hour, as data.

The released trace (kvcache-ai/Mooncake, `FAST25-release/traces/conversation_trace.jsonl`
at commit a2a4b18ac537fd798d50e6e9f57031ce86419a37: 3,029,533 characters, one
request a line in timestamp order, timestamps in ms on ticks of about 3 s) is
not copied here, only what was read of it: 41 windows of 16,000 characters, at
offsets 0, 75,000, 150,000, ... 2,925,000 and the file's last 16,000
characters. `CONVERSATION_SAMPLES` holds, for each window, the offset of its
first complete line, the characters its complete lines span (16,000 less the
partial lines at either end, estimated to tens of characters), that line's
timestamp and how many complete lines there are.

`rate_from_samples` turns them into a rate: the windows' line densities (lines
per character), integrated over the file by the trapezoid rule, give the
requests before each window's first line, so the requests between two windows
against the time between their first lines; one point per interval, at its
middle minute (`CONVERSATION_RATE`, 40 points from 2.6 to 4.2 requests/s).

Error: a window's mean line length rests on its 50-75 lines, whose lengths
vary with the prompt's (the windows' mean characters per line spread 197-324,
a standard deviation of 12 %); an interval's count averages two windows, so a
point is good to about ±9 % (one standard deviation), to which the 3 s ticks
add ±3 % over an interval of about 90 s. The curve's integral over the hour,
12,200 requests, is 1.4 % above the 12,031 the trace's README gives.

`rate_from_timestamps` makes the same curve from a trace's own timestamps (a
released file at hand), counting each interval's requests exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FILE_CHARS = 3_029_533
"""The released conversation trace's length in characters."""
SPAN_MS = 3_536_999
"""Its first timestamp is 0, its last 3,536,999 ms."""

CONVERSATION_SAMPLES: tuple[tuple[int, int, int, int], ...] = (
    # (first complete line's offset, characters of complete lines, its timestamp in ms, complete lines)
    (0, 15_600, 0, 75),
    (75_055, 15_835, 108_000, 66),
    (150_490, 15_440, 204_000, 72),
    (225_130, 15_750, 294_000, 55),
    (300_070, 15_810, 396_000, 56),
    (375_040, 15_850, 489_000, 67),
    (450_700, 15_130, 594_000, 51),
    (525_015, 15_865, 681_000, 71),
    (600_055, 15_885, 777_000, 49),
    (675_150, 15_780, 873_000, 68),
    (750_130, 15_868, 966_000, 57),
    (825_880, 14_930, 1_059_000, 56),
    (900_530, 15_360, 1_155_000, 65),
    (975_150, 15_730, 1_245_000, 51),
    (1_050_190, 15_750, 1_329_000, 61),
    (1_125_510, 15_360, 1_416_000, 63),
    (1_200_330, 15_510, 1_512_000, 73),
    (1_275_070, 15_890, 1_602_000, 63),
    (1_350_260, 15_540, 1_695_000, 60),
    (1_425_100, 15_770, 1_782_000, 73),
    (1_500_038, 15_912, 1_868_999, 75),
    (1_575_170, 15_610, 1_965_000, 73),
    (1_650_125, 14_975, 2_054_999, 76),
    (1_725_120, 15_790, 2_132_999, 58),
    (1_800_055, 15_865, 2_214_000, 57),
    (1_875_095, 15_655, 2_298_000, 65),
    (1_950_580, 15_150, 2_378_999, 70),
    (2_025_400, 15_000, 2_466_000, 69),
    (2_100_075, 15_815, 2_546_999, 64),
    (2_175_330, 15_620, 2_634_000, 73),
    (2_250_320, 15_430, 2_721_000, 55),
    (2_325_009, 15_621, 2_807_999, 52),
    (2_400_080, 15_630, 2_883_000, 70),
    (2_475_590, 15_370, 2_960_999, 51),
    (2_550_240, 15_660, 3_026_999, 60),
    (2_625_095, 15_855, 3_102_000, 61),
    (2_700_000, 15_740, 3_183_000, 63),
    (2_775_165, 15_685, 3_267_000, 54),
    (2_850_700, 14_940, 3_345_000, 58),
    (2_925_045, 15_953, 3_426_000, 68),
    (3_013_748, 15_785, 3_525_000, 54),  # the file's last window: its lines run to the end
)


@dataclass(frozen=True)
class RateCurve:
    """Requests per second over a trace's span: `points` of (minute, rate), minutes from its first arrival."""

    span_min: float
    points: tuple[tuple[float, float], ...]

    def requests(self) -> float:
        """The curve's integral over its span, each point standing for its interval (ends held flat)."""
        minutes = [m for m, _ in self.points]
        edges = [0.0] + [(a + b) / 2 for a, b in zip(minutes, minutes[1:])] + [self.span_min]
        return sum(rate * (hi - lo) * 60 for (_, rate), lo, hi in zip(self.points, edges, edges[1:]))


def rate_from_samples(samples: Sequence[tuple[int, int, int, int]], span_ms: float) -> RateCurve:
    """The rate between consecutive windows of a trace file read in samples (module docstring)."""
    points = []
    for (x0, chars0, t0, n0), (x1, chars1, t1, n1) in zip(samples, samples[1:]):
        between = (x1 - x0) * (n0 / chars0 + n1 / chars1) / 2
        points.append((round((t0 + t1) / 2 / 60_000, 2), round(between / ((t1 - t0) / 1000), 2)))
    return RateCurve(round(span_ms / 60_000, 2), tuple(points))


def rate_from_timestamps(timestamps_ms: Sequence[float], intervals: int = 40) -> RateCurve:
    """The rate over `intervals` equal intervals of a trace's span, from its timestamps (in order)."""
    first, last = timestamps_ms[0], timestamps_ms[-1]
    width = (last - first) / intervals
    if width <= 0:
        raise ValueError("a rate needs arrivals at two different times")
    counts = [0] * intervals
    for t in timestamps_ms:
        counts[min(intervals - 1, int((t - first) // width))] += 1
    return RateCurve(round((last - first) / 60_000, 2),
                     tuple((round((k + 0.5) * width / 60_000, 2), round(c / (width / 1000), 2))
                           for k, c in enumerate(counts)))


CONVERSATION_RATE = rate_from_samples(CONVERSATION_SAMPLES, SPAN_MS)
"""The released conversation trace's rate over its hour, as its samples give it."""

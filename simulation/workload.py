"""Request workloads: seeded generation and the `requests.csv` format of seed 002."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simulation.core import SimRequest

REQUEST_COLUMNS = ("arrival_time", "prefill_length", "decode_length")


@dataclass(frozen=True)
class RequestSpec:
    arrival_time: float
    prefill_length: int
    decode_length: int

    def to_request(self, request_id: str) -> SimRequest:
        return SimRequest(request_id, self.arrival_time, self.prefill_length, self.decode_length)


@dataclass(frozen=True)
class LengthDist:
    """`uniform:LO:HI`, `fixed:N`, `geometric:MEAN` or `lognormal:MEDIAN:SIGMA[:MAX]` (all >= 1)."""

    kind: str
    args: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        kind, *raw = text.strip().split(":")
        try:
            args = tuple(float(a) for a in raw)
        except ValueError:
            raise ValueError(f"bad length distribution {text!r}: arguments must be numbers") from None
        arity = {"uniform": (2,), "fixed": (1,), "geometric": (1,), "lognormal": (2, 3)}
        if kind not in arity:
            raise ValueError(f"bad length distribution {text!r}: kind must be one of {', '.join(arity)}")
        if len(args) not in arity[kind]:
            raise ValueError(f"bad length distribution {text!r}: {kind} takes {arity[kind]} arguments")
        if any(a <= 0 for a in args) or (kind == "uniform" and args[0] > args[1]):
            raise ValueError(f"bad length distribution {text!r}: arguments must be positive (and LO <= HI)")
        return cls(kind, args)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        a = self.args
        if self.kind == "uniform":
            out = rng.integers(int(a[0]), int(a[1]) + 1, size=n)
        elif self.kind == "fixed":
            out = np.full(n, int(a[0]))
        elif self.kind == "geometric":
            out = rng.geometric(1.0 / max(a[0], 1.0), size=n)
        else:
            out = np.rint(rng.lognormal(math.log(a[0]), a[1], size=n))
            if len(a) == 3:
                out = np.minimum(out, a[2])
        return np.maximum(out.astype(np.int64), 1)

    @property
    def mean(self) -> float:
        a = self.args
        if self.kind == "uniform":
            return (a[0] + a[1]) / 2
        if self.kind in ("fixed", "geometric"):
            return a[0]
        return a[0] * math.exp(a[1] ** 2 / 2)

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{x:g}" for x in self.args)])


def generate(
    n: int,
    rate: float,
    *,
    seed: int = 0,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    prefill: LengthDist | str = "uniform:20:200",
    decode: LengthDist | str = "uniform:10:100",
    start_time: float = 0.0,
) -> list[RequestSpec]:
    """`n` requests at mean `rate` per time unit.

    `poisson`: exponential gaps. `gamma`: gamma gaps with coefficient of
    variation `burstiness` (> 1 is burstier than Poisson), same mean rate.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if rate <= 0:
        raise ValueError("rate must be positive")
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    prefill = LengthDist.parse(prefill) if isinstance(prefill, str) else prefill
    decode = LengthDist.parse(decode) if isinstance(decode, str) else decode
    rng = np.random.default_rng(seed)
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
    elif arrival == "gamma":
        shape = 1.0 / burstiness**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    else:
        raise ValueError(f"arrival must be poisson or gamma, got {arrival!r}")
    times = start_time + np.cumsum(gaps)
    prefills = prefill.sample(rng, n)
    decodes = decode.sample(rng, n)
    return [RequestSpec(float(t), int(p), int(d)) for t, p, d in zip(times, prefills, decodes)]


def write_requests(path: str | Path, specs: list[RequestSpec]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for s in specs:
            w.writerow((f"{s.arrival_time:.6f}", s.prefill_length, s.decode_length))
    return path


def read_requests(path: str | Path, *, L_filter: int | None = None) -> list[RequestSpec]:
    """Read a requests.csv, sorted by arrival time. Spaces after commas, blank lines and `#` comment
    lines (as in the seed's example) are allowed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"request file not found: {path} (create one with `modelpool sim generate --out {path}`)"
        )
    specs: list[RequestSpec] = []
    with path.open(newline="") as f:
        lines = (line for line in f if line.strip() and not line.lstrip().startswith("#"))
        reader = csv.DictReader(lines, skipinitialspace=True)
        fields = [c.strip() for c in (reader.fieldnames or [])]
        missing = [c for c in REQUEST_COLUMNS if c not in fields]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {', '.join(REQUEST_COLUMNS)}")
        for line, row in enumerate(reader, start=2):
            row = {k.strip(): v for k, v in row.items() if k is not None}
            try:
                spec = RequestSpec(float(row["arrival_time"]), int(row["prefill_length"]), int(row["decode_length"]))
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line}: not a valid request row: {row}") from None
            if spec.arrival_time < 0 or spec.prefill_length < 0 or spec.decode_length < 1:
                raise ValueError(f"{path}:{line}: need arrival_time >= 0, prefill_length >= 0, decode_length >= 1")
            if L_filter is None or spec.decode_length <= L_filter:
                specs.append(spec)
    specs.sort(key=lambda s: s.arrival_time)
    return specs


def to_requests(specs: list[RequestSpec], prefix: str = "") -> list[SimRequest]:
    return [s.to_request(f"{prefix}{i}") for i, s in enumerate(specs)]

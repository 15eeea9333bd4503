"""Skewed agentic sessions in the trace format of `shared/contracts/trace.py`, seeded.

The shape is seed 004 §2.1's production trace (1.3 M sessions, 2.1 M requests):
about 1.6 requests per session, an input/output token ratio around 75, and a
heavy skew: the top 1 % of sessions carry 46.5 % of the input tokens, the top
5 % 66.5 %, 10 % 74.6 %, 25 % 87.5 %, 50 % 96.0 %.

A session's turns are 1 + a Pareto draw (`alpha`, capped at `max_turns`); its
token scale is lognormal (`session_sigma`: some sessions carry long contexts);
each turn adds lognormal new input on that scale. Input counts every request's
whole prompt, so a long session's later turns weigh most, as they do in
production. Answer lengths are lognormal, scaled so the whole trace's
input/output ratio is `io_ratio`. Sessions start at random times over `span_s`;
between turns an agent spends lognormal tool time. The defaults reproduce the
seed's skew within a few points (`tests/simulation/test_agentic.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.contracts.trace import TraceRequest

SEED_SKEW = {0.01: 0.465, 0.05: 0.665, 0.10: 0.746, 0.25: 0.875, 0.50: 0.960}
"""Share of input tokens carried by the top fraction of sessions, seed 004 §2.1."""


@dataclass(frozen=True)
class AgenticShape:
    sessions: int = 1000
    span_s: float = 600.0
    """Sessions start uniformly at random over this long."""
    alpha: float = 2.0
    max_turns: int = 32
    session_sigma: float = 0.8
    new_input_tokens: float = 400.0
    """Median new input of a turn, before the session's scale."""
    new_input_sigma: float = 0.6
    output_sigma: float = 0.5
    io_ratio: float = 75.0
    tool_time_s: float = 2.0
    """Median time an agent spends between an answer and its next turn."""
    tool_time_sigma: float = 0.8
    shared_prefix_share: float = 0.0
    """Fraction of sessions that start with one shared system prompt (`shared_prefix_id` "system-0")."""


def generate_agentic(shape: AgenticShape, seed: int) -> list[TraceRequest]:
    """Every request of the trace, in the order of their sessions' starts."""
    rng = np.random.default_rng(seed)
    n = shape.sessions
    turns = np.minimum(np.floor(rng.pareto(shape.alpha, n) + 1).astype(int), shape.max_turns)
    scales = rng.lognormal(0.0, shape.session_sigma, n)
    starts = np.sort(rng.uniform(0.0, shape.span_s, n))
    shared = rng.random(n) < shape.shared_prefix_share
    new_inputs = [np.maximum(1, np.rint(s * rng.lognormal(np.log(shape.new_input_tokens), shape.new_input_sigma, t)))
                  for t, s in zip(turns, scales)]
    raw_outputs = [rng.lognormal(0.0, shape.output_sigma, t) for t in turns]
    tool_times = [rng.lognormal(np.log(shape.tool_time_s), shape.tool_time_sigma, t) for t in turns]
    scale = _output_scale(new_inputs, raw_outputs, shape.io_ratio)
    requests = []
    for index in range(n):
        outputs = np.maximum(1, np.rint(raw_outputs[index] * scale))
        for turn in range(turns[index]):
            requests.append(TraceRequest(
                session_id=f"s{index}", turn=turn,
                delay_s=round(float(starts[index] if turn == 0 else tool_times[index][turn]), 3),
                new_input_tokens=int(new_inputs[index][turn]), output_tokens=int(outputs[turn]),
                shared_prefix_id="system-0" if shared[index] and turn == 0 else None,
            ))
    return requests


def _output_scale(new_inputs: list[np.ndarray], raw_outputs: list[np.ndarray], io_ratio: float) -> float:
    """The factor on answer lengths that makes total input / total output = `io_ratio`.

    Turn k's prompt holds every earlier answer, so input grows with the answers too:
    input = A + c B and output = c C, solved for c.
    """
    a = sum(float(np.cumsum(x).sum()) for x in new_inputs)
    b = sum(float((np.cumsum(o) - o).sum()) for o in raw_outputs)
    c = sum(float(o.sum()) for o in raw_outputs)
    if io_ratio * c <= b:
        raise ValueError(f"no answer length gives an input/output ratio of {io_ratio}: the sessions are too long")
    return a / (io_ratio * c - b)


def prompt_tokens(requests: list[TraceRequest]) -> dict[tuple[str, int], int]:
    """Each request's whole prompt: its session's earlier prompts and answers plus its new input."""
    prompts: dict[tuple[str, int], int] = {}
    running: dict[str, int] = {}
    for r in requests:
        prompt = running.get(r.session_id, 0) + r.new_input_tokens
        prompts[(r.session_id, r.turn)] = prompt
        running[r.session_id] = prompt + r.output_tokens
    return prompts


def skew(requests: list[TraceRequest]) -> dict[float, float]:
    """Share of all input tokens carried by the top fraction of sessions (the keys of `SEED_SKEW`)."""
    per_session: dict[str, int] = {}
    for (session, _), prompt in prompt_tokens(requests).items():
        per_session[session] = per_session.get(session, 0) + prompt
    masses = np.sort(np.fromiter(per_session.values(), dtype=float))[::-1]
    total = masses.sum()
    return {top: float(masses[: max(1, int(len(masses) * top))].sum() / total) for top in SEED_SKEW}


def io_ratio(requests: list[TraceRequest]) -> float:
    return sum(prompt_tokens(requests).values()) / sum(r.output_tokens for r in requests)


@dataclass(frozen=True)
class BurstyShape:
    """Independent requests (one turn each) for open-loop replay: a steady rate with bursts on top, seeded."""

    requests: int = 2000
    span_s: float = 600.0
    bursts: int = 6
    """Bursts over the span, each starting at a random time."""
    burst_s: float = 10.0
    burst_share: float = 0.5
    """Fraction of the requests that arrive inside bursts (the rest uniformly over the span)."""
    input_tokens: float = 1500.0
    """Median prompt length (lognormal, `new_input_sigma` of the agentic shape)."""
    output_tokens: float = 20.0
    """Median answer length (lognormal)."""


def generate_bursty(shape: BurstyShape, seed: int) -> list[TraceRequest]:
    """Every request, in arrival order; each is its own session's turn 0, `delay_s` its arrival."""
    if shape.bursts < 1 or not 0.0 <= shape.burst_share <= 1.0:
        raise ValueError("bursts must be at least 1 and burst_share within [0, 1]")
    rng = np.random.default_rng(seed)
    n = shape.requests
    in_burst = rng.random(n) < shape.burst_share
    burst_starts = rng.uniform(0.0, max(0.0, shape.span_s - shape.burst_s), shape.bursts)
    arrivals = np.where(in_burst, burst_starts[rng.integers(0, shape.bursts, n)] + rng.uniform(0.0, shape.burst_s, n),
                        rng.uniform(0.0, shape.span_s, n))
    inputs = np.maximum(1, np.rint(rng.lognormal(np.log(shape.input_tokens), 0.6, n)))
    outputs = np.maximum(1, np.rint(rng.lognormal(np.log(shape.output_tokens), 0.5, n)))
    order = np.argsort(arrivals)
    return [TraceRequest(session_id=f"r{i}", turn=0, delay_s=round(float(arrivals[k]), 3), new_input_tokens=int(inputs[k]),
                         output_tokens=int(outputs[k])) for i, k in enumerate(order)]

"""Mooncake-format traces (`shared/contracts/mooncake.py`) generated to the released traces' published statistics,
and conversion between that format and the agentic one.

The published statistics (kvcache-ai/Mooncake `FAST25-release/`, the paper's
appendix; one hour each):

| trace | requests | mean input | mean output |
| --- | --- | --- | --- |
| conversation | 12,031 | 12,035 | 343 |
| tool-and-agent | 23,608 | 8,596 | 182 |

What they do not state is drawn from what the released conversation file
shows (a sample of about 100 consecutive requests at minute 31, read for this
purpose and nowhere scored on) or assumed, and said so:

- every prompt opens with one shared block (id 0, a system prompt: in the file);
- a request continues an earlier conversation with probability
  `follow_up_share` (0.36 in the sample), carrying that conversation's last
  prompt whole (its full blocks) and adding new blocks for the answer and the
  new question (median `turn_tokens`, 600 assumed); otherwise it opens a new
  conversation with a prompt of lognormal length (σ 1.0, from the sample's
  spread, 900 to 87,000 tokens), its median set so the whole trace's mean input
  is the published one;
- a conversation's next turn comes at least `min_turn_gap_s` (15 s: the
  answer streamed, read, the next question typed; assumed) and then an
  exponential time (`turn_gap_s`, 120 s assumed) after its last: in the
  sample, reused blocks were first seen up to about eight minutes earlier;
- arrivals are Poisson at the published rate, modulated per minute by a
  lognormal factor (σ `burst_sigma`, 0.3 assumed), timestamps on the file's
  three-second ticks;
- tool-and-agent prompts open with one of `tool_prompts` shared tool
  descriptions (8, each 2–6 blocks: assumed) after the system block, and
  continue an earlier task with probability 0.5 (assumed).

Output lengths are lognormal (σ 0.8, assumed) scaled to the published mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.contracts.mooncake import BLOCK_TOKENS, MooncakeRequest, reuse_bound
from shared.contracts.trace import SHARED_PREFIX_TOKENS, TraceRequest

TICK_MS = 3000
"""The released files' arrivals fall on three-second ticks."""


@dataclass(frozen=True)
class MooncakeShape:
    requests: int
    duration_s: float
    mean_input: float
    mean_output: float
    follow_up_share: float
    turn_tokens: float = 600.0
    turn_gap_s: float = 120.0
    min_turn_gap_s: float = 15.0
    input_sigma: float = 1.0
    output_sigma: float = 0.8
    burst_sigma: float = 0.3
    tool_prompts: int = 0


SHAPES = {
    "mooncake-conversation": MooncakeShape(12031, 3600.0, 12035.0, 343.0, follow_up_share=0.36),
    "mooncake-toolagent": MooncakeShape(23608, 3600.0, 8596.0, 182.0, follow_up_share=0.5, tool_prompts=8),
}


@dataclass
class _Conversation:
    blocks: list[int]
    """Its last prompt's full blocks."""
    tokens: int
    last_ms: float


def generate_mooncake(shape: MooncakeShape, seed: int, requests: int | None = None) -> list[MooncakeRequest]:
    """A trace of `requests` (the shape's count by default) over a proportional share of its duration, its fresh
    prompts' median set (in two corrections on the same draws) so that the mean input is the published one."""
    fresh_median = shape.mean_input / math.exp(shape.input_sigma ** 2 / 2)
    trace: list[MooncakeRequest] = []
    for _ in range(3):
        trace = _generate(shape, seed, requests or shape.requests, fresh_median)
        fresh_median *= shape.mean_input / float(np.mean([r.input_length for r in trace]))
    return trace


def _generate(shape: MooncakeShape, seed: int, count: int, fresh_median: float) -> list[MooncakeRequest]:
    rng = np.random.default_rng(seed)
    duration_ms = shape.duration_s * 1000 * count / shape.requests
    arrivals = _arrivals(rng, count, duration_ms, shape.burst_sigma)
    next_id = 1  # 0: the system block every prompt opens with
    tools: list[list[int]] = []
    for _ in range(shape.tool_prompts):
        size = int(rng.integers(2, 7))
        tools.append(list(range(next_id, next_id + size)))
        next_id += size
    output_median = shape.mean_output / math.exp(shape.output_sigma ** 2 / 2)
    open_conversations: list[_Conversation] = []
    out: list[MooncakeRequest] = []
    for at in arrivals:
        output = max(1, int(rng.lognormal(math.log(output_median), shape.output_sigma)))
        follow = _pick_follow_up(rng, open_conversations, at, shape)
        drawn = rng.lognormal(0.0, 1.0)  # drawn for every request, so a correction of the median moves no other draw
        if follow is not None:
            new = max(1, int(shape.turn_tokens * math.exp(0.6 * math.log(drawn))))
            tokens = follow.tokens + new
            head = list(follow.blocks)
        else:
            tokens = max(BLOCK_TOKENS + 1, int(fresh_median * drawn ** shape.input_sigma))
            head = [0] + (tools[int(rng.integers(len(tools)))] if tools else [])
            tokens = max(tokens, BLOCK_TOKENS * len(head) + 1)
        fresh_blocks = list(range(next_id, next_id + math.ceil(tokens / BLOCK_TOKENS) - len(head)))
        next_id += len(fresh_blocks)
        ids = head + fresh_blocks
        out.append(MooncakeRequest(timestamp=int(at), input_length=tokens, output_length=output, hash_ids=tuple(ids)))
        full = tokens // BLOCK_TOKENS  # the partial last block is not reused: the next turn extends it
        conversation = follow or _Conversation([], 0, at)
        conversation.blocks, conversation.tokens, conversation.last_ms = ids[:full], tokens + output, at
        if follow is None:
            open_conversations.append(conversation)
    return out


def _arrivals(rng: np.random.Generator, count: int, duration_ms: float, burst_sigma: float) -> np.ndarray:
    minutes = max(1, math.ceil(duration_ms / 60_000))
    weights = rng.lognormal(0.0, burst_sigma, minutes)
    minute = rng.choice(minutes, size=count, p=weights / weights.sum())
    times = np.minimum((minute + rng.random(count)) * 60_000, duration_ms - 1)
    return np.sort(np.floor(times / TICK_MS) * TICK_MS)


def _pick_follow_up(rng: np.random.Generator, conversations: list[_Conversation], at: float,
                    shape: MooncakeShape) -> _Conversation | None:
    """The conversation this request continues, if any: among those open, the one whose next turn is due
    soonest after an exponential gap (most recent turns are the likeliest to go on)."""
    if not conversations or rng.random() >= shape.follow_up_share:
        return None
    # Conversations idle for much longer than the gap are closed (kept the list short).
    horizon = at - 10 * shape.turn_gap_s * 1000
    while conversations and conversations[0].last_ms < horizon:
        conversations.pop(0)
    if not conversations:
        return None
    recent = [c for c in conversations[-64:] if at - c.last_ms >= shape.min_turn_gap_s * 1000]
    if not recent:
        return None
    gaps = np.array([at - c.last_ms for c in recent]) / 1000 - shape.min_turn_gap_s
    weights = np.exp(-gaps / shape.turn_gap_s)
    return recent[int(rng.choice(len(recent), p=weights / weights.sum()))]


def statistics(requests: list[MooncakeRequest]) -> dict:
    """What a Mooncake trace looks like, for a reader to set beside the published figures."""
    reusable, total = reuse_bound(requests)
    span_s = (requests[-1].timestamp - requests[0].timestamp) / 1000 if requests else 0.0
    return {"requests": len(requests), "span_s": round(span_s, 1),
            "mean_input": round(float(np.mean([r.input_length for r in requests])), 1) if requests else None,
            "mean_output": round(float(np.mean([r.output_length for r in requests])), 1) if requests else None,
            "reusable_input_share": round(reusable / total, 3) if total else None}


# ---------------------------------------------------------------------------- conversion


def agentic_to_mooncake(requests: list[TraceRequest], block: int = BLOCK_TOKENS) -> list[MooncakeRequest]:
    """The agentic trace as Mooncake requests: open-loop arrivals (each session's offset plus its tool times, as
    if answers were instant), a turn's prompt its predecessor's prompt and answer plus its new input, blocked so
    that what a session's turns share, and the shared system prompts, carry the same ids."""
    next_id = 0
    shared_ids: dict[str, list[int]] = {}
    state: dict[str, tuple[list[int], int, float]] = {}  # session: full blocks so far, tokens, due (s)
    out: list[tuple[float, MooncakeRequest]] = []
    for r in requests:
        if r.turn == 0:
            head: list[int] = []
            tokens = 0
            if r.shared_prefix_id is not None:
                if r.shared_prefix_id not in shared_ids:
                    size = SHARED_PREFIX_TOKENS // block
                    shared_ids[r.shared_prefix_id] = list(range(next_id, next_id + size))
                    next_id += size
                head = list(shared_ids[r.shared_prefix_id])
                tokens = len(head) * block
            due = r.delay_s
        else:
            head, tokens, due = state[r.session_id]
            due += r.delay_s
        tokens += r.new_input_tokens
        new = list(range(next_id, next_id + max(0, math.ceil(tokens / block) - len(head))))
        next_id += len(new)
        ids = head + new
        out.append((due, MooncakeRequest(timestamp=int(due * 1000), input_length=tokens,
                                         output_length=r.output_tokens, hash_ids=tuple(ids))))
        # The next turn carries this prompt's full blocks; its partial last one is extended, so it is new.
        state[r.session_id] = (ids[:tokens // block], tokens + r.output_tokens, due)
    out.sort(key=lambda pair: pair[0])
    return [request for _, request in out]


def mooncake_to_agentic(requests: list[MooncakeRequest], sessions: list[str]) -> list[TraceRequest]:
    """A Mooncake trace's conversations (`sessions`, one per request, as `conversations` in
    `shared/contracts/mooncake.py` infers them) as agentic sessions: a turn's new input is what its prompt adds to its predecessor's prompt and
    answer (at least one token), its delay the time since its predecessor's arrival."""
    previous: dict[str, MooncakeRequest] = {}
    turns: dict[str, int] = {}
    out: list[TraceRequest] = []
    for request, session in zip(requests, sessions):
        before = previous.get(session)
        if before is None:
            new, delay = request.input_length, request.timestamp / 1000
        else:
            new = max(1, request.input_length - before.input_length - before.output_length)
            delay = (request.timestamp - before.timestamp) / 1000
        out.append(TraceRequest(session_id=session, turn=turns.get(session, 0), delay_s=delay, new_input_tokens=new,
                                output_tokens=max(1, request.output_length)))
        turns[session] = turns.get(session, 0) + 1
        previous[session] = request
    return out

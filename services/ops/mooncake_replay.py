"""Replaying a Mooncake-format trace against any OpenAI endpoint, open loop at its timestamps.

Each request's prompt is built block by block from its `hash_ids`: block id h
is `block_tokens` words drawn from h alone, so two requests share exactly the
text their shared leading ids say, and the last block is cut to the request's
`input_length`. `block_tokens` is the trace's 512 by default; a smaller one
keeps the trace's reuse at a size a small model's context holds.

Every request carries its conversation, as `conversations` in
`shared/contracts/mooncake.py` infers it, as `x-session-id`.

Reported beside what the agentic replay reports: the trace's own reuse bound
over the requests sent (`apc_bound_infinite`: an infinite prefix cache seeing
every request, in the trace's tokens) next to the prefix-cache hits the engines
reported (`apc`).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from services.ops.trace_replay import WORDS, Replay, ReplayedRequest, summarise
from shared.contracts.mooncake import BLOCK_TOKENS, MooncakeRequest, reuse_bound
from shared.contracts.trace import TraceRequest

@functools.lru_cache(maxsize=8192)
def block_text(block_id: int, words: int) -> str:
    """The block's text, its first `words` words: the same for every request that names the block."""
    return " ".join(WORDS[i] for i in np.random.default_rng(block_id).integers(0, len(WORDS), words))


def prompt_of(request: MooncakeRequest, block_tokens: int = BLOCK_TOKENS) -> str:
    """The request's prompt: its blocks' texts in order, the last cut to its length (scaled to `block_tokens`)."""
    scale = block_tokens / BLOCK_TOKENS
    parts = [block_text(b, max(1, round(request.block_tokens(i) * scale))) for i, b in enumerate(request.hash_ids)]
    return " ".join(parts)


def select(requests: Sequence[MooncakeRequest], start_s: float = 0.0,
           duration_s: float | None = None) -> list[MooncakeRequest]:
    """The requests arriving in [start, start + duration) seconds of the trace."""
    end = math.inf if duration_s is None else (start_s + duration_s) * 1000
    return [r for r in requests if start_s * 1000 <= r.timestamp < end]


class MooncakeReplay(Replay):
    """Every request sent at its timestamp (divided by `speedup`), whatever the endpoint does."""

    async def run_mooncake(self, requests: Sequence[MooncakeRequest], sessions: Sequence[str],
                           block_tokens: int = BLOCK_TOKENS, max_tokens: int | None = None) -> float:
        """Send every request at its time; the wall time it took. A prompt is built when its request is due, so a
        long trace's prompts are never all in memory."""
        began = self.clock()
        first = requests[0].timestamp if requests else 0
        turns: Counter[str] = Counter()
        sends = []
        for request, session in zip(requests, sessions):
            output = max(1, min(request.output_length, max_tokens or request.output_length))
            as_trace = TraceRequest(session_id=session, turn=turns[session], delay_s=0.0,
                                    new_input_tokens=request.input_length, output_tokens=output)
            turns[session] += 1
            due = began + (request.timestamp - first) / 1000 / self.speedup
            sends.append(asyncio.ensure_future(self._send_when_due(due, request, as_trace, block_tokens)))
        await asyncio.gather(*sends)
        return self.clock() - began

    async def _send_when_due(self, due: float, request: MooncakeRequest, as_trace: TraceRequest,
                             block_tokens: int) -> None:
        await asyncio.sleep(max(0.0, due - self.clock()))
        await self._send(as_trace, [{"role": "user", "content": prompt_of(request, block_tokens)}])


def summarise_mooncake(served: list[ReplayedRequest], requests: Sequence[MooncakeRequest], sessions: Sequence[str],
                       wall_s: float, speedup: float = 1.0, warm: int = 0) -> dict:
    """The agentic replay's summary, with the Mooncake trace's own reuse bound and span. The first `warm` requests
    were a warm-up: they filled the caches (and the bound's) and are left out of every figure."""
    keys, turns = [], Counter()
    for session in sessions:
        keys.append((session, turns[session]))
        turns[session] += 1
    scored_keys = set(keys[warm:])
    scored, scored_sessions = requests[warm:], sessions[warm:]
    as_trace = [TraceRequest(session_id=s, turn=0, delay_s=0.0, new_input_tokens=r.input_length,
                             output_tokens=max(1, r.output_length)) for r, s in zip(scored, scored_sessions)]
    summary = summarise([s for s in served if (s.session_id, s.turn) in scored_keys], as_trace, wall_s, speedup)
    reusable, total = reuse_bound(scored, warm=requests[:warm])
    span_s = (scored[-1].timestamp - scored[0].timestamp) / 1000 if scored else 0.0
    replayed_s = (requests[-1].timestamp - requests[0].timestamp) / 1000 if requests else 0.0  # the warm-up's too
    summary.update({
        "trace_format": "mooncake", "conversations": len(set(scored_sessions)), "warm_up_requests": warm,
        "apc_bound_infinite": round(reusable / total, 4) if total else None,
        "apc_upper_bound_intra_session": None, "apc_upper_bound_any_session": None,
        "trace_span_s": round(span_s, 3),
        "amplification": round(wall_s * speedup / replayed_s, 3) if replayed_s else None,
    })
    return summary

"""The agentic trace: its format read back strictly, and the generator's shape against seed 004's production trace."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from helpers import start_engine, wait_healthy
from services.ops.trace import save_run
from services.ops.trace_replay import Replay, replay_client, summarise
from shared.contracts.config import ConfigError
from shared.contracts.trace import TraceRequest, read_trace, write_trace
from simulation.agentic import (
    SEED_SKEW,
    AgenticShape,
    BurstyShape,
    generate_agentic,
    generate_bursty,
    io_ratio,
    prompt_tokens,
    skew,
)


def test_the_generator_reproduces_the_seeds_skew_ratio_and_turns_per_session():
    requests = generate_agentic(AgenticShape(sessions=20_000), seed=3)
    shares = skew(requests)
    for top, share in SEED_SKEW.items():
        assert share - 0.04 <= shares[top] <= share + 0.04, (top, shares[top])
    assert io_ratio(requests) == pytest.approx(75.0, rel=0.02)
    assert 1.4 <= len(requests) / 20_000 <= 1.9  # the seed's 2.1 M requests over 1.3 M sessions


def test_a_seed_gives_the_same_trace_and_prompts_grow_by_answer_and_new_input():
    shape = AgenticShape(sessions=300, span_s=60.0, shared_prefix_share=0.5)
    first, again, other = (generate_agentic(shape, seed) for seed in (5, 5, 6))
    assert first == again and first != other
    starts = [r.delay_s for r in first if r.turn == 0]
    assert starts == sorted(starts) and all(0 <= s <= 60 for s in starts)
    assert any(r.shared_prefix_id == "system-0" for r in first) and all(
        r.shared_prefix_id is None for r in first if r.turn > 0)
    prompts = prompt_tokens(first)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in first:
        by_session.setdefault(r.session_id, []).append(r)
    long_session = max(by_session.values(), key=len)
    assert len(long_session) >= 3
    for before, after in zip(long_session, long_session[1:]):
        assert prompts[(after.session_id, after.turn)] == (
            prompts[(before.session_id, before.turn)] + before.output_tokens + after.new_input_tokens)


def test_a_trace_file_round_trips_and_a_bad_line_is_named(tmp_path):
    requests = generate_agentic(AgenticShape(sessions=50), seed=1)
    path = tmp_path / "trace.jsonl"
    assert write_trace(requests, path) == len(requests)
    assert read_trace(path) == requests

    cases = {
        '{"session_id": "a", "turn": 0, "delay_s": 0, "new_input_tokens": 0, "output_tokens": 3}': "new_input_tokens",
        '{"session_id": "a", "turn": 0, "delay_s": 0, "output_tokens": 3}': "new_input_tokens",
        '{"session_id": "a", "turn": 1, "delay_s": 0, "new_input_tokens": 5, "output_tokens": 3}': "turn",
        '{"session_id": "a", "turn": 0, "delay_s": 0, "new_input_tokens": 5, "output_tokens": 3, "x": 1}': "x",
        '{"session_id": "a", "turn": 0': "<line>",
    }
    for line, field in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"session_id": "b", "turn": 0, "delay_s": 1, "new_input_tokens": 5, "output_tokens": 3}\n' + line + "\n")
        with pytest.raises(ConfigError) as raised:
            read_trace(bad)
        assert raised.value.field == field and "line 2" in str(raised.value), (line, str(raised.value))


def test_modelpool_trace_generate_writes_a_readable_trace_and_says_its_shape(tmp_path):
    out = tmp_path / "agentic.jsonl"
    run = subprocess.run([sys.executable, "-m", "services.cli", "trace", "generate", "--sessions", "500", "--seed", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    requests = read_trace(out)
    assert summary["requests"] == len(requests) and summary["sessions"] == 500
    assert summary["io_ratio"] == pytest.approx(75.0, rel=0.05) and set(summary["top_share_of_input"]) == {
        "1%", "5%", "10%", "25%", "50%"}


def test_a_replay_is_closed_loop_and_measures_what_it_says(tmp_path):
    """Against a simulated vLLM (its own process, prefix caching on), as any user would point it at an endpoint."""

    requests = generate_agentic(AgenticShape(sessions=12, span_s=1.0, alpha=1.2, max_turns=4, new_input_tokens=60,
                                             tool_time_s=0.2), seed=4)
    assert any(r.turn >= 2 for r in requests)
    engine = start_engine(tmp_path, "vllm", "agent", "--speedup", "20")
    try:
        wait_healthy([engine])

        async def replay():
            async with replay_client(60) as client:
                run = Replay(engine.url, "agent", client)
                return run, await run.run(requests)
        run, wall = asyncio.run(replay())
    finally:
        engine.stop()
    summary = summarise(run.served, requests, wall)
    assert summary["answered"] == len(requests) and summary["failed"] == 0
    by_turn = {(s.session_id, s.turn): s for s in run.served}
    delays = {(r.session_id, r.turn): r.delay_s for r in requests}
    for (session, turn), served in by_turn.items():
        if turn:  # a turn starts only after its predecessor's answer and its tool time
            before = by_turn[(session, turn - 1)]
            assert served.sent >= before.done + delays[(session, turn)] - 0.005
            assert served.cached_tokens > 0  # the previous turn's prompt and answer were reused
    assert 0 < summary["apc"] <= summary["apc_upper_bound_intra_session"] <= 1
    assert summary["amplification"] > 1 and summary["ttft_s"]["p50"] > 0 and summary["tpot_s"]["p50"] > 0


def test_bursty_traffic_arrives_in_its_bursts_and_is_seeded():
    shape = BurstyShape(requests=4000, span_s=600.0, bursts=4, burst_s=10.0, burst_share=0.5)
    requests = generate_bursty(shape, seed=5)
    assert requests == generate_bursty(shape, seed=5) and requests != generate_bursty(shape, seed=6)
    assert all(r.turn == 0 for r in requests) and len({r.session_id for r in requests}) == 4000
    arrivals = [r.delay_s for r in requests]
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] <= 600
    per_second = [0] * 600
    for t in arrivals:
        per_second[min(599, int(t))] += 1
    # Half the requests in 40 of 600 seconds: the busiest 40 seconds hold far more than a steady rate would (7 %).
    assert sum(sorted(per_second)[-40:]) > 0.45 * 4000
    with pytest.raises(ValueError, match="burst_share"):
        generate_bursty(BurstyShape(burst_share=1.5), seed=0)


def test_open_loop_sends_on_the_traces_clock_and_compare_puts_runs_side_by_side(tmp_path):
    """Answers slower than the tool times: open loop does not wait for them, closed loop does."""
    requests = [TraceRequest(session_id="a", turn=t, delay_s=0.05 if t else 0.0, new_input_tokens=20, output_tokens=40)
                for t in range(4)]
    # 40 tokens at the simulated llama.cpp's pace (~35 ms a step at speed-up 1) take over a second.
    engine = start_engine(tmp_path, "llama.cpp", "agent")
    try:
        wait_healthy([engine])

        async def replay(open_loop: bool) -> Replay:
            async with replay_client(60) as client:
                run = Replay(engine.url, "agent", client, open_loop=open_loop)
                run.wall = await run.run(requests)  # type: ignore[attr-defined]
                return run

        opened, closed = asyncio.run(replay(True)), asyncio.run(replay(False))
    finally:
        engine.stop()
    start = min(s.sent for s in opened.served)
    sent = sorted(s.sent - start for s in opened.served)
    assert sent[-1] < 0.15 + 0.1  # all four went out on the trace's clock (0, .05, .10, .15 s)
    assert all(s.done is not None and s.error is None for s in opened.served)
    turns = sorted(closed.served, key=lambda s: s.turn)
    assert all(b.sent >= a.done for a, b in zip(turns, turns[1:]))

    runs = []
    for name, run in (("open", opened), ("closed", closed)):
        path = tmp_path / f"{name}.json"
        save_run(path, summarise(run.served, requests, run.wall), run.served)  # type: ignore[attr-defined]
        runs.append(str(path))
    plot = tmp_path / "compare.png"
    done = subprocess.run([sys.executable, "-m", "services.cli", "trace", "compare", *runs, "--plot", str(plot)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    table = json.loads(done.stdout.strip().splitlines()[-1])["runs"]
    assert set(table) == {"open", "closed"} and table["open"]["answered"] == 4
    assert table["closed"]["amplification"] > table["open"]["amplification"]
    assert plot.stat().st_size > 10_000
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    refused = subprocess.run([sys.executable, "-m", "services.cli", "trace", "compare", str(bad)], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "trace run --out" in refused.stderr

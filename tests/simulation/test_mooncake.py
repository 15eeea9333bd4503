"""The Mooncake trace format: read strictly, generated to the released traces' published statistics, converted
to and from the agentic format, and replayed open loop with prompts that share exactly what their block ids say."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import start_engine, wait_healthy
from services.engines.simulated import synthetic
from services.ops.mooncake_replay import prompt_of, select
from shared.contracts.config import ConfigError
from shared.contracts.mooncake import (
    MooncakeRequest,
    conversations,
    is_mooncake,
    read_mooncake,
    reuse_bound,
    write_mooncake,
)
from shared.contracts.trace import read_trace
from simulation.agentic import AgenticShape, generate_agentic
from simulation.mooncake import SHAPES, TICK_MS, agentic_to_mooncake, generate_mooncake, mooncake_to_agentic


def request(at: int, ids: list[int], tokens: int | None = None, output: int = 10) -> MooncakeRequest:
    return MooncakeRequest(timestamp=at, input_length=tokens or 512 * len(ids), output_length=output,
                           hash_ids=tuple(ids))


def test_a_trace_round_trips_is_told_by_its_fields_and_a_bad_line_is_named(tmp_path):
    trace = [request(0, [0, 1, 2], 1200), request(3000, [0, 1, 3, 4], 1900)]
    path = tmp_path / "t.jsonl"
    write_mooncake(trace, path)
    assert is_mooncake(path) and read_mooncake(path) == trace
    agentic = tmp_path / "a.jsonl"
    agentic.write_text('{"session_id": "s", "turn": 0, "delay_s": 0, "new_input_tokens": 5, "output_tokens": 1}\n')
    assert not is_mooncake(agentic)
    for line, field in (('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
                        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp"),
                        ('{"timestamp": 0, "input_length": 5000, "output_length": 1, "hash_ids": [0]}', "hash_ids")):
        path.write_text(line + "\n")
        with pytest.raises(ConfigError) as bad:
            read_mooncake(path)
        assert bad.value.field == field and "line 1" in str(bad.value)
    path.write_text('{"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                    '{"timestamp": 3, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')
    with pytest.raises(ConfigError, match="line 2.*arrival order"):
        read_mooncake(path)


def test_the_reuse_bound_counts_leading_blocks_seen_before_and_stops_at_the_first_new_one():
    trace = [request(0, [0, 1, 2], 1300), request(1, [0, 1, 3], 1100), request(2, [0, 5, 2], 1536)]
    reusable, total = reuse_bound(trace)
    # The second reuses blocks 0 and 1; the third block 0 only: its block 2 comes after a block never seen.
    assert (reusable, total) == (1024 + 512, 1300 + 1100 + 1536)
    # After a warm-up that saw blocks 0 and 5 (and is not counted), the first reuses block 0, the third 0 and 5.
    warm = [request(0, [0, 5], 1024)]
    assert reuse_bound(trace, warm=warm) == (512 + 1024 + 512 + 1024, 1300 + 1100 + 1536)


def test_prompts_share_exactly_what_their_ids_say_and_conversations_are_told_by_private_blocks():
    first, turn, other = request(0, [0, 7, 8], 1200), request(5, [0, 7, 8, 9], 1900), request(6, [0, 20], 700)
    a, b, c = (prompt_of(r, 16).split() for r in (first, turn, other))
    assert b[:32] == a[:32] and len(a) == 16 + 16 + round(176 * 16 / 512) and len(b) == 16 * 3 + round(364 / 32)
    assert c[:16] == a[:16] and c[16:] != a[16:32][:len(c) - 16]
    trace = [request(t, [0, 100 + t]) for t in range(30)] + [first, turn, other]
    named = conversations(trace)
    assert named[-3] == named[-2] == "c7"  # the turn carries its conversation's first private block
    assert named[-1] == "r32"  # a lone request is a conversation of its own
    assert len(set(named)) == len(trace) - 1  # block 0, in every request, names nothing
    assert select([first, turn, other], 0.004, 0.002) == [turn]


def test_a_prompt_is_as_many_tokens_as_the_trace_says_to_the_simulated_engine():
    # The simulator's estimate is the engine's tokenizer in every simulated replay: a prompt longer than the trace
    # says would load the engines more than the trace does, and overflow a context the trace fits in.
    for r in (request(0, [0, 7, 8], 1200), request(1, [3, 4, 5, 6], 2000)):
        assert len(synthetic.pieces(prompt_of(r))) == r.input_length


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_generator_follows_the_published_statistics(name):
    shape = SHAPES[name]
    trace = generate_mooncake(shape, 3, requests=3000)
    assert len(trace) == 3000 and trace == generate_mooncake(shape, 3, requests=3000)
    assert abs(np.mean([r.input_length for r in trace]) / shape.mean_input - 1) < 0.02
    assert abs(np.mean([r.output_length for r in trace]) / shape.mean_output - 1) < 0.1
    assert all(r.timestamp % TICK_MS == 0 for r in trace) and trace[-1].timestamp <= 3600_000 * 3000 / shape.requests
    assert all(a.timestamp <= b.timestamp for a, b in zip(trace, trace[1:]))
    reusable, total = reuse_bound(trace)
    assert 0.25 < reusable / total < 0.7  # conversations' histories and shared prompts are reused, not everything
    assert all(r.hash_ids[0] == 0 for r in trace)


def test_agentic_sessions_convert_to_mooncake_and_back(tmp_path):
    agentic = generate_agentic(AgenticShape(sessions=40, shared_prefix_share=0.5), 1)
    mooncake = agentic_to_mooncake(agentic)
    assert len(mooncake) == len(agentic) and all(a.timestamp <= b.timestamp for a, b in zip(mooncake, mooncake[1:]))
    reusable, total = reuse_bound(mooncake)
    assert reusable > 0.3 * total  # later turns carry their predecessors' blocks
    back = mooncake_to_agentic(mooncake, conversations(mooncake))
    assert len(back) == len(mooncake) and sum(r.turn > 0 for r in back) > 0
    path, out = tmp_path / "a.jsonl", tmp_path / "m.jsonl"
    from shared.contracts.trace import write_trace

    write_trace(agentic, path)
    done = subprocess.run([sys.executable, "-m", "services.cli", "trace", "convert", str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout.splitlines()[-1])["to"] == "mooncake", done.stderr
    again = tmp_path / "a2.jsonl"
    done = subprocess.run([sys.executable, "-m", "services.cli", "trace", "convert", str(out), "--out", str(again)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and len(read_trace(again)) == len(agentic), done.stderr


def test_modelpool_trace_run_replays_a_mooncake_trace_open_loop_with_its_reuse(tmp_path):
    trace = tmp_path / "conversation.jsonl"
    made = subprocess.run([sys.executable, "-m", "services.cli", "trace", "generate", "--shape",
                           "mooncake-conversation", "--requests", "400", "--seed", "5", "--out", str(trace)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    engine = start_engine(tmp_path, "vllm", "mc", "--speedup", "50")
    try:
        wait_healthy([engine])
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "trace", "run", str(trace), "--url", engine.url, "--model", "mc",
             "--start", "30", "--duration", "60", "--warmup-s", "15", "--speedup", "20", "--max-tokens", "8",
             "--block-tokens", "32"],
            capture_output=True, text=True, timeout=300)
    finally:
        engine.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    sent, warm = select(read_mooncake(trace), 30, 60), select(read_mooncake(trace), 15, 15)
    # The warm-up's requests were sent first and are in no figure; the bound's cache saw their blocks.
    assert summary["trace_format"] == "mooncake" and summary["answered"] == summary["requests"] == len(sent)
    assert summary["warm_up_requests"] == len(warm) > 0
    reusable, total = reuse_bound(sent, warm=warm)
    assert summary["apc_bound_infinite"] == round(reusable / total, 4) > 0.1
    assert 0 < summary["apc"] <= 1 and summary["conversations"] < len(sent)
    assert 55 <= summary["trace_span_s"] <= 60 and summary["amplification"] < 1.5  # on the trace's clock


def test_the_lab_reads_mooncake_traces_and_shapes_as_workloads(tmp_path):
    from lab import workloads

    path = tmp_path / "day.jsonl"
    write_mooncake(generate_mooncake(SHAPES["mooncake-toolagent"], 2, requests=500), path)
    name, sessions = workloads.load(str(path), seed=0)
    assert name == "day" and len(sessions) == 500 and any(r.turn > 0 for r in sessions)
    name, generated = workloads.load("mooncake-conversation", seed=1)
    assert len(generated) == SHAPES["mooncake-conversation"].requests
    with pytest.raises(ConfigError, match="workload"):
        workloads.load("mooncake-conversation", seed=1, overrides={"requests": 5})

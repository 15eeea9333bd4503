"""Benchmark: moving a session's KV between two real llama.cpp engines against recomputing it.

Two `modelpool engine llama.cpp` processes (SmolLM2-135M, CPU) with their
internal ports. Per context length N, each repetition:

- **move**: a prompt of N tokens is computed on the source; its KV is exported
  from the source's internal port and imported into the target's by the
  gateway's own code (`services/gateway/kv_moves.py`, timed: `move_s`); then the next turn (the prompt plus
  one token) is sent to the target, whose TTFT is `ttft_after_move_s`.
- **recompute**: a fresh prompt of N tokens on the target, nothing cached:
  its TTFT is what a moved session pays without its KV (`recompute_s`).

`speedup` = recompute_s / (move_s + ttft_after_move_s): how much sooner the
moved session's next turn starts. Medians over `--repeats`, with min and max.

    .venv/bin/python bench/kv_move.py

Progress on stderr; the last line on stdout is the JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.gateway.kv_moves import KVMover, session_tag  # noqa: E402
from shared.contracts.backends import BackendType, EngineKind  # noqa: E402
from shared.contracts.states import InstanceState  # noqa: E402
from shared.internal_auth import SECRET_ENV  # noqa: E402
from shared.projections.rows import InstanceRow  # noqa: E402
from shared.net import free_ports  # noqa: E402
from shared.openai_protocol import SESSION_TAG_HEADER  # noqa: E402

from harness import BenchService, wait_ready  # noqa: E402

ALIAS = "smollm2"
SESSION = "bench/kv-move"


def say(message: str) -> None:
    print(f"[kv-move bench] {message}", file=sys.stderr, flush=True)


def engine_row(instance_id: str, internal: str) -> InstanceRow:
    """A running llama.cpp instance as the gateway's view holds it: what `move_kv` reads of its source and target."""
    return InstanceRow(instance_id, ALIAS, BackendType.LLAMA_CPP, EngineKind.LLAMA_CPP, "w1", InstanceState.RUNNING,
                       0, 0, None, None, internal, None, "running", datetime.now(timezone.utc))


def start(name: str, work: Path, args: argparse.Namespace) -> tuple[BenchService, str, str]:
    port, internal = free_ports(2)
    process = BenchService(name, [sys.executable, "-m", "services.cli", "engine", "llama.cpp", "--model-alias", ALIAS,
                             "--port", str(port), "--internal-port", str(internal), "--threads", str(args.threads),
                             "--n-seq-max", "4", "--n-ctx", str(4 * args.ctx_per_seq),
                             "--max-input-tokens", str(args.ctx_per_seq - 8), "--log-level", "warning"], work)
    return process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{internal}"


async def ttft(client: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of a one-token completion, and the cached tokens the engine reports."""
    started = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json={"model": ALIAS, "prompt": prompt, "max_tokens": 1,
                                                                "temperature": 0}, headers={SESSION_TAG_HEADER: session_tag(SESSION)})
    response.raise_for_status()
    usage = response.json()["usage"]
    return time.perf_counter() - started, (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def measure(args: argparse.Namespace, work: Path) -> dict:
    rng = random.Random(args.seed)
    secret = secrets.token_urlsafe(32)
    os.environ[SECRET_ENV] = secret  # the engines' cluster secret (they inherit this environment)
    engines = [start(name, work, args) for name in ("source", "target")]
    try:
        for process, url, internal in engines:
            await wait_ready(f"{url}/health", process)
            await wait_ready(f"{internal}/health", process)
        (_, source, source_internal), (_, target, target_internal) = engines
        rows = []
        # The gateway's own move (services/gateway/kv_moves.py), on an aiohttp client as the gateway's.
        async with httpx.AsyncClient(timeout=600) as client, aiohttp.ClientSession() as session:
            mover = KVMover(session, secret.encode(), time.perf_counter)
            await ttft(client, target, [1000, 1001, 1002])  # warm-up
            for n in args.tokens:
                runs = []
                for rep in range(args.repeats):
                    prompt = [rng.randrange(1000, 40000) for _ in range(n)]
                    await ttft(client, source, prompt)
                    turn = prompt + [rng.randrange(1000, 40000)]
                    move = await mover.move(engine_row("source", source_internal),
                                            engine_row("target", target_internal), SESSION, "/v1/completions",
                                            json.dumps({"model": ALIAS, "prompt": turn}).encode(), timeout_s=60)
                    if not move.moved:
                        raise RuntimeError(f"the KV did not move: {move.detail}")
                    move_s = move.seconds
                    after_s, cached = await ttft(client, target, turn)
                    recompute_s, _ = await ttft(client, target, [rng.randrange(1000, 40000) for _ in range(n)])
                    runs.append({"move_s": move_s, "ttft_after_move_s": after_s, "recompute_s": recompute_s,
                                 "cached_tokens": cached, "bytes": move.bytes})
                    say(f"N={n} #{rep + 1}: move {move_s * 1000:.1f} ms + next turn {after_s * 1000:.1f} ms "
                        f"(cached {cached}) vs recompute {recompute_s * 1000:.1f} ms")
                rows.append(summarise(n, runs))
        return {"engine": "llama.cpp (real, SmolLM2-135M, CPU)", "threads": args.threads, "repeats": args.repeats,
                "rows": rows}
    finally:
        for process, _, _ in engines:
            process.stop()


def summarise(n: int, runs: list[dict]) -> dict:
    def stat(key: str) -> dict:
        values = [r[key] for r in runs]
        return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}

    speedups = [r["recompute_s"] / (r["move_s"] + r["ttft_after_move_s"]) for r in runs]
    return {"tokens": n, "kv_bytes": runs[0]["bytes"], "move_s": stat("move_s"),
            "ttft_after_move_s": stat("ttft_after_move_s"), "recompute_s": stat("recompute_s"),
            "cached_tokens_min": min(r["cached_tokens"] for r in runs),
            "speedup": {"median": round(statistics.median(speedups), 2), "min": round(min(speedups), 2),
                        "max": round(max(speedups), 2)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx-per-seq", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-kv-move-") as tmp:
        result = asyncio.run(measure(args, Path(tmp)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

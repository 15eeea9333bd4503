"""Benchmark: how right is the ETA a client held through a cold start is told?

The whole pool runs as its real services (relay, projector, placement,
autoscaler, gateway, one worker) on the local Postgres and NATS, in a scratch
namespace dropped afterwards, with two aliases that scale to zero:

- `eta-llama`: the REAL llama.cpp engine (modelpool's, SmolLM2-135M, the
  default model), llama.cpp alone (the hybrid policy with vLLM off), back to
  COLD and no instance `--idle-s` after its last request;
- `eta-vllm`: a SIMULATED vLLM (`modelpool engine sim`, `--vllm-startup-s` of
  modelled start-up on top of its process start), scaled by utilization from
  0 to 1 instance and back to 0 `--idle-s` after its load ends.

For each alias in turn, `--starts` times: wait until it has no instance, send
one streaming chat request, and read the SSE comments the gateway sends while
it holds it (`: modelpool cold-start phase=... eta_ms=... waited_ms=...`, one a
second) up to `phase=ready`, when an instance took the request. Each ETA told
is compared with the wait that actually followed it (ready's arrival less the
comment's). The first start of an alias has nothing measured and tells no ETA:
it is counted, not scored. Nothing was tuned on these runs: the ETA is the
median of the alias's last five measured times of the same kind (`services/
gateway/starts.py`).

    .venv/bin/python bench/cold_start_eta.py

Progress goes to stderr; the last line on stdout is the JSON summary: per
alias, the median and p90 absolute error of every ETA told and of the first ETA
of each start, the actual waits, and the phases seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cluster.localpool import LocalPool  # noqa: E402
from services.ops.load import quantile  # noqa: E402
from shared.contracts.events import event_registry  # noqa: E402
from shared.eventlog.db import create_engine, migrate_async  # noqa: E402
from shared.eventlog.store import make_store  # noqa: E402
from shared.settings import Settings  # noqa: E402

from harness import drop_namespace  # noqa: E402

ALIASES = ("eta-llama", "eta-vllm")


def say(message: str) -> None:
    print(f"[cold-start eta bench] {message}", file=sys.stderr, flush=True)


def pool_yaml(args: argparse.Namespace) -> str:
    return f"""
aliases:
  - alias: eta-llama
    autoscaling_policy: {{name: hybrid, enable: false, cold_idle_s: {args.idle_s},
                         llama_scale_down_cooldown_s: 0, down_hold_s: 0}}
    backends:
      llama.cpp: {{model_name: eta-llama, model_path: default, gpu_memory_gb: 2, min_replicas: 0, max_replicas: 1}}
  - alias: eta-vllm
    autoscaling_policy: {{name: utilization, backend: vllm, min_instances: 0, max_instances: 1,
                         scale_out_cooldown: 0, scale_in_cooldown: {args.idle_s}}}
    backends:
      vllm: {{model_name: eta-vllm, model_path: /m, gpu_memory_gb: 8, min_replicas: 0, max_replicas: 1,
             max_model_len: 4096, engine: simulator, engine_args: {{startup-s: {args.vllm_startup_s}}}}}
"""


def comment_fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split()[3:])


async def live_instances(store, alias: str) -> set[str]:
    """The alias's instances not yet ABSENT, as the log has them."""
    state: dict[str, str] = {}
    for e in await store.of_type("InstanceStateChanged", alias=alias):
        state[e.payload["instance_id"]] = e.payload["to_state"]
    return {i for i, s in state.items() if s != "ABSENT"}


async def one_cold_start(client: httpx.AsyncClient, gateway: str, alias: str) -> dict:
    """One streaming request held through a cold start: each ETA told with the wait that followed it."""
    told: list[tuple[float, dict[str, str]]] = []
    ready_at = None
    other: list[str] = []
    body = {"model": alias, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "stream": True}
    sent = time.monotonic()
    async with client.stream("POST", f"{gateway}/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith(": modelpool cold-start "):
                fields = comment_fields(line)
                if fields["phase"] == "ready":
                    ready_at = time.monotonic()
                else:
                    told.append((time.monotonic(), fields))
            elif line and not line.startswith("data: {\"id"):
                other.append(line)
    if ready_at is None:
        raise RuntimeError(f"{alias}: the request was not held through a cold start (no `phase=ready` comment); "
                           f"told {told}, then {other[:5]}")
    errors = [abs(int(f["eta_ms"]) / 1000 - (ready_at - at)) for at, f in told if "eta_ms" in f]
    first = next(((at, f) for at, f in told if "eta_ms" in f), None)
    return {"waited_s": ready_at - sent, "phases": sorted({f["phase"] for _, f in told}), "errors": errors,
            "first_error": None if first is None else abs(int(first[1]["eta_ms"]) / 1000 - (ready_at - first[0])),
            "first_eta_s": None if first is None else int(first[1]["eta_ms"]) / 1000}


async def until_cold(store, alias: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while await live_instances(store, alias):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{alias} still has instances after {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


def summary(starts: list[dict]) -> dict:
    errors = [e for s in starts for e in s["errors"]]
    firsts = [s["first_error"] for s in starts if s["first_error"] is not None]
    r = lambda v: None if v is None else round(v, 3)  # noqa: E731
    return {"starts": len(starts), "scored_starts": len(firsts), "etas_told": len(errors),
            "abs_error_p50_s": r(quantile(errors, 0.5)), "abs_error_p90_s": r(quantile(errors, 0.9)),
            "first_eta_abs_error_p50_s": r(quantile(firsts, 0.5)),
            "first_eta_abs_error_p90_s": r(quantile(firsts, 0.9)),
            "waited_s": [round(s["waited_s"], 2) for s in starts],
            "first_eta_s": [r(s["first_eta_s"]) for s in starts],
            "phases": sorted({p for s in starts for p in s["phases"]})}


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=8, help="cold starts per alias")
    p.add_argument("--idle-s", type=float, default=2.0, help="idle time after which an alias goes back to zero")
    p.add_argument("--vllm-startup-s", type=float, default=8.0)
    args = p.parse_args()
    settings = Settings.load({}, namespace=f"bench_eta_{secrets.token_hex(4)}")
    await migrate_async(settings)
    results: dict[str, list[dict]] = {alias: [] for alias in ALIASES}
    with tempfile.TemporaryDirectory(prefix="modelpool-eta-") as work:
        pool = LocalPool(settings.database_url, settings.nats_url, settings.namespace, pool_yaml(args), Path(work),
                         workers={"w1": {"MODELPOOL_WORKER_GPU_MEMORY_GB": "24", "MODELPOOL_WORKER_SLOTS": "4"}},
                         env={"MODELPOOL_METRIC_WINDOW_S": "1", "MODELPOOL_CONTROL_TICK_S": "0.5",
                              "MODELPOOL_LOG_LEVEL": "WARNING"})
        await asyncio.to_thread(pool.start)
        db = create_engine(settings, pool_size=1)
        store = make_store(db, event_registry(), settings.namespace)
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
                for i in range(args.starts):
                    for alias in ALIASES:
                        await until_cold(store, alias, timeout_s=120)
                        start = await one_cold_start(client, pool.gateway, alias)
                        results[alias].append(start)
                        say(f"{alias} start {i + 1}/{args.starts}: waited {start['waited_s']:.2f} s, first ETA "
                            f"{start['first_eta_s']} s, phases {start['phases']}")
        finally:
            await db.dispose()
            await asyncio.to_thread(pool.stop)
            await drop_namespace(settings)
    out = {"llama_cpp_real": summary(results["eta-llama"]), "vllm_simulated": summary(results["eta-vllm"]),
           "engines": {"eta-llama": "llama.cpp (modelpool's engine, real)", "eta-vllm": "simulated-vllm"}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

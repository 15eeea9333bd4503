"""The multi-host compose cluster (deploy/compose/cluster.yml) through its faults, and its gateways' throughput.

    .venv/bin/python bench/cluster.py [--rounds 2] [--rps-seconds 15] [--rps-repeats 3] [--gateway-cpus 0.05]
                                      [--only faults|throughput]

Builds and starts the cluster as its tests do (stand-in base images where no registry is reachable), then:

- faults, `--rounds` times each, under three clients sending short chat requests through the balancer to the
  warm alias (real llama.cpp engines on two worker hosts): a worker host cut off from the network (recovery:
  until two replicas run off it), a gateway replica killed (recovery: from its restart until the balancer
  sends to it again), the NATS server leading the log's stream killed for 12 s (recovery: from its restart
  until it holds every event), the deciding autoscaler killed (recovery: until the standby decides);
- throughput: requests/s through the balancer with both gateway replicas and with one (the other paused),
  alternated `--rps-repeats` times, 32 connections sending 1-token requests to the simulated vLLM alias on all
  three hosts. Each gateway container is limited to `--gateway-cpus` of a CPU (`docker update --cpus`), as a
  gateway host of its own would be: on one 2-core machine the replicas otherwise share the cores the
  engines, the balancer and this load generator need, and the number measured would be the machine's.

Prints progress on stderr and one JSON line last: `faults` (each {"sent", "failed", "recovery_s"}, summed over
rounds, the slowest recovery), `rps_one_gateway`, `rps_two_gateways` (medians), and every round's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "ops")]

from compose_cluster import (Cluster, Outcome, cut_off_a_worker, gateway_behind_balancer, healthy,  # noqa: E402
                             lose_a_gateway, lose_a_nats_server, lose_the_deciding_autoscaler, until, warm_replicas)
from docker_support import (build_standins, ensure_docker_engine, offer_llama_wheel,  # noqa: E402
                            prune_replaced_images, run, say)

SIM_ALIAS = "smollm2-135m-sim"  # deploy/compose/pool.yaml: the simulated vLLM tier on all three hosts


async def requests_per_second(url: str, seconds: float, connections: int) -> tuple[float, int]:
    """Answered requests per second over `seconds` from `connections` loops, and how many failed."""
    body = json.dumps({"model": SIM_ALIAS, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    answered = failed = 0
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def loop() -> None:
            nonlocal answered, failed
            while time.monotonic() < end:
                try:
                    async with session.post(f"{url}/v1/chat/completions", data=body,
                                            headers={"content-type": "application/json"}) as response:
                        await response.read()
                        if response.status == 200:
                            answered += 1
                        else:
                            failed += 1
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    failed += 1
        began = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(connections)))
    return answered / (time.monotonic() - began), failed


def throughput(cluster: Cluster, seconds: float, repeats: int, connections: int) -> dict[str, Any]:
    until(f"three replicas of {SIM_ALIAS} running", lambda: len(cluster.running(SIM_ALIAS)) == 3, timeout_s=300,
          every_s=2)
    one, two, failed = [], [], 0
    for n in range(repeats):
        # Alternated, so neither is always measured first; gateway-2 paused (not restarted) for one, so both
        # measurements find warm processes; 5 s unmeasured after each change, for the balancer to settle.
        for gateways in ((2, 1) if n % 2 == 0 else (1, 2)):
            if gateways == 1:
                run(["docker", "pause", cluster.container("gateway-2")], timeout_s=60)
                until("the balancer sending to gateway-1 alone", lambda: all(
                    gateway_behind_balancer(cluster) == "gateway-1" for _ in range(4)), timeout_s=30, every_s=0.5)
            asyncio.run(requests_per_second(cluster.url(), 5, connections))
            rate, lost = asyncio.run(requests_per_second(cluster.url(), seconds, connections))
            (one if gateways == 1 else two).append(rate)
            failed += lost
            if gateways == 1:
                run(["docker", "unpause", cluster.container("gateway-2")], timeout_s=60)
                until("gateway-2 back behind the balancer", lambda: "gateway-2" in {
                    gateway_behind_balancer(cluster) for _ in range(4)}, timeout_s=120, every_s=0.5)
        say(f"round {n + 1}: {two[-1]:.0f} req/s through two gateways, {one[-1]:.0f} through one")
    return {"rps_one_gateway": round(statistics.median(one), 1), "rps_two_gateways": round(statistics.median(two), 1),
            "ratio": round(statistics.median(two) / statistics.median(one), 2),
            "rps_one_gateway_runs": [round(r, 1) for r in one], "rps_two_gateways_runs": [round(r, 1) for r in two],
            "rps_failed": failed}


def limit_gateways(cluster: Cluster, cpus: float) -> None:
    for gateway in ("gateway-1", "gateway-2"):
        run(["docker", "update", "--cpus", str(cpus), cluster.container(gateway)], timeout_s=60)


def merged(outcomes: list[Outcome]) -> dict[str, Any]:
    rounds = [o.summary() for o in outcomes]
    return {"sent": sum(r["sent"] for r in rounds), "failed": sum(r["failed"] for r in rounds),
            "recovery_s": max(r["recovery_s"] for r in rounds), "rounds": rounds}


def make_faults(cluster: Cluster, rounds: int) -> dict[str, Any]:
    faults: dict[str, list[Outcome]] = {"worker_partition": [], "gateway_loss": [], "nats_server_loss": [],
                                        "autoscaler_leader_loss": []}
    for n in range(rounds):
        say(f"faults, round {n + 1} of {rounds}")
        faults["gateway_loss"].append(lose_a_gateway(cluster))
        faults["nats_server_loss"].append(lose_a_nats_server(cluster))
        faults["autoscaler_leader_loss"].append(lose_the_deciding_autoscaler(cluster))
        faults["worker_partition"].append(cut_off_a_worker(cluster, f"worker-{n % 3 + 1}"))
    return {name: merged(outcomes) for name, outcomes in faults.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="times each fault is made (default 2)")
    parser.add_argument("--rps-seconds", type=float, default=15.0)
    parser.add_argument("--rps-repeats", type=int, default=3)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--gateway-cpus", type=float, default=0.05)
    parser.add_argument("--only", choices=("faults", "throughput"), help="measure one of the two")
    args = parser.parse_args()

    began = time.monotonic()
    ensure_docker_engine()
    images = build_standins()
    offer_llama_wheel()
    cluster = Cluster(images)
    result: dict[str, Any] = {}
    try:
        say("building the modelpool image")
        cluster.compose("build", "migrate", timeout_s=2400)
        cluster.up()
        warm_replicas(cluster)
        say(f"cluster serving after {time.monotonic() - began:.0f} s")
        if args.only != "throughput":
            result["faults"] = make_faults(cluster, args.rounds)
        if args.only != "faults":
            say(f"throughput, each gateway limited to {args.gateway_cpus} CPU")
            limit_gateways(cluster, args.gateway_cpus)
            result.update(throughput(cluster, args.rps_seconds, args.rps_repeats, args.connections))
        assert healthy(cluster.url())
    finally:
        leftovers = cluster.down()
        prune_replaced_images()
    result.update({
        "bench": "cluster",
        "engines": {"faults": "llama.cpp (real, CPU) on the worker hosts",
                    "throughput": "vLLM simulator (simulated: no GPU here)"},
        "hosts": "containers on one 2-core machine, one Docker network",
        "gateway_cpus": args.gateway_cpus, "connections": args.connections, "rounds": args.rounds,
        "left_on_the_engine": leftovers, "wall_s": round(time.monotonic() - began),
    })
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

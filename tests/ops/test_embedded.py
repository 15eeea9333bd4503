"""The embedded NATS and Postgres servers: real servers, started, reused and stopped cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import asyncpg
import nats
import pytest
from ops_processes import alive, descendants, pids_mentioning, wait_gone

from services.cluster.embedded import EmbeddedNats, EmbeddedPostgres, EmbeddedServerError

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("embedded")


async def _publish_and_count(url: str, stream: str, subject: str, publish: bool) -> tuple[int | None, int]:
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        if publish:
            await js.add_stream(name=stream, subjects=[subject])
            ack = await js.publish(subject, b"hello", headers={"Nats-Msg-Id": "m-1"})
            # The same message id again is deduplicated by JetStream, not stored twice.
            duplicate = await js.publish(subject, b"hello", headers={"Nats-Msg-Id": "m-1"})
            assert duplicate.duplicate
            seq: int | None = ack.seq
        else:
            seq = None
        info = await js.stream_info(stream)
        return seq, info.state.messages
    finally:
        await client.close()


async def test_nats_accepts_a_jetstream_publish_and_keeps_it_across_restarts(data_dir: Path) -> None:
    server = EmbeddedNats(data_dir / "nats")
    with server:
        assert server.url.startswith("nats://127.0.0.1:")
        pid = server.pid
        assert pid is not None and alive(pid)
        seq, messages = await _publish_and_count(server.url, "EMBEDDED", "embedded.test", publish=True)
        assert (seq, messages) == (1, 1)
    assert wait_gone([pid]) == []
    assert pids_mentioning(data_dir / "nats") == []

    with EmbeddedNats(data_dir / "nats") as again:  # the same store: the stream and its message are still there
        _, messages = await _publish_and_count(again.url, "EMBEDDED", "embedded.test", publish=False)
        assert messages == 1


async def test_postgres_accepts_queries_runs_unprivileged_and_keeps_data(data_dir: Path) -> None:
    server = EmbeddedPostgres(data_dir / "postgres", database="embedded_test")
    with server:
        # Services' URL: the service role, no password in it; the owner's for what creates tables.
        assert server.url.startswith("postgresql://modelpool_service@127.0.0.1:") and server.url.endswith("/embedded_test")
        postmaster = server.pid
        assert postmaster is not None
        # Postgres refuses root; as root the server runs as an unprivileged account.
        expected_uid = os.geteuid()
        if expected_uid == 0:
            assert _uid_of(postmaster) != 0
        else:
            assert _uid_of(postmaster) == expected_uid
        conn = await asyncpg.connect(server.owner_url, password=server.owner.password)
        try:
            version = await conn.fetchval("SHOW server_version")
            assert version.startswith("16.")
            await conn.execute("CREATE TABLE kept (v text)")
            await conn.execute("INSERT INTO kept VALUES ('survives a restart')")
        finally:
            await conn.close()
        assert postmaster in pids_mentioning(data_dir / "postgres")
        helpers = descendants(postmaster)
        assert helpers  # checkpointer, walwriter, ...: they must go too
    assert wait_gone([postmaster, *helpers]) == []
    assert pids_mentioning(data_dir / "postgres") == []

    # Second start finds the cluster: no initdb, the row is still there.
    with EmbeddedPostgres(data_dir / "postgres", database="embedded_test") as again:
        conn = await asyncpg.connect(again.owner_url, password=again.owner.password)
        try:
            assert await conn.fetchval("SELECT v FROM kept") == "survives a restart"
        finally:
            await conn.close()
    assert pids_mentioning(data_dir / "postgres") == []


def test_a_second_postgres_on_the_same_data_dir_is_refused(data_dir: Path) -> None:
    with EmbeddedPostgres(data_dir / "shared-pg"), pytest.raises(EmbeddedServerError, match="already running"):
        EmbeddedPostgres(data_dir / "shared-pg").start()
    assert pids_mentioning(data_dir / "shared-pg") == []


def test_servers_die_with_a_parent_killed_by_sigkill(tmp_path: Path) -> None:
    marker = f"MODELPOOL_TEST_RUN={uuid.uuid4().hex}"
    script = textwrap.dedent(
        f"""
        import sys, time
        from services.cluster.embedded import EmbeddedNats, EmbeddedPostgres
        nats = EmbeddedNats({str(tmp_path / "nats")!r}).start()
        pg = EmbeddedPostgres({str(tmp_path / "pg")!r}).start()
        print(nats.pid, pg.pid, flush=True)
        time.sleep(120)
        """
    )
    key, value = marker.split("=")
    env = {**os.environ, key: value, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        nats_pid, pg_pid = map(int, line.split())
        assert alive(nats_pid) and alive(pg_pid)
        started = pids_mentioning(marker)
        started += [child for pid in started for child in descendants(pid)]
        assert {nats_pid, pg_pid} <= set(started)
        assert len(set(started)) >= 5  # the parent, nats-server, postgres and its helpers
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert wait_gone(started, timeout_s=15) == []
    assert pids_mentioning(marker) == []


def test_a_port_taken_after_it_was_picked_is_replaced_by_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from services.cluster.embedded import nats

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real_free_port = nats.free_port
        picks = iter([taken])
        monkeypatch.setattr(nats, "free_port", lambda host="127.0.0.1": next(picks, None) or real_free_port(host))
        with EmbeddedNats(tmp_path / "nats") as server:
            assert server.port != taken
            assert "address already in use" in server.log_path.read_text().lower()  # the first attempt lost the race

        # A port the caller asked for is not silently replaced.
        with pytest.raises(EmbeddedServerError, match="already in use"):
            EmbeddedNats(tmp_path / "nats", port=taken).start()
    assert pids_mentioning(tmp_path) == []


async def test_a_killed_nats_starts_again_on_its_port_and_store(tmp_path: Path) -> None:
    with EmbeddedNats(tmp_path / "nats") as server:
        url, pid = server.url, server.pid
        assert pid is not None
        await _publish_and_count(url, "RESTARTED", "restarted.test", publish=True)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.running and server.returncode == -signal.SIGKILL

        server.start()
        assert server.running and server.url == url
        _, messages = await _publish_and_count(url, "RESTARTED", "restarted.test", publish=False)
        assert messages == 1
        assert "jetstream" in server.log_path.read_text().lower()  # the log of the first run is kept
    assert pids_mentioning(tmp_path / "nats") == []


async def test_a_killed_postgres_starts_again_on_its_port_despite_a_stuck_backend(data_dir: Path) -> None:
    with EmbeddedPostgres(data_dir / "postgres", database="embedded_test") as server:
        url, postmaster = server.url, server.pid
        assert postmaster is not None
        conn = await asyncpg.connect(server.owner_url, password=server.owner.password)
        await conn.execute("CREATE TABLE IF NOT EXISTS restarted AS SELECT 'kept' AS v")
        # A backend that cannot exit when its postmaster dies keeps the old shared memory
        # attached, which makes a new postmaster refuse to start until it is gone.
        stuck = await conn.fetchval("SELECT pg_backend_pid()")
        os.kill(stuck, signal.SIGSTOP)
        os.kill(postmaster, signal.SIGKILL)
        assert wait_gone([postmaster]) == [] and alive(stuck)
        conn.terminate()

        server.start()
        assert server.url == url and server.pid != postmaster and not alive(stuck)
        conn = await asyncpg.connect(server.owner_url, password=server.owner.password)
        try:
            assert await conn.fetchval("SELECT v FROM restarted") == "kept"
        finally:
            await conn.close()
    assert pids_mentioning(data_dir / "postgres") == []

"""Telling a server's absence from a bug, waiting it out quietly, and reporting it to health checks."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from services.links import Link, ServerLinks
from services.ops.health import judge_health
from shared.bus.jetstream import connect
from shared.faults import Backoff, Outage, StopRequested, is_transient, retry_until_done


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_server_that_is_not_there_is_transient_a_bad_query_is_not(settings):
    dead = f"postgresql+asyncpg://postgres@127.0.0.1:{closed_port()}/x"
    engine = create_async_engine(dead)
    with pytest.raises(Exception) as refused:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    await engine.dispose()
    assert is_transient(refused.value)  # a SQLAlchemy error caused by the refused connection

    with pytest.raises(Exception) as refused_raw:
        await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{closed_port()}/x", timeout=2)
    assert is_transient(refused_raw.value)

    live = create_async_engine(settings.sqlalchemy_url)
    try:
        with pytest.raises(Exception) as bad_sql:
            async with live.connect() as conn:
                await conn.execute(text("SELECT * FROM no_such_table_anywhere"))
        assert not is_transient(bad_sql.value)
        # A session ended by an administrator (a restart, a failover, pg_terminate_backend) is an absence.
        async with live.connect() as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar()
            async with live.connect() as other:
                await other.execute(text(f"SELECT pg_terminate_backend({pid})"))
            with pytest.raises(Exception) as terminated:
                await conn.execute(text("SELECT 1"))
        assert is_transient(terminated.value)
    finally:
        await live.dispose()
    assert not is_transient(ValueError("bad input")) and not is_transient(KeyError("x"))


def test_backoff_grows_to_its_cap_and_starts_over_after_a_success():
    backoff = Backoff(first_s=0.1, cap_s=1.0)
    delays = [backoff.next_s() for _ in range(8)]
    assert 0.08 <= delays[0] <= 0.1 and all(d <= 1.0 for d in delays) and delays[-1] >= 0.8
    assert delays[3] > delays[1]
    backoff.reset()
    assert backoff.next_s() <= 0.1


def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(caplog):
    now = [0.0]
    outage = Outage("reading the log", logging.getLogger("t"), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="t"):
        for _ in range(30):
            outage.failed(ConnectionRefusedError("refused"))
            now[0] += 1
        outage.succeeded()
        outage.succeeded()
    assert [r.getMessage() for r in caplog.records] == [
        "reading the log failed (ConnectionRefusedError: refused); retrying until its server is back",
        "reading the log works again after 30.0 s",
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="t"):
        outage.failed(KeyError("bug"))
        outage.failed(KeyError("bug"))
    assert len(caplog.records) == 2 and all(r.exc_info for r in caplog.records)  # a bug is never hidden


async def test_retry_until_done_waits_out_transient_failures_raises_others_and_stops_on_request():
    attempts = []

    async def flaky():
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionRefusedError("not yet")
        return "done"

    assert await retry_until_done(flaky, "x", logging.getLogger("t"), backoff=Backoff(first_s=0.01)) == "done"
    assert len(attempts) == 3

    async def broken():
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        await retry_until_done(broken, "x", logging.getLogger("t"))

    stop = asyncio.Event()

    async def never():
        stop.set()
        raise ConnectionRefusedError("down")

    with pytest.raises(StopRequested):
        await retry_until_done(never, "x", logging.getLogger("t"), stop)


def test_a_link_says_lost_and_back_once_and_how_long_it_has_been_up(caplog):
    now = [100.0]
    link = Link("Postgres", clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="modelpool.links"):
        link.reached()
        now[0] += 5
        assert link.up_for_s() == 5
        for _ in range(3):
            link.missed(ConnectionRefusedError("refused"))
        assert link.up_for_s() == 0 and not link.up
        now[0] += 8
        link.reached()
        link.reached()
        now[0] += 1
    assert [r.getMessage() for r in caplog.records] == [
        "Postgres reached",
        "Postgres lost (ConnectionRefusedError: refused); every part of this service retries until it is back",
        "Postgres is back after 8.0 s",
    ]
    assert link.up_for_s() == 1


def test_health_is_judged_on_freshness_and_how_long_a_server_has_been_away():
    now = time.time()
    healthy = {"service": "relay", "at": now, "postgres": {"up": True, "for_s": 50}, "nats": {"up": False, "for_s": 5}}
    assert judge_health(healthy, now, stale_after_s=10, down_after_s=30) == []  # a short NATS gap is no illness
    away = {**healthy, "nats": {"up": False, "for_s": 31, "error": "disconnected"}}
    assert judge_health(away, now, stale_after_s=10, down_after_s=30) == ["nats unreachable for 31 s (disconnected)"]
    stale = {**healthy, "at": now - 60}
    assert judge_health(stale, now, stale_after_s=10, down_after_s=30) == ["relay has not checked its servers for 60 s"]


async def test_a_services_links_are_probed_written_for_its_health_check_and_notice_a_lost_server(settings, tmp_path):
    from services.cluster.embedded import EmbeddedNats

    health_file = tmp_path / "relay.health.json"
    links = ServerLinks("relay", str(health_file))
    engine = create_async_engine(settings.sqlalchemy_url)
    with EmbeddedNats(tmp_path / "nats") as server:
        nc = await connect(server.url, name="links-test", **links.nats_callbacks())
        try:
            await links.probe(engine, nc)
            links.write_health()
            assert links.postgres.up and links.nats.up
            check = subprocess.run([sys.executable, "-m", "services.cli", "health", "--file", str(health_file)],
                                   capture_output=True, text=True)
            assert check.returncode == 0 and "healthy: relay" in check.stdout, check.stderr
            server.stop()
            await links.probe(engine, nc)
            assert not links.nats.up and links.postgres.up
        finally:
            await nc.close()
            await engine.dispose()
    await asyncio.sleep(0.2)
    links.write_health()
    written = json.loads(health_file.read_text())
    assert written["nats"]["up"] is False and written["postgres"]["up"] is True
    # Gone for longer than allowed: the check fails and says why.
    check = subprocess.run([sys.executable, "-m", "services.cli", "health", "--file", str(health_file),
                            "--down-after", "0"], capture_output=True, text=True)
    assert check.returncode == 1 and "unhealthy: nats unreachable" in check.stderr
    missing = subprocess.run([sys.executable, "-m", "services.cli", "health", "--file", str(tmp_path / "none")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "cannot read" in missing.stderr


async def test_a_paused_nats_is_missed_while_paused_and_reached_again_on_the_same_connection(settings, tmp_path):
    """A server that stops answering (SIGSTOP) is missed within a probe's timeout and reached again as soon as it
    resumes, on the connection it had: the probe's PING waits for its PONG however late it comes (a PING given up on,
    as nats-py's `flush(timeout)` does, breaks the connection's read loop when its PONG arrives, and every service
    then reconnected seconds after the server was back)."""
    from services.cluster.embedded import EmbeddedNats

    links = ServerLinks("relay")
    engine = create_async_engine(settings.sqlalchemy_url)
    errors: list[Exception] = []

    async def error_cb(exc: Exception) -> None:
        errors.append(exc)

    with EmbeddedNats(tmp_path / "nats") as server:
        nc = await connect(server.url, name="links-pause-test", **{**links.nats_callbacks(), "error_cb": error_cb})
        try:
            await links.probe(engine, nc)
            assert links.nats.up
            os.kill(server.pid, signal.SIGSTOP)
            try:
                for _ in range(3):  # three probes over about 6 s, each finding it silent
                    await links.probe(engine, nc)
                    assert not links.nats.up
            finally:
                os.kill(server.pid, signal.SIGCONT)
            await links.probe(engine, nc)
            assert links.nats.up, links.nats.error
            await asyncio.sleep(1.0)  # the PONGs owed arrive and are read
            await links.probe(engine, nc)
            assert links.nats.up and nc.is_connected
            assert nc.stats["reconnects"] == 0 and errors == [], (nc.stats, errors)
        finally:
            await nc.close()
            await engine.dispose()


def test_the_health_check_loads_no_client_library():
    """Containers run `modelpool health` every few seconds each: it must not pay for loading the servers' clients
    or the configuration's models (it cost two thirds of a CPU second when it did)."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, services.cli, services.ops.health; "
         "print(' '.join(m for m in ('nats', 'sqlalchemy', 'asyncpg', 'pydantic', 'faststream') if m in sys.modules))"],
        capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def test_a_health_check_with_an_endpoint_needs_it_to_answer_200(tmp_path):
    """`--url`: the service's own HTTP health too; `--ignore-servers`: that alone (the gateway serves while a
    server is away, so a load balancer must not drop it then)."""
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the handler's name)
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    servers_away = tmp_path / "gateway.health.json"
    servers_away.write_text(json.dumps({"service": "gateway", "at": time.time(),
                                        "postgres": {"up": False, "for_s": 120, "error": "refused"},
                                        "nats": {"up": True, "for_s": 120}}))

    def check(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "services.cli", "health", *args], capture_output=True, text=True)

    try:
        ok = check("--url", f"{base}/health", "--ignore-servers")
        assert ok.returncode == 0 and "answered 200" in ok.stdout, ok.stderr
        refused = check("--url", f"{base}/busy", "--ignore-servers")
        assert refused.returncode == 1 and "answered 503" in refused.stderr
        both = check("--file", str(servers_away), "--url", f"{base}/health")
        assert both.returncode == 1 and "postgres unreachable" in both.stderr
        assert check("--url", f"http://127.0.0.1:{closed_port()}/health", "--ignore-servers").returncode == 1
        assert check("--ignore-servers").returncode == 2  # a usage error: nothing to judge by
    finally:
        server.shutdown()

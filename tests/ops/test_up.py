"""`modelpool up` end to end: real servers, real services, clean stop, nothing left behind."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import nats
import pytest
from ops_processes import alive, cmdline, descendants, pids_mentioning, wait_gone

from services.cluster import supervisor, up
from shared.bus.auth import read_credentials_file
from services.cluster.embedded import EmbeddedNats, EmbeddedPostgres
from shared.net import free_port

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 90.0


@dataclass
class Cluster:
    proc: subprocess.Popen[bytes]
    log: Path
    marker: str
    gateway_port: int
    data_dir: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.gateway_port}/health", timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.health() != 200:
            if self.proc.poll() is not None:
                pytest.fail(f"modelpool up exited with {self.proc.returncode} before the gateway was healthy:\n{self.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"gateway not healthy within {READY_TIMEOUT_S:.0f} s:\n{self.output()}")
            time.sleep(0.2)

    def ctrl_c(self) -> None:
        # A terminal's Ctrl-C goes to the foreground process group.
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait_for(self, text: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no {text!r} in the output of modelpool up:\n{self.output()}")
            time.sleep(0.1)

    def service_pid(self, name: str) -> int:
        return next(pid for pid in self.processes() if cmdline(pid).endswith(f"services.cli {name}"))

    def wait_exit(self, timeout_s: float = 45.0) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"modelpool up did not exit within {timeout_s:.0f} s:\n{self.output()}")

    def processes(self) -> list[int]:
        """Every live process this run started: they all inherit the marker,
        except Postgres backends, which are found as the postmaster's descendants."""
        marked = pids_mentioning(self.marker)
        return sorted({*marked, *(child for pid in marked for child in descendants(pid))})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Shared by the tests in this module, so only the first one pays for initdb.
    return tmp_path_factory.mktemp("up")


def _start(data_dir: Path, log: Path, extra_env: dict[str, str] | None = None, options: tuple[str, ...] = ()) -> Cluster:
    marker = uuid.uuid4().hex
    gateway_port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in {"NATS_URL", "DATABASE_URL", "MODELPOOL_GATEWAY_PORT"}}
    env.update({"MODELPOOL_TEST_RUN": marker, "PYTHONPATH": str(REPO), **(extra_env or {})})
    argv = [sys.executable, "-m", "services.cli", "up", "--data-dir", str(data_dir), "--gateway-port", str(gateway_port), *options]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    return Cluster(proc, log, f"MODELPOOL_TEST_RUN={marker}", gateway_port, data_dir)


@pytest.fixture
def started() -> Iterator[list[Cluster]]:
    """Clusters started by a test; killed outright if the test failed midway."""
    clusters: list[Cluster] = []
    yield clusters
    for cluster in clusters:
        if cluster.proc.poll() is None:
            os.killpg(cluster.proc.pid, signal.SIGKILL)
            cluster.proc.wait()
        for pid in cluster.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_up_serves_then_ctrl_c_stops_everything(data_dir: Path, tmp_path: Path, started: list[Cluster]) -> None:
    cluster = _start(data_dir, tmp_path / "up.log")
    started.append(cluster)
    cluster.wait_healthy()

    text = cluster.output()
    assert f"http://127.0.0.1:{cluster.gateway_port}/v1" in text
    # Services log in to the embedded Postgres as the service role, its password in a file: none is ever printed.
    assert "nats://127.0.0.1:" in text and "postgresql://modelpool_service@127.0.0.1:" in text
    for name in ("superuser-password", "owner-password", "service-password"):
        secret = data_dir / "postgres" / name
        assert secret.stat().st_mode & 0o777 == 0o600, name
        assert secret.read_text().strip() not in text, name
    found = json.loads((data_dir / "cluster.json").read_text())
    assert found["database_password_file"] == str(data_dir / "postgres" / "service-password")
    assert found["database_url"].startswith("postgresql://modelpool_service@")
    running = cluster.processes()
    commands = [cmdline(pid) for pid in running]
    for name in up.SERVICES:
        assert any(c.endswith(f"services.cli {name}") for c in commands), f"{name} not running: {commands}"
    assert any("nats-server" in c and str(data_dir) in c for c in commands)
    assert any(c.split(" ", 1)[0].endswith("/postgres") for c in commands)
    assert any(c.startswith("postgres: ") for c in commands)  # the server's own helper processes

    cluster.ctrl_c()
    assert cluster.wait_exit() == 0, cluster.output()
    assert wait_gone(running, timeout_s=5) == [], cluster.output()
    assert cluster.processes() == []
    assert pids_mentioning(data_dir) == []
    assert "stopped" in cluster.output().splitlines()[-1]
    # Every service stopped on its own SIGTERM; none needed the SIGKILL fallback.
    assert "did not stop within" not in cluster.output()
    assert "killing leftover process" not in cluster.output()


def test_the_default_pool_serves_from_cold_and_operator_commands_find_the_cluster(
        data_dir: Path, tmp_path: Path, started: list[Cluster], settings) -> None:
    import openai

    admin_port = free_port()
    cluster = _start(data_dir, tmp_path / "up.log", {"MODELPOOL_ADMIN_PORT": str(admin_port)})
    started.append(cluster)
    cluster.wait_healthy()
    # Nothing started by hand: the first request is held while the controller starts real llama.cpp.
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.gateway_port}/v1", api_key="unused", timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Say hello."}], max_tokens=12)
    assert raw.headers["x-modelpool-engine"] == "llama.cpp" and raw.parse().choices[0].message.content

    # A second terminal, no settings at all: the operator's commands find this cluster.
    bare = {k: v for k, v in os.environ.items() if k not in {"NATS_URL", "DATABASE_URL", "MODELPOOL_NAMESPACE"}}
    bare["MODELPOOL_DATA_DIR"] = str(data_dir)
    status = subprocess.run([sys.executable, "-m", "services.cli", "status"], env=bare, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "smollm2-135m: FAST_ONLY" in status.stdout and "first demand" in status.stdout
    history = subprocess.run([sys.executable, "-m", "services.cli", "history", "smollm2-135m"], env=bare, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert history.returncode == 0 and "routing COLD -> FAST_ONLY" in history.stdout, history.stderr
    explained = subprocess.run([sys.executable, "-m", "services.cli", "explain", raw.headers["x-request-id"]], env=bare,
                               cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert explained.returncode == 0, explained.stderr
    assert "served by llama.cpp instance smollm2-135m-fast-" in explained.stdout and "\n  why: " in explained.stdout
    watch_top(bare, tmp_path)

    # The console is on: its token made at the first start, readable by its owner alone, named in the banner.
    token_file = data_dir / "admin-token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    # So are the cluster secret (engines' internal ports) and the file naming the servers (a DSN may hold a password),
    # and the bus's users: the request above went through a NATS that refuses a client without credentials.
    for private in ("cluster-secret", "cluster.json", "nats-users/gateway.json", "nats-users/nats-server.conf"):
        assert (data_dir / private).stat().st_mode & 0o777 == 0o600, private
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await_once(nats.connect(json.loads((data_dir / "cluster.json").read_text())["nats_url"], allow_reconnect=False))
    assert f"console   http://127.0.0.1:{admin_port}/console" in cluster.output()
    token = token_file.read_text().strip()
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/console", timeout=10) as page:
        assert b"console.js" in page.read()
    asked = urllib.request.Request(f"http://127.0.0.1:{admin_port}/admin/status",
                                   headers={"authorization": f"Bearer {token}"})
    with urllib.request.urlopen(asked, timeout=10) as answer:
        assert [a["alias"] for a in json.loads(answer.read())["aliases"]] == ["smollm2-135m"]

    cluster.ctrl_c()
    assert cluster.wait_exit() == 0, cluster.output()
    assert not (data_dir / "cluster.json").exists()
    # Pointed at a database without modelpool's schema, a command says so in one line.
    elsewhere = {**bare, "DATABASE_URL": settings.database_url, "MODELPOOL_NAMESPACE": settings.namespace}  # never migrated
    wrong = subprocess.run([sys.executable, "-m", "services.cli", "status"], env=elsewhere, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    assert "no modelpool schema" in wrong.stderr


def await_once(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def watch_top(env: dict[str, str], cwd: Path) -> None:
    """`modelpool top` in a real terminal (tmux on a socket of its own): the screen shows the pool, redraws every
    second, and Ctrl-C ends it."""
    tmux = ["tmux", "-L", f"modelpool-test-{uuid.uuid4().hex[:8]}"]
    command = shlex.join(["env", "-u", "COLUMNS", "-u", "LINES", *(f"{k}={v}" for k, v in env.items() if k.startswith(("MODELPOOL_", "PYTHON"))),
                          sys.executable, "-m", "services.cli", "top"])
    subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", "180", "-y", "40", "-c", str(cwd), command],
                   check=True, timeout=10)

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True,
                              timeout=10).stdout

    try:
        deadline = time.monotonic() + 30
        while "LATEST DECISIONS" not in (first := screen()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.startswith("modelpool top  namespace "), first
        assert "smollm2-135m  FAST_ONLY" in first and "smollm2-135m-fast-" in first and "RUNNING" in first, first
        assert "HEALTHY  WORKER  SINCE" in first and "smollm2-135m  COLD -> FAST_ONLY" in first, first
        assert max(len(line) for line in first.splitlines()) <= 180  # cut to the terminal, never wrapped
        # It redraws on its own: the clock in its first line moves (every second; the deadline allows for a busy
        # machine).
        deadline = time.monotonic() + 10
        while screen().splitlines()[0] == first.splitlines()[0]:
            assert time.monotonic() < deadline, f"top did not redraw within 10 s:\n{screen()}"
            time.sleep(0.2)
        subprocess.run([*tmux, "send-keys", "-t", "top", "C-c"], check=True, timeout=10)
        deadline = time.monotonic() + 10
        while subprocess.run([*tmux, "has-session", "-t", "top"], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, f"top did not end on Ctrl-C:\n{screen()}"
            time.sleep(0.2)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def test_a_killed_service_is_restarted_and_ctrl_c_still_stops_everything(
        data_dir: Path, tmp_path: Path, started: list[Cluster]) -> None:
    cluster = _start(data_dir, tmp_path / "up.log")
    started.append(cluster)
    cluster.wait_healthy()
    killed = cluster.service_pid("autoscaler")

    os.kill(killed, signal.SIGKILL)
    cluster.wait_for("[up] autoscaler exited with code -9; restarting it in 1 s (restart 1)")
    cluster.wait_for("[up] autoscaler started again (pid ")
    restarted = cluster.service_pid("autoscaler")
    assert restarted != killed and alive(restarted)
    assert cluster.proc.poll() is None and cluster.health() == 200

    running = cluster.processes()
    cluster.ctrl_c()
    assert cluster.wait_exit() == 0, cluster.output()
    assert wait_gone(running, timeout_s=5) == [], cluster.output()
    assert cluster.processes() == [] and pids_mentioning(data_dir) == []


def test_a_crash_loop_stops_up_and_names_the_service(data_dir: Path, tmp_path: Path, started: list[Cluster]) -> None:
    # A keys file the gateway cannot read: it exits with a configuration error every time it starts.
    missing = tmp_path / "missing-keys.txt"
    cluster = _start(data_dir, tmp_path / "up.log", {"MODELPOOL_API_KEYS_FILE": str(missing)},
                     ("--services", "gateway", "--restart-limit", "1", "--restart-window", "60"))
    started.append(cluster)

    assert cluster.wait_exit(timeout_s=90) == 1, cluster.output()
    text = cluster.output()
    assert "[up] gateway exited with code 2; restarting it in 1 s (restart 1)" in text
    assert "[up] gateway exited with code 2, 2 exits within 60 s (--restart-limit 1): a crash loop; stopping the cluster" in text
    assert f"    modelpool gateway: configuration error: gateway.api_keys_file: cannot read {missing}" in text  # the tail
    assert cluster.processes() == [] and pids_mentioning(data_dir) == []


async def test_killed_embedded_servers_come_back_on_their_port_with_their_data(
        data_dir: Path, tmp_path: Path, started: list[Cluster]) -> None:
    cluster = _start(data_dir, tmp_path / "up.log", options=("--services", "relay,projector"))
    started.append(cluster)
    cluster.wait_for("modelpool is starting:", timeout_s=READY_TIMEOUT_S)
    urls = json.loads((data_dir / "cluster.json").read_text())
    nats_url, database_url = urls["nats_url"], urls["database_url"]
    table = f"up_{uuid.uuid4().hex[:8]}"
    # The bus has users: an event published as the relay publishes them, into the stream the migrations declared.
    relay = read_credentials_file(data_dir / "nats-users" / "relay.json").connect_options()
    stream, subject = "MODELPOOL_EVENTS", f"modelpool.evt.test.Kept{uuid.uuid4().hex[:8]}"
    client = await nats.connect(nats_url, **relay)
    await client.jetstream().publish(subject, b"kept")
    await client.close()
    # As the owner of the database: the service role may create nothing.
    owner_url = database_url.replace("modelpool_service@", "modelpool_owner@")
    owner_password = (data_dir / "postgres" / "owner-password").read_text().strip()
    conn = await asyncpg.connect(owner_url, password=owner_password)
    await conn.execute(f"CREATE TABLE {table} AS SELECT 'kept' AS v")
    await conn.close()

    nats_server = next(pid for pid in cluster.processes() if cmdline(pid).split(" ", 1)[0].endswith("nats-server"))
    os.kill(nats_server, signal.SIGKILL)
    cluster.wait_for("[up] NATS exited with code -9; restarting it in 1 s (restart 1)")
    cluster.wait_for(f"[up] NATS is back on {nats_url}")
    client = await nats.connect(nats_url, **relay)
    assert (await client.jetstream().stream_info(stream, subjects_filter=subject)).state.subjects == {subject: 1}
    await client.close()

    postmaster = int((data_dir / "postgres" / "pgdata" / "postmaster.pid").read_text().split()[0])
    os.kill(postmaster, signal.SIGKILL)
    cluster.wait_for("[up] Postgres exited with code -9; restarting it in 1 s (restart 1)")
    cluster.wait_for(f"[up] Postgres is back on {database_url}")
    conn = await asyncpg.connect(owner_url, password=owner_password)
    assert await conn.fetchval(f"SELECT v FROM {table}") == "kept"
    await conn.execute(f"DROP TABLE {table}")
    await conn.close()

    # The services may have exited while a server was away and been restarted: up itself goes on.
    assert cluster.proc.poll() is None
    running = cluster.processes()  # the restarted servers (and Postgres' backends) among them
    cluster.ctrl_c()
    assert cluster.wait_exit() == 0, cluster.output()
    assert wait_gone(running, timeout_s=5) == [], cluster.output()
    assert cluster.processes() == [] and pids_mentioning(data_dir) == []


def test_restarts_back_off_and_a_stable_run_resets_the_delay() -> None:
    rules = supervisor.RestartRules(limit=10, window_s=1000, first_delay_s=1, max_delay_s=8, stable_after_s=60)
    restarts, now, delays = supervisor.Restarts(), 0.0, []
    for _ in range(5):  # each run lasts a second
        restarts = supervisor.after_exit(rules, restarts, started_at=now, exited_at=now + 1)
        delays.append(restarts.delay_s)
        now += 1 + restarts.delay_s
    assert delays == [1, 2, 4, 8, 8] and restarts.count == 5
    restarts = supervisor.after_exit(rules, restarts, started_at=now, exited_at=now + 59)  # not quite stable
    assert restarts.delay_s == 8
    restarts = supervisor.after_exit(rules, restarts, started_at=now + 67, exited_at=now + 127)  # up a minute
    assert restarts.delay_s == 1 and restarts.count == 7


def test_a_crash_loop_is_one_exit_more_than_the_limit_within_the_window() -> None:
    rules = supervisor.RestartRules(limit=2, window_s=100)
    first = supervisor.after_exit(rules, supervisor.Restarts(), started_at=0, exited_at=10)
    second = supervisor.after_exit(rules, first, started_at=11, exited_at=20)
    assert second is not None and second.exits == (10, 20)
    assert supervisor.after_exit(rules, second, started_at=22, exited_at=109) is None  # the third within 100 s
    later = supervisor.after_exit(rules, second, started_at=22, exited_at=110)  # the first exit has left the window
    assert later is not None and later.exits == (20, 110) and later.count == 3
    assert supervisor.after_exit(up.RestartRules(limit=0), supervisor.Restarts(), started_at=0, exited_at=1) is None  # never restart


def test_restart_options_are_checked() -> None:
    assert up.parse_args(["--restart-limit", "3", "--restart-window", "30"]).restart_limit == 3
    for bad in (["--restart-limit", "-1"], ["--restart-window", "0"]):
        with pytest.raises(SystemExit):
            up.parse_args(bad)


def test_external_servers_are_used_and_left_running(tmp_path: Path, started: list[Cluster]) -> None:
    with EmbeddedNats(tmp_path / "ext-nats") as nats, EmbeddedPostgres(tmp_path / "ext-pg") as postgres:
        own_dir = tmp_path / "own"
        # One login for migrations and services alike, as an external server is given (here its owner).
        cluster = _start(own_dir, tmp_path / "up.log", {
            "NATS_URL": nats.url, "DATABASE_URL": postgres.owner_url,
            "MODELPOOL_DATABASE_PASSWORD_FILE": str(postgres.owner.password_file)})
        started.append(cluster)
        cluster.wait_healthy()
        assert "external (NATS_URL)" in cluster.output() and "external (DATABASE_URL)" in cluster.output()
        assert not (own_dir / "nats").exists() and not (own_dir / "postgres").exists()

        cluster.ctrl_c()
        assert cluster.wait_exit() == 0, cluster.output()
        assert cluster.processes() == []
        assert nats.running and postgres.running  # not ours to stop
        assert postgres.psql("SELECT 1") == "1"


def test_a_busy_gateway_port_is_reported_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = up.parse_args(["--data-dir", str(tmp_path), "--gateway-port", str(port)])
        assert up.run(args, up.ShutdownRequest(), supervisor.Output(sys.stdout)) == 1
    assert f"gateway port {port} is in use" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # no server was started


def test_unknown_services_are_rejected() -> None:
    with pytest.raises(SystemExit) as exit_info:
        up.parse_args(["--services", "gateway,routerr"])
    assert exit_info.value.code == 2


def test_the_banner_says_which_engine_backs_each_tier(tmp_path: Path) -> None:
    config = tmp_path / "pool.yaml"
    config.write_text(
        """
aliases:
  - alias: qwen3-vl-2b
    backends:
      llama.cpp: {model_name: m, model_path: /models/m.gguf, gpu_memory_gb: 0, min_replicas: 1, max_replicas: 2}
      vllm: {model_name: m, model_path: /models/m, gpu_memory_gb: 12, max_replicas: 1, engine: simulator}
"""
    )
    lines = up.engine_lines({"MODELPOOL_CONFIG": str(config)})
    assert lines == ["alias     qwen3-vl-2b: fast tier: real llama.cpp; slow tier: simulated vllm (no real inference)"]
    assert "none configured" in up.engine_lines({})[0]
    config.write_text("aliases:\n  - alias: broken\n")
    assert "backends" in up.engine_lines({"MODELPOOL_CONFIG": str(config)})[0]

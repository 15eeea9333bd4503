"""PostgreSQL from the `pgserver` wheel (or the system's binaries), run as an unprivileged account, every login with
a password."""

from __future__ import annotations

import importlib.util
import logging
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from services.cluster.embedded.base import LOCALHOST, PORT_ATTEMPTS, EmbeddedServer, EmbeddedServerError, PortTaken, wait_until
from services.processes import Account, is_alive, kill_quietly, log_tail, processes_running, spawn, tied_to_us, wait_gone
from shared.eventlog import roles
from shared.internal_auth import make_secret_file
from shared.private_files import write_private
from shared.net import free_port
from shared.settings import read_password

log = logging.getLogger(__name__)

_DATABASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# The account a root-started Postgres runs as (created on first use).
SERVICE_ACCOUNT = "modelpool"

PG_HBA = """\
# Written by modelpool at each start: every connection proves its role's password (SCRAM-SHA-256).
local   all   all                  scram-sha-256
host    all   all   127.0.0.1/32   scram-sha-256
host    all   all   ::1/128        scram-sha-256
"""
PGPASS_FILE = "pgpass"
"""Every login of the cluster in libpq's password-file format: `PGPASSFILE=.../pgpass psql -h 127.0.0.1 -p PORT
-U modelpool_owner modelpool` for an operator."""


@dataclass(frozen=True)
class Login:
    """A role of the embedded cluster and the file its password is kept in (mode 0600, the caller's)."""

    user: str
    password_file: Path

    @property
    def password(self) -> str:
        return read_password(str(self.password_file))


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
    """PostgreSQL 16 on 127.0.0.1, cluster under `data_dir`, every connection authenticated by password (SCRAM).

    `data_dir` holds `pgdata/` (the cluster, created by initdb on first start),
    `postgres.log`, and the three logins' passwords, generated at the first start
    and kept (mode 0600): `superuser-password` (`postgres`), `owner-password`
    (`modelpool_owner`: owns the database and the schemas; migrations log in as
    it) and `service-password` (`modelpool_service`: what services log in as;
    migration 0006 says what it may do), with `pgpass` holding all three for
    libpq clients. `port=0` picks a free port on the first start. After
    `start()` the server accepts connections, `database` exists, owned by the
    owner, and `url` is the service role's `postgresql://modelpool_service@
    127.0.0.1:PORT/DATABASE`: URLs carry no password, which is read from the
    login's file (`MODELPOOL_DATABASE_PASSWORD_FILE`).

    A cluster made by an earlier modelpool, which trusted every local
    connection, is brought to password authentication at its next start, and
    its schemas handed to the owner (logged as a warning).

    As root, the server runs as an unprivileged account (see `service_account`);
    an existing cluster keeps running as the account that owns it.
    """

    name = "postgres"

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
        self.superuser = Login("postgres", self.data_dir / roles.SUPERUSER_PASSWORD_FILE)
        self.owner = Login(roles.OWNER_ROLE, self.data_dir / roles.OWNER_PASSWORD_FILE)
        self.service = Login(roles.SERVICE_ROLE, self.data_dir / roles.SERVICE_PASSWORD_FILE)

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "postgres.log"

    @property
    def pgpass(self) -> Path:
        return self.data_dir / PGPASS_FILE

    @property
    def url(self) -> str:
        """The service role's URL (no password: it is in `service.password_file`)."""
        return self.url_for(self.database, self.service)

    @property
    def owner_url(self) -> str:
        """The owner's URL, for migrations (no password: it is in `owner.password_file`)."""
        return self.url_for(self.database, self.owner)

    def url_for(self, database: str, login: Login | None = None) -> str:
        port = self.port or self.requested_port
        if not port:
            raise EmbeddedServerError("EmbeddedPostgres has not been started")
        return f"postgresql://{(login or self.service).user}@{LOCALHOST}:{port}/{database}"

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
            existed = (self.pgdata / "PG_VERSION").is_file()
            if not existed:
                self._initdb()
            self._clear_dead_server()
            self._require_passwords(existed)
            for attempt in range(1, PORT_ATTEMPTS + 1):
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
                    wait_until(self._accepting, self._proc, what="postgres", timeout_s=self.startup_timeout_s, log_path=self.log_path, log_offset=offset)
                    break
                except PortTaken:
                    if port or attempt == PORT_ATTEMPTS:
                        raise
            self._ensure_database()
        except BaseException:
            self.stop()
            raise
        log.info("postgres %s (pid %d, data %s)", self.url, self._proc.pid, self.pgdata)
        return self

    def _require_passwords(self, existed: bool) -> None:
        """Before the server starts: passwords made where absent, the superuser's set, no login without one.

        The superuser's password is set in single-user mode, with the server
        down, so the cluster never listens while it trusts anyone. Done when
        pg_hba.conf is not ours (a new cluster, or one an earlier modelpool made
        with trust) or the superuser's password file was just made.
        """
        fresh = not self.superuser.password_file.exists()
        for login in (self.superuser, self.owner, self.service):
            make_secret_file(login.password_file, min_chars=16)
        hba = self.pgdata / "pg_hba.conf"
        current = hba.read_text() if hba.exists() else ""
        if current == PG_HBA and not fresh:
            return
        if existed and current != PG_HBA:
            log.warning("the PostgreSQL cluster in %s let every local user in without a password (made by an earlier "
                        "modelpool): from now on every login needs its password (SCRAM-SHA-256), kept in %s",
                        self.pgdata, self.data_dir)
        statement = roles.password_sql(self.superuser.user, self.superuser.password)
        argv = [self._bin("postgres"), "--single", "-D", str(self.pgdata), "-c", "exit_on_error=true", "postgres"]
        result = self._run(argv, as_account=True, timeout_s=max(60.0, self.startup_timeout_s), input=statement.encode())
        if result.returncode != 0:
            raise EmbeddedServerError(f"setting the superuser's password failed with code {result.returncode}; "
                                      f"its log ({self.log_path}):\n{log_tail(self.log_path)}")
        staged = hba.with_name("pg_hba.conf.modelpool")
        staged.write_text(PG_HBA)
        if self.account is not None:
            os.chown(staged, self.account.uid, self.account.gid)
        staged.chmod(0o600)
        staged.rename(hba)

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

    def _run(self, argv: list[str], *, as_account: bool, timeout_s: float,
             input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        assert self._log_file is not None
        self._log_file.flush()
        return subprocess.run(
            argv,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
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
            "-U", self.superuser.user,
            # Replaced before the server first starts (`_require_passwords`): initdb would otherwise need the
            # password in a file the unprivileged account can read.
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
        argv = [self._bin("pg_isready"), "-q", "-h", LOCALHOST, "-p", str(self.port), "-U", self.superuser.user, "-d", "postgres"]
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0

    def psql(self, sql: str, database: str = "postgres", *, notices: list[str] | None = None) -> str:
        """Run SQL (one statement or several, `;`-separated) as the superuser with the bundled psql; returns
        unaligned output. The SQL goes through psql's standard input and the password through its environment:
        neither shows in a process list. `notices`: where the server's notices go."""
        argv = [self._bin("psql"), "-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1",
                "-h", LOCALHOST, "-p", str(self.port), "-U", self.superuser.user, "-d", database, "-f", "-"]
        env = {**os.environ, "PGPASSWORD": self.superuser.password, "PGCONNECT_TIMEOUT": "10"}
        env.pop("PGPASSFILE", None)
        result = subprocess.run(argv, input=sql if sql.rstrip().endswith(";") else sql + ";", capture_output=True,
                                text=True, timeout=60, env=env)
        if result.returncode != 0:
            raise EmbeddedServerError(f"psql failed: {result.stderr.strip()}")
        if notices is not None:
            notices += [line.split("NOTICE:", 1)[1].strip() for line in result.stderr.splitlines() if "NOTICE:" in line]
        return result.stdout.strip()

    def _ensure_database(self) -> None:
        """The owner and service logins with their passwords, the database the owner's, its schemas too."""
        self.psql(";\n".join(roles.login_sql(self.owner.user, self.owner.password)
                              + roles.login_sql(self.service.user, self.service.password)))
        exists = self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{self.database}'")
        if exists != "1":
            self.psql(f"CREATE DATABASE {roles.quoted(self.database)} OWNER {self.owner.user}")
        self.psql(";\n".join(roles.database_sql(self.database, self.owner.user, self.service.user)))
        handed: list[str] = []
        self.psql(";\n".join(roles.schemas_sql(self.owner.user)), self.database, notices=handed)
        for note in handed:
            log.warning("%s (made by an earlier modelpool as the superuser; migrations now run as the owner)", note)
        self._write_pgpass()

    def _write_pgpass(self) -> None:
        lines = [f"*:*:*:{login.user}:{login.password}" for login in (self.superuser, self.owner, self.service)]
        write_private(self.pgpass, "\n".join(lines) + "\n")

    def stop(self) -> None:
        self._stop(signal.SIGINT, self.stop_timeout_s)

"""`modelpool up`: the whole local cluster in one command.

Uses the NATS and Postgres servers named by `NATS_URL` / `DATABASE_URL`, or
starts embedded ones under the data directory (the embedded NATS with the bus's
users, made at the first start: every service connects as its own role's, and a
client without credentials is refused); applies the migrations (on the embedded
Postgres as the schema's owner); starts
every service as a child process with its output prefixed by its name; and on
Ctrl-C or SIGTERM stops the services (SIGTERM, then SIGKILL after the stop
timeout), then the embedded servers, and exits 0 with nothing left running.
A service or embedded server that dies on its own is started again after a
backoff; one that keeps dying (a crash loop) stops everything, exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.cluster.embedded import LOCALHOST, EmbeddedNats, EmbeddedPostgres, EmbeddedServerError
from services.cluster.supervisor import (
    Child,
    Output,
    RestartRules,
    Watched,
    WatchedServer,
    keep_running,
    service_argv,
    stop,
)
from services.processes import RUN_MARKER, is_alive, processes_with_marker
from services.ops.credentials import CLUSTER_SECRET_FILE
from shared.bus.auth import FILE_ENV as NATS_CREDENTIALS_ENV
from shared.bus.permissions import ROLES, user_name
from shared.bus.subjects import Subjects
from shared.bus.users import BusUsers, make_bus_users
from shared.internal_auth import SECRET_ENV, SECRET_FILE_ENV, make_secret_file
from shared.settings import redact_url

# Start order: the relay first so no committed event waits for a bus
# publisher, then the projector that keeps the read models; the gateway last
# so it opens its port onto a ready pool.
SERVICES: tuple[str, ...] = ("relay", "projector", "placement", "autoscaler", "worker", "gateway")

# The pool `make run` serves when no configuration is named: the default model
# on real llama.cpp, with the simulator standing in for vLLM.
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "pool.yaml"

SIMULATED_GPU_MEMORY_GB = 24
"""What the local worker offers when MODELPOOL_WORKER_GPU_MEMORY_GB does not say: the simulator's GPU."""
DEFAULT_ADMIN_PORT = 8001
ADMIN_TOKEN_FILE = "admin-token"
BUS_USERS_DIR = "nats-users"
"""Where the embedded NATS's users are kept, beside its data (`shared/bus/users.py`)."""



def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="modelpool up",
        description="Start the local modelpool cluster: NATS JetStream, Postgres, migrations and every service.",
        epilog="NATS_URL and DATABASE_URL, when set, name external servers to use instead of the embedded ones.",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(env.get("MODELPOOL_DATA_DIR", ".modelpool")),
        help="where the embedded servers keep their data between runs (default: .modelpool)",
    )
    # A string default goes through `type`, so a bad MODELPOOL_GATEWAY_PORT is a usage error.
    parser.add_argument("--gateway-port", type=int, default=env.get("MODELPOOL_GATEWAY_PORT", "8000"), help="the gateway's HTTP port (default: 8000)")
    parser.add_argument("--nats-port", type=int, default=0, help="port for the embedded NATS server (default: any free port)")
    parser.add_argument("--postgres-port", type=int, default=0, help="port for the embedded Postgres (default: any free port)")
    parser.add_argument("--config", type=Path, default=None, help="alias configuration file (sets MODELPOOL_CONFIG)")
    parser.add_argument("--namespace", default=None, help="bus and schema namespace (sets MODELPOOL_NAMESPACE)")
    parser.add_argument("--services", default=",".join(SERVICES), help=f"comma-separated services to start (default: {','.join(SERVICES)})")
    parser.add_argument("--stop-timeout", type=float, default=10.0, help="seconds services get to exit after SIGTERM before SIGKILL (default: 10)")
    parser.add_argument(
        "--restart-limit",
        type=int,
        default=env.get("MODELPOOL_RESTART_LIMIT", "5"),
        help="restarts of one service or embedded server allowed within --restart-window; one more exit stops the cluster (default: 5; 0: never restart)",
    )
    parser.add_argument(
        "--restart-window",
        type=float,
        default=env.get("MODELPOOL_RESTART_WINDOW_S", "120"),
        help="seconds over which --restart-limit counts a process's exits (default: 120)",
    )
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.services.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SERVICES))
    if unknown or not names:
        parser.error(f"--services: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SERVICES)}")
    args.services = names
    if not 0 < args.gateway_port < 65536:
        parser.error(f"--gateway-port: {args.gateway_port} is not a TCP port")
    if args.restart_limit < 0 or not args.restart_window > 0:
        parser.error("--restart-limit must be 0 or more and --restart-window more than 0")
    return args


# ---------------------------------------------------------------------------
# signals


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived while the cluster was still starting."""


class ShutdownRequest:
    """Turns SIGINT/SIGTERM into an orderly stop.

    While starting, a signal raises `Interrupted` so a slow step (initdb,
    migrations) is abandoned and unwound; once running, it only sets `event`,
    so the stop sequence itself is never cut short by a second Ctrl-C.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self.starting = True
        self.signal_name = ""

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        first = not self.event.is_set()
        self.event.set()
        self.signal_name = self.signal_name or signal.Signals(signum).name
        if self.starting and first:
            self.starting = False
            raise Interrupted()


# ---------------------------------------------------------------------------
# children


def start_service(name: str, env: dict[str, str], output: Output, users: BusUsers | None = None,
                  worker_id: str | None = None) -> Child:
    """`modelpool NAME`, given its own role's bus credentials when the bus has users (the operator's for the
    migrations, which declare the streams)."""
    return Child(name, service_argv(name), {**env, **bus_credentials_env(name, users, worker_id)}, output=output)


def bus_credentials_env(name: str, users: BusUsers | None, worker_id: str | None = None) -> dict[str, str]:
    """The variable naming the credentials of `name`'s role (a service, or the operator's for anything else)."""
    if users is None:
        return {}
    role = name if name in ROLES else "operator"
    found = {NATS_CREDENTIALS_ENV: str(users.credentials_file(user_name(role, worker_id)))}
    if role == "worker" and worker_id:
        found["MODELPOOL_WORKER_ID"] = worker_id  # the id its user was made for
    return found


def run_once(name: str, env: dict[str, str], output: Output, started: list[Child], users: BusUsers | None = None) -> int:
    """Run a one-shot service (the migrations) to completion, stopped like the others if interrupted."""
    child = start_service(name, env, output, users)
    started.append(child)
    code = child.proc.wait()
    if child.pump is not None:
        child.pump.join(timeout=2.0)
    started.remove(child)
    return code


def sweep(marker: str, output: Output) -> None:
    """Kill anything still carrying this run's marker (e.g. an engine a service orphaned)."""
    for pid in processes_with_marker(marker):
        if is_alive(pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            output.line("up", f"killing leftover process {pid}: {cmd}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------
# the cluster


def port_is_free(port: int, host: str = LOCALHOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers do: a port held only by closed connections in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


@dataclass
class BackingServers:
    """Where the cluster's NATS and Postgres are, and those of them `up` started (and watches)."""

    nats_url: str
    database_url: str
    nats_origin: str
    postgres_origin: str
    embedded: list[WatchedServer]
    database_env: dict[str, str]
    """What the services' environment adds to reach the database: the service role's password file."""
    migrate_env: dict[str, str]
    """What the migrations' environment adds: the owner's URL and password file, the role to grant to."""
    bus_users: BusUsers | None = None
    """The embedded NATS's users; None for an external NATS (its credentials, if any, are the environment's)."""
    worker_id: str | None = None
    """The local worker's id, as its bus user names it."""


@contextlib.contextmanager
def backing_servers(args: argparse.Namespace, env: dict[str, str], output: Output) -> Iterator[BackingServers]:
    """The servers named by NATS_URL / DATABASE_URL, else embedded ones, stopped on exit."""
    with contextlib.ExitStack() as stack:
        data_dir = args.data_dir.absolute()
        embedded = []
        users, worker_id = None, None
        if env.get("NATS_URL"):
            nats_url, nats_origin = env["NATS_URL"], "external (NATS_URL)"
        else:
            # Its users made at the first start, passwords kept; a worker id new since then gets its own.
            from services.worker.main import default_worker_id

            worker_id = env.get("MODELPOOL_WORKER_ID") or default_worker_id()
            namespace = args.namespace or env.get("MODELPOOL_NAMESPACE") or "modelpool"
            users = make_bus_users(data_dir / BUS_USERS_DIR, Subjects(namespace), workers=[worker_id])
            output.line("up", f"starting NATS JetStream (data in {data_dir / 'nats'}, users in {users.directory})")
            nats = stack.enter_context(EmbeddedNats(data_dir / "nats", args.nats_port, config=users.server_config))
            nats_url, nats_origin = nats.url, f"embedded, pid {nats.pid}, log {nats.log_path}, with users"
            embedded.append(WatchedServer("NATS", nats, redact_url(nats.url)))
        database_env: dict[str, str] = {}
        migrate_env: dict[str, str] = {}
        if env.get("DATABASE_URL"):
            database_url, pg_origin = env["DATABASE_URL"], "external (DATABASE_URL)"
        else:
            output.line("up", f"starting PostgreSQL 16 (data in {data_dir / 'postgres'})")
            postgres = stack.enter_context(EmbeddedPostgres(data_dir / "postgres", args.postgres_port))
            database_url, pg_origin = postgres.url, f"embedded, pid {postgres.pid}, log {postgres.log_path}"
            embedded.append(WatchedServer("Postgres", postgres, redact_url(postgres.url)))
            # Services log in as the service role, which may append to the log but not alter it; the
            # migrations as the owner of the schema, granting the service role what it needs.
            database_env = {"MODELPOOL_DATABASE_PASSWORD_FILE": str(postgres.service.password_file)}
            migrate_env = {"DATABASE_URL": postgres.owner_url,
                           "MODELPOOL_DATABASE_PASSWORD_FILE": str(postgres.owner.password_file),
                           "MODELPOOL_DATABASE_SERVICE_ROLE": postgres.service.user}
        if embedded:
            stack.callback(output.line, "up", "stopping the embedded servers")
        yield BackingServers(nats_url, database_url, nats_origin, pg_origin, embedded, database_env, migrate_env, users,
                             worker_id)


def engine_lines(env: dict[str, str]) -> list[str]:
    """Which engine backs each tier of each alias, as the pool configuration says."""
    from shared.contracts.backends import BackendType
    from shared.configuration import load_pool_config
    from shared.contracts.config import ConfigError

    path = env.get("MODELPOOL_CONFIG")
    if not path:
        return ["aliases   none configured (set MODELPOOL_CONFIG or --config)"]
    try:
        pool = load_pool_config(path, environ=env)
    except ConfigError as exc:
        return [f"aliases   configuration error: {exc}"]
    lines = []
    for alias in pool.aliases:
        tiers = []
        for backend in (BackendType.LLAMA_CPP, BackendType.VLLM):
            if backend in alias.backends:
                engine = alias.engine_for(backend)
                what = f"simulated {backend.value} (no real inference)" if engine.simulated else f"real {engine.value}"
                tiers.append(f"{backend.tier} tier: {what}")
        lines.append(f"alias     {alias.alias}: " + "; ".join(tiers))
    return lines or [f"aliases   none in {path}"]


def banner(args: argparse.Namespace, servers: BackingServers, env: dict[str, str]) -> str:
    gateway = f"http://{LOCALHOST}:{args.gateway_port}/v1"
    lines = [
        "modelpool is starting:",
        f"  gateway   {gateway}   (OpenAI-compatible; health at http://{LOCALHOST}:{args.gateway_port}/health)",
        f"  NATS      {redact_url(servers.nats_url)}   ({servers.nats_origin})",
        f"  Postgres  {redact_url(servers.database_url)}   ({servers.postgres_origin})",
        f"  services  {', '.join(args.services)}",
        *(f"  {line}" for line in engine_lines(env)),
        f"  worker    offers {env['MODELPOOL_WORKER_GPU_MEMORY_GB']} GB of GPU memory"
        + (" (simulated: no GPU here)" if env["MODELPOOL_WORKER_GPU_MEMORY_GB"] == str(SIMULATED_GPU_MEMORY_GB) else ""),
        *([f"  console   http://{LOCALHOST}:{env.get('MODELPOOL_ADMIN_PORT', DEFAULT_ADMIN_PORT)}/console   "
           f"(its token: {args.data_dir / ADMIN_TOKEN_FILE})"] if env.get("MODELPOOL_ADMIN_TOKEN") else []),
        "  watch     modelpool top | modelpool status | modelpool history ALIAS   (from this directory)",
        "  Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def admin_token(directory: Path) -> str:
    """The embedded cluster's admin token (the console's and the admin API's): made at its first start, kept
    beside its data, readable by its owner only."""
    return make_secret_file(directory / ADMIN_TOKEN_FILE, min_chars=16).read_text().strip()


def announce_cluster(directory: Path, env: dict[str, str], users: BusUsers | None = None) -> Path:
    """Say where this cluster's servers are, for operator commands run from the same place."""
    from shared.settings import CLUSTER_FILE

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CLUSTER_FILE
    # The database's URL may carry a password: readable by this cluster's owner only.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({
            "pid": os.getpid(), "database_url": env["DATABASE_URL"],
            "database_password_file": env.get("MODELPOOL_DATABASE_PASSWORD_FILE"), "nats_url": env["NATS_URL"],
            # Operator commands from here connect as the operator (the file's name, never the password).
            **({"nats_credentials_file": str(users.credentials_file("operator"))} if users else {}),
            "namespace": env.get("MODELPOOL_NAMESPACE") or "modelpool",
            "gateway": f"http://{LOCALHOST}:{env['MODELPOOL_GATEWAY_PORT']}/v1",
        }, indent=2) + "\n")
    return path


def supervise(watched: list[Watched], rules: RestartRules, shutdown: ShutdownRequest, output: Output, health_url: str | None) -> int:
    """Keep every process running until a stop signal (exit 0) or a crash loop (exit 1)."""
    healthy = health_url is None
    next_probe = 0.0
    while not shutdown.event.is_set():
        if not all(keep_running(process, rules, output) for process in watched):
            return 1
        if not healthy and time.monotonic() >= next_probe:
            healthy = http_ok(health_url)  # type: ignore[arg-type]
            next_probe = time.monotonic() + 0.5
            if healthy:
                output.line("up", f"gateway is healthy; send requests to {health_url.rsplit('/', 1)[0]}/v1")  # type: ignore[union-attr]
        shutdown.event.wait(0.1)
    return 0


def run(args: argparse.Namespace, shutdown: ShutdownRequest, output: Output) -> int:
    env = dict(os.environ)
    marker = f"{RUN_MARKER}={uuid.uuid4().hex}"
    children: list[Child] = []
    code = 1
    try:
        if "gateway" in args.services and not port_is_free(args.gateway_port):
            output.line("up", f"gateway port {args.gateway_port} is in use; choose another with --gateway-port")
            return 1
        with backing_servers(args, env, output) as servers:
            key, value = marker.split("=", 1)
            env.update({
                "NATS_URL": servers.nats_url,
                "DATABASE_URL": servers.database_url,
                **servers.database_env,
                "MODELPOOL_GATEWAY_PORT": str(args.gateway_port),
                "PYTHONUNBUFFERED": "1",
                key: value,
            })  # fmt: skip
            if args.config is not None:
                env["MODELPOOL_CONFIG"] = str(args.config.absolute())
            elif not env.get("MODELPOOL_CONFIG"):
                env["MODELPOOL_CONFIG"] = str(DEFAULT_CONFIG)
            if args.namespace is not None:
                env["MODELPOOL_NAMESPACE"] = args.namespace
            # No GPU here: the local worker offers the memory the simulated vLLM models.
            env.setdefault("MODELPOOL_WORKER_GPU_MEMORY_GB", str(SIMULATED_GPU_MEMORY_GB))
            # Where `modelpool explain` finds a request: the gateway's access log, beside the cluster's data.
            env.setdefault("MODELPOOL_ACCESS_LOG", str(args.data_dir.absolute() / "access.log"))
            if "gateway" in args.services and "MODELPOOL_ADMIN_TOKEN" not in env:
                if port_is_free(int(env.get("MODELPOOL_ADMIN_PORT", DEFAULT_ADMIN_PORT))):
                    env["MODELPOOL_ADMIN_TOKEN"] = admin_token(args.data_dir)
                else:
                    output.line("up", f"admin port {env.get('MODELPOOL_ADMIN_PORT', DEFAULT_ADMIN_PORT)} is in use: "
                                      "no console (choose another with MODELPOOL_ADMIN_PORT)")
            if not (env.get(SECRET_ENV) or env.get(SECRET_FILE_ENV)):
                # Signs every call to engines' internal ports and the KV they move: made at the first start.
                env[SECRET_FILE_ENV] = str(make_secret_file(args.data_dir.absolute() / CLUSTER_SECRET_FILE))
            cluster_file = announce_cluster(args.data_dir, env, servers.bus_users)
            try:
                output.line("up", "applying migrations" + (" and declaring the bus's streams" if servers.bus_users else ""))
                migrated = run_once("migrate", {**env, **servers.migrate_env}, output, children, servers.bus_users)
                if migrated != 0:
                    output.line("up", f"migrations failed with code {migrated}; stopping")
                    return 1
                children.extend(start_service(name, env, output, servers.bus_users, servers.worker_id)
                                for name in args.services)
                output.line("up", banner(args, servers, env))
                shutdown.starting = False
                health = f"http://{LOCALHOST}:{args.gateway_port}/health" if "gateway" in args.services else None
                rules = RestartRules(limit=args.restart_limit, window_s=args.restart_window)
                code = supervise([*servers.embedded, *children], rules, shutdown, output, health)
            except Interrupted:
                code = 0
            finally:
                shutdown.starting = False
                if shutdown.event.is_set():
                    output.line("up", f"{shutdown.signal_name or 'signal'} received; stopping services")
                stop(children, args.stop_timeout, on_kill=output)
                sweep(marker, output)
                cluster_file.unlink(missing_ok=True)
                output.line("up", "services stopped")
    except Interrupted:
        output.line("up", f"{shutdown.signal_name} received while starting; stopping")
        code = 0
    except EmbeddedServerError as exc:
        output.line("up", f"could not start: {exc}")
        code = 1
    finally:
        shutdown.starting = False
        sweep(marker, output)
    output.line("up", "stopped" if code == 0 else f"stopped (exit {code})")
    return code


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    shutdown = ShutdownRequest()
    shutdown.install()
    return run(args, shutdown, Output(sys.stdout))

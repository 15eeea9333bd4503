"""A whole pool as real processes in a namespace of its own, for scenario tests and benchmarks.

    with LocalPool(database_url, nats_url, namespace, pool_yaml, workdir, workers={"w1": {...}}) as pool:
        pool.gateway   # http://127.0.0.1:<port>/v1
        pool.kill_worker("w1", signal.SIGKILL)

Unlike `modelpool up` it starts no servers (it is given them), runs one
process per service (relay, projector, placement, autoscaler, gateway, and
one worker per entry of `workers`, each with its own settings), writes each
process's output to `<workdir>/<name>.log`, and stops them all on exit. The
caller migrates the namespace first. Its cluster secret is made in the workdir
(unless the environment gives one), as `modelpool up` makes its own.

On a NATS with the bus's users (`bus_users`, the server started with their
configuration), every process connects as its own role's user, each worker as
its own (`worker-<id>`, which must be among the users), and the pool first
declares the namespace's streams as the operator (`modelpool migrate`), as `modelpool
up` does.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from services.cluster.supervisor import Child, service_argv, stop
from services.worker.service import REGISTERED
from shared.bus.auth import FILE_ENV as NATS_CREDENTIALS_ENV
from shared.bus.permissions import ROLES, user_name
from shared.bus.users import BusUsers
from shared.internal_auth import SECRET_ENV, SECRET_FILE_ENV, make_secret_file
from shared.net import free_port

CONTROL_SERVICES = ("relay", "projector", "placement", "autoscaler", "gateway")


class LocalPool:
    def __init__(
        self,
        database_url: str,
        nats_url: str,
        namespace: str,
        pool_yaml: str,
        workdir: Path,
        *,
        workers: dict[str, dict[str, str]] | None = None,
        env: dict[str, str] | None = None,
        bus_users: BusUsers | None = None,
    ) -> None:
        self.bus_users = bus_users
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "pool.yaml"
        config.write_text(pool_yaml)
        self.port = free_port()
        self.env = {
            **os.environ, "DATABASE_URL": database_url, "NATS_URL": nats_url, "MODELPOOL_NAMESPACE": namespace,
            "MODELPOOL_CONFIG": str(config), "MODELPOOL_GATEWAY_PORT": str(self.port), "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        if not (self.env.get(SECRET_ENV) or self.env.get(SECRET_FILE_ENV)):
            self.env[SECRET_FILE_ENV] = str(make_secret_file(self.workdir / "cluster-secret"))
        self.worker_settings = workers if workers is not None else {"w1": {}}
        self.processes: dict[str, Child] = {}

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, ready_timeout_s: float = 60.0) -> "LocalPool":
        deadline = time.monotonic() + ready_timeout_s
        if self.bus_users is not None:
            # Only the operator and the autoscaler may declare streams; the workers starting first wait for theirs.
            declared = self.start_service("migrate")
            self._wait(lambda: not declared.alive, deadline, ignore=("migrate",))
            self.processes.pop("migrate").close()
            if declared.returncode != 0:
                raise RuntimeError(f"declaring the bus's streams failed; its log: {declared.logged()[-2000:]}")
        # Workers first, and the control plane once each has registered: its first placements must see them
        # all (placement never moves a running instance, so replicas placed before a worker joins stay together).
        for worker_id in self.worker_settings:
            self.start_worker(worker_id)
        self._wait(lambda: all(f" {REGISTERED} as worker " in self.processes[f"worker-{w}"].logged()
                               for w in self.worker_settings), deadline)
        for name in CONTROL_SERVICES:
            self.start_service(name)
        # Up once the gateway answers and its view of the log has every worker up.
        self._wait(lambda: self._healthy() and self._workers_up() >= len(self.worker_settings), deadline)
        return self

    def _wait(self, ready: Callable[[], bool], deadline: float, ignore: tuple[str, ...] = ()) -> None:
        while not ready():
            dead = [p.name for p in self.processes.values() if not p.alive and p.name not in ignore]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the pool did not come up (exited: {dead or 'none'}); logs in {self.workdir}")
            time.sleep(0.2)

    def start_service(self, name: str, command: str | None = None, env: dict[str, str] | None = None) -> Child:
        """Start `modelpool <command>` (default: `name`) as `name`; it writes whether it reaches its servers
        to `<workdir>/<name>.health.json` (`modelpool health --file ...` reads it)."""
        full_env = {**self.env, **(env or {}), "MODELPOOL_HEALTH_FILE": str(self.health_file(name))}
        if self.bus_users is not None:
            role = command or name
            role = role if role in ROLES else "operator"
            user = user_name(role, full_env.get("MODELPOOL_WORKER_ID") if role == "worker" else None)
            full_env[NATS_CREDENTIALS_ENV] = str(self.bus_users.credentials_file(user))
        # Not tied to the starting thread's life: a pool is often started from a worker thread that ends first.
        process = Child(name, service_argv(command or name), full_env, log_path=self.workdir / f"{name}.log",
                        death_signal=None, extra_env=env)
        self.processes[name] = process
        return process

    def health_file(self, name: str) -> Path:
        return self.workdir / f"{name}.health.json"

    def start_worker(self, worker_id: str) -> Child:
        return self.start_service(f"worker-{worker_id}", "worker",
                                  {"MODELPOOL_WORKER_ID": worker_id, **self.worker_settings[worker_id]})

    def start_gateway_replica(self) -> int:
        """Another gateway on a port of its own (the pool's gateways share nothing but the log); its port."""
        n = sum(name.startswith("gateway") for name in self.processes) + 1
        port = free_port()
        self.start_service(f"gateway-{n}", "gateway", {"MODELPOOL_GATEWAY_PORT": str(port),
                                                       "MODELPOOL_GATEWAY_ID": f"gateway-{n}"})
        return port

    def restart(self, name: str) -> Child:
        """Start a service that exited (or was killed) again, as it was started."""
        process = self.processes[name]
        if process.alive:
            raise RuntimeError(f"{name} is still running")
        process.start_again()
        return process

    def stop_service(self, name: str, sig: int = signal.SIGTERM) -> int | None:
        return self.processes.pop(name).signal(sig)

    def kill_worker(self, worker_id: str, sig: int = signal.SIGKILL) -> int | None:
        return self.stop_service(f"worker-{worker_id}", sig)

    def stop(self) -> dict[str, int | None]:
        """Every service: the gateways first (no new requests), the workers last (their engines go with them)."""
        stopped = {}
        for wave in (lambda n: n.startswith("gateway"), lambda n: not n.startswith("worker-"), lambda n: True):
            names = [name for name in self.processes if wave(name)]
            stop([self.processes[name] for name in names], timeout_s=30.0)
            stopped.update({name: self.processes.pop(name).returncode for name in names})
        return stopped

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.logged()[-tail:]}" for p in self.processes.values())

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1.0) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _workers_up(self) -> int:
        """Workers the gateway's view of the log has up (its `modelpool:workers` metric)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2.0) as response:
                found = re.search(rb'^modelpool:workers\{status="up"\} (\d+)', response.read(), re.MULTILINE)
        except (OSError, urllib.error.URLError):
            return 0
        return int(found.group(1)) if found else 0

    def __enter__(self) -> "LocalPool":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

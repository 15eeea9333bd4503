"""Where a modelpool process finds its servers and itself (how the pool behaves is the pool file's: `PoolConfig`).

Layers, later wins (`shared/configuration.py`): defaults, then (for operator
commands) the local cluster's file, then the environment, then explicit
arguments (`Settings.load(environ, database_url=...)`). A process builds one
`Settings` and passes it down.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from shared.bus.auth import BusCredentials, load_credentials
from shared.configuration import from_environment, layered
from shared.eventlog.roles import ROLE_NAME
from shared.internal_auth import load_secret

# The namespace names the Postgres schema and prefixes every bus subject and
# stream, so several pools (or test runs) share one server without touching each other.
NAMESPACE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")

ENVIRONMENT = {
    "database_url": "DATABASE_URL",
    "database_password_file": "MODELPOOL_DATABASE_PASSWORD_FILE",
    "database_service_role": "MODELPOOL_DATABASE_SERVICE_ROLE",
    "nats_url": "NATS_URL",
    "nats_user": "MODELPOOL_NATS_USER",
    "nats_password": "MODELPOOL_NATS_PASSWORD",
    "nats_credentials_file": "MODELPOOL_NATS_CREDENTIALS_FILE",
    "stream_replicas": "MODELPOOL_STREAM_REPLICAS",
    "namespace": "MODELPOOL_NAMESPACE",
    "config_path": "MODELPOOL_CONFIG",
    "gateway_host": "MODELPOOL_GATEWAY_HOST",
    "gateway_port": "MODELPOOL_GATEWAY_PORT",
    "admin_host": "MODELPOOL_ADMIN_HOST",
    "admin_port": "MODELPOOL_ADMIN_PORT",
    "admin_token": "MODELPOOL_ADMIN_TOKEN",
    "cluster_secret": "MODELPOOL_CLUSTER_SECRET",
    "cluster_secret_file": "MODELPOOL_CLUSTER_SECRET_FILE",
    "worker_id": "MODELPOOL_WORKER_ID",
    "worker_host": "MODELPOOL_WORKER_HOST",
    "worker_gpu_memory_gb": "MODELPOOL_WORKER_GPU_MEMORY_GB",
    "worker_gpus": "MODELPOOL_WORKER_GPUS",
    "worker_slots": "MODELPOOL_WORKER_SLOTS",
    "worker_sim_speedup": "MODELPOOL_WORKER_SIM_SPEEDUP",
    "worker_health_timeout_s": "MODELPOOL_WORKER_HEALTH_TIMEOUT_S",
    "worker_hang_timeout_s": "MODELPOOL_WORKER_HANG_TIMEOUT_S",
    "worker_report_interval_s": "MODELPOOL_WORKER_REPORT_INTERVAL_S",
    "worker_log_dir": "MODELPOOL_WORKER_LOG_DIR",
    "gateway_id": "MODELPOOL_GATEWAY_ID",
    "health_file": "MODELPOOL_HEALTH_FILE",
    "metrics_host": "MODELPOOL_METRICS_HOST",
    "metrics_port": "MODELPOOL_METRICS_PORT",
    "access_log": "MODELPOOL_ACCESS_LOG",
    "otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "service_name": "OTEL_SERVICE_NAME",
}


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    database_url: str = "postgresql://127.0.0.1:5432/postgres"
    database_password_file: str | None = None
    """A file holding the password of the URL's user (compose's and Kubernetes' credentials, the embedded cluster's
    `service-password`): read at each new connection, so a rotated password needs no restart. The URL itself then
    carries none, and nothing that prints it can leak one."""
    database_service_role: str | None = None
    """The role migrations grant the services' privileges to (migration 0006): set where `modelpool migrate` runs
    as the schema's owner and the services log in as another role."""
    nats_url: str = "nats://127.0.0.1:4222"
    """One server, or a cluster's servers comma-separated (the client fails over between them)."""
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    nats_credentials_file: str | None = None
    """This process's user on a bus with users (`shared/bus/auth.py`): a user and password, or the file holding
    them; none on a bus that asks for none."""
    stream_replicas: int = Field(default=1, ge=1, le=5)
    """Copies of every stream and bucket on a NATS cluster's servers: 3 keeps the bus whole through one
    server's loss. Raised on a running pool, the streams are updated to it."""
    namespace: str = "modelpool"
    config_path: str | None = None
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(default=8000, ge=0, le=65535)
    admin_host: str = "127.0.0.1"
    admin_port: int = Field(default=8001, ge=0, le=65535)
    admin_token: str | None = Field(default=None, min_length=16)
    """The gateway's admin API (its own port) is served only when a token is set; 16 characters at least."""
    cluster_secret: SecretStr | None = None
    cluster_secret_file: str | None = None
    """The cluster secret (or the file holding it) that signs calls to engines' internal ports and the KV they move
    (shared/internal_auth.py); without one the gateway moves no KV and engines refuse such calls."""
    worker_id: str | None = None
    worker_host: str = "127.0.0.1"
    """The address this worker's engines listen on and are reached at: loopback, or the worker's own
    address where the gateway runs elsewhere (never 0.0.0.0: engines' control paths stay off other networks)."""
    worker_gpu_memory_gb: Annotated[float, Field(ge=0)] | Literal["auto"] = 0.0
    """GB of GPU memory this worker offers, or `auto`: what its NVIDIA GPUs hold (`services/worker/gpus.py`)."""
    worker_gpus: int | None = Field(default=None, ge=1)
    """The GPUs that memory is spread over (each vLLM instance is given its share of one); `auto` memory counts
    them, else one."""
    worker_slots: int = Field(default=4, ge=0)
    worker_sim_speedup: float = Field(default=1.0, gt=0)
    """Simulated engines run this many times faster than real time (tests use large values)."""
    worker_health_timeout_s: float = Field(default=180.0, gt=0)
    worker_hang_timeout_s: float = Field(default=10.0, gt=0)
    """An engine that has not answered its /health for this long while serving is recorded ERROR and killed."""
    worker_report_interval_s: float = Field(default=1.0, gt=0)
    """How often a worker reads its engines' status and sends its heartbeat."""
    worker_log_dir: str | None = None
    """Where a worker keeps its engines' output (default: a directory under the system's temp dir)."""
    gateway_id: str | None = None
    """Names this gateway replica in its metric windows (default: host and process id)."""
    health_file: str | None = None
    """Where a service writes whether it reaches its servers, every second, for `modelpool health` (containers)."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Where a service other than the gateway serves its own /metrics (`services/service_metrics.py`); none
    unless set (the gateway's are on its public port)."""
    access_log: str | None = None
    """A file the gateway appends its access log to, one JSON line per request (rotated at 64 MiB, three kept):
    what `modelpool explain` reads. `modelpool up` keeps it in its data directory."""
    otlp_endpoint: str | None = None
    service_name: str = "modelpool"

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not NAMESPACE.match(value):
            raise ValueError("must start with a lowercase letter and hold only [a-z0-9_], at most 48 characters")
        return value

    @field_validator("worker_host")
    @classmethod
    def _one_address(cls, value: str) -> str:
        if value.strip() in ("", "0.0.0.0", "::", "[::]"):
            raise ValueError("must be one address (loopback or the worker's own), not every interface: "
                             "engines' control endpoints must not be reachable from other networks")
        return value

    @model_validator(mode="after")
    def _readable_secret(self) -> "Settings":
        self.cluster_key  # a secret file that cannot be read, or a short secret: said at start, by its setting
        self.nats_credentials  # likewise a credentials file that cannot be read, or a user without a password
        return self

    @field_validator("database_url")
    @classmethod
    def _postgres(cls, value: str) -> str:
        if not value.startswith(("postgresql://", "postgres://", "postgresql+asyncpg://")):
            raise ValueError("must be a postgresql:// URL")
        return value

    @field_validator("database_password_file")
    @classmethod
    def _readable_password(cls, value: str | None) -> str | None:
        if value:
            read_password(value)  # said at start, by its setting, rather than at the first connection
        return value

    @field_validator("database_service_role")
    @classmethod
    def _role_name(cls, value: str | None) -> str | None:
        if value and not ROLE_NAME.match(value):
            raise ValueError(f"must match {ROLE_NAME.pattern}")
        return value or None

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, *, discover: bool = False, **explicit: Any) -> "Settings":
        """Defaults, then (with `discover`) the local cluster's file, then the environment, then `explicit`."""
        environ = os.environ if environ is None else environ
        found = {k: v for k, v in local_cluster(environ).items() if k != "gateway"} if discover else {}
        return layered(cls, [(f"{data_dir(environ) / CLUSTER_FILE}", found), *from_environment(environ, ENVIRONMENT),
                             ("arguments", explicit)])

    @property
    def cluster_key(self) -> bytes | None:
        """The cluster secret's bytes, from the value or the file; None when neither is set."""
        value = self.cluster_secret.get_secret_value() if self.cluster_secret else None
        return load_secret(value, self.cluster_secret_file)

    def __repr_args__(self) -> Any:
        # A settings object shows up in tracebacks and test reports: never with a password in its URL.
        for name, value in super().__repr_args__():
            yield name, redact_url(value) if name == "database_url" and isinstance(value, str) else value

    @property
    def database_connect_args(self) -> dict[str, Any]:
        """asyncpg's `connect()` arguments beyond the URL: the password, read from its file at each connection."""
        if not self.database_password_file:
            return {}
        path = self.database_password_file
        return {"password": lambda: read_password(path)}

    @property
    def nats_credentials(self) -> BusCredentials | None:
        """This process's NATS user and password, from the values or the file; None when neither is set."""
        password = self.nats_password.get_secret_value() if self.nats_password else None
        return load_credentials(self.nats_user, password, self.nats_credentials_file)

    @property
    def asyncpg_dsn(self) -> str:
        """The URL as asyncpg wants it (no SQLAlchemy driver suffix)."""
        return re.sub(r"^postgres(ql)?(\+asyncpg)?://", "postgresql://", self.database_url)

    @property
    def sqlalchemy_url(self) -> str:
        return re.sub(r"^postgres(ql)?(\+asyncpg)?://", "postgresql+asyncpg://", self.database_url)


def redact_url(url: str) -> str:
    """A URL fit for printing: any password replaced by ***."""
    scheme, sep, rest = url.partition("://")
    credentials, at, location = rest.rpartition("@")
    if not (sep and at) or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{location}"


def read_password(path: str) -> str:
    """The password in the file at `path` (surrounding whitespace dropped); ValueError naming the file if it cannot
    be read or is empty (the settings' error names the setting it came from)."""
    try:
        password = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if not password:
        raise ValueError(f"{path} is empty")
    return password


# --------------------------------------------------------------------------- the local cluster

CLUSTER_FILE = "cluster.json"
"""Written by `modelpool up` into its data directory while it runs: where its servers are."""


def data_dir(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("MODELPOOL_DATA_DIR") or ".modelpool")


def local_cluster(environ: Mapping[str, str]) -> dict[str, str]:
    """The servers of the `modelpool up` running from here (its data directory), or nothing.

    This is what lets an operator type `modelpool status` in a second terminal
    with no settings at all and reach the cluster `make run` started.
    """
    try:
        found = json.loads((data_dir(environ) / CLUSTER_FILE).read_text())
        os.kill(int(found["pid"]), 0)  # still running?
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {key: found[key] for key in ("database_url", "database_password_file", "nats_url", "nats_credentials_file",
                                        "namespace", "gateway")
            if found.get(key)}

"""Where a modelpool process finds its servers and itself.

Layers, later wins: defaults, then the environment, then explicit arguments
(`Settings.load(environ, database_url=...)`). Nothing reads the environment
anywhere else; a process builds one `Settings` and passes it down.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shared.contracts.config import ConfigError

# The namespace names the Postgres schema and prefixes every bus subject and
# stream, so several pools (or test runs) share one server without touching each other.
NAMESPACE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")

ENVIRONMENT = {
    "database_url": "DATABASE_URL",
    "nats_url": "NATS_URL",
    "namespace": "MODELPOOL_NAMESPACE",
    "config_path": "MODELPOOL_CONFIG",
    "gateway_host": "MODELPOOL_GATEWAY_HOST",
    "gateway_port": "MODELPOOL_GATEWAY_PORT",
    "worker_id": "MODELPOOL_WORKER_ID",
    "worker_gpu_memory_gb": "MODELPOOL_WORKER_GPU_MEMORY_GB",
    "worker_slots": "MODELPOOL_WORKER_SLOTS",
    "worker_sim_speedup": "MODELPOOL_WORKER_SIM_SPEEDUP",
    "worker_health_timeout_s": "MODELPOOL_WORKER_HEALTH_TIMEOUT_S",
    "otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "service_name": "OTEL_SERVICE_NAME",
}


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    database_url: str = "postgresql://127.0.0.1:5432/postgres"
    nats_url: str = "nats://127.0.0.1:4222"
    namespace: str = "modelpool"
    config_path: str | None = None
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(default=8000, ge=0, le=65535)
    worker_id: str | None = None
    worker_gpu_memory_gb: float = Field(default=0.0, ge=0)
    worker_slots: int = Field(default=4, ge=0)
    worker_sim_speedup: float = Field(default=1.0, gt=0)
    """Simulated engines run this many times faster than real time (tests use large values)."""
    worker_health_timeout_s: float = Field(default=180.0, gt=0)
    otlp_endpoint: str | None = None
    service_name: str = "modelpool"

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not NAMESPACE.match(value):
            raise ValueError("must start with a lowercase letter and hold only [a-z0-9_], at most 48 characters")
        return value

    @field_validator("database_url")
    @classmethod
    def _postgres(cls, value: str) -> str:
        if not value.startswith(("postgresql://", "postgres://", "postgresql+asyncpg://")):
            raise ValueError("must be a postgresql:// URL")
        return value

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **explicit: Any) -> "Settings":
        environ = os.environ if environ is None else environ
        values = {field: environ[name] for field, name in ENVIRONMENT.items() if environ.get(name)}
        values.update({k: v for k, v in explicit.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = str(error["loc"][0]) if error["loc"] else "<settings>"
            source = "arguments" if field in explicit else f"environment variable {ENVIRONMENT.get(field, field)}"
            raise ConfigError(field, error["msg"], source) from None

    @property
    def asyncpg_dsn(self) -> str:
        """The URL as asyncpg wants it (no SQLAlchemy driver suffix)."""
        return re.sub(r"^postgres(ql)?(\+asyncpg)?://", "postgresql://", self.database_url)

    @property
    def sqlalchemy_url(self) -> str:
        return re.sub(r"^postgres(ql)?(\+asyncpg)?://", "postgresql+asyncpg://", self.database_url)

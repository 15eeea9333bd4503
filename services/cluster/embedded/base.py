"""What both embedded servers share: a child in its own session, its log, its port taken in a race, its stop."""

from __future__ import annotations

import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from services.processes import log_tail, stop_process

LOCALHOST = "127.0.0.1"


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be found, initialised or started."""


class PortTaken(EmbeddedServerError):
    """The server could not bind its port: someone took it after we picked it."""


def wait_until(
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
            raise (PortTaken if "address already in use" in this_attempt else EmbeddedServerError)(message)
        if ready():
            return
        if time.monotonic() > deadline:
            raise EmbeddedServerError(f"{what} did not become ready within {timeout_s:.0f} s; its log ({log_path}):\n{log_tail(log_path)}")
        time.sleep(0.05)


# A port picked by free_port() can be taken by another process before the
# server binds it; with ports we chose ourselves, pick again this many times.
PORT_ATTEMPTS = 4


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

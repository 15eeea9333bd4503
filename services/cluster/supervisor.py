"""The one supervisor of local processes: `modelpool up`, the test and benchmark pools (`LocalPool`) and the
benchmarks' own services all start, restart and stop their children here.

A child runs in a session of its own (its process group), started by the one
launcher (`services/processes.py`); its output goes to a log file, or line by
line, prefixed with its name, to the terminal (`Output`). Stopping a set of
children signals their groups together, gives them `timeout_s` to exit, then
kills what is left, the descendants a child leaves behind included. When a
child that exited on its own starts again, and when that is a crash loop, is
`RestartRules` (pure bookkeeping); `keep_running` applies it, once per pass of
the loop `modelpool up` runs (`up.py`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO

from services.cluster.embedded import EmbeddedServer, EmbeddedServerError
from services.processes import descendants_of, is_alive, log_tail, spawn

OUTPUT_TAIL_LINES = 20
"""Lines of a child's output kept to show when it keeps exiting."""


def service_argv(command: str, *args: str) -> list[str]:
    """`modelpool <command> <args>` as this interpreter runs it."""
    return [sys.executable, "-m", "services.cli", command, *args]


# --------------------------------------------------------------------------- restarts: pure bookkeeping


@dataclass(frozen=True)
class RestartRules:
    """When a process that exited on its own starts again, and when the supervisor gives up on it."""

    limit: int = 5
    """Restarts allowed within `window_s`; one more exit in the window is a crash loop."""
    window_s: float = 120.0
    first_delay_s: float = 1.0
    """The wait before a restart: this, doubled after each quick exit, at most `max_delay_s`."""
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0
    """A process that ran this long before it exited waits `first_delay_s` again."""


@dataclass(frozen=True)
class Restarts:
    """One process's restarts so far: all the next decision needs."""

    count: int = 0
    delay_s: float = 0.0
    """The wait before the latest restart; 0 before the first."""
    exits: tuple[float, ...] = ()
    """When it exited, within the last window."""


def after_exit(rules: RestartRules, restarts: Restarts, started_at: float, exited_at: float) -> Restarts | None:
    """`restarts` with this exit counted, its `delay_s` the wait before starting again; None: a crash loop."""
    exits = (*(t for t in restarts.exits if exited_at - t < rules.window_s), exited_at)
    if len(exits) > rules.limit:
        return None
    quick = restarts.delay_s > 0 and exited_at - started_at < rules.stable_after_s
    delay = min(2 * restarts.delay_s, rules.max_delay_s) if quick else rules.first_delay_s
    return Restarts(restarts.count + 1, delay, exits)


# --------------------------------------------------------------------------- output


class Output:
    """Serialised, prefixed writing of many children's lines to one stream."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def line(self, prefix: str, text: str) -> None:
        with self.lock:
            try:
                self.stream.write(f"[{prefix}] {text}\n")
                self.stream.flush()
            except (OSError, ValueError):  # the terminal went away; keep running
                pass

    def forward(self, prefix: str, pipe: IO[bytes], recent: deque[str]) -> threading.Thread:
        """Copy `pipe` line by line, prefixed, until it closes; `recent` keeps the last lines."""

        def pump() -> None:
            with pipe:
                for raw in iter(pipe.readline, b""):
                    text = raw.decode("utf-8", "replace").rstrip("\r\n")
                    recent.append(text)
                    self.line(prefix, text)

        thread = threading.Thread(target=pump, name=f"output-{prefix}", daemon=True)
        thread.start()
        return thread


# --------------------------------------------------------------------------- what is supervised


class Watched(ABC):
    """A process the supervisor keeps running: a child, or an embedded server."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started_at = time.monotonic()
        self.restarts = Restarts()
        self.restart_at: float | None = None
        """Once it exited: when it is due to start again."""

    @property
    @abstractmethod
    def returncode(self) -> int | None:
        """How it ended (negative: killed by that signal); None while it runs."""

    @property
    def alive(self) -> bool:
        return self.returncode is None

    @abstractmethod
    def start_again(self) -> str:
        """Start it again the way it was first started; returns what to tell the operator."""

    @abstractmethod
    def output_tail(self) -> str:
        """The end of its output, to show why it keeps exiting."""


class Child(Watched):
    """A child process in a session of its own, its output to `log_path` or forwarded to `output`, prefixed.

    `death_signal` reaches it when the thread that started it ends (None: never; a
    pool started from a thread that ends first must not take its children along).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], *, output: Output | None = None,
                 log_path: Path | None = None, death_signal: int | None = signal.SIGTERM, cwd: Path | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        super().__init__(name)
        assert (output is None) != (log_path is None), "output goes to a stream or to a file"
        self.argv = argv
        self.env = env
        self.extra_env = extra_env or {}
        """What this child's environment adds to its pool's (restarted the same way)."""
        self.output = output
        self.log_path = log_path
        self.death_signal = death_signal
        self.cwd = cwd
        self.recent_output: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
        self.descendants: set[int] = set()
        self._log: IO[bytes] | None = None
        self.pump: threading.Thread | None = None
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        if self.log_path is not None:
            self.close()
            self._log = open(self.log_path, "ab")
            return spawn(self.argv, output=self._log, env=self.env, death_signal=self.death_signal, cwd=self.cwd)
        proc = spawn(self.argv, output=subprocess.PIPE, env=self.env, death_signal=self.death_signal, cwd=self.cwd)
        assert proc.stdout is not None and self.output is not None
        self.pump = self.output.forward(self.name, proc.stdout, self.recent_output)
        return proc

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def start_again(self) -> str:
        self.proc = self._spawn()
        return f"{self.name} started again (pid {self.proc.pid})"

    def output_tail(self) -> str:
        if self.log_path is not None:
            return log_tail(self.log_path, limit=2000)
        if self.pump is not None:
            self.pump.join(timeout=2.0)  # its last lines may still be in the pipe
        return "\n".join(self.recent_output) or "(no output)"

    def logged(self) -> str:
        """All it has written to its log file."""
        assert self.log_path is not None
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int, wait_s: float = 30.0) -> int | None:
        """Send `sig` to its process group and wait for it (SIGKILL after `wait_s`); its exit code."""
        stop([self], wait_s, sig)
        return self.proc.returncode

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class WatchedServer(Watched):
    """An embedded server: restarted on the same port and data, where the services look for it."""

    def __init__(self, name: str, server: EmbeddedServer, describe: str) -> None:
        super().__init__(name)
        self.server = server
        self.describe = describe
        """Where it is, fit for printing."""

    @property
    def returncode(self) -> int | None:
        return self.server.returncode

    def start_again(self) -> str:
        self.server.start()
        return f"{self.name} is back on {self.describe}"

    def output_tail(self) -> str:
        return f"({self.server.log_path})\n{log_tail(self.server.log_path, limit=2000)}"


# --------------------------------------------------------------------------- stopping


def stop(children: Iterable[Child], timeout_s: float, first_signal: int = signal.SIGTERM,
         on_kill: Output | None = None) -> None:
    """Signal every child's process group at once, SIGKILL what outlives `timeout_s`, then the descendants any
    of them left behind (an engine a service started, say)."""
    children = list(children)
    live = [child for child in children if child.proc.poll() is None]
    for child in live:
        child.descendants = set(descendants_of(child.proc.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, first_signal)
    deadline = time.monotonic() + timeout_s
    for child in live:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if on_kill is not None:
                on_kill.line("up", f"{child.name} did not stop within {timeout_s:.0f} s; killing it")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
    for child in live:
        for pid in child.descendants:
            if is_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if child.pump is not None:
            child.pump.join(timeout=2.0)
    for child in children:
        child.close()


# --------------------------------------------------------------------------- supervising


def keep_running(process: Watched, rules: RestartRules, output: Output) -> bool:
    """Notice that `process` exited, or start it again when due; False: it is crash-looping."""
    now = time.monotonic()
    if process.restart_at is None:
        code = process.returncode
        if code is None:
            return True
        restarts = after_exit(rules, process.restarts, process.started_at, now)
        if restarts is None:
            exits = f"{rules.limit + 1} exits" if rules.limit else "1 exit"
            output.line("up", f"{process.name} exited with code {code}, {exits} within {rules.window_s:g} s "
                        f"(--restart-limit {rules.limit}): a crash loop; stopping the cluster. The end of its output:\n"
                        + textwrap.indent(process.output_tail(), "    "))
            return False
        process.restarts, process.restart_at = restarts, now + restarts.delay_s
        output.line("up", f"{process.name} exited with code {code}; restarting it in {restarts.delay_s:g} s "
                          f"(restart {restarts.count})")
    elif now >= process.restart_at:
        process.restart_at, process.started_at = None, now
        try:
            output.line("up", process.start_again())
        except EmbeddedServerError as exc:  # counted as an exit on the next pass
            output.line("up", f"{process.name} did not start again: {str(exc).splitlines()[0]}")
    return True

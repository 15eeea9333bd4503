"""Child processes: started tied to our life, stopped with everything they started, found again by a mark.

Every process modelpool starts goes through here: the servers `modelpool up`
embeds, the services the one supervisor runs (`services/cluster/supervisor.py`:
for `modelpool up`, the pools tests and benchmarks run, the benchmarks' own),
and the engines a worker runs. Each starts in a session of its own
(its own process group, so a signal reaches what it started) and, unless the
caller says otherwise, gets a signal from the kernel when its parent dies, even
by SIGKILL: nothing outlives the process that owns it unnoticed.

A process tree that must not outlive its owner also marks every process it
starts with an environment variable; children inherit it, whatever session or
group they move to, so whoever owns the mark can find them all again (`modelpool
up` at exit, a worker started again after a crash). Linux only (/proc, prctl).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Account:
    """The unprivileged system account a server runs as when we are root."""

    name: str
    uid: int
    gid: int


def tied_to_us(account: Account | None, death_signal: int | None, parent_pid: int) -> Callable[[], None] | None:
    """The function run in the forked child before exec; None when there is nothing to do, so the child is
    started the fast way (posix_spawn, no fork of a large parent).

    Order matters: the kernel clears the parent-death signal whenever the
    effective uid or gid changes, so the switch to `account` happens first and
    PR_SET_PDEATHSIG last. Everything it calls was loaded before the fork.
    """
    if account is None and death_signal is None:
        return None

    def setup() -> None:
        if account is not None:
            os.setgroups([])
            os.setgid(account.gid)
            os.setuid(account.uid)
        if death_signal is None:
            return
        _LIBC.prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), death_signal)

    return setup


def spawn(
    argv: list[str],
    *,
    output: IO[bytes] | int | None,
    death_signal: int | None = signal.SIGTERM,
    account: Account | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` in a new session (its own process group), tied to our life.

    The child gets `death_signal` when the thread calling this dies (None: never).

    `preexec_fn` is safe with threads here: the child only makes system calls
    through functions resolved before the fork, and takes no Python locks.
    """
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=tied_to_us(account, death_signal, os.getpid()),
        env=env,
        cwd=cwd,
    )


async def spawn_async(argv: Sequence[str], *, output: IO[bytes] | int | None, env: dict[str, str] | None = None,
                      death_signal: int | None = signal.SIGTERM) -> asyncio.subprocess.Process:
    """`spawn` for asyncio callers (a worker's engines): the same session and the same tie to our life."""
    return await asyncio.create_subprocess_exec(
        *argv, env=env, start_new_session=True, preexec_fn=tied_to_us(None, death_signal, os.getpid()),
        stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=asyncio.subprocess.STDOUT)


def descendants_of(pid: int) -> list[int]:
    """Every live descendant of `pid`, found by walking /proc parent links."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        kids = [child for child, parent in parents.items() if parent == current]
        found.extend(kids)
        frontier.extend(kids)
    return found


def is_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


def processes_running(executable: Path | str, *, in_directory: Path) -> list[int]:
    """Live pids running `executable` with `in_directory` as their working directory."""
    executable, directory = os.path.realpath(executable), os.path.realpath(in_directory)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            matches = os.readlink(f"/proc/{entry}/exe") == executable and os.readlink(f"/proc/{entry}/cwd") == directory
        except OSError:  # gone, or not ours to inspect
            continue
        if matches and is_alive(int(entry)):
            found.append(int(entry))
    return found


def kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_gone(pids: list[int], *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes], *, first_signal: int, grace_s: float) -> None:
    """Stop `proc` and everything it started: `first_signal`, then SIGKILL after `grace_s`.

    Descendants are collected before signalling because some (Postgres
    backends) make themselves session leaders, so killing the process group
    would miss them; they normally exit with their parent, and are killed if not.
    """
    if proc.poll() is not None:
        return
    descendants = descendants_of(proc.pid)
    kill_quietly(proc.pid, first_signal)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("pid %d did not stop within %.0f s after %s; killing it", proc.pid, grace_s, signal.Signals(first_signal).name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        kill_quietly(proc.pid, signal.SIGKILL)
        proc.wait()
    wait_gone(descendants, timeout_s=5.0)
    for pid in descendants:
        if is_alive(pid):
            kill_quietly(pid, signal.SIGKILL)


def log_tail(path: Path, limit: int = 4000) -> str:
    """The last `limit` characters of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-limit:].strip() or "(empty log)"


RUN_MARKER = "MODELPOOL_UP_RUN"
"""Every process `modelpool up` starts, and everything those start (engines too), inherits this variable; its
final sweep finds stragglers by it, whatever session they are in."""


def processes_with_marker(marker: str) -> list[int]:
    """Pids whose environment carries `marker` (a whole `NAME=value` entry; readable only for our own processes)."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found

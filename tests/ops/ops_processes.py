"""Finding processes by what they carry, so a test can prove nothing was left running."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _zombie(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    return not stat or stat.rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")


def pids_mentioning(text: str | Path) -> list[int]:
    """Live pids whose command line or environment contains `text`."""
    needle = str(text).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        if (needle in _read(f"/proc/{pid}/cmdline") or needle in _read(f"/proc/{pid}/environ")) and not _zombie(pid):
            found.append(pid)
    return found


def cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and not _zombie(pid)


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Waits for `pids` to exit; returns those still alive after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """Live descendants of `pid`, by parent links (Postgres backends rewrite their
    command line and lead their own sessions, so only ancestry finds them)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                parents[int(entry)] = int(stat.rsplit(b")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        kids = [child for child, parent in parents.items() if parent == current]
        found += kids
        frontier += kids
    return found

"""Finding this machine's processes by a mark in their environment (Linux /proc).

A process tree that must not outlive its owner marks every process it starts
with an environment variable; children inherit it, whatever session or group
they move to, so whoever owns the mark can find them all again (`modelpool up`
at exit, a worker started again after a crash).
"""

from __future__ import annotations

import os


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

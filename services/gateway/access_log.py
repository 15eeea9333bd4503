"""The access log: one JSON line per request, to the process's log and, where `MODELPOOL_ACCESS_LOG` names a
file, to that file too (rotated at 64 MiB, three kept), which `modelpool explain` reads."""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

access_log = logging.getLogger("modelpool.access")

ROTATE_BYTES = 64 * 1024 * 1024
KEPT = 3


def log_access(record: dict[str, Any]) -> None:
    """One request's line, stamped with when it ended."""
    if access_log.isEnabledFor(logging.INFO):
        access_log.info("%s", orjson.dumps({"at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                                            **record}).decode())


@contextlib.contextmanager
def writing_to(path: Path) -> Iterator[None]:
    """Every line also appended to `path`, as bare JSON lines, while in the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=ROTATE_BYTES, backupCount=KEPT, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = access_log.level
    access_log.addHandler(handler)
    if access_log.getEffectiveLevel() > logging.INFO:
        access_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        access_log.removeHandler(handler)
        access_log.setLevel(level)
        handler.close()


def files(path: Path) -> list[Path]:
    """The log and its rotated copies, newest first."""
    return [p for p in (path, *(path.with_name(f"{path.name}.{i}") for i in range(1, KEPT + 1))) if p.exists()]

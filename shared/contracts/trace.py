"""The agentic trace format (seed 004): JSON Lines, one request per line.

    {"session_id": "s17", "turn": 0, "delay_s": 3.2, "new_input_tokens": 512, "output_tokens": 40}
    {"session_id": "s17", "turn": 1, "delay_s": 1.5, "new_input_tokens": 96, "output_tokens": 12}

`delay_s` is, for turn 0, the offset from the trace's start; for a later turn,
the tool time after the previous turn's answer completes. Turn k's prompt is
turn k-1's prompt plus its answer plus `new_input_tokens` of new text, so a
replay reuses prefixes the way an agent does. `shared_prefix_id` names a
prefix (a system prompt) that sessions share. Version 1; a later version adds
fields with defaults and this reader keeps reading version 1 files.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.contracts.config import ConfigError

TRACE_VERSION = 1
SHARED_PREFIX_TOKENS = 1024
"""Length of the system prompt that sessions naming the same `shared_prefix_id` share."""
M = TypeVar("M", bound=BaseModel)


class TraceRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str = Field(min_length=1)
    turn: int = Field(ge=0)
    delay_s: float = Field(ge=0)
    new_input_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)
    shared_prefix_id: str | None = None


def write_trace(requests: Iterable[TraceRequest], path: Path) -> int:
    """Write the requests as JSON Lines; how many were written."""
    count = 0
    with path.open("wb") as out:
        for request in requests:
            out.write(orjson.dumps(request.model_dump(exclude_none=True)) + b"\n")
            count += 1
    return count


def checked_lines(path: Path, kind: type[M]) -> Iterator[tuple[M, str]]:
    """Each non-blank line of a JSON Lines file as `kind`, with where it is (`FILE, line N`); a bad line is a
    `ConfigError` naming the line and the field."""
    source = str(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError("<file>", f"cannot read: {exc.strerror}", source) from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}, line {number}"
        try:
            yield kind.model_validate(orjson.loads(line)), where
        except orjson.JSONDecodeError as exc:
            raise ConfigError("<line>", f"not valid JSON: {exc}", where) from None
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(str(p) for p in error["loc"]) or "<line>"
            raise ConfigError(field, "required field is missing" if error["type"] == "missing" else error["msg"],
                              where) from None


def read_trace(path: Path) -> list[TraceRequest]:
    """Every request of a trace file, checked: a bad line or a session whose turns are not 0, 1, 2, ...
    in order is a `ConfigError` naming the line and the field."""
    requests: list[TraceRequest] = []
    next_turn: dict[str, int] = {}
    for request, where in checked_lines(path, TraceRequest):
        expected = next_turn.get(request.session_id, 0)
        if request.turn != expected:
            raise ConfigError("turn", f"session {request.session_id!r} has turn {request.turn} where turn {expected} "
                                      "comes next (a session's turns are 0, 1, 2, ... in file order)", where)
        next_turn[request.session_id] = expected + 1
        requests.append(request)
    return requests

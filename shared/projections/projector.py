"""Keeping read models in Postgres: load, catch up from the log, rebuild.

Each projection's rows and its tracking position are written in one transaction,
so after a crash a projection is exactly at the position it says it is, and
events at or below that position are recognised as already applied.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shared.eventlog.store import EventStore, StoredEvent
from shared.projections.readmodels import ALL_PROJECTIONS, Projection, Reducer, Rows
from shared.projections.rows import to_record


async def _raw(conn: AsyncConnection) -> Any:
    return (await conn.get_raw_connection()).driver_connection


async def load_rows(conn: AsyncConnection, projection: Projection[Any]) -> Rows:
    raw = await _raw(conn)
    row_type, key = projection.row, projection.row.KEY  # type: ignore[attr-defined]
    records = await raw.fetch(f"SELECT {', '.join(row_type._fields)} FROM {projection.table}")  # type: ignore[attr-defined]
    return {r[key]: row_type.from_record(r) for r in records}  # type: ignore[attr-defined]


async def load_position(conn: AsyncConnection, name: str) -> int:
    raw = await _raw(conn)
    value = await raw.fetchval("SELECT position FROM tracking WHERE name = $1", name)
    return int(value or 0)


async def write_rows(conn: AsyncConnection, projection: Projection[Any], rows: Rows, keys: Sequence[str]) -> None:
    """Upsert the rows for `keys` that exist and delete the ones that no longer do."""
    raw = await _raw(conn)
    key = projection.row.KEY  # type: ignore[attr-defined]
    gone = [k for k in keys if k not in rows]
    present = [rows[k] for k in keys if k in rows]
    if gone:
        await raw.execute(f"DELETE FROM {projection.table} WHERE {key} = ANY($1::text[])", gone)
    if present:
        cols = projection.row._fields  # type: ignore[attr-defined]
        placeholders = ", ".join(f"${i}" for i in range(1, len(cols) + 1))
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in cols if c != key)
        await raw.executemany(
            f"INSERT INTO {projection.table} ({', '.join(cols)}) VALUES ({placeholders})"
            f" ON CONFLICT ({key}) DO UPDATE SET {updates}",
            [to_record(row) for row in present],
        )


async def save_position(conn: AsyncConnection, name: str, position: int) -> None:
    raw = await _raw(conn)
    await raw.execute(
        "INSERT INTO tracking (name, position, updated_at) VALUES ($1, $2, now())"
        " ON CONFLICT (name) DO UPDATE SET position = EXCLUDED.position, updated_at = now()",
        name,
        position,
    )


class Projector:
    """Maintains every read model in the Postgres schema `engine` points at."""

    def __init__(self, store: EventStore, engine: AsyncEngine, projections: Sequence[Projection] = ALL_PROJECTIONS) -> None:
        self.store = store
        self.engine = engine
        self.projections = tuple(projections)
        self.rows: dict[str, Rows] = {}
        self.positions: dict[str, int] = {}
        self.stale = True
        """The rows in memory may be ahead of the tables (a write failed): nothing is folded until they are reloaded."""

    @property
    def position(self) -> int:
        return min(self.positions.values(), default=0)

    async def load(self) -> None:
        self.stale = True
        rows, positions = {}, {}
        async with self.engine.connect() as conn:
            for p in self.projections:
                rows[p.name] = await load_rows(conn, p)
                positions[p.name] = await load_position(conn, p.name)
        self.rows, self.positions, self.stale = rows, positions, False

    async def catch_up(self, upto: int | None = None, batch: int = 5000) -> int:
        """Apply every committed event after our position; return how many were applied."""
        if self.stale:
            await self.load()
        applied = 0
        async for events in self.store.iter_events(self.position, upto, batch):
            if events:
                applied += await self._apply_batch(events)
        return applied

    async def _apply_batch(self, events: list[StoredEvent]) -> int:
        # From the first fold until the write commits, the rows in memory are ahead of the tables; folding the same
        # events again on top of them would count some twice. Whatever ends this early (a failed write, a reducer's
        # error, the task cancelled), the next catch-up starts over from the tables, whenever they can be read again.
        self.stale = True
        touched: dict[str, dict[str, None]] = {p.name: {} for p in self.projections}
        applied = 0
        for event in events:
            fresh = [p for p in self.projections if event.position > self.positions[p.name]]
            for p in fresh:
                for key in p.apply(self.rows[p.name], event):
                    touched[p.name][key] = None
            applied += bool(fresh)
        last = events[-1].position
        async with self.engine.begin() as conn:
            for p in self.projections:
                if touched[p.name]:
                    await write_rows(conn, p, self.rows[p.name], list(touched[p.name]))
                if last > self.positions[p.name]:
                    await save_position(conn, p.name, last)
        for p in self.projections:
            self.positions[p.name] = max(self.positions[p.name], last)
        self.stale = False
        return applied


async def rebuild(store: EventStore, projections: Sequence[Projection] = ALL_PROJECTIONS, upto: int | None = None) -> tuple[dict[str, Rows], int, int]:
    """Fold the log (up to `upto`) into fresh rows in memory: (rows per projection, last position, events read)."""
    rows: dict[str, Rows] = {p.name: {} for p in projections}
    # event type -> the (rows, reducer) pairs that fold it, resolved once for the hot loop
    folds: dict[str, list[tuple[Rows, Reducer]]] = {}
    for p in projections:
        for type_name, reducer in p.reducers.items():
            folds.setdefault(type_name, []).append((rows[p.name], reducer))
    last, count = 0, 0
    # A rebuild allocates millions of short-lived dicts and no reference cycles;
    # the cyclic collector would keep rescanning the growing projections for
    # nothing. Reference counting frees everything as usual.
    collecting = gc.isenabled()
    gc.disable()
    try:
        async for events in store.iter_events(0, upto, types=folds.keys()):
            for stored in events:
                event, at = stored.event, stored.occurred_at
                for target, reducer in folds[event.TYPE]:
                    reducer(target, event, at)
            count += len(events)
            if events:
                last = events[-1].position
    finally:
        if collecting:
            gc.enable()
    return rows, last, count


async def write_all(conn: AsyncConnection, projections: Sequence[Projection], rows: dict[str, Rows], position: int) -> None:
    """Replace the tables of `projections` with `rows`, recording `position`, in `conn`'s transaction."""
    raw = await _raw(conn)
    for p in projections:
        await raw.execute(f"DELETE FROM {p.table}")
        await write_rows(conn, p, rows[p.name], list(rows[p.name]))
        await save_position(conn, p.name, position)

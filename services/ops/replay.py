"""`modelpool replay`: rebuild every read model from the log and compare with the live one.

With `--verify-decisions [ALIAS]` it re-runs every recorded decision through the
policy code instead (services/ops/verify.py) and reports each that differs.

The rebuild goes, up to the position the live projections say they are at, into
temporary copies of the live tables (the same columns, types and keys, in the
session's own temporary schema, gone when it ends), and is read back through the
same code as the live rows, so equal means equal. Temporary tables need no
right to create anything in the database: the service role runs a replay too.
Any difference is printed and the command exits 1: a live row was changed
behind the log's back, or a projection lost an event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from shared.contracts.events import event_registry
from shared.eventlog.db import create_engine
from shared.eventlog.store import make_store
from shared.projections.projector import load_position, load_rows, rebuild, write_all
from shared.projections.readmodels import ALL_PROJECTIONS, Projection, Rows
from shared.projections.rows import as_json
from shared.settings import Settings
from services.ops.verify import Mismatch, verify_decisions


@dataclass(frozen=True)
class Difference:
    projection: str
    key: str
    kind: str  # "missing" (in rebuild, not live), "extra" (live only), "changed"
    live: Any
    rebuilt: Any

    def describe(self) -> str:
        if self.kind == "changed":
            assert self.live is not None and self.rebuilt is not None
            live, log = as_json(self.live), as_json(self.rebuilt)
            parts = [f"{c}: live={live[c]!r} log={log[c]!r}" for c in live if live[c] != log[c]]
            return f"{self.projection} {self.key}: changed — " + "; ".join(parts)
        if self.kind == "missing":
            return f"{self.projection} {self.key}: in the log but missing from the live table"
        return f"{self.projection} {self.key}: in the live table but not in the log"


@dataclass(frozen=True)
class ReplayReport:
    positions: dict[str, int]
    events_read: int
    rows: dict[str, int]
    differences: list[Difference]

    @property
    def consistent(self) -> bool:
        return not self.differences


def compare(projection: Projection, live: Rows, rebuilt: Rows) -> list[Difference]:
    out = []
    for key in sorted(set(live) | set(rebuilt)):
        a, b = live.get(key), rebuilt.get(key)
        if a is None:
            out.append(Difference(projection.name, key, "missing", None, b))
        elif b is None:
            out.append(Difference(projection.name, key, "extra", a, None))
        elif a != b:
            out.append(Difference(projection.name, key, "changed", a, b))
    return out


SCRATCH_TABLES = ("tracking", *(p.table for p in ALL_PROJECTIONS))


async def replay(settings: Settings) -> ReplayReport:
    live_engine = create_engine(settings, pool_size=2)
    store = make_store(live_engine, event_registry(), settings.namespace)
    try:
        # One snapshot of the live side: positions and rows as of the same instant.
        live: dict[str, Rows] = {}
        positions: dict[str, int] = {}
        async with live_engine.connect() as conn:
            await conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
            for p in ALL_PROJECTIONS:
                positions[p.name] = await load_position(conn, p.name)
                live[p.name] = await load_rows(conn, p)
            await conn.rollback()

        differences: list[Difference] = []
        events_read = 0
        rows_count: dict[str, int] = {}
        # One session holds the scratch tables: a temporary table of the live one's name comes first in its
        # search path, so the projector's own statements write and read the copies, not the live tables.
        async with live_engine.connect() as scratch:
            for table in SCRATCH_TABLES:
                await scratch.execute(text(f'CREATE TEMPORARY TABLE {table} (LIKE "{settings.namespace}".{table} '
                                           "INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)"))
            await scratch.commit()
            for position in sorted(set(positions.values())):
                group = [p for p in ALL_PROJECTIONS if positions[p.name] == position]
                rebuilt, _, count = await rebuild(store, group, upto=position)
                events_read = max(events_read, count)
                await write_all(scratch, group, rebuilt, position)
                await scratch.commit()
                for p in group:
                    reread = await load_rows(scratch, p)
                    rows_count[p.name] = len(reread)
                    differences += compare(p, live[p.name], reread)
            await scratch.rollback()
        return ReplayReport(positions, events_read, rows_count, differences)
    finally:
        await live_engine.dispose()


async def verify(settings: Settings, alias: str | None) -> tuple[int, list[Mismatch]]:
    engine = create_engine(settings, pool_size=2)
    try:
        registry = event_registry()
        return await verify_decisions(make_store(engine, registry, settings.namespace), registry, alias)
    finally:
        await engine.dispose()


def main_verify(settings: Settings, alias: str | None, as_json: bool) -> int:
    checked, mismatches = asyncio.run(verify(settings, alias))
    if as_json:
        print(json.dumps({"checked": checked, "mismatches": [m.describe() for m in mismatches]}, indent=2))
    elif mismatches:
        print(f"{len(mismatches)} of {checked} recorded decision(s) differ from what the policy code decides:", file=sys.stderr)
        for m in mismatches:
            print("  " + m.describe(), file=sys.stderr)
    else:
        print(f"verified: the policy code makes each of the {checked} recorded decision(s) again, field for field")
    return 1 if mismatches else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool replay", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--verify-decisions", nargs="?", const="", metavar="ALIAS", default=None,
                        help="re-run every recorded decision (of ALIAS, or all) through the policy code; exit 1 on any difference")
    args = parser.parse_args(argv)
    settings = Settings.load(discover=True)
    if args.verify_decisions is not None:
        return main_verify(settings, args.verify_decisions or None, args.json)
    report = asyncio.run(replay(settings))
    if args.json:
        print(
            json.dumps(
                {
                    "consistent": report.consistent,
                    "positions": report.positions,
                    "events_read": report.events_read,
                    "rows": report.rows,
                    "differences": [d.describe() for d in report.differences],
                },
                indent=2,
            )
        )
    else:
        for name in report.positions:
            print(f"{name:<10} position {report.positions[name]:>10}  rows {report.rows.get(name, 0):>8}")
        if report.consistent:
            print(f"consistent: every projection equals a rebuild from the log ({report.events_read} events)")
        else:
            print(f"{len(report.differences)} difference(s) between the live projections and the log:", file=sys.stderr)
            for d in report.differences:
                print("  " + d.describe(), file=sys.stderr)
    return 0 if report.consistent else 1

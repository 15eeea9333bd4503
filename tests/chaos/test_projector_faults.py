"""The projector's write failing or cancelled, and then its reload too: nothing is folded twice, and the tables equal
a rebuild."""

from __future__ import annotations

import asyncio

import pytest
from test_projections import ALIAS, record_a_day

from services.ops.replay import replay
from shared.projections import projector as projector_module
from shared.projections.projector import Projector, rebuild
from shared.projections.readmodels import ALL_PROJECTIONS


def fail_once(monkeypatch, name: str, error: BaseException | None = None) -> list[int]:
    """Make `projector.<name>` raise `error` (a dropped connection) the next time it is called; the calls made."""
    real, calls = getattr(projector_module, name), []

    async def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error or ConnectionResetError("the server closed the connection")
        return await real(*args, **kwargs)

    monkeypatch.setattr(projector_module, name, flaky)
    return calls


async def test_a_failed_write_then_a_failed_reload_fold_nothing_twice(store, settings, monkeypatch):
    await record_a_day(store)
    head = await store.head_position()
    projector = Projector(store, store.engine)
    await projector.catch_up(upto=head // 2)
    halfway = projector.position

    writes, loads = fail_once(monkeypatch, "write_rows"), fail_once(monkeypatch, "load_rows")
    with pytest.raises(ConnectionResetError):
        await projector.catch_up()  # folded the rest in memory, then the write failed: rows ahead of the tables
    assert projector.stale and projector.position == halfway and len(writes) >= 1
    with pytest.raises(ConnectionResetError):
        await projector.catch_up()  # the reload failed too: still nothing folded on top of the stale rows
    assert projector.stale and len(loads) == 1
    await projector.catch_up()
    assert not projector.stale and projector.position == head

    rebuilt, _, _ = await rebuild(store, ALL_PROJECTIONS)
    assert projector.rows["control"][ALIAS].version == rebuilt["control"][ALIAS].version  # not doubled
    assert projector.rows == rebuilt
    report = await replay(settings)
    assert report.consistent, [d.describe() for d in report.differences]


async def test_a_write_cancelled_midway_folds_nothing_twice(store, settings, monkeypatch):
    """The task catching up is cancelled inside its write (a service stopping a handler, a timeout around it): the
    events folded in memory are not folded again on top of themselves by the next catch-up."""
    await record_a_day(store)
    head = await store.head_position()
    projector = Projector(store, store.engine)
    await projector.catch_up(upto=head // 2)
    halfway = projector.position

    fail_once(monkeypatch, "write_rows", asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await projector.catch_up()
    assert projector.stale and projector.position == halfway
    await projector.catch_up()
    assert not projector.stale and projector.position == head

    rebuilt, _, _ = await rebuild(store, ALL_PROJECTIONS)
    assert projector.rows == rebuilt
    report = await replay(settings)
    assert report.consistent, [d.describe() for d in report.differences]

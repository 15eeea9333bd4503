"""`modelpool top` keeps drawing when its servers are away (the screen under tmux is tested in test_up.py)."""

from __future__ import annotations

import socket

from services.ops import top
from shared.settings import Settings


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_with_postgres_and_nats_away_each_frame_says_so_and_the_next_one_comes():
    settings = Settings(database_url=f"postgresql://127.0.0.1:{closed_port()}/none",
                        nats_url=f"nats://127.0.0.1:{closed_port()}")
    frames: list[str] = []
    await top.run(settings, 0.1, 2, frames.append, lambda: (100, 20))
    assert len(frames) == 2
    for frame in frames:
        lines = frame.splitlines()
        assert lines[0].startswith("modelpool top  namespace modelpool  ")
        assert lines[1].startswith("the log is unavailable: ") and lines[2].startswith("live facts unavailable: ")
        assert all(len(line) <= 100 for line in lines)

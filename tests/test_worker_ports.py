"""A worker tells its engine's listening socket from a stranger's on the same port."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from services.worker.engines import listens_elsewhere
from shared.net import free_port

LISTEN = "import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(60)"


def test_a_port_held_by_the_engines_own_process_group_is_its_own():
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-c", LISTEN, str(port)], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while listens_elsewhere(engine.pid, port) and time.monotonic() < deadline:
            time.sleep(0.05)  # until it has bound
        assert not listens_elsewhere(engine.pid, port)
    finally:
        engine.kill()
        engine.wait()


def test_a_port_taken_by_another_process_is_not_the_engines():
    stranger = socket.socket()
    stranger.bind(("127.0.0.1", 0))
    stranger.listen()
    port = stranger.getsockname()[1]
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert listens_elsewhere(engine.pid, port)
    finally:
        engine.kill()
        engine.wait()
        stranger.close()

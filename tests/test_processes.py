"""The one launcher: children die with the process that started them, and a stop takes everything they started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import wait_until
from services.processes import descendants_of, is_alive, processes_with_marker, spawn, stop_process, tied_to_us

PARENT = """
import asyncio, os, subprocess, sys, time
from services.processes import spawn, spawn_async
env = {**os.environ, "MODELPOOL_TEST_MARK": sys.argv[1]}
spawn(["sleep", "60"], output=subprocess.DEVNULL, env=env)
async def main():
    await spawn_async(["sleep", "60"], output=subprocess.DEVNULL, env=env)
asyncio.run(main())
print("started", flush=True)
time.sleep(60)
"""


def test_children_die_with_their_parent_even_when_it_is_killed(tmp_path):
    mark = f"MODELPOOL_TEST_MARK={tmp_path.name}"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, tmp_path.name], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "started"
        children = processes_with_marker(mark)
        assert len(children) == 2, children
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until(lambda: not any(is_alive(pid) for pid in children)), "a child outlived its parent"
    finally:
        parent.kill()
        parent.wait()


def test_a_stop_takes_the_whole_tree_even_from_a_child_that_ignores_sigterm(tmp_path):
    stubborn = "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
               "subprocess.Popen(['sleep', '60']); print('up', flush=True); time.sleep(60)"
    with open(tmp_path / "out.log", "wb") as log:
        proc = spawn([sys.executable, "-c", stubborn], output=log, death_signal=None)
    assert wait_until(lambda: (tmp_path / "out.log").read_text().strip() == "up")
    grandchildren = descendants_of(proc.pid)
    assert grandchildren
    started = time.monotonic()
    stop_process(proc, first_signal=signal.SIGTERM, grace_s=0.5)
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - started < 10
    assert not any(is_alive(pid) for pid in grandchildren)


def test_a_child_whose_parent_died_before_it_could_be_tied_to_it_ends_itself():
    # The parent-death signal only fires for a parent alive when it was set: a child that finds another
    # parent than the one that forked it (its parent died in between) ends at once, before its program runs.
    child = subprocess.run(["sleep", "30"], preexec_fn=tied_to_us(None, signal.SIGTERM, os.getpid() + 999_999),
                           timeout=10)
    assert child.returncode == -signal.SIGTERM
    alive = subprocess.run(["true"], preexec_fn=tied_to_us(None, signal.SIGTERM, os.getpid()), timeout=10)
    assert alive.returncode == 0

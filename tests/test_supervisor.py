"""The one supervisor: a child's output, its restart, a stop that leaves nothing behind, and when to give up."""

from __future__ import annotations

import io
import signal
import sys

from helpers import wait_until
from services.cluster.supervisor import Child, Output, RestartRules, keep_running, stop
from services.processes import is_alive

# Prints a line, starts a grandchild that ignores SIGTERM, says its pid, then waits; SIGTERM ends it at once.
SERVICE = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"], start_new_session=True)
print("serving", grandchild.pid, flush=True)
time.sleep(60)
"""


def grandchild_of(text: str) -> int:
    """The grandchild's pid from the first `serving` line in `text`."""
    return int(text.split("serving", 1)[1].split()[0])


def test_a_stop_takes_the_children_and_what_they_left_in_sessions_of_their_own(tmp_path):
    log = tmp_path / "svc.log"
    child = Child("svc", [sys.executable, "-c", SERVICE], {}, log_path=log, death_signal=None)
    assert wait_until(lambda: "serving" in child.logged())
    grandchild = grandchild_of(child.logged())
    stop([child], timeout_s=5.0)
    assert child.returncode == -signal.SIGTERM  # it went at once, on the signal
    assert wait_until(lambda: not is_alive(grandchild))  # in its own session, ignoring SIGTERM: killed all the same
    child.start_again()  # as it was started: into the same log, after what it wrote before
    assert wait_until(lambda: child.logged().count("serving") == 2)
    second = grandchild_of("serving" + child.logged().rsplit("serving", 1)[1])
    assert child.signal(signal.SIGKILL) == -signal.SIGKILL and not child.alive
    assert wait_until(lambda: not is_alive(second))


def test_forwarded_output_is_prefixed_and_a_crash_loop_stops_the_supervision():
    stream = io.StringIO()
    output = Output(stream)
    child = Child("flaky", [sys.executable, "-c", "print('about to fail', flush=True); raise SystemExit(3)"], {},
                  output=output)
    rules = RestartRules(limit=1, window_s=60, first_delay_s=0.0)
    assert wait_until(lambda: child.returncode == 3)
    assert keep_running(child, rules, output)  # the first exit: a restart is due at once
    assert keep_running(child, rules, output)  # started again
    assert wait_until(lambda: child.returncode == 3)
    assert not keep_running(child, rules, output)  # the second within the window: a crash loop
    text = stream.getvalue()
    assert "[flaky] about to fail" in text and "flaky exited with code 3; restarting it" in text
    assert "a crash loop" in text and "    about to fail" in text  # with the end of its output

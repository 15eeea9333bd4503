"""The web console in a real browser (Debian's chromium, driven through chromium-driver) over a running pool.

The whole pool runs as processes (simulated engines) under a bounded load of conversations; an operator signs in,
reads the pool, watches an alias's live charts move, pauses the controller, pins a minimum while it is paused (and
nothing happens), resumes it (and the pin is honoured), sleeps an instance, opens a decision with its inputs, asks
why a request went where it went, and opens the sessions page. Every action is read back from the log; the decisions made meanwhile verify
(`replay --verify-decisions`); the browser logs no error. Screenshots of each page are kept (and written to
`MODELPOOL_CONSOLE_SCREENSHOTS`, where set: docs/img/ is made that way, see docs/console.md).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import debian_chromium
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from shared.net import free_port

pytestmark = [pytest.mark.processes, pytest.mark.slow]

TOKEN = "console-token-for-tests-0123"
OPERATOR = "ops-console-test"
POOL = """
aliases:
  - alias: chat
    router: {plugin: affinity}
    backends:
      llama.cpp: {model_name: chat, model_path: default, gpu_memory_gb: 0, min_replicas: 1, max_replicas: 2,
                  engine: simulator}
      vllm: {model_name: chat, model_path: simulated, gpu_memory_gb: 12, min_replicas: 1, max_replicas: 1,
             max_model_len: 4096, engine: simulator}
"""


def conversations(url: str, stop: threading.Event, answered: list[str], clients: int = 3,
                  limit_s: float = 240.0) -> list[int]:
    """`clients` conversations (each its own `x-session-id`), one turn after another, until `stop` (or `limit_s`);
    the request ids of those answered go to `answered`."""
    statuses: list[int] = []

    def client(n: int) -> None:
        deadline = time.monotonic() + limit_s
        with httpx.Client(base_url=url, timeout=60) as http:
            while not stop.is_set() and time.monotonic() < deadline:
                response = http.post("/chat/completions", headers={"x-session-id": f"conversation-{n}"}, json={
                    "model": "chat", "max_tokens": 12, "messages": [{"role": "user", "content": "Tell me more."}]})
                statuses.append(response.status_code)
                if response.status_code == 200:
                    answered.append(response.headers["x-request-id"])
                stop.wait(0.2)
    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(timeout=90)
    return statuses


class Console:
    """The console in a headless chromium: waits, clicks that survive the page's refreshes, screenshots."""

    def __init__(self, url: str, shots: Path) -> None:
        browser, driver = debian_chromium()
        options = Options()
        options.binary_location = browser
        for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1400,1100", "--lang=en-US"):
            options.add_argument(argument)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(driver), options=options)
        self.url, self.shots = url, shots

    def close(self) -> None:
        self.driver.quit()

    def until(self, what: str, check: Callable[[], Any], timeout_s: float = 30) -> Any:
        def attempt(_: Any) -> Any:
            try:
                return check()
            except (StaleElementReferenceException, WebDriverException):
                return None  # the page re-rendered under us: look again
        return WebDriverWait(self.driver, timeout_s, poll_frequency=0.2).until(attempt, message=what)

    def find(self, css: str) -> list:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def click(self, css: str) -> None:
        self.until(f"{css} clicked", lambda: self.find(css)[0].click() or True)

    def act(self, css: str, reason: str) -> None:
        """An operator action: its button, then why, then the dialog's confirmation; done once it is recorded."""
        self.click(css)
        self.until("the action's dialog", lambda: self.find("#confirm[open]"))
        field = self.find("#confirm-reason")[0]
        field.send_keys(reason)
        self.click("#confirm-submit")
        self.until(f"{css} recorded", lambda: self.find("#banner.ok") and not self.find("#confirm[open]"))

    def text(self, css: str) -> str:
        return " ".join(e.text for e in self.find(css))

    def shoot(self, name: str, height: int = 1100) -> Path:
        """The page as shown in a window `height` pixels tall (what a reader of docs/console.md sees)."""
        path = self.shots / f"console-{name}.png"
        self.driver.set_window_size(1400, height)
        self.driver.save_screenshot(str(path))
        self.driver.set_window_size(1400, 1100)
        return path

    def errors(self) -> list[dict]:
        return [entry for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]


def drive(admin: str, shots: Path, answered: list[str]) -> dict[str, Any]:
    """The operator's session in the browser; what it saw, for the assertions."""
    console = Console(admin, shots)
    seen: dict[str, Any] = {}
    try:
        console.driver.get(f"{admin}/console")
        console.until("the sign-in dialog", lambda: console.find("#sign-in[open]"))
        console.find("#token")[0].send_keys("not-the-token-0123456789")
        console.click("#sign-in-submit")
        console.until("a refused token said so", lambda: "refused" in console.text("#sign-in-error"))
        field = console.find("#token")[0]
        field.clear()
        field.send_keys(TOKEN)
        console.click("#sign-in-submit")
        console.until("the pool page", lambda: console.find('main a[href="#/alias/chat"]'))
        refused = console.errors()  # the wrong token's 401, as the browser reports a refused call; nothing else
        assert [e for e in refused if "401 (Unauthorized)" not in e["message"]] == [], refused
        console.until("both workers' rows and the alias's outlook", lambda: "w2" in console.text("main table")
                      and "what the controller does next" in console.text("main table").lower())
        seen["pool"] = console.text("main")
        seen["shots"] = [console.shoot("pool")]
        operator = console.find("#operator")[0]
        operator.send_keys(OPERATOR, Keys.TAB)  # kept for every action, recorded with each

        console.click('main a[href="#/alias/chat"]')
        console.until("the instances of both tiers", lambda: "llama.cpp" in console.text("#instances")
                      and "vllm" in console.text("#instances"))
        # The live charts: drawn again at every refresh (at least every 2 s), with the gateway's windows in them.
        canvas = "#chart-arrivals"
        console.until("arrivals on the chart", lambda: int(console.find(canvas)[0].get_attribute("data-points") or 0) > 2,
                      timeout_s=60)
        drawn = []
        for _ in range(3):
            before = console.find(canvas)[0].get_attribute("data-drawn-at")
            drawn.append(int(console.until("the chart drawn again", lambda: (now := console.find(canvas)[0]
                                                                                 .get_attribute("data-drawn-at")) != before and now)))
        seen["redraw_gaps_ms"] = [b - a for a, b in zip(drawn, drawn[1:])]

        # Paused, a pin asks for a second llama.cpp replica: nothing happens until the controller is resumed.
        console.act("#pause", "freeze for the console test")
        console.until("the alias shown paused", lambda: "paused" in console.text("main h1"))
        pin = console.find('input[data-pin="llama.cpp"]')[0]
        pin.clear()
        pin.send_keys("2")
        console.act('button[data-pin-button="llama.cpp"]', "two replicas for the launch")
        console.until("the pin shown", lambda: "llama.cpp ≥ 2" in console.text("main h1"))
        time.sleep(5)  # ten of the controller's ticks
        seen["llama_running_while_paused"] = llama_running(console)
        console.act("#resume", "console test: go on")
        console.until("two llama.cpp replicas running once resumed", lambda: llama_running(console) == 2, timeout_s=60)

        console.until("a vLLM instance awake", lambda: console.find('button[data-action="sleep-1"]'), timeout_s=60)
        seen["slept"] = console.find('button[data-action="sleep-1"]')[0].get_attribute("data-instance")
        console.act('button[data-action="sleep-1"]', "free the GPU for a moment")
        console.until("the operator's actions in the timeline", lambda: len(console.find("tr.operator")) >= 4)
        seen["shots"].append(console.shoot("alias", height=2400))

        console.click("tr.decision a")
        console.until("a decision with its inputs", lambda: "Decided" in console.text("main h2")
                      and "Inputs: the instances" in console.text("main h2"))
        seen["decision"] = console.text("main")
        seen["shots"].append(console.shoot("decision", height=1500))

        # Why one request went where it went, as `modelpool explain` says it, from the access log.
        seen["explained_id"] = answered[-1]  # read once: the load goes on answering requests meanwhile
        console.find("#explain-id")[0].send_keys(seen["explained_id"], Keys.ENTER)
        console.until("the request explained", lambda: "served by" in console.text("#explained"))
        seen["explained"] = console.text("#explained")
        seen["shots"].append(console.shoot("request"))

        console.driver.get(f"{admin}/console#/sessions")
        console.until("the conversations bound", lambda: len(console.find("main tbody tr")) >= 3)
        seen["sessions"] = console.text("main")
        seen["shots"].append(console.shoot("sessions"))
        seen["errors"] = console.errors()
    except Exception as exc:
        shot = console.shoot("failure")
        raise AssertionError(f"{exc}; the page showed (screenshot {shot}):\n{console.text('body')[:4000]}\n"
                             f"the browser logged: {console.driver.get_log('browser')}") from exc
    finally:
        console.close()
    return seen


def llama_running(console: Console) -> int:
    return sum(1 for row in console.find("#instances tbody tr") if "llama.cpp" in row.text and "RUNNING" in row.text)


async def test_an_operator_reads_the_pool_and_acts_on_it_from_the_console(local_pool, tmp_path):
    admin_port = free_port()
    worker = {"MODELPOOL_WORKER_GPU_MEMORY_GB": "24"}
    pool = local_pool(POOL, workers={"w1": worker, "w2": worker}, MODELPOOL_ADMIN_TOKEN=TOKEN,
                      MODELPOOL_ADMIN_PORT=str(admin_port), MODELPOOL_ACCESS_LOG=str(tmp_path / "access.log"))
    admin = f"http://127.0.0.1:{admin_port}"
    stop, answered = threading.Event(), []
    load = asyncio.create_task(asyncio.to_thread(conversations, pool.gateway, stop, answered))
    try:
        seen = await asyncio.to_thread(drive, admin, tmp_path, answered)
    finally:
        stop.set()
        statuses = await load

    assert seen["errors"] == [], seen["errors"]
    assert all(gap <= 3000 for gap in seen["redraw_gaps_ms"]), seen["redraw_gaps_ms"]
    assert "FAST_ONLY" in seen["pool"] or "MIXED" in seen["pool"] or "VLLM_ONLY" in seen["pool"], seen["pool"]
    assert seen["llama_running_while_paused"] == 1
    assert "Inputs: the metric window" in seen["decision"]
    assert "conversation-0" in seen["sessions"]
    assert seen["explained"].startswith(f"request {seen['explained_id']} /v1/chat/completions for chat")
    assert "served by llama.cpp instance chat-fast-" in seen["explained"] and "\n  why: " in seen["explained"]
    assert statuses and all(status == 200 for status in statuses), sorted(set(statuses))

    # Every action is in the log with who and why; the sleep reached the engine with them.
    async with httpx.AsyncClient(base_url=admin, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
        events = (await client.get("/admin/history/chat")).json()["events"]
    said = [e["summary"] for e in events if e["type"] == "OperatorCommanded"]
    assert said == [f"operator {OPERATOR}: pause the controller: freeze for the console test",
                    f"operator {OPERATOR}: pin llama.cpp min_replicas to 2: two replicas for the launch",
                    f"operator {OPERATOR}: resume the controller: console test: go on",
                    f"operator {OPERATOR}: sleep instance {seen['slept']} at level 1: free the GPU for a moment"]
    positions = {e["summary"].split(": ")[1]: e["position"] for e in events if e["type"] == "OperatorCommanded"}
    paused = [e for e in events if e["type"] == "PolicyDecided"
              and positions["pause the controller"] < e["position"] < positions["resume the controller"]]
    assert paused == [], "the controller decided for a paused alias"
    assert any(e["type"] == "ScalingTargetsChanged" and "pinned to 2 by an operator" in e["summary"] for e in events)
    assert any(e["type"] == "InstanceStateChanged" and e["instance_id"] == seen["slept"] and "SLEEP_1" in e["summary"]
               and f"operator {OPERATOR}: free the GPU for a moment" in e["summary"] for e in events)

    # The read models rebuilt from the log equal the tables (the holds included), and the decisions made around
    # the pause and the pin are the ones the code makes again from their inputs.
    for options in ([], ["--verify-decisions"]):
        replay = subprocess.run([sys.executable, "-m", "services.cli", "replay", *options], env=pool.env,
                                capture_output=True, text=True, timeout=300)
        assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]

    for shot in seen["shots"]:
        assert shot.stat().st_size > 20_000, f"{shot.name} looks blank"
    if target := os.environ.get("MODELPOOL_CONSOLE_SCREENSHOTS"):
        for shot in seen["shots"]:
            shutil.copy(shot, Path(target) / shot.name)

"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shared.internal_auth import SECRET_ENV, sign
from shared.net import free_ports

CLUSTER_SECRET = "modelpool-tests-cluster-secret-0123456789"
"""The cluster secret of engines and gateways the tests start (shared/internal_auth.py)."""
CLUSTER_KEY = CLUSTER_SECRET.encode()


def signed(path: str, body: bytes, content_type: str = "application/json", key: bytes = CLUSTER_KEY) -> dict[str, str]:
    """Headers for a POST of `body` to an engine's internal `path`, signed as the gateway signs it."""
    return {"content-type": content_type, **sign(key, "POST", path, body)}


def post_signed(client: httpx.Client, base: str, path: str, payload: bytes | dict,
                content_type: str = "application/json") -> httpx.Response:
    """POST `payload` (bytes, or a dict sent as JSON) to an engine's internal `path` at `base`, signed."""
    import json

    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return client.post(f"{base}{path}", content=body, headers=signed(path, body, content_type))


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Wait until `predicate()` (sync or async) is truthy; return its value or fail with the last one."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await asyncio.sleep(interval)


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """`eventually` for code that is not async: whether `condition()` came true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


async def fetch(sub, n: int, timeout: float = 10.0) -> list:
    """Up to `n` messages from a pull subscription within `timeout`, acked."""
    got = []
    deadline = asyncio.get_running_loop().time() + timeout
    while len(got) < n and asyncio.get_running_loop().time() < deadline:
        try:
            got += await sub.fetch(n - len(got), timeout=0.5)
        except Exception:
            pass
    for m in got:
        await m.ack()  # unacked, a consumer would stop at its max_ack_pending
    return got


class ServiceProcess:
    """A `modelpool <command>` child process whose output goes to a log file."""

    def __init__(self, command: str, env: dict[str, str], log_dir) -> None:
        import os
        import subprocess
        import sys

        self.command = command
        self.log_path = log_dir / f"{command}-{len(list(log_dir.glob(command + '-*')))}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", command],
            env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def kill(self, sig: int) -> int:
        import os

        os.killpg(self.proc.pid, sig)
        code = self.proc.wait(timeout=30)
        self._log.close()
        return code

    def stop(self) -> int:
        import signal

        if self.proc.poll() is not None:
            self._log.close()
            return self.proc.returncode
        return self.kill(signal.SIGTERM)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


class consuming:
    """Run bus consumers on a FastStream broker for the duration of a `async with` block."""

    def __init__(self, nats_url: str, *consumers) -> None:
        import logging

        from faststream.nats import NatsBroker

        self.broker = NatsBroker(nats_url, logger=logging.getLogger("tests.bus"))
        for consumer in consumers:
            consumer.subscribe(self.broker)

    async def __aenter__(self):
        await self.broker.start()
        return self.broker

    async def __aexit__(self, *exc) -> None:
        await self.broker.stop()


# --------------------------------------------------------------------------- simulated engines


@dataclass
class EngineProcess:
    """`modelpool engine sim` as a child process."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    internal_url: str | None = None
    """The engine's internal port (KV export and import), when started with one."""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_engine(log_dir: Path, profile: str, alias: str, *options: str, env: dict[str, str] | None = None,
                 internal: bool = False) -> EngineProcess:
    port, *internal_ports = free_ports(2 if internal else 1)
    internal_port = internal_ports[0] if internal else None
    log_path = log_dir / f"engine-{profile}-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "engine", "sim", "--profile", profile, "--port", str(port),
         "--model", alias, "--startup-s", "0", *options,
         *(["--internal-port", str(internal_port)] if internal_port else [])],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, SECRET_ENV: CLUSTER_SECRET, **(env or {})},
    )
    return EngineProcess(f"http://127.0.0.1:{port}", proc, log_path,
                         f"http://127.0.0.1:{internal_port}" if internal_port else None)


def start_llama_engine(log_dir: Path, alias: str, *options: str) -> EngineProcess:
    """`modelpool engine llama.cpp` (the real model, SmolLM2-135M) as a child process, with its internal port."""
    port, internal_port = free_ports(2)
    log_path = log_dir / f"engine-llama.cpp-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "engine", "llama.cpp", "--port", str(port), "--model-alias", alias,
         "--internal-port", str(internal_port), "--threads", "1", "--log-level", "warning", *options],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, SECRET_ENV: CLUSTER_SECRET},
    )
    return EngineProcess(f"http://127.0.0.1:{port}", proc, log_path, f"http://127.0.0.1:{internal_port}")


def wait_healthy(engines: list[EngineProcess], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for engine in engines:
        while True:
            try:
                if httpx.get(f"{engine.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if engine.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine {engine.url} did not start:\n{engine.log_path.read_text()[-2000:]}")
            time.sleep(0.1)


PROMETHEUS_CACHE = Path.home() / ".cache" / "modelpool" / "prometheus"


def debian_prometheus() -> Path:
    """The directory holding `prometheus` and `promtool`: the machine's, else those of Debian's `prometheus`
    package, unpacked (not installed: installing would start a Prometheus server) into the cache once."""
    found = shutil.which("promtool")
    if found and shutil.which("prometheus"):
        return Path(found).parent
    unpacked = PROMETHEUS_CACHE / "usr" / "bin"
    if (unpacked / "promtool").exists() and (unpacked / "prometheus").exists():
        return unpacked
    if shutil.which("apt-get") is None:
        pytest.fail("these tests need Prometheus: Debian's `prometheus` package (or prometheus and promtool on the PATH)")
    PROMETHEUS_CACHE.mkdir(parents=True, exist_ok=True)
    download = ["apt-get", "download", "prometheus"]
    fetched = subprocess.run(download, cwd=PROMETHEUS_CACHE, capture_output=True, text=True, timeout=600)
    if fetched.returncode != 0 and os.geteuid() == 0:  # no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=600)
        fetched = subprocess.run(download, cwd=PROMETHEUS_CACHE, capture_output=True, text=True, timeout=600)
    debs = sorted(PROMETHEUS_CACHE.glob("prometheus_*.deb"))
    if fetched.returncode != 0 or not debs:
        pytest.fail(f"could not fetch Debian's prometheus package:\n{fetched.stderr[-3000:]}")
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(PROMETHEUS_CACHE)], check=True, timeout=300)
    for deb in debs:
        deb.unlink()
    return unpacked


def debian_chromium() -> tuple[str, str]:
    """The system browser and its driver (Debian's `chromium` and `chromium-driver`), installed where missing
    and the tests run as root on Debian; the console's tests drive them."""
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail("the console's tests need a browser: install Debian's `chromium` and `chromium-driver`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]
    done = subprocess.run(install, capture_output=True, text=True, timeout=1200, env=env)
    if done.returncode != 0:  # no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=600, env=env)
        done = subprocess.run(install, capture_output=True, text=True, timeout=1200, env=env)
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if done.returncode != 0 or not (browser and driver):
        pytest.fail(f"could not install Debian's chromium and chromium-driver:\n{done.stderr[-3000:]}")
    return browser, driver

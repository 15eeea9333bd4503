"""A Docker engine for the compose tests: found running, or installed and started where the machine allows it.

On a machine with no Docker engine, as root, with Debian's packages reachable, the engine is installed
(`docker.io`, `docker-compose`, `debootstrap`) and `dockerd` started with the vfs storage driver, left
running for the next test as a system daemon would be. Anywhere else the test fails with what to do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "modelpool"
PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
HOW_TO_GET_ONE = ("a Docker engine is needed: start one (`dockerd`), or run the tests as root on a Debian machine "
                  "where `apt-get install docker.io docker-compose debootstrap` works, and they start one themselves")


def say(message: str) -> None:
    print(f"[compose test] {message}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO)
    if check and done.returncode != 0:
        pytest.fail(f"`{' '.join(argv)}` exited with {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def ensure_docker_engine() -> None:
    """A Docker engine answering `docker info`, and docker-compose and debootstrap beside it."""
    missing = [package for command, package in PACKAGES.items() if shutil.which(command) is None]
    if engine_answers() and not [p for p in missing if p != "docker.io"]:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail(f"{HOW_TO_GET_ONE} (missing: {', '.join(missing) or 'a running engine'})")
    if missing:
        say(f"installing {', '.join(missing)} from Debian's packages")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        update = run(["apt-get", "update"], timeout_s=600, env=env, check=False)
        installed = run(["apt-get", "install", "-y", "--no-install-recommends", *missing, "iptables"],
                        timeout_s=1200, env=env, check=False)
        if installed.returncode != 0:
            pytest.fail(f"{HOW_TO_GET_ONE}; apt-get failed:\n{update.stderr[-2000:]}\n{installed.stderr[-4000:]}")
    if engine_answers():
        return
    say("starting dockerd (vfs storage driver)")
    CACHE.mkdir(parents=True, exist_ok=True)
    log = (CACHE / "dockerd.log").open("ab")
    # A daemon of the machine's, not of this test: it outlives the test session.
    subprocess.Popen(["dockerd", "--storage-driver=vfs"], stdout=log, stderr=subprocess.STDOUT,
                     stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not engine_answers():
        if time.monotonic() > deadline:
            tail = (CACHE / "dockerd.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"{HOW_TO_GET_ONE}; dockerd did not answer within 120 s:\n{tail}")
        time.sleep(1)


def build_standins() -> dict[str, str]:
    """The stand-ins for the official base images (deploy/standins/build.sh), as compose variables."""
    done = run(["sh", str(REPO / "deploy" / "standins" / "build.sh"), sys.executable], timeout_s=2400)
    images = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    assert set(images) == {"PYTHON_IMAGE", "NATS_IMAGE", "POSTGRES_IMAGE", "HAPROXY_IMAGE", "PROMETHEUS_IMAGE"}, \
        done.stdout
    return images


def offer_llama_wheel() -> None:
    """Put the llama.cpp wheel `make install` built where the image build takes it instead of compiling."""
    for wheel in (CACHE / "wheels").glob("llama_cpp_python-*.whl"):
        target = REPO / "deploy" / "wheels" / wheel.name
        if not target.exists():
            shutil.copy2(wheel, target)


def prune_replaced_images() -> None:
    """Remove modelpool images a newer build replaced: with the vfs storage driver each holds its own copy of
    the whole file system. The dependencies' stage is unlabelled and stays, so the next build reuses it."""
    run(["docker", "image", "prune", "-f", "--filter", "label=org.opencontainers.image.title=modelpool"],
        timeout_s=300)


def healthy(url: str) -> bool:
    """A modelpool gateway (or the balancer before the gateways) answering GET /health with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class Compose:
    """`docker-compose` on the repository's compose file, as one project with its own name and variables."""

    def __init__(self, project: str, env: dict[str, str], files: Sequence[str] = ("docker-compose.yml",)) -> None:
        self.project = project
        # On the vfs storage driver a container's creation copies its image whole: creating a cluster's worth at
        # once outlasts compose's default 60 s wait for the engine's answer.
        self.env = {"COMPOSE_HTTP_TIMEOUT": "600", **os.environ, **env}
        self.files = [arg for f in files for arg in ("-f", str(REPO / f))]

    def __call__(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(["docker-compose", "-p", self.project, *self.files, *args], timeout_s=timeout_s, env=self.env,
                   check=check)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of the project still on the engine."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, listing in (("containers", ["ps", "-a"]), ("networks", ["network", "ls"]),
                              ("volumes", ["volume", "ls"])):
            out = run(["docker", *listing, "-q", "--filter", label], timeout_s=60).stdout.split()
            if out:
                found[kind] = out
        return found

"""The shipped Prometheus configuration and alerts, checked by Prometheus's own `promtool` (from Debian's
`prometheus` package, fetched here if missing): the configuration and rules load, and each alert fires on the series that
should fire it, after its `for`, and not before (`deploy/prometheus/alerts_test.yml`). That the rules' metrics are
the ones the gateway exports is tested against a real gateway (tests/gateway/test_gateway_edge.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import debian_prometheus

pytestmark = pytest.mark.processes

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    return str(debian_prometheus() / "promtool")


def run(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120)


def test_the_configuration_and_the_rules_load(promtool):
    for name in ("prometheus.yml", "compose.yml"):  # this machine's pool, and docker-compose.yml's
        config = run(promtool, "check", "config", name)
        assert config.returncode == 0, config.stdout + config.stderr
    rules = run(promtool, "check", "rules", "alerts.yml")
    assert rules.returncode == 0 and "SUCCESS: 7 rules found" in rules.stdout, rules.stdout + rules.stderr


def test_each_alert_fires_when_it_should_and_not_before(promtool):
    tested = run(promtool, "test", "rules", "alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_a_rule_that_fires_too_early_is_caught(promtool, tmp_path):
    """The unit tests can fail: the same tests against a rule without its `for` do."""
    (tmp_path / "alerts.yml").write_text((PROMETHEUS / "alerts.yml").read_text().replace("for: 10m", "for: 0m"))
    (tmp_path / "alerts_test.yml").write_text((PROMETHEUS / "alerts_test.yml").read_text())
    tested = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert tested.returncode != 0 and "ModelpoolAliasDegraded" in tested.stdout + tested.stderr

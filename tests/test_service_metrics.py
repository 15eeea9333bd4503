"""Every service's own /metrics (`MODELPOOL_METRICS_PORT`): served by a real service process, saying whether it
reaches its servers through a NATS restart, answering nothing but a scrape."""

from __future__ import annotations

import httpx
import pytest

from helpers import ServiceProcess, eventually
from services.cluster.embedded import EmbeddedNats
from services.service_metrics import ServiceMetrics
from shared.net import free_port
from shared.prometheus import parse_samples

pytestmark = pytest.mark.processes


def test_what_a_service_adds_is_read_at_each_scrape_and_one_that_fails_leaves_the_others():
    metrics, seen = ServiceMetrics("projector"), {"position": 7}
    metrics.add("modelpool_projector_position", "where it is", lambda: seen["position"])
    metrics.add("modelpool_broken", "cannot be read", lambda: 1 / 0)
    metrics.add("modelpool_things_total", "by kind", lambda: {(("kind", 'a"b'),): 3}, kind="counter")
    first = {s.name: s for s in parse_samples(metrics.render())}
    seen["position"] = 9
    second = metrics.render()
    assert first["modelpool_projector_position"].value == 7 and "modelpool_projector_position 9" in second
    assert "modelpool_broken" not in second and "# TYPE modelpool_things_total counter" in second
    assert first["modelpool_things_total"].labels == {"kind": 'a"b'}  # escaped, and read back whole
    assert first["modelpool_service_info"].labels["service"] == "projector"


async def test_a_service_serves_its_metrics_and_says_when_nats_is_away_and_back(settings, migrated, tmp_path):
    port = free_port()
    with EmbeddedNats(tmp_path / "nats") as nats:
        relay = ServiceProcess("relay", {"DATABASE_URL": settings.database_url, "NATS_URL": nats.url,
                                         "MODELPOOL_NAMESPACE": settings.namespace,
                                         "MODELPOOL_METRICS_PORT": str(port)}, tmp_path)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
                async def scraped(nats_up: int) -> dict | None:
                    try:
                        answer = await client.get("/metrics")
                    except httpx.TransportError:
                        return None
                    samples = {(s.name, s.labels.get("server")): s.value for s in parse_samples(answer.text)}
                    up = samples.get(("modelpool_service_server_up", "nats"))
                    return samples if up == nats_up and ("modelpool_relay_position", None) in samples else None

                seen = await eventually(lambda: scraped(1), timeout=30)
                assert seen[("modelpool_service_server_up", "postgres")] == 1
                assert seen[("modelpool_relay_published_total", None)] >= 0
                nats.stop()
                await eventually(lambda: scraped(0), timeout=15)  # still answering, and saying so
                nats.start()
                await eventually(lambda: scraped(1), timeout=30)
                assert (await client.get("/admin/status")).status_code == 404
                assert (await client.post("/metrics")).status_code == 405
        finally:
            assert relay.stop() == 0, relay.log_path.read_text()[-3000:]

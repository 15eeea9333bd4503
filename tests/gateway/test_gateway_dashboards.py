"""The Grafana dashboards shipped in deploy/grafana: as their source builds them, and every query on metrics the
services really export (the gateway's, the simulated vLLM's, modelpool's llama.cpp engine's on the real model)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import httpx
import yaml
from gateway_support import ALIAS, SLOW
from test_gateway_clients import llama  # noqa: F401  (the real llama.cpp engine, a fixture)
from test_gateway_edge import serving

from helpers import debian_prometheus, eventually
from shared.net import free_port

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
PROMETHEUS = GRAFANA.parent / "prometheus"
TOKEN = "admin-token-for-tests-0123"


def built() -> dict[str, dict]:
    spec = importlib.util.spec_from_file_location("grafana_build", GRAFANA / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return {name: build() for name, build in module.DASHBOARDS.items()}


def exported(text: str) -> set[str]:
    """The sample names a /metrics page has or would have once it counted something (a histogram's _bucket, _sum
    and _count; a counter's _total)."""
    names = set()
    for line in text.splitlines():
        declared = re.match(r"# TYPE (\S+) (\w+)", line)
        if declared:
            name, kind = declared.groups()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def queried(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return {m.group(0) for e in exprs for m in re.finditer(r"\b(modelpool|vllm|llamacpp):[A-Za-z0-9_]+", e)}


def test_the_shipped_json_is_what_its_source_builds():
    for name, dashboard in built().items():
        assert json.loads((GRAFANA / name).read_text()) == dashboard, f"{name}: run deploy/grafana/build.py"


async def test_every_query_names_a_metric_the_services_export(engines, llama, facts, gateways):  # noqa: F811
    await serving(engines, facts)
    gateway = await gateways.start()
    async with httpx.AsyncClient(timeout=30) as client:
        pages = {"modelpool": await gateway.metrics(),
                 "vllm": (await client.get(f"{engines[SLOW][0].url}/metrics")).text,
                 "llamacpp": (await client.get(f"{llama.url}/metrics")).text}
    available = {prefix: exported(text) for prefix, text in pages.items()}
    dashboards = built()
    assert {"pool.json", "alias.json", "engines.json"} <= set(dashboards)
    for name, dashboard in dashboards.items():
        names = queried(dashboard)
        assert names, name
        missing = {n for n in names if n not in available[n.split(":")[0]]}
        assert not missing, f"{name} queries metrics nobody exports: {sorted(missing)}"
    engine_queries = queried(dashboards["engines.json"])
    assert any(n.startswith("vllm:") for n in engine_queries) and any(n.startswith("llamacpp:") for n in engine_queries)


async def test_a_real_prometheus_scrapes_the_gateway_and_the_engines_and_answers_every_query(engines, facts, gateways,
                                                                                             tmp_path):
    """Debian's Prometheus on the shipped configuration (ports and token put in): it finds the engines through the
    admin API, scrapes them and the gateway, and answers every dashboard query and alert expression."""
    await serving(engines, facts)
    admin_port, prometheus_port = free_port(), free_port()
    gateway = await gateways.start(admin_token=TOKEN, admin_port=admin_port)
    config = (PROMETHEUS / "prometheus.yml").read_text().replace("127.0.0.1:8000", gateway.url.removeprefix("http://"))
    (tmp_path / "prometheus.yml").write_text(config.replace("127.0.0.1:8001", f"127.0.0.1:{admin_port}"))
    (tmp_path / "alerts.yml").write_text((PROMETHEUS / "alerts.yml").read_text())
    (tmp_path / "admin-token").write_text(TOKEN)
    server = subprocess.Popen([str(debian_prometheus() / "prometheus"), "--config.file=prometheus.yml",
                               f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=(tmp_path / "log").open("wb"))
    api = f"http://127.0.0.1:{prometheus_port}/api/v1"
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            async def all_up() -> bool:
                try:
                    active = (await client.get(f"{api}/targets")).json()["data"]["activeTargets"]
                except (httpx.HTTPError, KeyError, ValueError):
                    return False
                jobs = {(t["labels"]["job"], t["labels"].get("instance_id")) for t in active if t["health"] == "up"}
                return {("modelpool-gateway", None), ("modelpool-engines", "f1"), ("modelpool-engines", "v1")} <= jobs

            try:
                await eventually(all_up, timeout=60, interval=0.5)
            except AssertionError:
                seen = (await client.get(f"{api}/targets")).json()["data"]
                raise AssertionError(f"targets not up: {seen}\n{(tmp_path / 'log').read_text()[-2000:]}") from None
            state = await eventually(lambda: query(client, api, "max by (alias, state) (modelpool:alias_routing_state) == 1"),
                                     timeout=30, interval=0.5)
            assert [(s["metric"]["alias"], s["metric"]["state"]) for s in state] == [(ALIAS, "FAST_ONLY")]
            running = await query(client, api, 'vllm:num_requests_running{alias="tiny",instance_id="v1"}')
            assert running and running[0]["metric"]["backend"] == "vllm"  # the engines carry what they serve

            exprs = [t["expr"].replace("$alias", ALIAS) for d in built().values() for p in d["panels"]
                     for t in p["targets"]]
            exprs += [r["expr"] for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
                      for r in g["rules"]]
            for expr in exprs:
                answer = (await client.get(f"{api}/query", params={"query": expr})).json()
                assert answer["status"] == "success", (expr, answer)
    finally:
        server.terminate()
        server.wait(timeout=30)


async def query(client: httpx.AsyncClient, api: str, expr: str) -> list[dict]:
    answer = (await client.get(f"{api}/query", params={"query": expr})).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]

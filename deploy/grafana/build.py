"""Writes the Grafana dashboards in this directory (pool.json, alias.json, engines.json) from the panels below.

    .venv/bin/python deploy/grafana/build.py

The JSON files are what Grafana imports (Dashboards > Import, or provisioning);
this script is their source. Every query names metrics the services export:
the gateway's `modelpool:` ones, and the engines' own (`vllm:` as vLLM and the
simulated vLLM name them, `llamacpp:` as llama.cpp's servers do);
tests/gateway/test_gateway_dashboards.py checks them against real /metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
          width: int = 12, description: str = "") -> dict[str, Any]:
    return {"type": kind, "title": title, "description": description, "datasource": DATASOURCE,
            "gridPos": {"w": width, "h": 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if kind == "timeseries" else {},
            "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": DATASOURCE}
                        for i, (expr, legend) in enumerate(targets)]}


def dashboard(uid: str, title: str, panels: list[dict[str, Any]], variables: list[dict[str, Any]]) -> dict[str, Any]:
    x = y = 0
    for i, p in enumerate(panels):
        p["id"] = i + 1
        w = p["gridPos"]["w"]
        if x + w > 24:
            x, y = 0, y + 8
        p["gridPos"].update(x=x, y=y)
        x += w
    return {"uid": uid, "title": title, "tags": ["modelpool"], "timezone": "utc", "schemaVersion": 38,
            "version": 1, "refresh": "5s", "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                     "label": "Prometheus"}, *variables]},
            "panels": panels}


def alias_variable(metric: str) -> dict[str, Any]:
    return {"name": "alias", "type": "query", "datasource": DATASOURCE, "label": "alias", "refresh": 2,
            "query": {"query": f"label_values({metric}, alias)", "refId": "alias"},
            "definition": f"label_values({metric}, alias)"}


def pool() -> dict[str, Any]:
    return dashboard("modelpool-pool", "modelpool: the pool", [
        panel("Requests per second, by alias", [("sum by (alias) (rate(modelpool:requests_total[1m]))", "{{alias}}")],
              "reqps"),
        panel("Requests not answered, by outcome", [(
            'sum by (alias, outcome) (rate(modelpool:requests_total{outcome!="ok"}[5m]))', "{{alias}} {{outcome}}")],
              "reqps", description="client_error, engine_error, unreachable, hold_expired, queue_full, queue_timeout, "
                                   "gateway_error, client_left"),
        panel("Routing state", [("max by (alias, state) (modelpool:alias_routing_state) == 1", "{{alias}} {{state}}")],
              kind="state-timeline"),
        panel("Share of traffic to vLLM", [("max by (alias) (modelpool:alias_vllm_share)", "{{alias}}")],
              "percentunit"),
        panel("Instances, by backend and state", [("sum by (backend, state) (modelpool:instances)",
                                                    "{{backend}} {{state}}")]),
        panel("Workers", [("max by (status) (modelpool:workers)", "{{status}}")]),
        panel("Requests waiting in the gateways", [("sum by (alias) (modelpool:num_requests_waiting)", "{{alias}}")]),
        panel("Cold starts (5 min)", [("sum by (alias) (increase(modelpool:cold_starts_total[5m]))", "{{alias}}")]),
    ], [])


def alias() -> dict[str, Any]:
    a = 'alias="$alias"'
    return dashboard("modelpool-alias", "modelpool: an alias", [
        panel("Routing state", [(f"max by (state) (modelpool:alias_routing_state{{{a}}}) == 1", "{{state}}")],
              kind="state-timeline", width=24),
        panel("Arrivals per second, by backend that answered",
              [(f"sum by (backend) (rate(modelpool:requests_total{{{a}}}[1m]))", "{{backend}}")], "reqps"),
        panel("Share of traffic to vLLM (the mix weight)", [(f"max(modelpool:alias_vllm_share{{{a}}})", "vLLM")],
              "percentunit"),
        panel("Time to first token, p50 and p95", [
            (f"histogram_quantile(0.5, sum by (le, backend) (rate(modelpool:time_to_first_token_seconds_bucket{{{a}}}[5m])))",
             "p50 {{backend}}"),
            (f"histogram_quantile(0.95, sum by (le, backend) (rate(modelpool:time_to_first_token_seconds_bucket{{{a}}}[5m])))",
             "p95 {{backend}}")], "s"),
        panel("End to end, p95", [(
            f"histogram_quantile(0.95, sum by (le, backend) (rate(modelpool:e2e_request_latency_seconds_bucket{{{a}}}[5m])))",
            "{{backend}}")], "s"),
        panel("Queue time, p95, by how the wait ended", [(
            f"histogram_quantile(0.95, sum by (le, outcome) (rate(modelpool:request_queue_time_seconds_bucket{{{a}}}[5m])))",
            "{{outcome}}")], "s"),
        panel("Time per output token, p95", [(
            f"histogram_quantile(0.95, sum by (le, backend) "
            f"(rate(modelpool:request_time_per_output_token_seconds_bucket{{{a}}}[5m])))", "{{backend}}")], "s"),
        panel("Requests running and waiting", [
            (f"sum by (backend) (modelpool:num_requests_running{{{a}}})", "running {{backend}}"),
            (f"sum(modelpool:num_requests_waiting{{{a}}})", "waiting")]),
        panel("Instances per tier and state", [(f"sum by (backend, state) (modelpool:instances{{{a}}})",
                                                "{{backend}} {{state}}")]),
        panel("Retries, by reason", [(f"sum by (reason) (rate(modelpool:retries_total{{{a}}}[5m]))", "{{reason}}")],
              "reqps"),
        panel("Sessions moved, and their KV", [
            (f"sum by (reason) (rate(modelpool:session_migrations_total{{{a}}}[5m]))", "moved: {{reason}}"),
            (f"sum by (outcome) (rate(modelpool:session_kv_moves_total{{{a}}}[5m]))", "KV {{outcome}}")], "ops"),
    ], [alias_variable("modelpool:requests_total")])


def engines() -> dict[str, Any]:
    return dashboard("modelpool-engines", "modelpool: engines", [
        panel("Requests running", [("sum by (instance) (vllm:num_requests_running)", "vLLM {{instance}}"),
                                   ("sum by (instance) (llamacpp:requests_processing)", "llama.cpp {{instance}}")]),
        panel("Requests waiting in the engine", [
            ("sum by (instance) (vllm:num_requests_waiting)", "vLLM {{instance}}"),
            ("sum by (instance) (llamacpp:requests_deferred)", "llama.cpp {{instance}}")]),
        panel("Generated tokens per second", [
            ("sum by (instance) (rate(vllm:generation_tokens_total[1m]))", "vLLM {{instance}}"),
            ("sum by (instance) (rate(llamacpp:tokens_predicted_total[1m]))", "llama.cpp {{instance}}")]),
        panel("Prompt tokens per second", [
            ("sum by (instance) (rate(vllm:prompt_tokens_total[1m]))", "vLLM {{instance}}"),
            ("sum by (instance) (rate(llamacpp:prompt_tokens_total[1m]))", "llama.cpp {{instance}}")]),
        panel("KV cache in use", [("max by (instance) (vllm:kv_cache_usage_perc)", "vLLM {{instance}}"),
                                  ("max by (instance) (llamacpp:kv_cache_usage_ratio)", "llama.cpp {{instance}}")],
              "percentunit"),
        panel("Prefix cache hits (vLLM: of blocks asked; llama.cpp: of prompt tokens reused)", [
            ("sum by (instance) (rate(vllm:prefix_cache_hits_total[5m])) "
             "/ sum by (instance) (rate(vllm:prefix_cache_queries_total[5m]))", "vLLM {{instance}}"),
            ("sum by (instance) (rate(llamacpp:prompt_tokens_reused_total[5m])) "
             "/ sum by (instance) (rate(llamacpp:prompt_tokens_total[5m]))", "llama.cpp {{instance}}")],
              "percentunit"),
        panel("Time to first token in the engine, p95", [
            ("histogram_quantile(0.95, sum by (le, instance) (rate(vllm:time_to_first_token_seconds_bucket[5m])))",
             "vLLM {{instance}}"),
            ("histogram_quantile(0.95, sum by (le, instance) (rate(llamacpp:time_to_first_token_seconds_bucket[5m])))",
             "llama.cpp {{instance}}")], "s"),
        panel("vLLM sleep state", [("max by (instance, sleep_state) (vllm:engine_sleep_state) == 1",
                                    "{{instance}} {{sleep_state}}")], kind="state-timeline"),
    ], [])


DASHBOARDS = {"pool.json": pool, "alias.json": alias, "engines.json": engines}


def main() -> None:
    for name, build in DASHBOARDS.items():
        (HERE / name).write_text(json.dumps(build(), indent=1) + "\n")
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()

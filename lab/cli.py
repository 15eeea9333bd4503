"""`modelpool lab`: what would a policy do to this traffic, and what would it cost?

    modelpool lab run --workload diurnal --set autoscaling_policy=heteroscale --plot lab.png
    modelpool lab compare --workload bursty --policies hybrid,heteroscale,utilization,latency,periodic \\
        --out results/bursty --plot bursty.png

Each run simulates the pool file's alias (default `config/lab.yaml`) in
virtual time with the pool's own controller, placement and router code
(`lab/cluster.py`), and reports per policy: TTFT and E2E p50/p95/p99, SLO
attainment, throughput, scale actions and routing switches, lost requests,
GPU-memory-seconds and the objective of seed 000 §13.4. `--out` writes the
JSON summary, each policy's scaling log (seed 001's `time,action,target,status`
plus the reason) and its run record (for `modelpool calibrate`); `--debug`
prints every decision as it is made.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lab import workloads
from lab.config import LabSettings, apply_sets, load_lab_pool, parse_sets
from lab.results import RunResult, run
from shared.contracts.config import ConfigError
from shared.contracts.policies import POLICY_NAMES

DEFAULT_POOL = "config/lab.yaml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelpool lab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "simulate one policy"), ("compare", "simulate several policies on the same workload")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--pool", default=DEFAULT_POOL, help=f"pool file (default {DEFAULT_POOL})")
        p.add_argument("--alias", help="the alias to simulate (default: the pool file's first)")
        p.add_argument("--workload", default="diurnal",
                       help=f"{', '.join(workloads.SHAPES)}, or a trace file (.jsonl) (default diurnal)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                       help="override: autoscaling_policy=NAME, autoscaling_policy.X, <policy>.X, policy.X, "
                            "lab.X, workload.X, router.X")
        p.add_argument("--out", type=Path, help="directory for summary.json and scaling/<policy>.log")
        p.add_argument("--plot", type=Path, help="write the instances-and-load figure here (PNG)")
        p.add_argument("--debug", action="store_true", help="print every decision as it is made")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        if name == "compare":
            p.add_argument("--policies", default=",".join(POLICY_NAMES),
                           help=f"comma-separated (default {','.join(POLICY_NAMES)})")
    return parser


def run_policies(args: argparse.Namespace, policies: list[str]) -> tuple[str, list[RunResult]]:
    pool = load_lab_pool(args.pool)
    sets = parse_sets(args.sets)
    name, trace = workloads.load(args.workload, args.seed, sets["workload"])
    if not trace:
        raise ConfigError("workload", f"{name} has no requests")
    results = []
    for policy in policies:
        per_run = {k: dict(v) for k, v in sets.items()}
        if policy:
            per_run["autoscaling_policy"] = {**per_run["autoscaling_policy"], "name": policy}
        if args.debug:
            per_run["autoscaling_policy"]["debug"] = True
        alias, pool_for_run, lab = apply_sets(pool, args.alias, per_run, LabSettings(seed=args.seed))
        horizon = max(r.delay_s for r in trace if r.turn == 0) + lab.drain_s
        label = alias.autoscaling_policy.name
        bar = None if args.quiet else tqdm(total=round(horizon), unit="vs", desc=f"{label:>11}", file=sys.stderr,
                                           leave=True, mininterval=0.5)

        def progress(t: float, bar: Any = bar) -> None:
            if bar is not None:
                bar.update(max(0, min(round(t), bar.total) - bar.n))

        result = run(alias, pool_for_run.controller, lab, trace, progress=progress,
                     on_decision=print_decision if args.debug else None)
        if bar is not None:
            bar.update(bar.total - bar.n)
            bar.close()
        results.append(result)
    return name, results


def print_decision(t: float, decision: Any) -> None:
    actions = ", ".join(f"{a.action.value} {a.instance_id}" for a in decision.actions) or "no command"
    routing = f" {decision.routing.from_state.value}->{decision.routing.to_state.value}" if decision.routing else ""
    print(f"[{t:9.1f}]{routing} targets {({b.value: n for b, n in decision.targets.items()})} "
          f"{decision.targets_reason} | {actions}", file=sys.stderr)


def table(results: list[RunResult]) -> str:
    head = ("policy", "requests", "lost", "SLO", "TTFT p50/p95/p99 (s)", "E2E p50/p95/p99 (s)", "req/s",
            "scale actions", "switches", "GPU GB·h", "objective")
    rows = [head]
    for r in results:
        s = r.summary
        rows.append((r.policy, str(s["requests"]), str(s["lost"]), f"{s['slo_attainment']:.1%}",
                     "/".join(_f(s["ttft_s"][k]) for k in ("p50", "p95", "p99")),
                     "/".join(_f(s["e2e_s"][k]) for k in ("p50", "p95", "p99")), f"{s['throughput_rps']:.2f}",
                     str(s["scale_actions"]), str(s["routing_switches"] + s["session_moves"]),
                     f"{s['gpu_mem_s'] / 3600:.1f}", f"{s['objective']:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_out(out: Path, workload: str, results: list[RunResult]) -> None:
    (out / "scaling").mkdir(parents=True, exist_ok=True)
    for r in results:
        lines = ["time,action,target,status,reason", *(line.csv() for line in r.log)]
        (out / "scaling" / f"{r.policy}.log").write_text("\n".join(lines) + "\n")
        r.record.write(out / f"record-{r.policy}.json")  # what `modelpool calibrate --record` reads
    summary = {"workload": workload, "runs": {r.policy: r.summary for r in results}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    policies = [""] if args.command == "run" else [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p and p not in POLICY_NAMES]
    if unknown:
        raise ConfigError("--policies", f"unknown {', '.join(unknown)}; known: {', '.join(POLICY_NAMES)}")
    name, results = run_policies(args, policies)
    print(f"workload {name}: {results[0].summary['requests']} requests; engines: "
          f"{', '.join(f'{b} = {e}' for b, e in results[0].summary['engines'].items())}")
    print(table(results))
    if args.out:
        write_out(args.out, name, results)
        print(f"wrote {args.out / 'summary.json'} and {args.out / 'scaling'}/<policy>.log")
    if args.plot:
        from lab.plots import plot_runs

        plot_runs(results, args.plot, f"modelpool lab: {name}, seed {args.seed}")
        print(f"wrote {args.plot}")
    print(json.dumps({r.policy: r.summary for r in results}))
    return 0

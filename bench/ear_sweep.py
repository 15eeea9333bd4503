"""Benchmark: EAR's sensitivity to arrival rate, skew, KV size, `t_hot_tokens` and `t_cool_s` (seed 004).

One parameter at a time moves away from the comparison's defaults
(`bench/ear.py`: 500 sessions over 120 s, Pareto alpha 2.0, 262,144 KV
tokens per engine, `t_hot_tokens` 4096, `t_cool_s` 30 trace seconds). Where
the workload changes (rate, skew, KV size) EAR runs beside kv-aware, the best
baseline of the comparison; where only EAR's thresholds change, EAR alone.
Each run is `bench/ear.py`'s: fresh SIMULATED vLLM engines, the real gateway,
the trace replayed closed loop, sessions' KV moved over the engines' internal
ports.

    .venv/bin/python bench/ear_sweep.py --plot docs/img/ear_sweep.png

Progress on stderr; the last line on stdout is the JSON summary (one row per run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ear import agentic_replay, run_router, say  # noqa: E402

from shared.contracts.config import DEFAULT_T_COOL_S, DEFAULT_T_HOT_TOKENS  # noqa: E402
from simulation.agentic import AgenticShape, generate_agentic  # noqa: E402

DEFAULTS = {"sessions": 500, "alpha": 2.0, "kv_cache_tokens": 262_144,
            "t_hot_tokens": DEFAULT_T_HOT_TOKENS, "t_cool_s": DEFAULT_T_COOL_S}
WORKLOAD = ("sessions", "alpha", "kv_cache_tokens")
SWEEP: dict[str, list[float]] = {
    "sessions": [250, 1000],
    "alpha": [1.5, 3.0],
    "kv_cache_tokens": [131_072, 524_288],
    "t_hot_tokens": [1024, 2048, 8192, 16384],
    "t_cool_s": [10, 90],
}


def points() -> list[tuple[str, float, tuple[str, ...]]]:
    out: list[tuple[str, float, tuple[str, ...]]] = [("default", 0, ("ear", "kv-aware"))]
    for name, values in SWEEP.items():
        out += [(name, v, ("ear", "kv-aware") if name in WORKLOAD else ("ear",)) for v in values]
    return out


def base_args(**overrides: float) -> argparse.Namespace:
    return argparse.Namespace(engines=8, speedup=4.0, span_s=120.0, new_input_tokens=AgenticShape.new_input_tokens,
                              seed=1, d_1=0.0004, max_model_len=65_536, timeout_s=900.0, kv_moves=True,
                              kv_transfer_gb_s=10.0, router_configs={}, **{**DEFAULTS, **overrides})


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(SWEEP)
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 6.5), squeeze=False)
    default = {r["router"]: r for r in rows if r["parameter"] == "default"}
    for col, name in enumerate(names):
        for router, style in (("ear", "o-"), ("kv-aware", "s--")):
            series = sorted([(DEFAULTS[name], default[router])] if router in default else [], key=lambda p: p[0])
            series += [(r["value"], r) for r in rows if r["parameter"] == name and r["router"] == router]
            series.sort(key=lambda p: p[0])
            if len(series) < 2:
                continue
            xs = [x for x, _ in series]
            axes[0][col].plot(xs, [r["ttft_p90_s"] for _, r in series], style, label=router)
            axes[1][col].plot(xs, [r["apc_of_bound"] for _, r in series], style, label=router)
        axes[0][col].set_title(name)
        axes[1][col].set_xlabel(name)
        if name in ("sessions", "kv_cache_tokens", "t_hot_tokens"):
            for row in axes:
                row[col].set_xscale("log", base=2)
        axes[1][col].axhline(0.97, color="grey", lw=0.8, ls=":")
    axes[0][0].set_ylabel("TTFT p90, trace s")
    axes[1][0].set_ylabel("APC / intra-session bound")
    axes[0][0].legend()
    fig.suptitle("EAR sensitivity (8 SIMULATED vLLM engines through the real gateway)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    rows: list[dict] = []
    todo = points()
    with tempfile.TemporaryDirectory(prefix="bench-ear-sweep-") as tmp:
        for i, (name, value, routers) in enumerate(todo, 1):
            run_args = base_args(**({} if name == "default" else {name: value}))
            shape = AgenticShape(sessions=int(run_args.sessions), span_s=run_args.span_s, alpha=run_args.alpha,
                                 new_input_tokens=run_args.new_input_tokens, max_turns=32)
            trace = generate_agentic(shape, run_args.seed)
            run_args.kv_cache_tokens = int(run_args.kv_cache_tokens)
            run_args.t_hot_tokens = int(run_args.t_hot_tokens)
            for router in routers:
                say(f"sweep point {i}/{len(todo)}: {name}={value:g} {router}")
                r = asyncio.run(run_router(router, run_args, agentic_replay(trace, run_args.speedup), len(trace),
                                           Path(tmp)))
                row = {"parameter": name, "value": value, "router": router, "requests": len(trace),
                       "ttft_p90_s": r["ttft_s"]["p90"], "worst_instance_ttft_p90_s": r["instance_ttft_p90_s"]["max"],
                       "apc": r["apc"], "apc_upper_bound": r["apc_upper_bound_intra_session"],
                       "apc_of_bound": round(r["apc"] / r["apc_upper_bound_intra_session"], 3),
                       "amplification": r["amplification"], "migrations": r["migrations"],
                       "kv_moves": r["kv_moves"], "thrash_sessions": r["thrash_sessions"], "failed": r["failed"]}
                rows.append(row)
                say(json.dumps(row))
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps({"engine": "simulated-vllm", "defaults": DEFAULTS, "rows": rows}))


if __name__ == "__main__":
    main()

"""Benchmark: the decode simulator's speed and the simulated engine's capacity on one core.

Part 1, simulator speed (no HTTP), measured by `simulation.speed.measure_sim_speed`:
the default seed-002 config at arrival rate x1 and x100 (memory and budget scaled
with it), batches/s and requests/s of `DecodeSystem`, and batches/s as the number
of RUNNING requests grows.

Part 2, engine capacity: `modelpool engine sim --profile vllm` with its default
timing (d_0 = 12 ms, d_1 = 40 us per token) runs in a subprocess pinned to CPU 0;
this process, pinned to CPU 1, holds N raw HTTP streams (`ignore_eos`, long
answers) and ramps N. At each level it measures, over a window:

- tokens/s received by the clients;
- the engine's own drift: wall time / scheduled batch time - 1 (from /sim/status);
- the client-observed drift: scheduled inter-token time / observed one - 1, i.e.
  how far the streams' pace falls behind what the decode model scheduled.

The engine holds a level while both drifts stay within 5 %. The peer named for
comparison is the decode model itself: the ratio reported is observed tokens/s
over the tokens/s the model scheduled at that level.

    .venv/bin/python bench/sim.py [--levels 100,250,...] [--window 3]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.net import free_port  # noqa: E402

DRIFT_LIMIT = 0.05
TOKEN_MARK = b'"text":"'


# --------------------------------------------------------------------------- engine capacity


class StreamCounter(asyncio.Protocol):
    """One raw HTTP/1.1 streaming request; counts token events without parsing JSON."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.tokens = 0
        self.closed = False
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        buf = self._tail + data
        self.tokens += buf.count(TOKEN_MARK)
        self._tail = buf[-(len(TOKEN_MARK) - 1):]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True


def stream_request(port: int, i: int, model: str) -> bytes:
    body = json.dumps({
        "model": model, "prompt": f"benchmark stream {i}: tell a long story", "max_tokens": 30000,
        "ignore_eos": True, "stream": True,
    }).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


@dataclass
class Level:
    streams: int
    client_tokens_per_s: float
    scheduled_tokens_per_s: float
    engine_drift: float
    client_drift: float
    engine_cpu: float
    client_cpu: float
    batches_per_s: float
    extra: dict = field(default_factory=dict)

    @property
    def holds(self) -> bool:
        return self.engine_drift <= DRIFT_LIMIT and self.client_drift <= DRIFT_LIMIT


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure_window(http: httpx.AsyncClient, streams: list[StreamCounter], pid: int, n: int,
                         window: float) -> Level:
    s0 = (await http.get("/sim/status")).json()
    t0, tok0, e0, c0 = time.perf_counter(), sum(s.tokens for s in streams), _cpu_seconds(pid), _own_cpu()
    await asyncio.sleep(window)
    s1 = (await http.get("/sim/status")).json()
    t1, tok1, e1, c1 = time.perf_counter(), sum(s.tokens for s in streams), _cpu_seconds(pid), _own_cpu()
    wall = t1 - t0
    scheduled = s1["scheduled_wall_s"] - s0["scheduled_wall_s"]
    batches = s1["batches"] - s0["batches"]
    running = s1["requests"]["running"]
    scheduled_itl = scheduled / batches if batches else float("inf")
    client_tps = (tok1 - tok0) / wall
    scheduled_tps = running / scheduled_itl if batches else 0.0
    return Level(
        streams=n,
        client_tokens_per_s=client_tps,
        scheduled_tokens_per_s=scheduled_tps,
        engine_drift=wall / scheduled - 1 if scheduled else float("inf"),
        client_drift=scheduled_tps / client_tps - 1 if client_tps else float("inf"),
        engine_cpu=(e1 - e0) / wall,
        client_cpu=(c1 - c0) / wall,
        batches_per_s=batches / wall,
        extra={"running": running, "closed_streams": sum(s.closed for s in streams),
               "schedule_resets": s1["schedule_resets"] - s0["schedule_resets"],
               "scheduled_itl_ms": scheduled_itl * 1000},
    )


async def ramp(port: int, pid: int, levels: list[int], warmup: float, window: float, model: str) -> list[Level]:
    loop = asyncio.get_running_loop()
    streams: list[StreamCounter] = []
    results: list[Level] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        for n in tqdm(levels, desc="engine streams", unit="level"):
            while len(streams) < n:
                batch = []
                for _ in range(min(100, n - len(streams))):
                    proto = StreamCounter(stream_request(port, len(streams) + len(batch), model))
                    batch.append(loop.create_connection(lambda p=proto: p, "127.0.0.1", port))
                    streams.append(proto)
                await asyncio.gather(*batch)
                await asyncio.sleep(0.05)
            await asyncio.sleep(warmup)
            level = await measure_window(http, streams, pid, n, window)
            if not level.holds:
                # Other processes on the machine only ever slow the engine down, so a second
                # window (the better one counts) separates a passing hiccup from a real limit.
                again = await measure_window(http, streams, pid, n, window)
                if again.engine_drift + again.client_drift < level.engine_drift + level.client_drift:
                    level = again
            results.append(level)
            tqdm.write(
                f"  {n:5d} streams: {level.client_tokens_per_s:9.0f} tok/s received, "
                f"{level.scheduled_tokens_per_s:9.0f} scheduled, "
                f"engine drift {level.engine_drift:+.1%}, client drift {level.client_drift:+.1%}, "
                f"engine cpu {level.engine_cpu:.0%}, client cpu {level.client_cpu:.0%}, "
                f"ITL {level.extra['scheduled_itl_ms']:.1f} ms, resets {level.extra['schedule_resets']}"
            )
            if not level.holds:
                break
    return results


def engine_capacity(levels: list[int], warmup: float, window: float,
                    timing: list[str]) -> tuple[list[Level], list[str]]:
    port = free_port()
    model = "bench-sim"
    cmd = [
        sys.executable, "-m", "services.cli", "engine", "sim", "--profile", "vllm", "--port", str(port),
        "--model", model, "--startup-s", "0", "--max-num-seqs", "100000", "--kv-cache-tokens", "200000000",
        "--max-model-len", "32768", "--no-prefix-caching", *timing,
    ]
    pinned = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(pinned, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"engine did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.1)
        if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > 1:
            os.sched_setaffinity(0, {1})
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:  # pragma: no cover
            runner = asyncio.run
        return runner(ramp(port, proc.pid, levels, warmup, window, model)), pinned
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def plot_ramp(results: dict[str, list[Level]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 6), sharex="col", squeeze=False)
    for col, (name, levels) in enumerate(results.items()):
        top, bottom = axes[0][col], axes[1][col]
        x = [lv.streams for lv in levels]
        top.plot(x, [lv.client_tokens_per_s for lv in levels], "o-", label="received by clients")
        top.plot(x, [lv.scheduled_tokens_per_s for lv in levels], "x--", label="scheduled by the decode model")
        top.set_ylabel("streamed tokens/s")
        top.set_title(f"Simulated vLLM engine on one core ({name} timing)")
        top.legend()
        bottom.plot(x, [100 * lv.engine_drift for lv in levels], "o-", label="engine: wall / scheduled - 1")
        bottom.plot(x, [100 * lv.client_drift for lv in levels], "x-", label="clients: scheduled / received - 1")
        bottom.axhline(100 * DRIFT_LIMIT, color="red", linestyle=":", label="5 % limit")
        bottom.set_xlabel("concurrent streams")
        bottom.set_ylabel("drift (%)")
        bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="100,250,500,750,1000,1500,2000,2500,3000,4000",
                    help="concurrent streams per ramp step, default timing")
    ap.add_argument("--stress-levels", default="100,200,300,400,500,600,800,1000",
                    help="concurrent streams per ramp step, stress timing (10 ms batches)")
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--skip-sim", action="store_true", help="only the engine capacity part")
    ap.add_argument("--plot", default=None, help="write the engine ramp as a PNG here")
    args = ap.parse_args(argv)

    out: dict[str, object] = {}
    if not args.skip_sim:
        out.update(simulator_speed())

    # default: the vLLM profile's own timing (tokens/s is bounded by the model near 1/d_1 = 25k);
    # stress: 10 ms batches whatever their size, so the engine's CPU is the only limit.
    ramps = {
        "default": ([int(x) for x in args.levels.split(",")], []),
        "stress": ([int(x) for x in args.stress_levels.split(",")], ["--d-0", "0.01", "--d-1", "0"]),
    }
    results: dict[str, list[Level]] = {}
    commands: dict[str, list[str]] = {}
    for name, (levels, timing) in ramps.items():
        tqdm.write(f"engine ramp, {name} timing")
        results[name], commands[name] = engine_capacity(levels, args.warmup, args.window, timing)

    def best(levels: list[Level]) -> Level | None:
        held = [lv for lv in levels if lv.holds]
        return max(held, key=lambda lv: lv.client_tokens_per_s) if held else None

    def table(levels: list[Level]) -> list[dict[str, object]]:
        return [
            {"streams": lv.streams, "tokens_per_s": round(lv.client_tokens_per_s),
             "scheduled_tokens_per_s": round(lv.scheduled_tokens_per_s),
             "engine_drift": round(lv.engine_drift, 4), "client_drift": round(lv.client_drift, 4),
             "engine_cpu": round(lv.engine_cpu, 3), "client_cpu": round(lv.client_cpu, 3),
             "itl_ms": round(lv.extra["scheduled_itl_ms"], 2), "holds": lv.holds}
            for lv in levels
        ]

    default, stress = best(results["default"]), best(results["stress"])
    out["engine_max_streams"] = default.streams if default else 0
    out["engine_tokens_per_s"] = round(default.client_tokens_per_s) if default else 0
    out["engine_vs_schedule_ratio"] = (
        round(default.client_tokens_per_s / default.scheduled_tokens_per_s, 3) if default else 0.0)
    out["engine_first_failing_streams"] = next((lv.streams for lv in results["default"] if not lv.holds), None)
    out["engine_stress_max_streams"] = stress.streams if stress else 0
    out["engine_stress_tokens_per_s"] = round(stress.client_tokens_per_s) if stress else 0
    out["engine_stress_first_failing_streams"] = next(
        (lv.streams for lv in results["stress"] if not lv.holds), None)
    out["engine_ramp"] = table(results["default"])
    out["engine_stress_ramp"] = table(results["stress"])
    if args.plot:
        plot_ramp(results, args.plot)
        out["engine_plot"] = args.plot
    out["engine_commands"] = {
        name: " ".join(["taskset", "-c", "0", "python", *cmd[cmd.index("-m"):]]) for name, cmd in commands.items()
    }
    print(json.dumps(out))
    return 0


# --------------------------------------------------------------------------- simulator speed


def simulator_speed() -> dict[str, object]:
    """`simulation.speed.measure_sim_speed` at lambda x1 and x100 (memory and budget scaled with it)."""
    from simulation.speed import measure_sim_speed

    runs = [measure_sim_speed(scale) for scale in tqdm((1, 100), desc="simulator speed", unit="scale")]
    for run in runs:
        tqdm.write(f"  simulator x{run['scale']}: {run['sim_batches_per_s']:.0f} batches/s, "
                   f"{run['sim_requests_per_s']:.0f} requests/s, mean running {run['mean_running']:.0f}")
    x1, x100 = runs
    return {
        "sim_batches_per_s": round(x1["sim_batches_per_s"]),
        "sim_requests_per_s": round(x1["sim_requests_per_s"]),
        "sim_x100_batches_per_s": round(x100["sim_batches_per_s"]),
        "sim_x100_requests_per_s": round(x100["sim_requests_per_s"]),
        "sim_runs": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in run.items() if k != "scaling"}
                     for run in runs],
        "sim_batches_per_s_by_running": {
            int(p["running"]): round(p["batches_per_s"]) for p in x1["scaling"]},
        "sim_decode_tokens_per_s_by_running": {
            int(p["running"]): round(p["tokens_per_s"]) for p in x1["scaling"]},
    }


if __name__ == "__main__":
    sys.exit(main())

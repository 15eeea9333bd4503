"""Benchmark: the llama.cpp engine against llama.cpp's own C++ server, llama-cpp-python's server and the bare
decode limit.

All run in this one invocation, on the same model, thread count and number of sequence slots:

- llama-server: llama.cpp's own server (continuous batching over `--parallel` slots), built from the very
  llama.cpp the binding vendors (`services/engines/llama_server/binary.py`): the peer people run in production;
- stock: `python -m llama_cpp.server --interrupt_requests False` (llama-cpp-python's
  server, told to queue concurrent requests instead of aborting the running stream; `--skip-stock` leaves it out);
- limit: a bare loop of batched `llama_decode` calls with N sequences (one token
  each, greedy argmax, no HTTP, no scheduling; prefill untimed): the most any
  engine on this library reaches on this machine;
- ours: `modelpool engine llama.cpp` over HTTP.

Each level c in --concurrency runs c client streams for --seconds, each sending
chat requests back to back (greedy, --max-tokens output with end-of-generation
suppressed by logit_bias so every answer has the same length). Streams a server
starts in different steps drift apart, so requests arrive one at a time while
others decode, as a server's clients do; streams it starts in one step end in one
step and come back as a burst (at 8 streams, our engine's usually do: there TTFT
is mostly how a burst is started from idle). With --slots 8, 16 streams are twice
what either server decodes at once: the overload level, where it shows who queues
and who refuses. Reported: aggregate output tokens/s (over all repeats, and the
spread of the ratio to llama-server repeat by repeat), client-side TTFT
p50/p95/p99 over every request of every repeat, refused or failed requests, and
retried ones (a connection the server dropped before answering is retried once,
as OpenAI's client does). Each repeat measures every system once, in an order
rotated by one each repeat, so a drift in the machine lands on each alike.
The last line printed is one JSON object.

    .venv/bin/python bench/llamacpp_engine.py [--threads 2] [--slots 8] [--concurrency 1,4,8,16] [--seconds 10] [--repeats 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engines.llama_server.binary import llama_server_binary  # noqa: E402
from services.engines.llamacpp.llama_backend import LlamaModelConfig, LlamaBackend  # noqa: E402
from services.engines.llamacpp.model_files import default_model_path  # noqa: E402
from services.engines.llamacpp.scheduler import SeqWork  # noqa: E402
from shared.net import free_port  # noqa: E402

STOCK_EXTRAS = ("fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
TOPICS = [
    "the sea", "a lighthouse", "a train journey", "winter in the mountains", "a lost cat", "the moon",
    "a busy market", "an old library", "a thunderstorm", "a desert night", "a small bakery", "a robot gardener",
    "a river boat", "autumn leaves", "a city at dawn", "a chess game",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def messages(i: int, tag: str = "") -> list[dict[str, str]]:
    """Request `i`'s prompt; with a `tag` (unique per request) leading the user's words, no two prompts share more
    than the chat template's opening, so no engine's prompt cache answers one from another."""
    return [{"role": "user", "content": f"{tag}Write a short story about {TOPICS[i % len(TOPICS)]}."}]


# --------------------------------------------------------------------------- limit


class BareDecodeLimit:
    """The most any engine on this library reaches here: a bare loop of batched llama_decode steps."""

    def __init__(self, model: Path, threads: int, n_seq_max: int, n_ctx: int) -> None:
        from services.engines.llamacpp.chat_template import ChatTemplate

        self.backend = LlamaBackend(LlamaModelConfig(model, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=512, threads=threads))
        tmpl = ChatTemplate(self.backend.chat_template())
        self.prompts = [self.backend.tokenize(tmpl.render(messages(i)), add_special=True) for i in range(n_seq_max)]

    def measure(self, n: int, max_tokens: int, rounds: int) -> float:
        """Decode-only tokens/s: prompts are prefilled untimed, then max_tokens steps of N tokens are timed.

        Prefill is left out on purpose: a server that reuses cached prompt prefixes pays
        less of it, so only the decode steps bound every engine on this library.
        """
        backend = self.backend
        tokens = 0
        elapsed = 0.0
        for r in range(rounds):
            prompts = [self.prompts[(s + r * n) % len(self.prompts)] for s in range(n)]
            for s in range(n):
                backend.seq_rm(s, 0)
            nxt: list[int] = []
            group: list[SeqWork] = []
            for s in range(n + 1):  # whole prompts, as many per call as the 512-token batch holds
                if s == n or sum(len(w.tokens) for w in group) + len(prompts[s]) > 512:
                    out = backend.decode(group)
                    nxt += [int(backend.logits(i).argmax()) for i in out]
                    group = []
                if s < n:
                    group.append(SeqWork(s, s, prompts[s], 0, True, "prefill"))
            pos = [len(p) for p in prompts]
            t0 = time.perf_counter()
            for _step in range(max_tokens):
                out = backend.decode([SeqWork(s, s, [nxt[s]], pos[s], True, "decode") for s in range(n)])
                for s in range(n):
                    nxt[s] = int(backend.logits(out[s]).argmax())
                    pos[s] += 1
            elapsed += time.perf_counter() - t0
            tokens += n * max_tokens
        return tokens / elapsed

    def close(self) -> None:
        self.backend.close()


# --------------------------------------------------------------------------- servers


def start_server(cmd: list[str], port: int, log_path: Path, ready_path: str) -> subprocess.Popen[bytes]:
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2)
            if r.status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError(f"server did not come up; see {log_path}")


CTX_PER_SLOT = 1024
"""Tokens of KV each sequence slot gets, in every server alike."""


def engine_command(model: Path, port: int, threads: int, slots: int, extra: list[str]) -> list[str]:
    """modelpool's engine decoding `slots` sequences at once with `CTX_PER_SLOT` tokens of KV each, as the peers get."""
    return [
        sys.executable, "-m", "services.cli", "engine", "llama.cpp", "--model", str(model), "--port", str(port),
        "--threads", str(threads), "--n-seq-max", str(slots), "--n-ctx", str(slots * CTX_PER_SLOT),
        "--max-running", str(slots), "--max-batch-size", str(slots), "--model-alias", "bench", "--log-level", "warning",
        *extra,
    ]


def llama_server_command(model: Path, port: int, threads: int, slots: int, extra: list[str]) -> list[str]:
    """llama-server decoding `slots` sequences at once (continuous batching) with `CTX_PER_SLOT` tokens of KV each."""
    return [
        str(llama_server_binary()), "--model", str(model), "--port", str(port), "--host", "127.0.0.1",
        "--threads", str(threads), "--parallel", str(slots), "--ctx-size", str(slots * CTX_PER_SLOT), "--cont-batching",
        "--alias", "bench", "--no-webui", *extra,
    ]


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


async def one_stream(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int,
                     eog_bias: dict[str, float], unique: bool) -> tuple[float, int, int]:
    """One streamed chat request: (TTFT from the first send, content chunks, retries).

    A server that closes a kept-alive connection just as the next request goes out on it (llama-server does, now
    and then) has answered nothing: the request is sent once more on a new connection, as OpenAI's client retries
    a dropped connection, and the retry is counted. TTFT counts from the first send, as that client's caller sees it.
    """
    body = {
        "model": model,
        "messages": messages(i, f"[{uuid.uuid4().hex[:8]}] " if unique else ""),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "logit_bias": eog_bias,
    }
    t0 = time.perf_counter()
    ttft = None
    n = 0
    for retries in range(2):
        answered = False
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                answered = True
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        if choice.get("delta", {}).get("content"):
                            n += 1
                            if ttft is None:
                                ttft = time.perf_counter() - t0
            return (ttft if ttft is not None else float("nan")), n, retries
        except httpx.RemoteProtocolError:
            if answered or retries:
                raise
    raise AssertionError("unreachable")


async def load_level(url: str, model: str, c: int, seconds: float, max_tokens: int, eog_bias: dict[str, float],
                     unique: bool = False) -> dict:
    """c streams sending requests back to back for `seconds` (each finishes the one it has in flight); tokens/s
    over the wall time until the last one ends, and every answered request's TTFT."""
    ttfts: list[float] = []
    tokens = 0
    failed = 0
    retried = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=c + 4)) as client:
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def worker(w: int) -> None:
            nonlocal tokens, failed, retried
            k = 0
            while time.perf_counter() < deadline:
                try:
                    ttft, n, retries = await one_stream(client, url, model, w + c * k, max_tokens, eog_bias, unique)
                except (RuntimeError, httpx.HTTPError) as exc:  # refused (a full queue) or failed: counted
                    failed += 1
                    print(f"{url}: request failed: {exc!r}", file=sys.stderr)
                else:
                    ttfts.append(ttft)
                    tokens += n
                    retried += retries
                k += 1

        await asyncio.gather(*(worker(w) for w in range(c)))
        wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "ttfts": ttfts, "failed": failed, "retried": retried, "tokens": tokens,
            "wall_s": wall}


def level_result(runs: list[dict]) -> dict[str, float]:
    """The repeats of one level on one system: tokens/s over them all (every token over every repeat's wall time,
    so a slow spell of the machine weighs by its length), TTFT percentiles over every request of every repeat and
    the range of each repeat's own p99, failures and retries summed."""
    ttfts = [t for run in runs for t in run["ttfts"]]
    p99s = [percentile(run["ttfts"], 0.99) * 1000 for run in runs]
    return {
        "tokens_per_s": sum(run["tokens"] for run in runs) / sum(run["wall_s"] for run in runs),
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1000,
        "ttft_p95_ms": percentile(ttfts, 0.95) * 1000,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1000,
        "ttft_p99_ms_range": [min(p99s), max(p99s)],
        "requests": len(ttfts),
        "failed": sum(run["failed"] for run in runs),
        "retried": sum(run["retried"] for run in runs),
    }


def warm_up(url: str, model: str, eog_bias: dict[str, float]) -> None:
    """A few short requests, so model pages and caches are hot for every server alike."""
    asyncio.run(load_level(url, model, 1, 1.0, 8, eog_bias))


def plot(path: Path, levels: list[int], systems: dict[str, dict[int, dict[str, float]]], limit: dict[int, float],
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(levels, [limit[c] for c in levels], "k--", label="limit: bare batched llama_decode")
    for (name, runs), marker in zip(systems.items(), "os^"):
        ax1.plot(levels, [runs[c]["tokens_per_s"] for c in levels], f"{marker}-", label=name)
        ax2.plot(levels, [runs[c]["ttft_p50_ms"] for c in levels], f"{marker}-", label=f"{name} p50")
        ax2.plot(levels, [runs[c]["ttft_p99_ms"] for c in levels], f"{marker}:", label=f"{name} p99")
    ax1.set(xlabel="concurrent streams", ylabel="aggregate output tokens/s", xscale="log", xticks=levels, xticklabels=levels)
    ax2.set(xlabel="concurrent streams", ylabel="TTFT (ms)", xscale="log", yscale="log", xticks=levels, xticklabels=levels)
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stock_available() -> str | None:
    import importlib.util

    missing = [m for m in STOCK_EXTRAS if importlib.util.find_spec(m) is None]
    if missing:
        return (
            f"llama_cpp.server needs {', '.join(missing)}: install them with "
            f"`.venv/bin/pip install 'llama-cpp-python[server]==0.3.36' --find-links ~/.cache/modelpool/wheels` "
            f"(or: pip install fastapi sse-starlette starlette-context pydantic-settings)"
        )
    return None


OURS, SERVER, STOCK = "modelpool engine llama.cpp", "llama-server", "llama_cpp.server"
LIMIT_ROUNDS = 2
"""Rounds of --max-tokens decode steps the bare loop times per repeat."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--slots", type=int, default=8, help="sequences each server decodes at once (its default: 8)")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0, help="how long each level runs on each system, per repeat")
    ap.add_argument("--repeats", type=int, default=8,
                    help="measure each level this many times on every system, alternating (this machine's speed "
                         "drifts by tens of percent within a minute: short alternating windows share the drift)")
    ap.add_argument("--prompts", choices=("repeated", "unique"), default="repeated",
                    help="repeated: 16 prompts over and over (prompt caches answer them); unique: each request's "
                         "own (only the chat template's opening is shared)")
    ap.add_argument("--llama-server-args", default="",
                    help="more arguments for llama-server, as one string (e.g. \"--cache-ram 0\" turns its host-memory "
                         "prompt cache off)")
    ap.add_argument("--engine-args", default="",
                    help="more arguments for modelpool's engine, as one string (e.g. \"--admission-wait-ms 0\")")
    ap.add_argument("--skip-stock", action="store_true")
    ap.add_argument("--logs", type=Path, default=Path("/tmp"), help="where server logs go")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of tokens/s and TTFT against streams")
    args = ap.parse_args()
    model = args.model or default_model_path()
    levels = [int(x) for x in args.concurrency.split(",")]
    slots = args.slots
    overload = 2 * slots

    backend = LlamaBackend(LlamaModelConfig(model, n_ctx=256, n_seq_max=1, threads=1))
    eog_bias = {str(t): -100.0 for t in range(backend.n_vocab) if backend.is_eog(t)}
    backend.close()

    # Both continuous-batching servers decode `slots` sequences at once with `CTX_PER_SLOT` tokens each,
    # queueing the rest: one KV stream per sequence, as our engine keeps them.
    commands: dict[str, tuple[list[str], str]] = {}
    port = free_port()
    commands[OURS] = (engine_command(model, port, args.threads, slots, args.engine_args.split()),
                      f"http://127.0.0.1:{port}")
    port = free_port()
    commands[SERVER] = (llama_server_command(model, port, args.threads, slots, args.llama_server_args.split()),
                        f"http://127.0.0.1:{port}")
    problem = "skipped (--skip-stock)" if args.skip_stock else stock_available()
    if problem is not None:
        print(f"stock server not measured: {problem}", file=sys.stderr)
    else:
        port = free_port()
        commands[STOCK] = ([
            sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
            "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "2048",
            "--interrupt_requests", "False", "--model_alias", "bench",
        ], f"http://127.0.0.1:{port}")

    # All are up at once (idle servers cost no CPU) and each level is measured on every system
    # back to back, so drifting background load biases no one system.
    limit_loop = BareDecodeLimit(model, args.threads, max(levels), max(levels) * CTX_PER_SLOT)
    procs = []
    limit: dict[int, float] = {}
    results: dict[str, dict[int, dict[str, float]]] = {name: {} for name in commands}
    ratio_spread: dict[int, list[float]] = {}
    try:
        for name, (cmd, url) in commands.items():
            port_of = int(url.rsplit(":", 1)[1])
            procs.append(start_server(cmd, port_of, args.logs / f"bench_llamacpp_{name.split()[-1]}.log",
                                      "/v1/models" if name == STOCK else "/health"))
            warm_up(url, "bench", eog_bias)
        for c in tqdm(levels, desc="concurrency levels"):
            limit_runs: list[float] = []
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in commands}
            for repeat in range(args.repeats):
                limit_runs.append(limit_loop.measure(c, args.max_tokens, LIMIT_ROUNDS))
                names = list(commands)
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    runs[name].append(asyncio.run(load_level(commands[name][1], "bench", c, args.seconds,
                                                             args.max_tokens, eog_bias, args.prompts == "unique")))
            limit[c] = sorted(limit_runs)[len(limit_runs) // 2]
            for name in commands:
                results[name][c] = level_result(runs[name])
            ratio_spread[c] = sorted(o["tokens_per_s"] / s["tokens_per_s"] for o, s in zip(runs[OURS], runs[SERVER]))
            tqdm.write(f"c={c}: limit {limit[c]:.1f} tok/s, " + ", ".join(
                f"{name} {results[name][c]['tokens_per_s']:.1f} tok/s" for name in commands), file=sys.stderr)
    finally:
        for proc in procs:
            stop_server(proc)
        limit_loop.close()

    ours, server = results[OURS], results[SERVER]
    print(f"model {model.name}, threads {args.threads}, {slots} slots each, max_tokens {args.max_tokens}, "
          f"{args.seconds:g} s a level, {args.prompts} prompts, {args.repeats} repeats")
    print("| streams | " + " | ".join(f"{n} tok/s" for n in commands) + " | limit tok/s | ours / llama-server (spread) | "
          + " | ".join(f"{n} TTFT p50/p99 ms" for n in commands) + " | requests (ours / llama-server) | failed | retried |")
    for c in levels:
        spread = ratio_spread[c]
        print(f"| {c} | " + " | ".join(f"{results[n][c]['tokens_per_s']:.1f}" for n in commands)
              + f" | {limit[c]:.1f} | {ours[c]['tokens_per_s'] / server[c]['tokens_per_s']:.2f} "
              f"({spread[0]:.2f}–{spread[-1]:.2f}) | "
              + " | ".join(f"{results[n][c]['ttft_p50_ms']:.0f} / {results[n][c]['ttft_p99_ms']:.0f}" for n in commands)
              + f" | {ours[c]['requests']} / {server[c]['requests']} | {ours[c]['failed']} / {server[c]['failed']}"
              f" | {ours[c]['retried']} / {server[c]['retried']} |")

    if args.plot is not None:
        plot(args.plot, levels, results, limit,
             f"{model.name}, {args.threads} threads, {slots} slots, {args.max_tokens} tokens/answer")

    def r(x: float | None, nd: int = 3) -> float | None:
        return None if x is None else round(x, nd)

    def ratio(c: int) -> float | None:
        return r(ours[c]["tokens_per_s"] / server[c]["tokens_per_s"]) if c in ours and c in server else None

    stock = results.get(STOCK, {})
    result = {
        "slots": slots,
        "prompts": args.prompts,
        "seconds_per_level": args.seconds,
        "repeats": args.repeats,
        "llama_server_tokens_per_s_c8": r(server[8]["tokens_per_s"], 1) if 8 in server else None,
        "ratio_vs_llama_server_c1": ratio(1),
        "ratio_vs_llama_server_c8": ratio(8),
        "ratio_vs_llama_server_c16": ratio(16),
        "ratio_vs_llama_server_c8_spread": [r(x) for x in (ratio_spread[8][0], ratio_spread[8][-1])] if 8 in ratio_spread else None,
        "ours_ttft_p50_ms_c8": r(ours[8]["ttft_p50_ms"], 1) if 8 in ours else None,
        "llama_server_ttft_p50_ms_c8": r(server[8]["ttft_p50_ms"], 1) if 8 in server else None,
        "ttft_p99_ms_c8": {OURS: r(ours[8]["ttft_p99_ms"], 1), SERVER: r(server[8]["ttft_p99_ms"], 1)}
        if 8 in ours and 8 in server else None,
        "ttft_p99_ms_c8_range": {
            OURS: [r(x, 1) for x in ours[8]["ttft_p99_ms_range"]],
            SERVER: [r(x, 1) for x in server[8]["ttft_p99_ms_range"]],
        } if 8 in ours and 8 in server else None,
        "ours_ttft_p99_ms_overload": r(ours[overload]["ttft_p99_ms"], 1) if overload in ours else None,
        "llama_server_ttft_p99_ms_overload": r(server[overload]["ttft_p99_ms"], 1) if overload in server else None,
        "ttft_p99_ms_overload_range": {
            OURS: [r(x, 1) for x in ours[overload]["ttft_p99_ms_range"]],
            SERVER: [r(x, 1) for x in server[overload]["ttft_p99_ms_range"]],
        } if overload in ours and overload in server else None,
        "failed_overload": [ours[overload]["failed"], server[overload]["failed"]] if overload in ours else None,
        "retried": {name: sum(results[name][c]["retried"] for c in levels) for name in commands},
        "ratio_tokens_per_s_c1": r(ours[1]["tokens_per_s"] / stock[1]["tokens_per_s"]) if 1 in stock else None,
        "ratio_tokens_per_s_c8": r(ours[8]["tokens_per_s"] / stock[8]["tokens_per_s"]) if 8 in stock else None,
        "efficiency_c8": r(ours[8]["tokens_per_s"] / limit[8]) if 8 in ours else None,
        "ours_tokens_per_s_c8": r(ours[8]["tokens_per_s"], 1) if 8 in ours else None,
        "limit_tokens_per_s_c8": r(limit.get(8), 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

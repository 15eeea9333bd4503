"""`modelpool history ALIAS --plot`: the series gathered from the log and the bus, and the figure drawn from them."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alias_life import ALIAS, WARMING_REASON, AliasLife, F, I, R, V, at, record_a_cycle, window

from services.ops.timeline import gather_timeline
from services.ops.timeline_figure import draw_timeline, short_reason
from shared.bus.telemetry import TelemetryBus
from shared.contracts.backends import EngineKind
from shared.contracts.telemetry import GatewayWindow, HistogramRecorder, merge_windows


def gateway_window(gateway: str, start_s: float, *, arrivals: int, inflight_fast: float, inflight_slow: float,
                   ttft: list[float]) -> GatewayWindow:
    recorder = HistogramRecorder()
    for value in ttft:
        recorder.record(value)
    return GatewayWindow(gateway_id=gateway, alias=ALIAS, window_start=at(start_s), window_end=at(start_s + 2),
                         arrivals=arrivals, requests_fast=arrivals, inflight_fast=inflight_fast,
                         inflight_slow=inflight_slow, ttft_s=recorder.snapshot(), e2e_fast_s=recorder.snapshot())


async def publish_gateway_windows(bus) -> list[GatewayWindow]:
    """Two gateway replicas from 300 s to 420 s; the bus holds nothing earlier (as if it had aged out)."""
    telemetry = TelemetryBus(bus.nc, bus.js, bus.subjects)
    await telemetry.ensure()
    published = []
    for k in range(60):
        start = 300 + 2 * k
        for gateway, share in (("g1", 1.0), ("g2", 2.0)):
            w = gateway_window(gateway, start, arrivals=int(share * 2), inflight_fast=share * (1 + k % 5) / 2,
                               inflight_slow=share * 0.5 if start < 400 else 0.0, ttft=[0.1 * share, 0.2 * share])
            await telemetry.publish_window(w)
            published.append(w)
    other = gateway_window("g1", 300, arrivals=50, inflight_fast=9, inflight_slow=9, ttft=[5.0])
    await telemetry.publish_window(other.model_copy(update={"alias": "another"}))
    return published


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def cli(settings, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "DATABASE_URL": settings.database_url, "NATS_URL": settings.nats_url,
               "MODELPOOL_NAMESPACE": settings.namespace, **env}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], env=environ, capture_output=True, text=True,
                          timeout=120)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_the_timeline_gathers_states_mix_instances_and_merged_windows(store, bus, settings):
    await record_a_cycle(store)
    published = await publish_gateway_windows(bus)

    t = await gather_timeline(settings, ALIAS, at(0), at(1000))

    assert [(s.number, s.from_state, s.to_state) for s in t.switches] == [
        (1, R.COLD, R.FAST_ONLY), (2, R.FAST_ONLY, R.WARMING_VLLM), (3, R.WARMING_VLLM, R.MIXED),
        (4, R.MIXED, R.VLLM_PRIMARY), (5, R.VLLM_PRIMARY, R.FAST_ONLY), (6, R.FAST_ONLY, R.COLD)]
    assert [(s.state, s.start, s.end) for s in t.spans] == [
        (R.COLD, at(0), at(10)), (R.FAST_ONLY, at(10), at(60)), (R.WARMING_VLLM, at(60), at(100)),
        (R.MIXED, at(100), at(140)), (R.VLLM_PRIMARY, at(140), at(400)), (R.FAST_ONLY, at(400), at(900)),
        (R.COLD, at(900), at(1000))]
    assert t.spans[0].switch is None and t.spans[2].switch.reason == WARMING_REASON
    assert t.switches[5].reason == "no request for 300 s and min_replicas 0"
    assert [(s.at, s.value) for s in t.mix] == [(at(0), 0.0), (at(100), 0.2), (at(110), 0.5), (at(120), 0.8),
                                                (at(130), 1.0), (at(400), 0.0)]
    assert [(s.at, s.value) for s in t.targets[V]] == [(at(0), 0), (at(60), 1), (at(400), 0)]
    assert t.engines == {F: (EngineKind.LLAMA_CPP,), V: (EngineKind.SIMULATOR,)}

    assert t.instances_at(at(5)) == {}
    assert t.instances_at(at(12)) == {F: {I.STARTING: 1}}
    assert t.instances_at(at(95)) == {F: {I.RUNNING: 1}, V: {I.RUNNING: 1}}
    assert t.instances_at(at(550)) == {F: {I.RUNNING: 1}, V: {I.SLEEP_1: 1}}
    assert t.instances_at(at(700)) == {F: {I.RUNNING: 1}, V: {I.SLEEP_2: 1}}
    assert t.instances_at(at(802)) == {F: {I.RUNNING: 1}, V: {I.DELETING: 1}}
    assert t.instances_at(at(903)) == {F: {I.DRAINING: 1}}
    assert t.instances_at(at(999)) == {}

    # The bus's windows, the two replicas of each period merged, the other alias's left out.
    assert len(t.load) == 60 and all(w.gateways == 2 for w in t.load)
    first = t.load[0]
    assert first.window_start == at(300) and first.arrivals == 6 and first.inflight_fast == pytest.approx(1.5)
    assert first.inflight_slow == pytest.approx(1.5)
    expected = merge_windows([w for w in published if w.window_start == at(300)])
    assert first.ttft_p95_s == expected.ttft_p95_s and first.e2e_p95_s == expected.e2e_p95_s
    assert first.ttft_p95_s == pytest.approx(0.4, rel=0.05)
    # Before 300 s the bus holds nothing: the windows recorded with the decisions stand in, each once.
    assert [w.window_end for w in t.recorded_load] == [at(10), at(60), at(100), at(110), at(118), at(140)]
    assert t.recorded_load[1].inflight_fast == 3.5 and t.recorded_load[0].held == 2
    assert t.load_note.startswith("load: 60 windows measured by the gateways (up to 2 replicas merged a window)")
    assert "6 metric windows recorded with the controller's decisions" in t.load_note

    # A range that starts inside the cycle starts in the state the alias was in.
    later = await gather_timeline(settings, ALIAS, at(125), at(650))
    assert [(s.state, s.switch is None) for s in later.spans] == [
        (R.MIXED, True), (R.VLLM_PRIMARY, False), (R.FAST_ONLY, False)]
    assert [s.number for s in later.switches] == [1, 2]
    assert later.mix_at(at(125)) == 0.8 and later.mix_at(at(135)) == 1.0
    assert later.instances_at(at(125)) == {F: {I.RUNNING: 1}, V: {I.RUNNING: 1}}
    assert [w.window_end for w in later.recorded_load] == [at(140)]


async def test_history_plot_writes_an_image_and_says_where(store, bus, settings, tmp_path):
    await record_a_cycle(store)
    await publish_gateway_windows(bus)
    path = tmp_path / "timeline.png"

    done = cli(settings, "history", ALIAS, "--since", at(0).isoformat(), "--until", at(1000).isoformat(),
               "--plot", str(path))

    assert done.returncode == 0, done.stderr
    assert str(path) in done.stdout and "6 routing switches" in done.stdout
    width, height = png_size(path)
    assert width == 1400 and 1000 <= height <= 2400
    assert path.stat().st_size > 40_000  # bands, lines and text, not an empty canvas


async def test_without_nats_the_load_comes_from_the_decisions(store, settings, tmp_path):
    await record_a_cycle(store)
    unreachable = settings.model_copy(update={"nats_url": f"nats://127.0.0.1:{closed_port()}"})

    t = await gather_timeline(unreachable, ALIAS, at(0), at(1000))

    assert t.load == [] and [w.window_end for w in t.recorded_load] == [
        at(10), at(60), at(100), at(110), at(118), at(140), at(400)]
    assert t.load_note.startswith(f"NATS at {unreachable.nats_url} unreachable (") and "Connect call failed" in t.load_note
    assert "7 metric windows recorded with the controller's decisions" in t.load_note
    assert len(t.switches) == 6  # the log alone still gives the whole story

    path = tmp_path / "no-bus.png"
    done = cli(settings, "history", ALIAS, "--since", at(0).isoformat(), "--until", at(1000).isoformat(),
               "--plot", str(path), NATS_URL=unreachable.nats_url)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # the bus's absence is said in the figure, not as tracebacks
    assert png_size(path)[0] == 1400


async def test_history_plot_of_an_unknown_alias_says_so(migrated, settings, tmp_path):
    done = cli(settings, "history", "nobody", "--plot", str(tmp_path / "x.png"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"modelpool history: alias 'nobody' has no events in namespace '{settings.namespace}'"]
    assert not (tmp_path / "x.png").exists()


async def test_a_long_history_is_gathered_and_drawn_in_seconds(store, settings, tmp_path):
    """A day of churn: 300 cycles of the controller and its instances, several thousand events."""
    life = AliasLife(store)
    await life.configure(0)
    cycle = [(R.FAST_ONLY, 0.0, "first demand (1 request(s) waiting): llama.cpp takes it"),
             (R.WARMING_VLLM, 0.0, WARMING_REASON), (R.MIXED, 0.2, "vLLM v1 healthy in 2 consecutive probes"),
             (R.VLLM_PRIMARY, 1.0, "ramp complete at 100 % and held 10 s"),
             (R.FAST_ONLY, 0.0, "inflight_total 0.4 < 3 for 180 s and vLLM idle"),
             (R.COLD, 0.0, "no request for 300 s and min_replicas 0")]
    seconds = 0.0
    for n in range(300):
        for to, weight, reason in cycle:
            seconds += 40
            await life.decide(seconds, to=to, weight=weight, reason=reason, metrics=window(seconds, inflight_fast=n % 7))
        iid = f"f{n}"
        await life.instance(iid, F, [(seconds + 1, I.ABSENT, I.STARTING), (seconds + 2, I.STARTING, I.RUNNING),
                                     (seconds + 3, I.RUNNING, I.DRAINING), (seconds + 4, I.DRAINING, I.DELETING),
                                     (seconds + 5, I.DELETING, I.ABSENT)])
    unreachable = settings.model_copy(update={"nats_url": f"nats://127.0.0.1:{closed_port()}"})

    started = time.monotonic()
    t = await gather_timeline(unreachable, ALIAS, at(0), at(seconds + 10))
    draw_timeline(t, tmp_path / "day.png")
    elapsed = time.monotonic() - started

    assert len(t.switches) == 1800 and len(t.recorded_load) == 1800
    assert elapsed < 10.0, f"{elapsed:.1f} s"  # a few seconds, with room for a busy machine
    assert png_size(tmp_path / "day.png")[0] == 1400


def test_reasons_are_shortened_to_their_gist():
    assert short_reason(WARMING_REASON, 200) == (
        "2 consecutive windows with inflight_fast 3.5 >= C_up 3; inflight_total 3.5 >= C_prepare 3")
    assert short_reason(WARMING_REASON, 40) == "2 consecutive windows with …"
    assert short_reason("first demand (2 request(s) waiting): llama.cpp takes it", 80) == \
        "first demand (2 request(s) waiting): llama.cpp takes it"
    assert short_reason("2 consecutive windows with inflight_total 6 >= C_prepare 3 (C_vllm 39 (T_kv 160000 / "
                        "T_req 4096), C_up 27, C_l 8)", 200) == "2 consecutive windows with inflight_total 6 >= C_prepare 3"

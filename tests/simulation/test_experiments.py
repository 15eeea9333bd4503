"""`modelpool sim` experiments: the files of seed 002 with their columns, truncation, comparison."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from simulation.cli import main
from simulation.config import load_config
from simulation.experiment import run_experiment
from simulation.recorder import BATCH_COLUMNS, SACRIFICE_COLUMNS, TRACE_COLUMNS
from simulation.workload import generate, read_requests

COMMON_FILES = {
    "batch_snapshots.csv", "request_traces.csv", "events.csv", "queue_timeline.csv", "memory_events.csv",
    "summary.txt", "config_used.yaml", "experiment_meta.yaml", "queue_dynamics.png", "arrival_dynamics.png",
}
SACRIFICE_FILES = {
    "sacrifice_snapshot.csv", "sacrifice_distribution.csv", "sacrifice_conditional_prob_timeline.csv",
    "sacrifice_dynamics.png",
}


def header(path: Path) -> list[str]:
    with path.open() as f:
        return next(csv.reader(f))


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def write_small_config(root: Path) -> Path:
    # a small, overloaded system: memory pressure and preemptions within 250 requests
    cfg = {
        "system": {"M_total": 1500, "B": 400, "d_0": 1.0, "d_1": 0.001},
        "data": {"request_file": str(root / "requests.csv"), "experiments_dir": str(root / "exp")},
        "experiment": {"seed": 1, "verbose": False, "window_batches": 20, "queue_timeline_interval": 5},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["generate", "--out", str(root / "requests.csv"), "--n", "250", "--rate", "2.0",
                 "--seed", "3", "--prefill", "uniform:10:80", "--decode", "uniform:5:40"]) == 0
    return path


@pytest.fixture
def small_config(tmp_path: Path) -> Path:
    return write_small_config(tmp_path)


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Path:
    """One `sim compare` (four full experiments) shared by the tests that read its files."""
    root = tmp_path_factory.mktemp("compare")
    config = write_small_config(root)
    assert main(["compare", "--config", str(config), "--quiet"]) == 0
    return only_dir(root / "exp")


def only_dir(root: Path) -> Path:
    dirs = [p for p in root.iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_generate_is_seeded_and_writes_the_seed_columns(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    for out in (a, b):
        assert main(["generate", "--out", str(out), "--n", "50", "--rate", "2", "--seed", "9",
                     "--arrival", "gamma", "--burstiness", "3"]) == 0
    assert a.read_text() == b.read_text()
    assert header(a) == ["arrival_time", "prefill_length", "decode_length"]
    specs = read_requests(a)
    assert len(specs) == 50
    assert all(s.decode_length >= 1 for s in specs)
    assert [s.arrival_time for s in specs] == sorted(s.arrival_time for s in specs)


def test_reads_the_seed_example_format(tmp_path):
    path = tmp_path / "requests.csv"
    path.write_text("# requests.csv\narrival_time, prefill_length, decode_length\n1.2, 75, 25\n0.0, 50, 20\n\n0.5, 100, 30\n")
    specs = read_requests(path, L_filter=25)
    assert [(s.arrival_time, s.prefill_length, s.decode_length) for s in specs] == [(0.0, 50, 20), (1.2, 75, 25)]


def test_gamma_burstiness_keeps_the_rate_and_raises_variability():
    import numpy as np

    poisson = generate(4000, 2.0, seed=1)
    bursty = generate(4000, 2.0, seed=1, arrival="gamma", burstiness=3.0)
    gaps_p = np.diff([s.arrival_time for s in poisson])
    gaps_b = np.diff([s.arrival_time for s in bursty])
    assert gaps_p.mean() == pytest.approx(0.5, rel=0.1)
    assert gaps_b.mean() == pytest.approx(0.5, rel=0.15)
    assert gaps_b.std() / gaps_b.mean() > 2 * gaps_p.std() / gaps_p.mean()


def test_run_sacrifice_writes_every_file_with_the_seed_columns(small_config, tmp_path, capsys):
    assert main(["run", "--config", str(small_config), "--mode", "sacrifice", "--strategy", "aggressive"]) == 0
    out = only_dir(tmp_path / "exp")
    names = {p.name for p in out.iterdir()}
    assert COMMON_FILES | SACRIFICE_FILES <= names
    assert header(out / "batch_snapshots.csv") == list(BATCH_COLUMNS)
    assert header(out / "request_traces.csv") == list(TRACE_COLUMNS)
    assert header(out / "sacrifice_snapshot.csv") == list(SACRIFICE_COLUMNS)
    assert header(out / "sacrifice_distribution.csv")[:4] == ["event_index", "time", "req_id", "pos_0"]
    assert header(out / "sacrifice_conditional_prob_timeline.csv")[:4] == ["window", "time_start", "time_end", "pos_0"]

    traces = rows(out / "request_traces.csv")
    assert len(traces) == 250 and all(r["completion_time"] for r in traces)
    sacrifices = rows(out / "sacrifice_snapshot.csv")
    assert sacrifices, "the small config must produce sacrifices"
    assert sum(int(r["sacrifice_count"]) for r in traces) == len(sacrifices)
    batches = rows(out / "batch_snapshots.csv")
    assert all(int(b["gpu_memory_used"]) <= 1500 for b in batches)
    assert sum(int(b["batch_sacrifice_count"]) for b in batches) == len(sacrifices)
    # each distribution row is a CDF over positions, and the last one matches the snapshot
    dist = rows(out / "sacrifice_distribution.csv")
    for r in dist:
        cdf = [float(v) for k, v in r.items() if k.startswith("pos_")]
        assert all(a <= b + 1e-9 for a, b in zip(cdf, cdf[1:])) and cdf[-1] == pytest.approx(1.0, abs=1e-4)
    positions = [int(r["current_decode_position"]) for r in sacrifices]
    last = [float(v) for k, v in dist[-1].items() if k.startswith("pos_")]
    assert last[0] == pytest.approx(positions.count(0) / len(positions), abs=1e-4)
    events = rows(out / "events.csv")
    kinds = {e["event_type"] for e in events}
    assert {"arrival", "admit", "sacrifice", "completion"} <= kinds
    assert sum(e["event_type"] == "completion" for e in events) == 250
    memory = rows(out / "memory_events.csv")
    assert all(int(m["gpu_memory_used"]) <= 1500 for m in memory)
    assert int(memory[-1]["gpu_memory_used"]) == 0
    summary = (out / "summary.txt").read_text()
    assert "Little's law" in summary and "-> holds" in summary
    assert "memory_bookkeeping_mismatches: 0" in summary
    meta = yaml.safe_load((out / "experiment_meta.yaml").read_text())
    assert meta["preemption_mode"] == "sacrifice" and meta["requests"] == 250
    used = yaml.safe_load((out / "config_used.yaml").read_text())
    assert used["control"]["preemption_strategy"] == "aggressive"
    assert "experiment written to" in capsys.readouterr().out


def test_swap_has_no_sacrifice_files_and_logs_swaps(compared):
    out = compared / "swap_aggressive"
    names = {p.name for p in out.iterdir()}
    assert COMMON_FILES <= names and not (SACRIFICE_FILES & names)
    assert header(out / "batch_snapshots.csv") == list(BATCH_COLUMNS)
    assert header(out / "request_traces.csv") == list(TRACE_COLUMNS)
    events = rows(out / "events.csv")
    outs = [e for e in events if e["event_type"] == "swap_out"]
    ins = [e for e in events if e["event_type"] == "swap_in"]
    assert outs and len(outs) == len(ins)
    # a swapped request comes back at the position it left
    left = {}
    for e in events:
        if e["event_type"] == "swap_out":
            left[e["req_id"]] = e["decode_position"]
        elif e["event_type"] == "swap_in":
            assert left.pop(e["req_id"]) == e["decode_position"]
    queue = rows(out / "queue_timeline.csv")
    assert queue and all(len(q["running_ids"].split()) == int(q["running_count"]) for q in queue)


def test_littles_law_and_throughput_in_summary(small_config):
    cfg = load_config(small_config)
    specs = read_requests(cfg.data.request_file)
    result = run_experiment(cfg, specs)
    ll = result.summary["littles_law"]
    assert ll["relative_error"] < 0.05
    assert result.summary["basic"]["completed"] == len(specs)
    assert result.summary["throughput"]["tokens_per_time"] == pytest.approx(
        sum(s.decode_length for s in specs) / result.end_time)


def test_compare_runs_the_four_combinations(compared):
    out = compared
    table = rows(out / "comparison.csv")
    assert {(r["mode"], r["strategy"]) for r in table} == {
        ("swap", "conservative"), ("swap", "aggressive"), ("sacrifice", "conservative"), ("sacrifice", "aggressive")}
    assert all(int(r["completed"]) == 250 for r in table)
    assert (out / "comparison.png").stat().st_size > 0
    by = {(r["mode"], r["strategy"]): r for r in table}
    assert int(by[("swap", "aggressive")]["swap_out"]) > 0 and int(by[("swap", "aggressive")]["sacrifices"]) == 0
    assert int(by[("sacrifice", "aggressive")]["sacrifices"]) > 0
    for combo in ("swap_conservative", "swap_aggressive", "sacrifice_conservative", "sacrifice_aggressive"):
        names = {p.name for p in (out / combo).iterdir()}
        assert COMMON_FILES <= names
        assert (SACRIFICE_FILES <= names) == combo.startswith("sacrifice")


def test_truncate_explore_then_cut(small_config, tmp_path, capsys):
    assert main(["truncate", "--config", str(small_config), "--explore", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "candidate truncation batches:" in text
    assert main(["truncate", "--config", str(small_config), "--at", "100", "--new-rate", "0.1",
                 "--new-n", "40", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "phase1" in text and "phase2" in text
    cut_dir = next(p for p in (tmp_path / "exp").iterdir() if p.name.split("_", 2)[2].startswith("truncate"))
    meta = yaml.safe_load((cut_dir / "experiment_meta.yaml").read_text())
    trunc = meta["truncation"]
    assert trunc["at_batch"] == 100 and trunc["injected_requests"] == 40 and trunc["dropped_requests"] > 0
    traces = rows(cut_dir / "request_traces.csv")
    new = [r for r in traces if r["req_id"].startswith("new")]
    assert len(new) == 40 and all(float(r["arrival_time"]) >= trunc["time"] for r in new)
    assert all(r["completion_time"] for r in traces)
    assert len(traces) == 250 - trunc["dropped_requests"] + 40


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope.csv"
    assert main(["run", "--requests", str(missing), "--experiments-dir", str(tmp_path), "--quiet"]) == 2
    assert "request file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("system:\n  M_total: -5\n")
    assert main(["run", "--config", str(bad), "--quiet"]) == 2
    assert "M_total" in capsys.readouterr().err
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("system:\n  M_totl: 5\n")
    assert main(["run", "--config", str(unknown), "--quiet"]) == 2
    assert "M_totl" in capsys.readouterr().err
    broken = tmp_path / "broken.csv"
    broken.write_text("arrival_time,prefill_length\n1,2\n")
    assert main(["run", "--requests", str(broken), "--experiments-dir", str(tmp_path), "--quiet"]) == 2
    assert "decode_length" in capsys.readouterr().err


def test_config_layers_defaults_file_env_arguments(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("system:\n  B: 77\ndata:\n  experiments_dir: from_file\n")
    cfg = load_config(path, env={"MODELPOOL_SIM_EXPERIMENTS_DIR": "from_env"},
                      overrides={"control": {"preemption_mode": "SACRIFICE"}})
    assert cfg.system.B == 77 and cfg.system.M_total == 10_000
    assert cfg.data.experiments_dir == "from_env"
    assert cfg.control.preemption_mode.value == "sacrifice"


def test_compare_victim_policies(small_config, tmp_path, capsys):
    assert main(["compare", "--config", str(small_config), "--victims", "--mode", "sacrifice",
                 "--strategy", "aggressive", "--quiet"]) == 0
    out = only_dir(tmp_path / "exp")
    table = rows(out / "comparison.csv")
    assert [r["victim_policy"] for r in table] == ["lifo", "lru", "random"]
    assert {(r["mode"], r["strategy"]) for r in table} == {("sacrifice", "aggressive")}
    assert all(int(r["completed"]) == 250 for r in table)
    # LIFO victims are the newest requests, which have the least progress to lose
    by = {r["victim_policy"]: r for r in table}
    assert int(by["lifo"]["wasted_tokens"]) < int(by["random"]["wasted_tokens"])
    assert main(["compare", "--config", str(small_config), "--mode", "swap", "--quiet"]) == 2

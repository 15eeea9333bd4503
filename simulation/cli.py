"""`modelpool sim ...`: the decode simulator's experiments (seed 002).

    modelpool sim generate --out experiments/input/requests.csv --n 1000 --rate 0.08
    modelpool sim run --config simulation/configs/default.yaml [--mode sacrifice] [--strategy aggressive]
    modelpool sim compare --config ...
    modelpool sim truncate --config ... --explore | --at BATCH [--new-rate R] [--new-n N]
    modelpool sim fluid-limit --config ... [--scales 1,10,100,1000]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from contextlib import contextmanager

from pydantic import ValidationError
from tqdm import tqdm

from simulation.config import DEFAULT_CONFIG, SimConfig, load_config
from simulation.core import PreemptionMode, Strategy, VictimPolicy
from simulation.workload import LengthDist, generate, read_requests, write_requests


def _add_config_args(p: argparse.ArgumentParser, *, control: bool = True) -> None:
    p.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG})")
    p.add_argument("--requests", default=None, help="requests.csv to replay (overrides data.request_file)")
    p.add_argument("--experiments-dir", default=None, help="output root (overrides data.experiments_dir)")
    p.add_argument("--seed", type=int, default=None, help="overrides experiment.seed")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    if control:
        p.add_argument("--mode", choices=[m.value for m in PreemptionMode], default=None)
        p.add_argument("--strategy", choices=[s.value for s in Strategy], default=None)
        p.add_argument("--victim-policy", choices=[v.value for v in VictimPolicy], default=None)


def _length_dist(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_workload_args(p: argparse.ArgumentParser, *, n: int | None, rate: float | None) -> None:
    p.add_argument("--n", type=int, default=n, help="number of requests")
    p.add_argument("--rate", type=float, default=rate, help="mean arrival rate (requests per time unit)")
    p.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma arrivals: coefficient of variation of the gaps (>1 burstier than Poisson)")
    p.add_argument("--prefill", type=_length_dist, default=LengthDist.parse("uniform:20:200"),
                   help="prefill length: uniform:LO:HI | fixed:N | geometric:MEAN | lognormal:MEDIAN:SIGMA[:MAX]")
    p.add_argument("--decode", type=_length_dist, default=LengthDist.parse("uniform:10:100"),
                   help="decode length, same syntax")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelpool sim", description="Offline decode simulator (seed 002).")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="write a requests.csv from seeded Poisson or gamma arrivals")
    g.add_argument("--out", required=True, help="output CSV path")
    g.add_argument("--seed", type=int, default=42)
    _add_workload_args(g, n=2000, rate=1.2)

    r = sub.add_parser("run", help="one simulation, all of seed 002's output files and plots")
    _add_config_args(r)

    c = sub.add_parser("compare", help="the four mode x strategy combinations on the same requests")
    _add_config_args(c)
    c.add_argument("--victims", action="store_true",
                   help="compare the victim policies LIFO, LRU and random instead, under --mode/--strategy")

    t = sub.add_parser("truncate", help="truncation experiments: explore candidates, or cut and inject")
    _add_config_args(t)
    how = t.add_mutually_exclusive_group()
    how.add_argument("--explore", action="store_true", help="run in full and mark candidate truncation points")
    how.add_argument("--at", type=int, metavar="BATCH", help="cut after this batch and inject new arrivals")
    t.add_argument("--new-rate", type=float, default=None, help="arrival rate after the cut (default: half)")
    t.add_argument("--new-n", type=int, default=None, help="requests injected after the cut")

    f = sub.add_parser("fluid-limit", help="discrete runs at lambda x n against the fluid ODE")
    _add_config_args(f)
    _add_workload_args(f, n=None, rate=1.5)
    f.add_argument("--scales", default="1,10,100,1000", help="comma-separated scale factors n")
    f.add_argument("--horizon", type=float, default=300.0, help="arrivals stop at this time")
    f.add_argument("--reference-scale", type=int, default=None,
                   help="scale of the independent run the ODE parameters are estimated from (default: the largest)")
    return parser


def _config(args: argparse.Namespace) -> SimConfig:
    overrides: dict = {}
    if args.requests:
        overrides.setdefault("data", {})["request_file"] = args.requests
    if args.experiments_dir:
        overrides.setdefault("data", {})["experiments_dir"] = args.experiments_dir
    if args.seed is not None:
        overrides.setdefault("experiment", {})["seed"] = args.seed
    if args.quiet:
        overrides.setdefault("experiment", {})["verbose"] = False
    control = {}
    for key, attr in (("preemption_mode", "mode"), ("preemption_strategy", "strategy"),
                      ("victim_policy", "victim_policy")):
        value = getattr(args, attr, None)
        if value:
            control[key] = value
    if control:
        overrides["control"] = control
    return load_config(args.config or DEFAULT_CONFIG, overrides=overrides)


@contextmanager
def _progress(total: int, enabled: bool, desc: str):
    bar = tqdm(total=total, unit="req", desc=desc, disable=not enabled, file=sys.stderr, mininterval=0.5)
    try:
        yield bar.update
    finally:
        bar.close()


def cmd_generate(args: argparse.Namespace) -> int:
    specs = generate(args.n, args.rate, seed=args.seed, arrival=args.arrival, burstiness=args.burstiness,
                     prefill=args.prefill, decode=args.decode)
    path = write_requests(args.out, specs)
    span = specs[-1].arrival_time if specs else 0.0
    print(f"wrote {len(specs)} requests to {path} ({args.arrival} arrivals at rate {args.rate:g}, "
          f"prefill {args.prefill}, decode {args.decode}, seed {args.seed}, last arrival t={span:.1f})")
    return 0


def cmd_run(args: argparse.Namespace, command: str) -> int:
    from simulation.experiment import experiment_dir, run_experiment, write_experiment

    cfg = _config(args)
    specs = read_requests(cfg.data.request_file, L_filter=cfg.data.L_filter)
    label = f"{cfg.control.preemption_mode.value}_{cfg.control.preemption_strategy.value}"
    with _progress(len(specs), cfg.experiment.verbose, f"simulating {label}") as update:
        result = run_experiment(cfg, specs, progress=update)
    out = experiment_dir(cfg.data.experiments_dir, label)
    write_experiment(result, out, request_file=cfg.data.request_file, command=command)
    print((out / "summary.txt").read_text())
    print(f"experiment written to {out}")
    return 0


def cmd_compare(args: argparse.Namespace, command: str) -> int:
    from simulation.experiment import ALL_COMBINATIONS, experiment_dir, run_experiment, write_comparison, write_experiment

    cfg = _config(args)
    if not args.victims and (args.mode or args.strategy):
        raise ValueError("compare runs every mode and strategy; --mode/--strategy only go with --victims")
    specs = read_requests(cfg.data.request_file, L_filter=cfg.data.L_filter)
    if args.victims:
        variants = [(cfg.control.preemption_mode, cfg.control.preemption_strategy, v) for v in VictimPolicy]
    else:
        variants = [(m, s, cfg.control.victim_policy) for m, s in ALL_COMBINATIONS]
    out = experiment_dir(cfg.data.experiments_dir, "compare_victims" if args.victims else "compare")
    results = []
    for mode, strategy, victim in variants:
        one = cfg.with_control(mode, strategy, victim)
        label = f"{mode.value}_{strategy.value}" + (f"_{victim.value}" if args.victims else "")
        with _progress(len(specs), cfg.experiment.verbose, label) as update:
            result = run_experiment(one, specs, progress=update)
        write_experiment(result, out / label, request_file=cfg.data.request_file, command=command)
        results.append(result)
    table, _ = write_comparison(results, out)
    print(table)
    print(f"comparison written to {out} (comparison.csv, comparison.png; one directory per combination)")
    return 0


def cmd_truncate(args: argparse.Namespace, command: str) -> int:
    from simulation.experiment import (
        candidate_truncation_batches,
        experiment_dir,
        run_experiment,
        run_truncated,
        write_experiment,
    )
    from simulation.summary import format_summary

    cfg = _config(args)
    specs = read_requests(cfg.data.request_file, L_filter=cfg.data.L_filter)
    label = f"{cfg.control.preemption_mode.value}_{cfg.control.preemption_strategy.value}"
    if args.explore:
        with _progress(len(specs), cfg.experiment.verbose, f"explore {label}") as update:
            result = run_experiment(cfg, specs, progress=update)
        candidates = candidate_truncation_batches(result, cfg.truncation.candidates)
        result.marks = [(t, f"candidate batch {b}") for b, t in candidates]
        out = experiment_dir(cfg.data.experiments_dir, f"explore_{label}")
        write_experiment(result, out, request_file=cfg.data.request_file, command=command)
        print((out / "summary.txt").read_text())
        print("candidate truncation batches: " + ", ".join(f"{b} (t={t:.1f})" for b, t in candidates))
        print(f"explore run written to {out}; cut with `modelpool sim truncate --at BATCH`")
        return 0
    at = args.at if args.at is not None else cfg.truncation.at_batch
    if at is None:
        raise ValueError("truncate needs --explore, --at BATCH, or truncation.at_batch in the config")
    new_rate = args.new_rate if args.new_rate is not None else cfg.truncation.new_rate
    new_n = args.new_n if args.new_n is not None else cfg.truncation.new_n
    with _progress(len(specs), cfg.experiment.verbose, f"truncate {label}") as update:
        result = run_truncated(cfg, specs, at, new_rate=new_rate, new_n=new_n, progress=update)
    out = experiment_dir(cfg.data.experiments_dir, f"truncate_{label}_b{at}")
    write_experiment(result, out, request_file=cfg.data.request_file, command=command)
    print(format_summary(result.phases, title="Truncation phases"))
    print(f"truncated run written to {out}")
    return 0


def cmd_fluid_limit(args: argparse.Namespace, command: str) -> int:
    from simulation.fluid import FluidLimitSpec, run_fluid_limit, write_fluid_limit
    from simulation.experiment import experiment_dir

    cfg = _config(args)
    try:
        scales = [int(x) for x in args.scales.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--scales must be comma-separated integers, got {args.scales!r}") from None
    if not scales or any(s < 1 for s in scales):
        raise ValueError("--scales needs positive integers")
    spec = FluidLimitSpec(rate=args.rate, horizon=args.horizon, prefill=args.prefill, decode=args.decode,
                          arrival=args.arrival, burstiness=args.burstiness, scales=tuple(scales),
                          reference_scale=args.reference_scale or max(scales), seed=cfg.experiment.seed)
    bar = tqdm(total=len(scales) + 1, desc="fluid limit", unit="run", disable=not cfg.experiment.verbose,
               file=sys.stderr)
    try:
        result = run_fluid_limit(cfg, spec, progress=bar.update)
    finally:
        bar.close()
    out = experiment_dir(cfg.data.experiments_dir, "fluid_limit")
    text = write_fluid_limit(result, out, command=command)
    print(text)
    print(f"fluid-limit results written to {out}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, str], int]] = {
    "run": cmd_run,
    "compare": cmd_compare,
    "truncate": cmd_truncate,
    "fluid-limit": cmd_fluid_limit,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    command = "modelpool sim " + shlex.join(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        return COMMANDS[args.command](args, command)
    except (ValueError, FileNotFoundError, ValidationError) as exc:
        print(f"modelpool sim {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

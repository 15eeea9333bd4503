"""`modelpool calibrate`: estimate the rates of a run, derive the hybrid policy's parameters, tune them in the lab.

    modelpool calibrate --alias smollm2-135m --workload bursty --out calibrated.yaml   # the local cluster's log
    modelpool calibrate --record results/run/record-hybrid.json --workload diurnal      # a lab run's record

Prints the estimates, the derivation of seed 000 §13.7 and the search, and
writes the alias's pool-file fragment (its hybrid `autoscaling_policy`) to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from lab import workloads
from lab.calibrate import KAPPA, estimate, fragment, initial_parameters, search
from lab.config import LabSettings, apply_sets, parse_sets
from lab.record import RunRecord, record_from_log
from shared.contracts.config import AliasConfig, ConfigError, PoolConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelpool calibrate", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--alias", help="read this alias's run from the local cluster's event log")
    source.add_argument("--record", type=Path, help="a lab run's record (lab run --out DIR writes record-<policy>.json)")
    parser.add_argument("--workload", default="bursty", help="the trace the search runs (a workload name or a .jsonl file)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="lab.X (objective weights: lab.objective.gamma=0.02), workload.X")
    parser.add_argument("--kappa", type=float, default=KAPPA,
                        help=f"cost of a second of start delay in §13.7 (default {KAPPA:g})")
    parser.add_argument("--rounds", type=int, default=8,
                        help="at most this many passes of the search; it stops when a pass finds nothing better (0: no search)")
    parser.add_argument("--out", type=Path, help="write the pool-file fragment here")
    return parser


async def _from_log(alias: str) -> RunRecord:
    from services.ops.history import load_history
    from shared.settings import Settings

    events = await load_history(Settings.load(discover=True), alias, None, None)
    return record_from_log(events)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        record = RunRecord.read(args.record) if args.record else asyncio.run(_from_log(args.alias))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError("--record" if args.record else "--alias", f"cannot read the run: {exc}") from None
    source = str(args.record) if args.record else f"the event log of {args.alias}"
    e = estimate(record)
    print(f"estimates from {source} ({len(record.windows)} windows, {len(record.transitions)} transitions):")
    for key, value in e.as_dict().items():
        note = e.notes.get(key) or (e.notes["m"] if key.startswith("m_") else "")
        print(f"  {key:<21} {'-' if value is None else f'{value:g}'}{'   (' + note + ')' if note else ''}")
    sets = parse_sets(args.sets)
    alias = AliasConfig.model_validate(record.alias)
    pool = PoolConfig(aliases=[alias])
    alias, pool, lab = apply_sets(pool, None, sets, LabSettings(seed=args.seed))
    o = lab.objective
    try:
        init = initial_parameters(e, o.beta, o.gamma, args.kappa)
    except ValueError as exc:
        print(f"modelpool calibrate: {exc}", file=sys.stderr)
        return 1
    print("\nseed 000 §13.7, initial values:")
    for line in init.derivation:
        print(f"  {line}")
    best = init.params
    if args.rounds > 0:
        name, trace = workloads.load(args.workload, args.seed, sets["workload"])
        print(f"\nsearch in the lab on {name} ({len(trace)} requests), objective weights alpha {o.alpha:g}, "
              f"beta {o.beta:g}, gamma {o.gamma:g}, eta {o.eta:g}:")

        def show(params: dict, summary: dict) -> None:
            print(f"  {params}: objective {summary['objective']:.4f}, SLO {summary['slo_attainment']:.1%}, "
                  f"{summary['gpu_mem_s'] / 3600:.1f} GB·h, {summary['scale_actions']} scale actions", flush=True)

        best, _ = search(alias, pool.controller, lab, trace, init.params, args.rounds, on_run=show)
        print(f"\nbest: {best}")
    text = fragment(best, init.heteroscale_target_tps, init.derivation, source)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print("\n" + text)
    return 0

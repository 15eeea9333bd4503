"""The `modelpool` command line: one entry point, one sub-command per job.

Each sub-command lives with the code it runs; this module only dispatches, and
imports lazily so `modelpool status` does not pay for loading llama.cpp.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, help). The module exposes `main(argv: list[str]) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.cluster.up", "start the local cluster on the embedded default (or NATS_URL / DATABASE_URL)"),
    "migrate": ("services.ops.migrate", "apply the database migrations"),
    "credentials": ("services.ops.credentials", "make the cluster's credentials in a directory where absent (compose)"),
    "database-roles": ("services.ops.database_roles", "create the owner and service logins, as Postgres' superuser"),
    "gateway": ("services.gateway.main", "run the gateway service"),
    "autoscaler": ("services.autoscaler.main", "run the autoscaler service"),
    "placement": ("services.placement.main", "run the placement service"),
    "worker": ("services.worker.main", "run a worker service"),
    "relay": ("services.relay.main", "run the outbox relay (event log -> bus)"),
    "projector": ("services.projector.main", "keep the read models in Postgres up to date with the log"),
    "status": ("services.ops.status", "show workers, aliases, routing states and instances"),
    "top": ("services.ops.top", "the pool live in a terminal: aliases, instances, load, latest decisions"),
    "health": ("services.ops.health", "a service's health check, from its MODELPOOL_HEALTH_FILE (containers)"),
    "history": ("services.ops.history", "show an alias's timeline from the event log"),
    "explain": ("services.ops.explain", "why a past request went where it went, from the gateway's access log"),
    "replay": ("services.ops.replay", "rebuild projections from the log and compare them; --verify-decisions re-runs decisions"),
    "load": ("services.ops.load", "steady concurrent load on an alias, to watch the pool respond"),
    "sim": ("simulation.cli", "offline decode simulator: generate, run, compare, truncate, fluid-limit"),
    "trace": ("services.ops.trace", "agentic traces in seed 004's format: generate, run (closed-loop replay)"),
    "lab": ("lab.cli", "policy lab: simulate the pool's policies on a workload (run, compare)"),
    "calibrate": ("lab.calibrate_cli", "estimate a run's rates, derive the hybrid parameters, tune them in the lab"),
    "engine": ("services.engines.cli", "run an inference engine: `engine llama.cpp` or `engine sim`"),
    "vllm-check": ("services.ops.vllm_check", "drive a real `vllm serve` through start, sleep and wake (needs a GPU)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: modelpool COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"modelpool: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except Exception as exc:
        # Imported only here: `modelpool health` runs every few seconds in each container and stays light.
        from shared.contracts.config import ConfigError
        if isinstance(exc, ConfigError):
            # A configuration problem is the user's to fix: say which field, where, and stop.
            print(f"modelpool {name}: configuration error: {exc}", file=sys.stderr)
            return 2
        problem = database_problem(exc)
        if problem is None:
            raise
        print(f"modelpool {name}: {problem}", file=sys.stderr)
        return 2


def database_problem(exc: BaseException) -> str | None:
    """One line for the database problems an operator meets (no schema, no server), else None."""
    import asyncpg

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError)):
            return (f"this database has no modelpool schema ({cause}); run `modelpool migrate`, or point "
                    "DATABASE_URL and MODELPOOL_NAMESPACE at a modelpool cluster (`make run` starts one)")
        if isinstance(cause, (ConnectionRefusedError, asyncpg.CannotConnectNowError, asyncpg.InvalidCatalogNameError)):
            return (f"cannot reach the database ({cause}); is the cluster running? `make run` starts one, "
                    "or set DATABASE_URL")
        cause = getattr(cause, "orig", None) or cause.__cause__ or cause.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())

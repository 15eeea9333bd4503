"""`modelpool migrate`: bring the namespace's schema to the latest migration."""

from __future__ import annotations

import argparse

from shared.eventlog.db import migrate
from shared.settings import Settings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool migrate", description=__doc__)
    parser.add_argument("--database-url", help="default: DATABASE_URL")
    parser.add_argument("--namespace", help="schema to migrate (default: MODELPOOL_NAMESPACE or 'modelpool')")
    parser.add_argument("--revision", default="head")
    args = parser.parse_args(argv)
    settings = Settings.load(database_url=args.database_url, namespace=args.namespace)
    migrate(settings, revision=args.revision)
    print(f"schema {settings.namespace!r} is at {args.revision}")
    return 0

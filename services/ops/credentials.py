"""`modelpool credentials DIR`: the cluster's generated credentials in DIR, made where absent, kept where present.

What `modelpool up` makes in its data directory at a cluster's first start, for
clusters it does not start: compose runs it once, writing each credential into
the volume of those who need it (docs/security.md); Kubernetes takes the same
values from a Secret. Every file is readable by its owner only.

    DIR/cluster-secret                  signs calls to engines' internal ports and the KV they
                                        move (MODELPOOL_CLUSTER_SECRET_FILE): gateways, workers
    --database DIR/service-password     the service role's password: every service
    --database-admin DIR/superuser-password, DIR/owner-password
                                        Postgres' superuser (POSTGRES_PASSWORD_FILE) and the schema's
                                        owner (migrations): the database and `modelpool migrate` only
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.eventlog.roles import OWNER_PASSWORD_FILE, SERVICE_PASSWORD_FILE, SUPERUSER_PASSWORD_FILE
from shared.internal_auth import MIN_SECRET_CHARS, make_secret_file

CLUSTER_SECRET_FILE = "cluster-secret"
MIN_PASSWORD_CHARS = 16


def keep_or_make(path: Path, min_chars: int) -> str:
    existed = path.exists() and len(path.read_text().strip()) >= min_chars
    make_secret_file(path, min_chars=min_chars)
    return f"{path}: {'kept' if existed else 'made'}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool credentials", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where the cluster secret goes")
    parser.add_argument("--database", type=Path, help="where the service role's password goes")
    parser.add_argument("--database-admin", type=Path, help="where the superuser's and the owner's passwords go")
    args = parser.parse_args(argv)
    print(keep_or_make(args.directory / CLUSTER_SECRET_FILE, MIN_SECRET_CHARS))
    if args.database is not None:
        print(keep_or_make(args.database / SERVICE_PASSWORD_FILE, MIN_PASSWORD_CHARS))
    if args.database_admin is not None:
        for name in (SUPERUSER_PASSWORD_FILE, OWNER_PASSWORD_FILE):
            print(keep_or_make(args.database_admin / name, MIN_PASSWORD_CHARS))
    return 0

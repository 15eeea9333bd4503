"""`modelpool credentials DIR`: the cluster's generated credentials in DIR, made where absent, kept where present.

What `modelpool up` makes in its data directory at a cluster's first start, for
clusters it does not start: compose runs it once, writing each credential into
the volume of those who need it, each volume mounted by those services only;
Kubernetes takes the same from Secrets (docs/security.md). Every file is
readable by its owner only.

    DIR/cluster-secret            signs calls to engines' internal ports and the KV they
                                  move (MODELPOOL_CLUSTER_SECRET_FILE): gateways, workers
    DIR/nats/<user>/nats.json     one bus user's name and password
                                  (MODELPOOL_NATS_CREDENTIALS_FILE): gateway, autoscaler,
                                  placement, relay, projector, operator, worker-<id> for
                                  each --nats-worker, worker with --nats-shared-worker
    DIR/nats/server/nats-server.conf
                                  the NATS server's users: bcrypt hashes and each one's
                                  permissions (shared/bus/users.py)
    --database DIR/service-password
                                  the database's service role's password: every service
    --database-admin DIR/superuser-password, DIR/owner-password
                                  Postgres' superuser (POSTGRES_PASSWORD_FILE) and the schema's
                                  owner (migrations): the database and `modelpool migrate` only

`--owner` hands every file and directory it writes to that account (compose runs
this as root, so that a new, root-owned volume can be written, for services that
run as `modelpool`).
"""

from __future__ import annotations

import argparse
import os
import pwd
from pathlib import Path

from shared.bus.subjects import Subjects
from shared.bus.users import make_bus_users
from shared.eventlog.roles import OWNER_PASSWORD_FILE, SERVICE_PASSWORD_FILE, SUPERUSER_PASSWORD_FILE
from shared.internal_auth import MIN_SECRET_CHARS, make_secret_file
from shared.settings import NAMESPACE

CLUSTER_SECRET_FILE = "cluster-secret"
NATS_DIRECTORY = "nats"
MIN_PASSWORD_CHARS = 16


def keep_or_make(path: Path, min_chars: int) -> Path:
    existed = path.exists() and len(path.read_text().strip()) >= min_chars
    make_secret_file(path, min_chars=min_chars)
    print(f"{path}: {'kept' if existed else 'made'}")
    return path


def _hand_over(paths: list[Path], owner: str) -> None:
    try:
        account = pwd.getpwnam(owner)
    except KeyError:
        raise SystemExit(f"modelpool credentials: --owner: no account {owner!r}") from None
    for path in paths:
        os.chown(path, account.pw_uid, account.pw_gid)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool credentials", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where the cluster secret and the bus users go")
    parser.add_argument("--nats-worker", action="append", default=[], metavar="ID",
                        help="a worker whose id is known: a bus user of its own, `worker-ID` (repeat for each)")
    parser.add_argument("--nats-shared-worker", action="store_true",
                        help="the user `worker`, for workers whose ids are not known in advance (Kubernetes)")
    parser.add_argument("--namespace", default=os.environ.get("MODELPOOL_NAMESPACE") or "modelpool",
                        help="the pool's namespace, which the users' permissions name (default: MODELPOOL_NAMESPACE "
                             "or modelpool)")
    parser.add_argument("--no-nats", action="store_true", help="no bus users")
    parser.add_argument("--database", type=Path, help="where the database's service role's password goes")
    parser.add_argument("--database-admin", type=Path, help="where the superuser's and the owner's passwords go")
    parser.add_argument("--owner", help="the account every file and directory written is handed to")
    args = parser.parse_args(argv)
    if not NAMESPACE.match(args.namespace):
        parser.error(f"--namespace: {args.namespace!r} must start with a lowercase letter and hold only [a-z0-9_]")
    written = [keep_or_make(args.directory / CLUSTER_SECRET_FILE, MIN_SECRET_CHARS)]
    if not args.no_nats:
        try:
            users = make_bus_users(args.directory / NATS_DIRECTORY, Subjects(args.namespace), workers=args.nats_worker,
                                   shared_worker=args.nats_shared_worker, own_directories=True)
        except ValueError as exc:
            parser.error(f"--nats-worker: {exc}")
        for user in users.users:
            written += [users.credentials_file(user).parent, users.credentials_file(user)]
        written += [users.server_config.parent, users.server_config, users.directory]
        print(f"{users.directory}: bus users {', '.join(users.users)}; the server's in {users.server_config}")
    if args.database is not None:
        written.append(keep_or_make(args.database / SERVICE_PASSWORD_FILE, MIN_PASSWORD_CHARS))
    if args.database_admin is not None:
        written += [keep_or_make(args.database_admin / name, MIN_PASSWORD_CHARS)
                    for name in (SUPERUSER_PASSWORD_FILE, OWNER_PASSWORD_FILE)]
    if args.owner:
        _hand_over(written, args.owner)
    return 0

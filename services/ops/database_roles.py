"""`modelpool database-roles`: the owner and service logins on a Postgres whose superuser you hold.

Run as the superuser (DATABASE_URL names it and the database,
MODELPOOL_DATABASE_PASSWORD_FILE holds its password), before `modelpool
migrate`: creates the owner and the service role where absent, sets their
passwords from their files (again at every run: rotating a password is
changing its file and running this), gives the database to the owner, lets
nobody else but the service role connect, and hands the owner any schema a
superuser made there (`shared/eventlog/roles.py`). Compose runs it once per
`up`; `modelpool up` does the same for its embedded Postgres by itself.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from urllib.parse import urlparse

import asyncpg

from shared.eventlog import roles
from shared.settings import Settings, read_password


async def apply(settings: Settings, owner: str, owner_password: str, service: str, service_password: str) -> list[str]:
    """Everything above, in the database DATABASE_URL names; what the server said it changed."""
    database = urlparse(settings.asyncpg_dsn).path.lstrip("/")
    if not database:
        raise ValueError("DATABASE_URL must name the database the pool uses (postgresql://postgres@host/modelpool)")
    said: list[str] = []
    conn = await asyncpg.connect(settings.asyncpg_dsn, timeout=10, **settings.database_connect_args)
    conn.add_log_listener(lambda _conn, message: said.append(message.message))
    try:
        if not await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
            raise PermissionError("modelpool database-roles must log in as a superuser (DATABASE_URL's user)")
        for statement in (*roles.login_sql(owner, owner_password), *roles.login_sql(service, service_password),
                          *roles.database_sql(database, owner, service), *roles.schemas_sql(owner)):
            await conn.execute(statement)
    finally:
        await conn.close()
    return said


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool database-roles", description=__doc__.split("\n\n")[0])
    parser.add_argument("--owner", default=roles.OWNER_ROLE, help=f"the schema owner's role (default: {roles.OWNER_ROLE})")
    parser.add_argument("--owner-password-file", type=Path, required=True)
    parser.add_argument("--service", default=roles.SERVICE_ROLE,
                        help=f"the role services log in as (default: {roles.SERVICE_ROLE})")
    parser.add_argument("--service-password-file", type=Path, required=True)
    args = parser.parse_args(argv)
    for flag, name in (("--owner", args.owner), ("--service", args.service)):
        if not roles.ROLE_NAME.match(name):
            parser.error(f"{flag}: {name!r} must match {roles.ROLE_NAME.pattern}")
    try:
        owner_password = read_password(str(args.owner_password_file))
        service_password = read_password(str(args.service_password_file))
    except ValueError as exc:
        parser.error(str(exc))
    settings = Settings.load()
    said = asyncio.run(apply(settings, args.owner, owner_password, args.service, service_password))
    for line in said:
        print(line)
    print(f"roles {args.owner} (owner) and {args.service} (services) are ready, each with its password file's password")
    return 0

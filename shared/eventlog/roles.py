"""The database's two logins, as SQL a superuser runs: the owner of the log's schema and the role services use.

- The **owner** (`modelpool_owner`) owns the database, the namespace schemas,
  their tables and the log's append-only trigger; `modelpool migrate` logs in
  as it. It is no superuser and cannot create roles or databases.
- The **service role** (`modelpool_service`) is what every service and
  operator command logs in as. It owns nothing; migration 0006 grants it
  SELECT and INSERT on the log (no UPDATE, DELETE or TRUNCATE), the read
  models and positions it keeps, and SELECT on `alembic_version`. A role that
  owns neither the table nor the trigger can neither drop nor disable it.

Who runs this: `EmbeddedPostgres` at every start (psql), `modelpool
database-roles` for compose and any Postgres whose superuser you hold
(asyncpg). Passwords reach the server only as SCRAM-SHA-256 verifiers, so no
plaintext password is ever in a statement, a server log or a process list;
setting them again at each start makes a changed password file the way to
rotate one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re

OWNER_ROLE = "modelpool_owner"
SERVICE_ROLE = "modelpool_service"
ROLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

SUPERUSER_PASSWORD_FILE = "superuser-password"
OWNER_PASSWORD_FILE = "owner-password"
SERVICE_PASSWORD_FILE = "service-password"
"""The files each password is kept in, in the embedded cluster's directory and compose's credential volumes."""

SCRAM_ITERATIONS = 4096
"""Postgres' own default (`scram_iterations`)."""


def checked_role(name: str) -> str:
    """`name` if it can be used unquoted-safe in the statements below (letters, digits, `_`), else ValueError."""
    if not ROLE_NAME.match(name):
        raise ValueError(f"role name {name!r} must match {ROLE_NAME.pattern}")
    return name


def quoted(identifier: str) -> str:
    """An identifier (a database's name) quoted for SQL."""
    return '"' + identifier.replace('"', '""') + '"'


def scram_verifier(password: str, *, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier Postgres stores for `password` (RFC 5802, as `PQencryptPasswordConn` makes it)."""
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def login_sql(role: str, password: str) -> list[str]:
    """Create `role` if absent and (re)set it to a plain login with `password`: no superuser, no role or database
    creation, no replication, no RLS bypass, whatever it was before."""
    role = checked_role(role)
    return [
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN CREATE ROLE {role}; END IF; END $$",
        f"ALTER ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT "
        f"PASSWORD '{scram_verifier(password)}'",
    ]


def password_sql(role: str, password: str) -> str:
    """Set `role`'s password (the superuser's own, say) as a verifier."""
    return f"ALTER ROLE {checked_role(role)} PASSWORD '{scram_verifier(password)}'"


def database_sql(database: str, owner: str, service: str) -> list[str]:
    """Run in the server's maintenance database once the database exists: the owner owns it, nobody else but the
    service role may connect (and use temporary tables: `modelpool replay` rebuilds into them)."""
    name, owner, service = quoted(database), checked_role(owner), checked_role(service)
    return [
        f"ALTER DATABASE {name} OWNER TO {owner}",
        f"REVOKE ALL ON DATABASE {name} FROM PUBLIC",
        f"GRANT CONNECT, TEMPORARY ON DATABASE {name} TO {service}",
    ]


def schemas_sql(owner: str) -> list[str]:
    """Run in the database: hand every schema a superuser made there (a cluster migrated before the owner role
    existed), with its tables, sequences and functions, to the owner, so migrations run as the owner can change
    them. Schemas already the owner's, and Postgres' own, are left alone."""
    owner = checked_role(owner)
    return [
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        f"""DO $$
DECLARE
    s record;
    r record;
BEGIN
    FOR s IN SELECT n.oid, n.nspname FROM pg_namespace n JOIN pg_roles o ON o.oid = n.nspowner
             WHERE o.rolsuper AND n.nspname NOT LIKE 'pg\\_%' AND n.nspname NOT IN ('public', 'information_schema')
    LOOP
        RAISE NOTICE 'schema % now belongs to {owner}', s.nspname;
        EXECUTE format('ALTER SCHEMA %I OWNER TO {owner}', s.nspname);
        -- Tables carry their identity sequences along; free-standing sequences and views go one by one.
        FOR r IN SELECT c.relname, c.relkind FROM pg_class c
                 WHERE c.relnamespace = s.oid AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
                   AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                                   AND d.objid = c.oid AND d.deptype IN ('a', 'i'))
        LOOP
            EXECUTE format('ALTER %s %I.%I OWNER TO {owner}',
                           CASE r.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                                          WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE 'TABLE' END,
                           s.nspname, r.relname);
        END LOOP;
        FOR r IN SELECT p.oid::regprocedure AS signature FROM pg_proc p WHERE p.pronamespace = s.oid LOOP
            EXECUTE format('ALTER ROUTINE %s OWNER TO {owner}', r.signature);
        END LOOP;
    END LOOP;
END $$""",
    ]

"""The bus's users, made once and kept: a password per user, and the NATS server's configuration that knows them.

    users = make_bus_users(directory, Subjects("modelpool"), workers=["w1"])
    EmbeddedNats(data_dir, config=users.server_config)      # refuses clients without credentials
    env["MODELPOOL_NATS_CREDENTIALS_FILE"] = str(users.credentials_file("gateway"))

`directory` holds, each readable by its owner only (mode 0600):

- `<user>.json` (or `<user>/nats.json` with `own_directories`, where each user's
  directory is a volume of its own: compose): the user's name and password
  (`shared/bus/auth.py` reads it), one
  per role (`gateway`, `autoscaler`, `placement`, `relay`, `projector`,
  `operator`), one per known worker (`worker-<id>`), and `worker` for workers
  whose ids are not known in advance when asked for;
- `nats-server.conf` (`server/nats-server.conf` with `own_directories`): an
  `authorization` block listing every user with its
  password as a bcrypt hash and its role's permissions (`permissions.py`),
  included by the server's own configuration or given to it as its config file.

A password once made is kept: calling again (every start of `modelpool up`) adds
the users of new workers and writes the server's configuration afresh from the
kept passwords and the current permissions. Rotating a user's password is
deleting its file and starting again (docs/security.md).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import bcrypt

from shared.bus.auth import BusCredentials, read_credentials_file
from shared.bus.permissions import ROLES, SHARED_WORKER, Permissions, permissions, user_name
from shared.bus.subjects import Subjects
from shared.private_files import write_private

SERVER_CONFIG = "nats-server.conf"
BCRYPT_COST = 10
"""nats-server checks a bcrypt hash at every connection: 10 costs it tens of milliseconds per connection."""
SUBJECT_TOKEN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


CREDENTIALS_FILE = "nats.json"
SERVER_DIRECTORY = "server"


def _credentials_path(directory: Path, user: str, own_directories: bool) -> Path:
    return directory / user / CREDENTIALS_FILE if own_directories else directory / f"{user}.json"


@dataclass(frozen=True)
class BusUsers:
    directory: Path
    users: dict[str, tuple[BusCredentials, Permissions]]
    own_directories: bool = False

    @property
    def server_config(self) -> Path:
        return (self.directory / SERVER_DIRECTORY if self.own_directories else self.directory) / SERVER_CONFIG

    def credentials_file(self, user: str) -> Path:
        if user not in self.users:
            raise KeyError(f"no bus user {user!r} in {self.directory} (there are {', '.join(sorted(self.users))})")
        return _credentials_path(self.directory, user, self.own_directories)

    def credentials(self, user: str) -> BusCredentials:
        return self.users[user][0]


def _check_worker_id(worker_id: str) -> str:
    if not worker_id or not set(worker_id) <= SUBJECT_TOKEN:
        raise ValueError(f"worker id {worker_id!r}: only letters, digits, '_' and '-' make a subject token")
    return worker_id


def _kept_or_new(path: Path, user: str) -> BusCredentials:
    if path.exists():
        found = read_credentials_file(path, source="bus credentials")
        if found.user == user:
            os.chmod(path, 0o600)
            return found
    made = BusCredentials(user, secrets.token_urlsafe(32))
    write_private(path, made.to_json())
    return made


def authorization_block(users: Iterable[tuple[BusCredentials, Permissions]], cost: int = BCRYPT_COST) -> str:
    """nats-server's `authorization` block for these users: bcrypt-hashed passwords, allow-lists only."""
    entries = []
    for credentials, allowed in users:
        hashed = bcrypt.hashpw(credentials.password.encode(), bcrypt.gensalt(cost, prefix=b"2a")).decode()
        entries.append({"user": credentials.user, "password": hashed, "permissions": {
            "publish": {"allow": list(allowed.publish)}, "subscribe": {"allow": list(allowed.subscribe)}}})
    # JSON is valid nats-server configuration; strings quoted so `$JS...` and `$2a$...` are never variables.
    return "authorization {\n  users = " + json.dumps(entries, indent=2).replace("\n", "\n  ") + "\n}\n"


def make_bus_users(directory: Path | str, subjects: Subjects, *, workers: Iterable[str] = (),
                   shared_worker: bool = False, own_directories: bool = False, cost: int = BCRYPT_COST) -> BusUsers:
    """Every role's user (and each known worker's, and the shared worker's if asked), passwords kept where present;
    the server's configuration written afresh."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    wanted: list[tuple[str, str | None]] = [(role, None) for role in ROLES if role != "worker"]
    wanted += [("worker", _check_worker_id(w)) for w in dict.fromkeys(workers)]
    if shared_worker:
        wanted.append(("worker", None))
    users = {}
    for role, worker_id in wanted:
        user = user_name(role, worker_id) if role != "worker" or worker_id else SHARED_WORKER
        path = _credentials_path(directory, user, own_directories)
        users[user] = (_kept_or_new(path, user), permissions(subjects, role, worker_id))
    found = BusUsers(directory, users, own_directories)
    header = (f"# modelpool's bus users for namespace {subjects.namespace!r}, written by modelpool; the passwords are\n"
              f"# bcrypt hashes, each user's own beside it (docs/security.md).\n")
    write_private(found.server_config, header + authorization_block(users.values(), cost))
    return found

"""A service's own credentials on the bus: which NATS user it connects as, and with what password.

A NATS server that knows modelpool's users (`shared/bus/users.py` makes them;
`modelpool up` runs its embedded server so) refuses a client without
credentials, and lets each user publish and subscribe only where its role needs
(`shared/bus/permissions.py`). A service is given its own user's credentials,
and nothing else's:

- `MODELPOOL_NATS_CREDENTIALS_FILE`: a file (mode 0600) holding
  `{"user": ..., "password": ...}`, as `modelpool up`, `modelpool credentials`
  (compose) and `users.py` write them; or
- `MODELPOOL_NATS_USER` and `MODELPOOL_NATS_PASSWORD` (a Kubernetes Secret's keys).

They go to the server in the connection's handshake, never in a URL: NATS_URL is
printed and logged as it is. With none configured a service connects as it
always did, to a server that asks for none (the test suite's).

Each user's replies come to inboxes of its own (`_INBOX.<user>.>`), the only
subjects outside its role's that it may subscribe to: no user reads another's
replies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

USER_ENV = "MODELPOOL_NATS_USER"
PASSWORD_ENV = "MODELPOOL_NATS_PASSWORD"
FILE_ENV = "MODELPOOL_NATS_CREDENTIALS_FILE"


class CredentialsError(ValueError):
    """The configured NATS credentials are unusable (the message names the setting)."""


def inbox_prefix(user: str) -> str:
    """Where a user's replies come: a subject space of its own, so that no user reads another's."""
    return f"_INBOX.{user}"


@dataclass(frozen=True)
class BusCredentials:
    user: str
    password: str = field(repr=False)

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.user)

    def connect_options(self) -> dict[str, Any]:
        """What nats-py's `connect` (and FastStream's broker) take to connect as this user."""
        return {"user": self.user, "password": self.password, "inbox_prefix": self.inbox_prefix}

    def to_json(self) -> str:
        return json.dumps({"user": self.user, "password": self.password}) + "\n"


def read_credentials_file(path: str | Path, source: str = FILE_ENV) -> BusCredentials:
    """A credentials file's user and password; an unreadable or malformed file is an error naming `source`."""
    where = f"{source} ({path})"
    try:
        found = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CredentialsError(f"{where}: cannot read it: {exc.strerror}") from None
    except ValueError:
        raise CredentialsError(f"{where}: not JSON; it holds {{\"user\": ..., \"password\": ...}}") from None
    if not isinstance(found, dict) or not all(isinstance(found.get(k), str) and found[k] for k in ("user", "password")):
        raise CredentialsError(f"{where}: needs a non-empty \"user\" and \"password\"")
    return BusCredentials(found["user"], found["password"])


def load_credentials(user: str | None, password: str | None, path: str | None) -> BusCredentials | None:
    """The credentials given by `user` and `password`, else read from the file at `path`; None when neither is."""
    if user or password:
        if not (user and password):
            missing = PASSWORD_ENV if user else USER_ENV
            raise CredentialsError(f"{missing}: {USER_ENV} and {PASSWORD_ENV} go together")
        return BusCredentials(user, password)
    if path:
        return read_credentials_file(path)
    return None


def credentials_from_environment(environ: Mapping[str, str]) -> BusCredentials | None:
    return load_credentials(environ.get(USER_ENV), environ.get(PASSWORD_ENV), environ.get(FILE_ENV))

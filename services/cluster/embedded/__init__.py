"""Real NATS (JetStream) and PostgreSQL servers started from their Python wheels.

`modelpool up` and the test suite use these when no external server is named by
`NATS_URL` / `DATABASE_URL`. Both are synchronous context managers:

    with EmbeddedNats(".modelpool/nats") as nats, EmbeddedPostgres(".modelpool/postgres") as pg:
        print(nats.url, pg.url)

Lifetime rules, the same for both servers:
- the server runs in its own session and process group, so a Ctrl-C typed in the
  terminal reaches only the parent, which then stops the server in order;
- the kernel sends the server a signal when the thread that started it dies
  (PR_SET_PDEATHSIG), so even a SIGKILLed parent leaves nothing running; start
  servers from a thread that lives as long as they should (the main thread),
  or pass `die_with_parent=False` and rely on `stop()` alone;
- the data directory is kept between runs: a second start skips initialisation
  and only replays what the server needs to recover;
- `start()` again, after `stop()` or after the server died (`running` is False,
  `returncode` says how it ended), starts it on the same port and data, so
  clients find it at the URL they were given; its log is appended to.

`base.py` holds what both share; `nats.py` and `postgres.py` one server each.
"""

from services.cluster.embedded.base import LOCALHOST, EmbeddedServer, EmbeddedServerError
from services.cluster.embedded.nats import EmbeddedNats, find_nats_server
from services.cluster.embedded.postgres import EmbeddedPostgres, find_postgres_bin, service_account

__all__ = ["LOCALHOST", "EmbeddedNats", "EmbeddedPostgres", "EmbeddedServer", "EmbeddedServerError",
           "find_nats_server", "find_postgres_bin", "service_account"]

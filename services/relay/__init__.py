"""`modelpool relay`: the outbox relay, committed events from the log to the bus (the logic: `shared/bus/relay.py`)."""

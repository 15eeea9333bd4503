"""`modelpool projector`: the read models kept in Postgres (the logic: `shared/projections/projector.py`)."""

"""The event log's contract suite runs against every store (the `any_store` fixture, in tests/conftest.py)."""

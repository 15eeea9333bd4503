"""A whole cluster on one machine: `modelpool up` (`up.py`: embedded servers from `embedded.py`, every service),
the same as processes for tests and benchmarks (`localpool.py`), both on one supervisor (`supervisor.py`), and
the faults the chaos suite injects into one (`chaos.py`)."""

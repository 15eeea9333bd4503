"""A whole cluster on one machine: `modelpool up` (embedded servers, every service, supervised), the same as
processes for tests and benchmarks (`localpool.py`), and the faults the chaos suite injects into one."""

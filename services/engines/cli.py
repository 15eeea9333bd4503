"""`modelpool engine KIND ...`: dispatch to an engine server."""

from __future__ import annotations

import importlib
import sys

ENGINES: dict[str, str] = {
    "llama.cpp": "services.engines.llamacpp.cli",
    "llama-server": "services.engines.llama_server.cli",
    "sim": "services.engines.simulated.cli",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ENGINES:
        print(f"usage: modelpool engine {{{'|'.join(ENGINES)}}} [ARGS...]", file=sys.stderr)
        return 2
    return int(importlib.import_module(ENGINES[argv[0]]).main(argv[1:]) or 0)

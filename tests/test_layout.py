"""The decision cores import only the contracts: `policy/` and `routing/` run the same in the services, the lab,
`replay --verify-decisions` and the tests, with no I/O of their own."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PURE = ("policy", "routing")
ALLOWED = ("shared.contracts", *PURE)
THIRD_PARTY_ALLOWED = ("pydantic",)  # the contracts' own base; no clients, servers or clocks


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_the_decision_cores_import_only_the_contracts_and_the_standard_library():
    stdlib = sys.stdlib_module_names
    outside = []
    for package in PURE:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.startswith("test_") or path.name == "testing.py":
                continue
            for name in imports_of(path):
                top = name.split(".")[0]
                if top in stdlib or top == "__future__" or top in THIRD_PARTY_ALLOWED:
                    continue
                if not any(name == a or name.startswith(a + ".") for a in ALLOWED):
                    outside.append(f"{path.relative_to(ROOT)}: {name}")
    assert outside == [], "a decision core imports beyond the contracts:\n" + "\n".join(outside)

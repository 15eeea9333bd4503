"""Every benchmark script still starts: its imports and arguments match the code it measures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "harness.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_benchmark_starts(script):
    done = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout

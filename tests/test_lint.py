"""The tree passes `ruff check` with the configuration in pyproject.toml (CI runs this test)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_ruff_finds_nothing():
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=root, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

"""Shared fixtures. Subprocesses (CLI, torchrun) must import this checkout's vltrain."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SRC = str(TESTS.parent / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)
os.environ["PYTHONPATH"] = SRC + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def cli(tmp_path):
    """Run ``python -m vltrain ARGS`` in a subprocess; returns the CompletedProcess."""
    import subprocess

    def run(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "vltrain", *map(str, args)],
            capture_output=True, text=True, timeout=timeout, cwd=cwd or tmp_path,
        )

    return run

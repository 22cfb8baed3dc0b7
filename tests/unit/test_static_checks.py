"""The annotations are checked and the code is linted as part of the suite, so `./dev test` (and
CI, which runs it) fails on either. The settings are in pyproject.toml ([tool.mypy], [tool.ruff])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.timeout(900)  # a cold mypy on a loaded 2-core machine
def test_mypy_finds_no_error():
    done = _run("mypy")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


def test_ruff_finds_nothing():
    done = _run("ruff", "check", "toolq", "tests")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]

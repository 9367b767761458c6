"""The tree is lint-clean and the package type-checks: ruff and mypy (pinned in the test extras,
configured in pyproject.toml) run as a contributor runs them by hand, from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The torch build .ci/run installs: its annotations are what the package is checked against (another
# torch's may differ, and is not what CI runs).
TYPED_AGAINST_TORCH = "2.13.0"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    done = _run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(torch.__version__.split("+")[0] != TYPED_AGAINST_TORCH,
                    reason=f"the package is type-checked against torch {TYPED_AGAINST_TORCH}")
def test_mypy_finds_nothing_in_the_package() -> None:
    done = _run("mypy")  # the files and settings of [tool.mypy]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr

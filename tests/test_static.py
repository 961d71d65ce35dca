"""The code follows the rules its own configuration states (pyproject.toml): ruff's lint
rules and format, and mypy's types on the package. Skipped only where the tools are not
installed (they are in the ``test`` extra)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=REPO, capture_output=True, text=True, timeout=1800)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_lint() -> None:
    r = _run("ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_format() -> None:
    r = _run("ruff", "format", "--check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_on_the_package() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    r = _run(sys.executable, "-m", "mypy", "hcapo_store", "cli.py")
    assert r.returncode == 0, r.stdout + r.stderr

"""The code passes ruff, mypy and the import contracts with the project's settings
(pyproject.toml's ``[tool.ruff]``, ``[tool.mypy]`` and ``[tool.importlinter]``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests"],
                            cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(600)
def test_mypy_finds_nothing():
    """Type-checks src/shardline (about 25 s on 2 cores without mypy's cache)."""
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True,
                            timeout=580)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_imports_keep_to_their_floors_without_circles():
    """import-linter's contracts: cli > bench > local cluster > control > connect > api >
    node > runner > parallel > placement > models > the ground floor, and no circle among
    a package's modules (node's roles aside, written in the contract)."""
    result = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr

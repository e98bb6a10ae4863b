"""An installed shardline carries every non-Python file it reads at run time: the package
data globs of pyproject.toml cover the kernel sources (compiled on first use, headers
included) and the dashboard's static files."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "shardline"


@pytest.mark.fast
@pytest.mark.timeout(10)
def test_package_data_covers_the_kernel_sources_and_static_files():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["shardline"]
    needed = [
        p
        for folder in ("models/kernels", "api/static")
        for p in (PACKAGE / folder).rglob("*")
        if p.is_file() and p.suffix != ".pyc"
    ]
    assert any(p.suffix == ".h" for p in needed)
    missing = [str(p.relative_to(PACKAGE)) for p in needed if not any(p.relative_to(PACKAGE).match(g) for g in globs)]
    assert not missing, f"not in the package data: {missing}"

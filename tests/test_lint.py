"""The code passes ruff (its linter and its formatter), mypy and the import contracts with
the project's settings (pyproject.toml's ``[tool.ruff]``, ``[tool.mypy]`` and
``[tool.importlinter]``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_ruff_finds_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_the_code_is_as_ruff_formats_it():
    """``ruff format`` would change nothing (``ruff format src tests`` writes it so)."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "src", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(600)
def test_mypy_finds_nothing():
    """Type-checks src/shardline (about 25 s on 2 cores without mypy's cache)."""
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_imports_keep_to_their_floors_without_circles():
    """import-linter's contracts: cli > bench > local cluster > control > connect > api >
    node > runner > parallel > placement > models > the ground floor, and no circle among
    a package's modules (node's roles aside, written in the contract)."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr


MAX_FUNCTION_LINES = 80
"""The most lines a function in src/shardline may take, ``def`` to its last line, its
docstring included."""


def _long_functions(root: Path) -> dict[tuple[str, str], int]:
    """Each function in ``root``'s modules over MAX_FUNCTION_LINES, by (path, qualified
    name), with its lines."""
    import ast

    found: dict[tuple[str, str], int] = {}
    for path in sorted(root.rglob("*.py")):
        module = str(path.relative_to(root.parent))

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = prefix + child.name
                    if not isinstance(child, ast.ClassDef):
                        lines = (child.end_lineno or child.lineno) - child.lineno + 1
                        if lines > MAX_FUNCTION_LINES:
                            found[(module, name)] = lines
                    visit(child, name + ".")
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_no_function_is_over_80_lines():
    """No function in src/shardline is over MAX_FUNCTION_LINES lines (decorators aside)."""
    found = _long_functions(ROOT / "src" / "shardline")
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"

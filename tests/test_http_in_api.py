"""All HTTP serving is in api/ (issue 44): no module of node/ imports an HTTP framework
(httpx, the client, is the node's: peer_client and what it runs) or anything of api/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

NODE = Path(__file__).resolve().parent.parent / "src" / "shardline" / "node"
SERVING = ("fastapi", "starlette", "uvicorn", "shardline.api")


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_node_imports_no_http_framework_and_nothing_of_api():
    found = {
        f"{p.name}: {name}"
        for p in sorted(NODE.glob("*.py"))
        for name in imported(p)
        if name in SERVING or name.startswith(tuple(s + "." for s in SERVING))
    }
    assert not found, f"node/ imports what serves HTTP: {sorted(found)}"

"""A Python file's absolute imports, read from its source (the layout and image tests check them)."""

from __future__ import annotations

import ast
from pathlib import Path


def import_statements(source: Path) -> list[tuple[str, list[str]]]:
    """Each absolute import anywhere in ``source``: ``import a, b`` as ``("a", [])`` and ``("b", [])``,
    ``from a import b, c`` as ``("a", ["b", "c"])``."""
    statements: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            statements += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            statements.append((node.module, [alias.name for alias in node.names]))
    return statements

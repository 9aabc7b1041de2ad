"""The layout's rules, read from the source: which folder may import which, no import circles, the
server package used through its entry points, test modules importing no other test module."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

import server
from server.paths import ROOT
from tests.harness.imports import import_statements

# Each folder and the folders its code may import (tests may import everything).
ALLOWED = {
    "handler": set(),
    "clients": set(),
    "server": set(),
    "model_making": {"server"},
    "observability": {"handler", "server"},
    "loadtest": {"server"},
    "bench": {"handler", "server", "model_making", "loadtest"},
}
# handler/'s rooms and the rooms each may import: imports run down, never back up (docs/architecture.md).
# A room is a package of handler/ or one of the worker's modules at its top.
HANDLER_ROOMS = {
    "config": set(),
    "metrics": set(),
    "control": set(),
    "single_worker": set(),
    "families": {"config"},
    "checkpoints": {"config"},
    "adapters": {"config", "families", "checkpoints"},
    "engine": {"config", "families", "adapters", "checkpoints"},
    "api": {"config", "adapters"},
    "service": {"config", "metrics", "families", "adapters", "engine", "api"},
    "sd_handler": {"config", "metrics", "control", "single_worker", "api", "engine", "service"},
}
# What the operations side may import of server/: the package (its entry points, server.__all__) and the paths.
ENTRY_MODULES = {"server", "server.paths"}
FOLDERS = (*ALLOWED, "tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")}


@cache
def imports(module: str) -> frozenset[str]:
    """The project's modules that ``module`` imports, anywhere in its body (``from a import b`` names
    ``a.b`` where that is a module)."""
    found = set()
    for imported, names in import_statements(modules()[module]):
        found |= {name for name in [imported, *(f"{imported}.{name}" for name in names)] if name in modules()}
    return frozenset(found)


def folder(module: str) -> str:
    return module.split(".")[0]


def test_every_folder_says_what_it_holds():
    for name in ALLOWED:
        docstring = ast.get_docstring(ast.parse((ROOT / name / "__init__.py").read_text()))
        assert docstring and len(docstring) > 40, f"{name}/__init__.py has no docstring saying what the folder holds"


@pytest.mark.parametrize("name", ALLOWED)
def test_a_folder_imports_only_the_folders_below_it(name):
    for module in (module for module in modules() if folder(module) == name):
        for imported in imports(module):
            allowed = ALLOWED[name] | {name}
            assert folder(imported) in allowed, f"{module} imports {imported}; {name}/ may import {sorted(allowed)}"


def room(module: str) -> str | None:
    """The handler room of a handler module (None for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_handler_has_exactly_these_rooms():
    rooms = {room(module) for module in modules() if folder(module) == "handler"} - {None}
    assert rooms == set(HANDLER_ROOMS), "a new room of handler/ goes into HANDLER_ROOMS and docs/architecture.md"


@pytest.mark.parametrize("name", HANDLER_ROOMS)
def test_a_handler_room_imports_only_the_rooms_below_it(name):
    allowed = HANDLER_ROOMS[name] | {name, None}
    for module in (module for module in modules() if folder(module) == "handler" and room(module) == name):
        for imported in imports(module):
            assert room(imported) in allowed, (
                f"{module} imports {imported}; handler/{name} may import {sorted(allowed - {None})}"
            )


def test_the_operations_side_uses_the_server_package_through_its_entry_points():
    for module in (module for module in modules() if folder(module) not in {"server", "tests"}):
        for imported in imports(module):
            if folder(imported) == "server":
                assert imported in ENTRY_MODULES, (
                    f"{module} imports {imported}: use `from server import` or server.paths"
                )
        for imported, names in import_statements(modules()[module]):
            if imported == "server":
                taken = set(names) - set(server.__all__)
                assert not taken, f"{module} takes {taken} from server"


def test_no_module_imports_itself_through_a_circle():
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in done:
            return
        assert module not in visiting, "import circle: " + " -> ".join([*visiting[visiting.index(module) :], module])
        visiting.append(module)
        for imported in sorted(imports(module)):
            visit(imported)
        visiting.pop()
        done.add(module)

    for module in sorted(modules()):
        visit(module)


def test_test_modules_share_helpers_through_the_harness_not_each_other():
    for module in (module for module in modules() if folder(module) == "tests"):
        for imported in imports(module):
            leaf = imported.rsplit(".", 1)[-1]
            assert not leaf.startswith("test_") and leaf != "conftest", (
                f"{module} imports {imported}: shared helpers go in tests/harness/, fixtures in a conftest"
            )

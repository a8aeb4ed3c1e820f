"""DESIGN's floors, held by test: a room of rl_async imports only rooms on lower floors (or
itself), nothing in rl_async imports the actors, the launcher or Ray, and the package root
holds only `__init__.py` and the rooms."""

import ast
import re
from pathlib import Path

import pytest

import rl_async

ROOT = Path(rl_async.__file__).parent

# Ground floor first. Rooms on one floor do not import each other.
FLOORS = [
    {"base"},
    {"algo", "observe"},
    {"plan"},
    {"state"},
    {"engine"},
    {"train", "loop"},
    {"sim"},
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
ABOVE_EVERYTHING = ("actors", "launch", "ray")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, lazy ones inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "rl_async":  # `from rl_async import room`
                found += [(node.lineno, f"rl_async.{a.name}") for a in node.names]
    return found


def violations(root: Path = ROOT) -> list[str]:
    """Every import that runs against the floors, as `file:line imports module (why)`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) == 1:
            continue  # the package root's __init__ re-exports; it sits above every room
        room = rel.parts[0]
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top in ABOVE_EVERYTHING:
                out.append(f"{rel}:{line} imports {module} (rl_async never imports {top})")
                continue
            parts = module.split(".")
            if top != "rl_async" or len(parts) < 2 or parts[1] == room:
                continue
            target = parts[1]
            if target not in FLOOR:
                continue  # a name re-exported at the package root: its own test below
            if FLOOR[target] >= FLOOR[room]:
                out.append(f"{rel}:{line} imports {module} ({room} is on floor "
                           f"{FLOOR[room]}, {target} on floor {FLOOR[target]})")
    return out


def test_every_room_is_on_a_floor_and_the_root_holds_only_rooms():
    rooms = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(FLOOR), f"rooms on disk {sorted(rooms)} vs floors {sorted(FLOOR)}"
    loose = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a room: {loose}"


def test_no_room_imports_a_room_above_it():
    assert violations() == []


def rooms_imported(room: str, root: Path = ROOT) -> set[str]:
    """The other rooms a room's files import."""
    used = set()
    for path in (root / room).rglob("*.py"):
        for _, module in _imports(path):
            parts = module.split(".")
            if parts[0] == "rl_async" and len(parts) > 1 and parts[1] in FLOOR \
                    and parts[1] != room:
                used.add(parts[1])
    return used


def rooms_declared(room: str, root: Path = ROOT) -> set[str]:
    """The rooms named (in backticks) in the `Imports:` paragraph of a room's docstring."""
    doc = ast.get_docstring(ast.parse((root / room / "__init__.py").read_text())) or ""
    assert "Imports:" in doc, f"rl_async/{room}/__init__.py needs an `Imports:` paragraph"
    paragraph = doc.split("Imports:", 1)[1].split("\n\n")[0]
    return {word for word in re.findall(r"`([a-z_]+)`", paragraph) if word in FLOOR}


@pytest.mark.parametrize("room", sorted(FLOOR))
def test_every_room_says_exactly_which_rooms_it_imports(room):
    assert rooms_declared(room) == rooms_imported(room), (
        f"rl_async/{room}/__init__.py's `Imports:` names {sorted(rooms_declared(room))}, its "
        f"files import {sorted(rooms_imported(room))}: make the docstring say what is true")


def test_a_room_imports_names_from_their_own_room_not_the_package_root():
    """`from rl_async import CompletedBuffer` inside a room hides which room it reaches into
    (the floors check cannot see it): rooms import from the module that defines a name."""
    found = [f"{p.relative_to(ROOT)}:{line} imports {module}"
             for p in sorted(ROOT.rglob("*.py")) if len(p.relative_to(ROOT).parts) > 1
             for line, module in _imports(p)
             if module.startswith("rl_async.") and module.split(".")[1] not in FLOOR]
    assert found == []


def test_an_upward_import_is_caught(tmp_path):
    """The check itself can fail: a copy of two rooms where the algorithm imports the loop."""
    for room in ("algo", "loop"):
        (tmp_path / room).mkdir()
        (tmp_path / room / "__init__.py").write_text('"""Imports: x."""\n')
    (tmp_path / "algo" / "loss.py").write_text(
        "def f():\n    from rl_async.loop.controller import Controller\n")
    (tmp_path / "loop" / "x.py").write_text("import actors.fleet\n")
    found = violations(tmp_path)
    assert any("algo/loss.py:2 imports rl_async.loop.controller" in v for v in found)
    assert any("loop/x.py:1 imports actors.fleet" in v for v in found)


@pytest.mark.parametrize("name", ["CompletedBuffer", "Group", "Sample", "policy_loss"])
def test_the_public_names_import_from_the_package_root(name):
    from importlib import import_module
    assert getattr(import_module("rl_async"), name).__name__ == name

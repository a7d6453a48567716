"""No import cycles inside a layer: in ``app/`` and ``runner/`` every module's imports form a tree-like order.

Every import counts, wherever it is written: at the top, inside a function (a cycle hidden until the call)
and under ``TYPE_CHECKING`` (a cycle the type checker sees): a module that needs its importer back is one
module split in two, or a neighbour that belongs lower down.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_layering import ROOT, imported_modules, module_name

# layer folder -> its package
LAYERS = {"app": "arstream.app", "runner": "arstream.runner"}


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    """Each module of ``folder`` -> the modules of the same folder it imports (``from . import x`` included)."""
    paths = {module_name(path, folder, package): path for path in sorted(folder.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        graph[module] = {name for name in imported_modules(path, module) if name in paths and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_a_layer_has_no_import_cycle(folder: str) -> None:
    assert cycles(import_graph(ROOT / folder, LAYERS[folder])) == []


def test_the_check_sees_cycles_hidden_in_functions_and_type_checking(tmp_path: Path) -> None:
    """Three modules of a package ``pkg``: ``a`` imports ``b`` at the top, ``b`` imports ``a`` inside a function;
    ``c`` imports ``a`` under ``TYPE_CHECKING`` and ``a`` imports ``c`` inside a method."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from . import b\n\nclass A:\n    def f(self):\n        from .c import C\n")
    (tmp_path / "b.py").write_text("def g():\n    from .a import A\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    (tmp_path / "d.py").write_text("from .b import g\n")  # imports into the cycle; not part of it
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b", "pkg.c"]]

"""One thread owns the runtime: outside ``app/worker.py`` no product code reads the worker's runtime.

Everything that needs the runtime (exports, imports, branches, parking) hands a function to
``ModelWorker.call``, which runs it on the worker's thread (app/transfers.py). Reading ``worker.runtime``
(or the old ``worker.runner``) anywhere else would run model code, or hash weights, on the event loop.
"""

from __future__ import annotations

import ast

import pytest

from test_layering import ROOT

OWNER = ROOT / "app" / "worker.py"
PRODUCT_FOLDERS = ("app", "programs", "runner", "models", "arstream")
RUNTIME_NAMES = {"runtime", "runner", "_runtime"}


def names_a_worker(node: ast.expr) -> bool:
    """``worker``, ``self.worker``, ``hub.worker``, ``self._worker()``: an expression that is a worker."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return "worker" in node.id.lower()
    return isinstance(node, ast.Attribute) and "worker" in node.attr.lower()


def runtime_reads(source: str) -> list[int]:
    """Lines that read a worker's runtime: ``<worker>.runtime`` or ``getattr(<worker>, "runtime")``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in RUNTIME_NAMES and names_a_worker(node.value):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and names_a_worker(node.args[0])
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in RUNTIME_NAMES
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_nothing_outside_the_worker_reads_its_runtime() -> None:
    files = [
        path
        for folder in PRODUCT_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.resolve() != OWNER.resolve()
    ]
    assert files
    offenders = [
        f"{path.relative_to(ROOT)}:{line}" for path in files for line in runtime_reads(path.read_text())
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("plan = getattr(worker.runner, 'plan', None)\n", [1]),
        ("x = 1\nif hub.worker is None or hub.worker.runtime is None:\n    pass\n", [2]),
        ("check(self.hub.worker.runtime, header)\n", [1]),
        ("getattr(self._worker(), 'runtime')\n", [1]),
        ("stats = worker.runner_stats\nworker.call(lambda on: on.runtime.stats())\n", []),
    ],
)
def test_the_check_sees_a_read_of_the_runtime(source: str, expected: list[int]) -> None:
    assert runtime_reads(source) == expected

"""The one import arrow the architecture forbids: the runtime (``runner/``) never imports a model or the transport.

Tools that drive a model (``bench runner``, ``bench model``) live in ``models/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

RUNNER_DIR = Path(__file__).resolve().parent.parent / "runner"
FORBIDDEN = ("arstream.models", "arstream.app")


def imported_modules(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.append(node.module)
    return modules


def test_the_runtime_never_imports_a_model_or_the_transport() -> None:
    files = sorted(RUNNER_DIR.rglob("*.py"))
    assert files, RUNNER_DIR
    offenders = [
        f"{path.relative_to(RUNNER_DIR)}: {module}"
        for path in files
        for module in imported_modules(path)
        if module.startswith(FORBIDDEN)
    ]
    assert offenders == []


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("import torch\nfrom arstream.models.toy_attention import run_chunk\n")
    assert [m for m in imported_modules(module) if m.startswith(FORBIDDEN)] == ["arstream.models.toy_attention"]

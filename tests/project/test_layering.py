"""The import arrows the architecture forbids: the runtime (``runner/``) never imports a model or the transport,
the models (``models/``) never import the transport, and the server (``app/``) never imports the programs
that run beside it (``programs/``: client, bench serve, gpu-check, drain) nor the distributed code of a replica
over several devices (``runner/distributed/``, ``torch.distributed``).

Tools that drive a model (``bench runner``, ``bench model``, ``train``, ``eval``) live in ``programs/``, beside
the models they drive and never inside them: ``models/`` holds what a server loads and nothing that trains, evaluates
or measures. The ``arstream`` command tree that names them all is ``arstream/cli.py``, outside every layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# layer folder -> (its package, the packages it must never import)
RULES = {
    "runner": ("arstream.runner", ("arstream.models", "arstream.app", "arstream.programs")),
    "models": ("arstream.models", ("arstream.app", "arstream.programs")),
    # a replica over several devices is the runtime's business: the server never sees a process group
    "app": ("arstream.app", ("arstream.programs", "arstream.runner.distributed", "torch.distributed")),
}


def module_name(path: Path, folder: Path, package: str) -> str:
    """``models/tiny_world/model.py`` under ``arstream.models`` is ``arstream.models.tiny_world.model``."""
    parts = path.relative_to(folder).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


def imported_modules(path: Path, module: str) -> list[str]:
    """Absolute names of every module ``path`` (the module ``module``) imports; relative imports resolved."""
    is_package = path.name == "__init__.py"
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                # ``from . import x`` in a plain module is relative to its package, in __init__ to itself
                anchor = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = ".".join([*anchor[: len(anchor) - drop], *([node.module] if node.module else [])])
            # ``from arstream import app`` imports arstream.app: count each name as a possible submodule too
            modules += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return modules


def forbidden(modules: list[str], packages: tuple[str, ...]) -> list[str]:
    """The imported modules inside ``packages``, each import once (``a.b`` and its ``a.b.c`` read as ``a.b``)."""
    hits = {name for name in modules if any(name == p or name.startswith(p + ".") for p in packages)}
    return sorted(name for name in hits if not any(name.startswith(other + ".") for other in hits))


@pytest.mark.parametrize("folder", sorted(RULES))
def test_a_layer_never_imports_what_sits_above_it(folder: str) -> None:
    package, packages = RULES[folder]
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    offenders = [
        f"{path.relative_to(ROOT)}: {imported}"
        for path in files
        for imported in forbidden(imported_modules(path, module_name(path, ROOT / folder, package)), packages)
    ]
    assert offenders == []


# What only a tool imports: an optimizer (training), the command tree (a program's entry) and the side-by-side
# measurement helpers (benches).
TOOL_IMPORTS = ("torch.optim", "arstream.cli", "arstream.measure")
TRAINING_CALLS = ("torch.optim.", ".backward(")  # an optimizer reached through ``import torch``, a gradient step


def test_models_hold_no_training_evaluation_or_bench_code() -> None:
    folder = ROOT / "models"
    offenders = [
        f"{path.relative_to(ROOT)}: {imported}"
        for path in sorted(folder.rglob("*.py"))
        for imported in forbidden(imported_modules(path, module_name(path, folder, "arstream.models")), TOOL_IMPORTS)
    ]
    offenders += [
        str(path.relative_to(ROOT))
        for path in sorted(folder.rglob("*.py"))
        if path.stem.startswith(("train", "bench", "eval")) or any(s in path.read_text() for s in TRAINING_CALLS)
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch\nfrom arstream.models.toy_attention import run_chunk\n", ["arstream.models.toy_attention"]),
        ("from arstream.app.cli import main_for\n", ["arstream.app.cli"]),
        ("from arstream import app\n", ["arstream.app"]),
        ("from ...app.cli import main_for\n", ["arstream.app.cli"]),
        ("from ... import app\n", ["arstream.app"]),
        ("from .. import weights\n", []),
    ],
)
def test_the_check_sees_a_forbidden_import(tmp_path: Path, source: str, expected: list[str]) -> None:
    """As if written in ``models/tiny_world/bad.py``: relative imports climb to ``arstream``, not past it."""
    module = tmp_path / "bad.py"
    module.write_text(source)
    imported = imported_modules(module, "arstream.models.tiny_world.bad")
    assert forbidden(imported, ("arstream.models.toy_attention", "arstream.app")) == expected

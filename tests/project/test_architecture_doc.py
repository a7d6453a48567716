"""docs/architecture.md names every module of app/ and runner/, and every built-in model."""

from __future__ import annotations

from pathlib import Path

from arstream.models.registry import BUILTIN

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_every_transport_and_runtime_module_is_in_the_architecture_doc() -> None:
    modules = [p for folder in ("app", "runner") for p in (ROOT / folder).rglob("*.py") if p.name != "__init__.py"]
    assert len(modules) > 30
    missing = [str(p.relative_to(ROOT)) for p in modules if f"{p.name}`" not in DOC]
    assert missing == []


def test_every_built_in_model_is_in_the_architecture_doc() -> None:
    assert [name for name in BUILTIN if f"`{name}`" not in DOC] == []

"""Every package folder of the source tree is in pyproject.toml's ``[tool.setuptools] packages``: an installed
copy (the image, the GPU check's install) lacks any folder left out, though a checkout imports it by path."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the source folders the arstream/ symlinks name, as installed
LAYERS = {"app": "arstream.app", "runner": "arstream.runner", "models": "arstream.models", "programs": "arstream.programs"}


def test_every_package_folder_is_installed() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        ".".join((package, *init.parent.relative_to(REPO / folder).parts))
        for folder, package in LAYERS.items()
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert "arstream.runner.distributed" in folders
    assert sorted(folders - listed) == []

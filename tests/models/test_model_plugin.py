"""Bring your own model: the example package in docs/examples/model-package, installed as a user
installs it (pip, into its own folder), found by `arstream serve --model dot-world` through the
``arstream.models`` entry point, and served over a real WebSocket."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from servers import REPO_ROOT, LiveServer, server_process, session_client

PACKAGE = REPO_ROOT / "docs" / "examples" / "model-package"
INSTALL_GUARD_S = 300


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("plugin-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(PACKAGE)],
        check=True,
        capture_output=True,
        timeout=INSTALL_GUARD_S,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    return site


@pytest.fixture(scope="module")
def dot_world(plugin_site: Path) -> Iterator[LiveServer]:
    env = {"PYTHONPATH": os.pathsep.join([str(plugin_site), os.environ.get("PYTHONPATH", "")])}
    with server_process(["--model", "dot-world", "--codec", "raw"], env=env) as live:
        yield live


def dot_position(frame: np.ndarray) -> tuple[int, int]:
    ys, xs = np.nonzero((frame == (255, 220, 80)).all(axis=-1))
    assert len(xs) == 1, "one dot per frame"
    return int(xs[0]), int(ys[0])


def test_an_installed_model_package_is_served_by_name(dot_world: LiveServer) -> None:
    card = dot_world.get("/v1/model").json()
    assert card["name"] == "dot-world" and card["width"] == 32

    async def scenario() -> list[np.ndarray]:
        frames: list[np.ndarray] = []
        async with session_client(dot_world.ws_url, start={"codec": "raw"}) as client:
            for tick_id in range(4):
                await client.send(type="tick", tick_id=tick_id, controls={"keys": ["d"]})
                _, chunk = await client.recv_chunk()
                frames.extend(pixels for _, pixels in chunk)
        return frames

    frames = asyncio.run(scenario())
    # The dot moves one pixel right per frame, from the centre.
    assert [dot_position(frame) for frame in frames] == [(17 + i, 16) for i in range(8)]
    # The trail is what the runner's KV kept: the sink frame and the window's frames before this one.
    trail = int((frames[-1] == (40, 90, 160)).all(axis=-1).sum())
    assert trail == 7, "the last frame shows the 7 frames before it (all still in the sink + window)"
    dot_world.settled(dot_world.stats()["kv"]["blocks_total"])


def test_an_unknown_model_lists_the_installed_plugins(plugin_site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(plugin_site)}
    result = subprocess.run(
        [sys.executable, "-m", "arstream", "serve", "--model", "no-such", "--port", "0"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_GUARD_S,
    )
    assert result.returncode == 2
    assert "dot-world" in result.stderr and "tiny-world" in result.stderr, result.stderr

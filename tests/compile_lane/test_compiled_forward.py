"""``--compile``: the compiled DiT gives eager's frames, and a server stays unready, saying so, until it is built.

Runs torch's inductor on the CPU (a C++ compiler builds its kernels: minutes
on two cores), so it is its own lane, ``scripts/test-compile.sh``; the main
suite skips it. One tiny config (matrix-game-2).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from servers import fake_settings, running_server

from arstream.models.registry import load_pipeline
from arstream.programs import gpu_check
from arstream.runner.runner import runner_for_sessions
from arstream.runner.types import TickRequest

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("ARSTREAM_COMPILE_LANE") != "1", reason="runs inductor (minutes): scripts/test-compile.sh"
    ),
    pytest.mark.usefixtures("one_thread"),
    # torch's inductor imports its own deprecated torch.jit.script_method helpers (torch/utils/mkldnn.py)
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]
OPTIONS = {"config": "tiny", "random_init": True}
CHUNKS = 4  # the first (no history), the second (a history: torch recompiles with its length dynamic), two more


def test_inductor_has_a_cpp_compiler() -> None:
    assert shutil.which("g++") or shutil.which("c++"), "inductor builds its CPU kernels with a C++ compiler"


def frames_and_latents(compiled: bool) -> list[tuple[np.ndarray, torch.Tensor]]:
    pipeline: Any = load_pipeline("matrix-game-2", "cpu", **OPTIONS)
    if compiled:
        pipeline.compile_forward()
    runner = runner_for_sessions(pipeline, 1)
    out = []
    for chunk in range(CHUNKS):
        controls = {"keys": [["w"], ["a"], ["d"], []][chunk], "camera": {"yaw": 0.1 * chunk}}
        result = runner.execute_tick(TickRequest(session_id="s", request_id=chunk, controls=controls, seed=5))
        out.append((result.frames, pipeline.last_latents["s"].clone()))
    return out


def test_compiled_frames_equal_eager_frames() -> None:
    eager, compiled = frames_and_latents(False), frames_and_latents(True)
    for chunk, ((frames_e, latents_e), (frames_c, latents_c)) in enumerate(zip(eager, compiled, strict=True)):
        # inductor fuses and reorders float arithmetic: latents agree to float rounding, pixels to one level
        latent_gap = float((latents_e - latents_c).abs().max())
        pixel_gap = int(np.abs(frames_e.astype(int) - frames_c.astype(int)).max())
        assert latent_gap < 1e-4 and pixel_gap <= 1, (chunk, latent_gap, pixel_gap)
    # the control: another seed's frames are far beyond that
    other: Any = load_pipeline("matrix-game-2", "cpu", **OPTIONS)
    result = runner_for_sessions(other, 1).execute_tick(TickRequest(session_id="s", request_id=0, controls={}, seed=6))
    assert int(np.abs(result.frames.astype(int) - eager[0][0].astype(int)).max()) > 1


def test_a_compiling_server_is_unready_says_compiling_and_then_serves(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="arstream.compile")
    settings = fake_settings(model="matrix-game-2", model_options=OPTIONS, compile=True, torch_threads=1)
    with running_server(settings, wait_ready=False) as server:
        reasons = set()
        while (readyz := httpx.get(server.base_url + "/readyz", timeout=10)).status_code == 503:
            reasons.add(readyz.json()["reason"])
            time.sleep(0.2)  # a hang is caught by the test's timeout (scripts/test-compile.sh)
        assert readyz.json() == {"ready": True}
        assert any("compiling" in reason for reason in reasons), reasons
        dit = next(c for c in server.stats()["components"] if c["name"] == "dit")
        assert dit["device"] == "cpu" and dit["bytes"] > 0
    said = [r.getMessage() for r in caplog.records if r.name == "arstream.compile"]
    assert said and all(line.startswith("compiling") for line in said), said
    assert any("DiT forward for latents" in line for line in said), said  # the warm-up's first shape


def test_the_gpu_checks_compiled_variant_runs_on_the_cpu() -> None:
    profile = gpu_check.profile_for("cpu")
    figures = gpu_check.fit_variant_figures(profile, "cpu", "matrix-game-2", "int8", True)
    assert figures["options"]["weights"] == "int8" and figures["fps"] > 0 and figures["warmup_to_ready_s"] > 0
    assert figures["plan_weights_bytes"] > 0 and figures["card_weights_bytes_on_device"] > 0

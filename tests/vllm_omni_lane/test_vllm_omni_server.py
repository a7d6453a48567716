"""The server on vLLM-Omni's runner: shipped models over the wire give the frames the default runtime gives.

Needs vLLM-Omni (``scripts/test-vllm-omni.sh``, which also runs the other server
tests with ``ARSTREAM_RUNTIME=vllm-omni``); the main suite skips this module.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed; scripts/test-vllm-omni.sh runs these tests")

from servers import fake_settings, running_server, server_process, session_client  # noqa: E402

EXIT_GUARD_S = 60.0
TICKS = 5


async def _rollout(url: str, keys: list[list[str]]) -> list[np.ndarray]:
    """One raw-codec session: a tick per entry of ``keys`` (held keys), every frame back."""
    frames: list[np.ndarray] = []
    async with session_client(url, start={"seed": 11, "codec": "raw"}) as client:
        for tick_id, held in enumerate(keys, start=1):
            await client.send(type="tick", tick_id=tick_id, controls={"keys": held})
            chunk, decoded = await client.recv_chunk()
            assert chunk["tick_id"] == tick_id
            frames += [pixels for _header, pixels in decoded]
    return frames


MODELS = {
    "tiny-world": {},
    "matrix-game-2": {"config": "tiny", "random_init": True},
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_shipped_model_over_the_wire_is_the_same_on_both_runtimes(model: str) -> None:
    keys = [["w"], ["w"], ["a"], [], ["d"]][:TICKS]
    seen: dict[str, list[np.ndarray]] = {}
    stats: dict[str, dict[str, Any]] = {}
    for runtime in ("arstream", "vllm-omni"):
        settings = fake_settings(model=model, model_options=MODELS[model], runtime=runtime)
        with running_server(settings) as server:
            seen[runtime] = asyncio.run(_rollout(server.ws_url, keys))
            stats[runtime] = server.stats()
    assert len(seen["arstream"]) == len(seen["vllm-omni"]) > 0
    for i, (a, b) in enumerate(zip(seen["arstream"], seen["vllm-omni"])):
        assert np.array_equal(a, b), f"frame {i} differs between the runtimes"
    assert stats["vllm-omni"]["chunks"]["total"] == stats["arstream"]["chunks"]["total"] == TICKS
    # The pool the stats describe is vLLM-Omni's: its session capacity comes from its own sizing.
    assert stats["vllm-omni"]["kv"]["session_capacity"] > 0


def test_serve_runtime_flag_starts_vllm_omni_and_shuts_down_gracefully() -> None:
    args = ["--runtime", "vllm-omni", "--model", "fake-kv", "--model-options", '{"session_capacity": 2}']
    with server_process(args, env={"ARSTREAM_RUNTIME": "arstream"}) as server:  # the flag beats the environment
        kv = server.stats()["kv"]
        # vLLM-Omni's pool: scratch is one chunk (2 blocks) where ARStream's staging row is sink + window (7).
        assert kv["session_capacity"] == 2 and kv["scratch_blocks"] == 2

        async def scenario() -> None:
            async with session_client(server.ws_url, start={}) as client:
                await client.send(type="tick", tick_id=1)
                await client.recv_chunk()

        asyncio.run(scenario())
        assert server.process is not None
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(EXIT_GUARD_S) == 0

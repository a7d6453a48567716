"""Tiny LongLive over two CPU devices (runner/distributed/) through a prompt switch, against one device.

A prompt switch re-caches the session's history under the new prompt (LongLive's re-cache rewrites the KV
blocks it holds), so on two ranks each rewrites its own half of the heads. The frames match the one-device
runner's within one step of uint8 rounding, chunk by chunk, before and after the switch, and the session's
snapshot afterwards (every head gathered) holds the one-device runner's KV within fp32 tolerance.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from arstream.models.registry import load_pipeline
from arstream.runner.contract import ARPipeline
from arstream.runner.distributed.runtime import DistributedRuntime
from arstream.runner.runner import ARRunner
from arstream.runner.snapshot import export_session
from arstream.runner.types import RuntimeOptions, TickFailure, TickRequest

MODEL = "longlive"
MODEL_OPTIONS: dict[str, Any] = {"config": "tiny", "random_init": True}
PROMPTS = ["a fox in the snow"] * 2 + ["a reef at dawn"] * 2  # the switch at chunk 2
OPTIONS = RuntimeOptions(
    kv_budget_bytes=32 * 2**20,
    max_batch_sessions=1,
    load_pipeline=functools.partial(load_pipeline, MODEL, **MODEL_OPTIONS),
)


def _pipeline() -> ARPipeline:
    pipeline = load_pipeline(MODEL, "cpu", **MODEL_OPTIONS)
    assert isinstance(pipeline, ARPipeline)
    return pipeline


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[DistributedRuntime]:
    runtime = DistributedRuntime.for_pipeline(_pipeline(), RuntimeOptions(**{**OPTIONS.__dict__, "devices": ("cpu", "cpu")}))
    yield runtime
    runtime.shutdown()


def _frames(runtime: DistributedRuntime | ARRunner, index: int) -> np.ndarray:
    tick = TickRequest(session_id="p", request_id=index, controls={}, seed=7, prompt=PROMPTS[index])
    (result,) = runtime.execute([tick])
    assert not isinstance(result, TickFailure), result.error
    return result.frames


def test_two_ranks_equal_one_through_a_prompt_switch(two_ranks: DistributedRuntime) -> None:
    one_rank = ARRunner(_pipeline(), **OPTIONS.pool())
    assert two_ranks.rank_pool_shapes()[1][4] * 2 == one_rank.pool.kv.shape[4]  # half the heads each
    for index in range(len(PROMPTS)):
        sharded, whole = _frames(two_ranks, index), _frames(one_rank, index)
        assert sharded.shape == whole.shape
        assert np.abs(sharded.astype(np.int16) - whole.astype(np.int16)).max() <= 1, f"chunk {index}"
    gathered, alone = export_session(two_ranks, "p"), export_session(one_rank, "p")
    assert gathered.header["config_hash"] == alone.header["config_hash"]
    for name, tensor in alone.tensors.items():
        torch.testing.assert_close(gathered.tensors[name], tensor, rtol=1e-4, atol=1e-5)
    two_ranks.close_session("p")
    assert two_ranks.local.pool.num_free == two_ranks.blocks_free_at_start

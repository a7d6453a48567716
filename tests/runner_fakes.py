"""Runner test helpers: spec and runner builders, ticks, and fakes around FakeKVPipeline for the batched path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from arstream.models.fake import FakeKVPipeline
from arstream.runner.contract import ModelState
from arstream.runner.runner import ARRunner
from arstream.runner.spec import KVCacheSpec
from arstream.runner.types import TickRequest

# Roomy enough for every fake-kv runner test; the spec's session_capacity is what binds.
FAKE_KV_BUDGET_BYTES = 1 << 20
FakeT = TypeVar("FakeT", bound=FakeKVPipeline)


def tiny_spec(**overrides: Any) -> KVCacheSpec:
    """A one-layer spec with 2-frame chunks, 1 sink and 6 window frames; ``overrides`` replace fields."""
    fields: dict[str, Any] = dict(num_layers=1, num_kv_heads=1, head_size=2, tokens_per_frame=1)
    fields.update(frames_per_chunk=2, sink_frames=1, window_frames=6)
    fields.update(overrides)
    return KVCacheSpec(**fields)


def fake_runner(
    pipeline_type: type[FakeT] = FakeKVPipeline,  # type: ignore[assignment]
    *,
    max_batch_sessions: int = 1,
    **options: Any,
) -> tuple[ARRunner, FakeT]:
    """A runner over a fresh ``pipeline_type(**options)`` and that pipeline."""
    pipeline = pipeline_type(**options)
    return ARRunner(pipeline, kv_budget_bytes=FAKE_KV_BUDGET_BYTES, max_batch_sessions=max_batch_sessions), pipeline


def tick(session: str, request_id: int = 0, **fields: Any) -> TickRequest:
    return TickRequest(session_id=session, request_id=request_id, **fields)


class BatchRecordingFakePipeline(FakeKVPipeline):
    """FakeKVPipeline that records the sessions of every forward: a list per batch, a 1-list when alone."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.forwards: list[list[str]] = []

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        self.forwards.append([tick.session_id])
        return super().generate_chunk(tick)

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        self.forwards.append([t.session_id for t in ticks])
        return super().generate_chunks(ticks)


class RaisingAfterCommitFakePipeline(FakeKVPipeline):
    """A fake whose next batched forward raises after every row committed its chunk."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.raise_next_batch = False

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        frames = super().generate_chunks(ticks)
        if self.raise_next_batch:
            self.raise_next_batch = False
            raise RuntimeError("fault after the committing pass")
        return frames


class FailingImportFakePipeline(FakeKVPipeline):
    """Test fake: ``import_session_state`` raises while ``fail_import`` is set."""

    fail_import = False

    def import_session_state(self, session_id: str, state: ModelState) -> None:
        if self.fail_import:
            raise RuntimeError("import failed on purpose")
        super().import_session_state(session_id, state)

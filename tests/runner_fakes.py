"""Test fakes around FakeKVPipeline for the runner's batched path."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from arstream.models.fake import FakeKVPipeline
from arstream.runner.types import TickRequest


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

"""Rewind points: the chunk boundaries a session keeps, so it can go back to one (or branch from it).

Which ones (every chunk of the last seconds, sparser further back, none past
the horizon) is the session's :class:`~arstream.runner.rewind_schedule.RewindSchedule`;
this module holds them.

Boundary b is the session's state after its chunks 0..b-1: its KV block tables
and counters (:class:`~arstream.runner.kv_state.HistoryTables`) and its
model-owned state (the pipeline's ``export_session_state``). The block tables
*share* the live history's blocks: the pool counts references, a block that
slides out of the live window stays allocated while a boundary still lists
it, and goes back to the free queue with its last reference. So K boundaries
cost at most K chunks of blocks beyond the live window, never K copies of it
(with a sliding window and sink frames, boundary b's visible history is the
sink plus the window as it was at b: the same sink blocks, older window blocks).
The model-owned state is copied (tensors cloned) per boundary, since a
pipeline may reuse its tensors in place from one chunk to the next; a tensor
equal to the previous boundary's of the same name (a start image, a rollout's
first controls) is kept once, shared by both boundaries.

The runner records the boundary a chunk starts from just before its forward
(:meth:`RewindPoints.record`), so the boundary the session is at now is the live
state itself and costs nothing extra.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .contract import ModelState
from .kv_state import HistoryTables
from .pool import PagedKVPool
from .rewind_schedule import RewindSchedule


@dataclass
class Boundary:
    """One kept chunk boundary: shared block tables (one pool reference each) and a copy of the model state."""

    tables: HistoryTables
    model: ModelState

    @property
    def index(self) -> int:
        return self.tables.chunks_committed


def copy_model_state(state: ModelState, previous: ModelState | None = None) -> ModelState:
    """A copy that later chunks of the session cannot change (JSON deep-copied, tensors cloned).

    A tensor equal to ``previous``'s tensor of the same name is not cloned
    again: the copy shares ``previous``'s (kept copies are never written, and
    one handed to a pipeline is copied first, :meth:`RewindPoints.take`).
    """
    tensors = {}
    for name, tensor in state.tensors.items():
        kept = previous.tensors.get(name) if previous is not None else None
        if kept is not None and _same(kept, tensor):
            tensors[name] = kept
        else:
            tensors[name] = tensor.clone()
    return ModelState(copy.deepcopy(state.json), tensors)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))


class RewindPoints:
    """One session's kept boundaries before the one it is at, oldest first, thinned by ``schedule``.

    Together with the boundary the session is at (its live state), the session
    can go back to any of :meth:`indices`.
    """

    def __init__(self, pool: PagedKVPool, schedule: RewindSchedule) -> None:
        self.pool = pool
        self.schedule = schedule
        self._boundaries: list[Boundary] = []

    def indices(self, now: int) -> tuple[int, ...]:
        """Every boundary a rewind may name when the session is at ``now``, oldest first (``now`` last)."""
        return (*(b.index for b in self._boundaries if b.index != now), now)

    def holds(self, index: int) -> bool:
        return any(b.index == index for b in self._boundaries)

    @property
    def newest(self) -> Boundary | None:
        return self._boundaries[-1] if self._boundaries else None

    def record(self, boundary: Boundary) -> None:
        """Keep ``boundary`` (its references become ours), dropping those the schedule no longer keeps."""
        held, self._boundaries = [*self._boundaries, boundary], []
        for b in held:
            if self.schedule.keeps(b.index, boundary.index):
                self._boundaries.append(b)
            else:
                self._drop(b)

    def take(self, index: int) -> Boundary:
        """Remove boundary ``index`` and hand it (with its references) to the caller; later ones are dropped.

        A rewind past them makes them unreachable: the session's next chunks
        start a new line of boundaries from ``index``. The model state handed
        over is a copy of its own (older boundaries may share its tensors).
        """
        position = next(i for i, b in enumerate(self._boundaries) if b.index == index)
        taken, later = self._boundaries[position], self._boundaries[position + 1 :]
        del self._boundaries[position:]
        for boundary in later:
            self._drop(boundary)
        return Boundary(taken.tables, copy_model_state(taken.model))

    def share(self, index: int) -> Boundary:
        """Boundary ``index`` for another session (a branch): its blocks shared once more, its model state copied."""
        boundary = next(b for b in self._boundaries if b.index == index)
        tables = copy.deepcopy(boundary.tables)
        self.pool.share(tables.blocks())
        return Boundary(tables, copy_model_state(boundary.model))

    def boundaries(self) -> list[Boundary]:
        """The kept boundaries, oldest first (still held here: for a copy, e.g. parking)."""
        return list(self._boundaries)

    def restore(self, boundaries: list[Boundary]) -> None:
        """Hold ``boundaries`` (oldest first, their references ours): a restored session's (runner/parking.py)."""
        if self._boundaries:
            raise ValueError("restore needs empty rewind points")
        self._boundaries = list(boundaries)

    def blocks(self) -> list[int]:
        """Every block reference held (a block kept by two boundaries is listed twice)."""
        return [i for b in self._boundaries for i in b.tables.blocks()]

    def release(self) -> None:
        """Drop every boundary; safe to call twice."""
        boundaries, self._boundaries = self._boundaries, []
        self.pool.free(i for b in boundaries for i in b.tables.blocks())

    def _drop(self, boundary: Boundary) -> None:
        self.pool.free(boundary.tables.blocks())

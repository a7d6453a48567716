"""A session's snapshot over several devices: its heads gathered onto rank 0 a window of blocks at a time, and
scattered back by heads.

Each rank's pool holds ``heads / P`` heads of every KV block, rank ``r`` the ``r``-th share (the all-to-all
of :mod:`.sequence_parallel` hands them out in that order). A snapshot has one format whatever P: the KV
tensors (``kv/<branch>``, and ``rewind/kv`` for the rewind points' own blocks) of every head,
``[layers, 2, frames, tokens, heads, head_size]``, exactly as a single device exports them.

An export is a plan (runner/snapshot_stream.py) like a single device's: every rank plans its own share
(:func:`share_plan`: its blocks read from its pool, or from its parked copy), and rank 0's plan reads each KV
block whole by joining its own share of the block with the other ranks' (:class:`GatheredBlocks`), which it asks
for a window of blocks at a time. So rank 0 holds at most a window (``GATHER_WINDOW_BYTES`` of the others'
shares) beyond what a single device holds, never the session. Everything else in a snapshot (counters, the
model-owned state, the server's section) is the same on every rank, since every rank runs the same calls:
rank 0's travels. An import slices a whole snapshot and each rank imports its own share through the one import
path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from ..capabilities import SupportsExport
from ..snapshot import SessionSnapshot, export_parked
from ..snapshot_import import import_session
from ..snapshot_rewind import REWIND_KV
from ..snapshot_stream import Part, SnapshotPlan, plan_export, plan_of

HEADS_DIM = 4  # of a KV tensor [layers, K/V, frames, tokens, heads, head_size]
BLOCK_HEADS_DIM = -2  # of one block of it [tokens, heads, head_size]
# How much of the other ranks' shares rank 0 holds at once while it streams a session out.
GATHER_WINDOW_BYTES = 4 * 2**20


def is_kv(name: str) -> bool:
    """Whether the snapshot's tensor holds KV blocks (the live history's, or its rewind points' beyond it)."""
    return name.startswith("kv/") or name == REWIND_KV


def _frame(tensor: torch.Tensor, layer: int, kind: int, frame: int) -> torch.Tensor:
    return tensor[layer, kind, frame]


def share_plan(
    runner: SupportsExport, session_id: str, protocol_version: int | None
) -> tuple[SnapshotPlan, dict[str, list[Part]]]:
    """This rank's plan of the session (its share of the heads), and each KV tensor's blocks in file order
    (layer, then K/V, then frame), each read when called."""
    if session_id in runner.sessions.lot:  # its host copy: planned from it, nothing restored
        snapshot = export_parked(runner, session_id, protocol_version=protocol_version)
        blocks: dict[str, list[Part]] = {
            name: [partial(_frame, t, layer, kind, frame)
                   for layer in range(t.shape[0]) for kind in range(t.shape[1]) for frame in range(t.shape[2])]
            for name, t in snapshot.tensors.items() if is_kv(name)
        }  # fmt: skip
        return plan_of(snapshot), blocks
    plan = plan_export(runner, session_id, protocol_version=protocol_version)
    return plan, {tensor.name: tensor.parts for tensor in plan.tensors if is_kv(tensor.name)}


def share_layout(blocks: dict[str, list[Part]]) -> tuple[tuple[str, int], ...]:
    """What every rank's share plan must agree on: its KV tensors and their block counts."""
    return tuple((name, len(parts)) for name, parts in blocks.items())


def block_copy(part: Part) -> torch.Tensor:
    """A block of a share as it crosses to rank 0: its own host copy (a view would carry the whole pool along)."""
    return part().to("cpu").clone()


class GatheredBlocks:
    """Rank 0's reader of one KV tensor's whole blocks: its own share of each, joined with the other ranks',
    which ``fetch(start, count)`` brings a window at a time (one list of blocks per other rank)."""

    def __init__(
        self,
        mine: list[Part],
        fetch: Callable[[int, int], Sequence[Sequence[torch.Tensor]]],
        on_held: Callable[[int], None],
    ) -> None:
        self._mine = mine
        self._fetch = fetch
        self._on_held = on_held  # told the bytes held here after each window arrives (the peak is measured)
        self._held: dict[int, list[torch.Tensor]] = {}

    def block(self, index: int) -> torch.Tensor:
        mine = self._mine[index]().to("cpu")
        if index not in self._held:
            self._held = {}  # the previous window is done with
            share_bytes = mine.numel() * mine.element_size()
            count = max(1, GATHER_WINDOW_BYTES // max(1, share_bytes))
            shares = self._fetch(index, min(count, len(self._mine) - index))
            self._held = {index + i: [share[i] for share in shares] for i in range(len(shares[0]))}
            held = sum(t.numel() * t.element_size() for blocks in self._held.values() for t in blocks)
            self._on_held(held + share_bytes * (1 + len(shares)))  # and the block joined from them
        return torch.cat([mine, *self._held.pop(index)], dim=BLOCK_HEADS_DIM)


def snapshot_of(plan: SnapshotPlan) -> SessionSnapshot:
    """A plan read whole (a caller that wants the snapshot in memory, not streamed)."""
    tensors = {
        tensor.name: torch.cat([part().reshape(-1) for part in tensor.parts]).view(tensor.shape)
        for tensor in plan.tensors
    }
    return SessionSnapshot(dict(plan.header), tensors)


def scattered(snapshot: SessionSnapshot, world: int, header: dict[str, object]) -> list[SessionSnapshot]:
    """Each rank's share of a whole snapshot, rank 0 first, with ``header`` (its ranks' own identity)."""
    shares: list[SessionSnapshot] = []
    for rank in range(world):
        tensors = {}
        for name, tensor in snapshot.tensors.items():
            if is_kv(name):
                per = tensor.shape[HEADS_DIM] // world
                tensor = tensor.narrow(HEADS_DIM, rank * per, per).contiguous()
            tensors[name] = tensor
        shares.append(SessionSnapshot(dict(header), tensors))
    return shares


def import_shard(runner: SupportsExport, session_id: str, share: SessionSnapshot, protocol_version: int | None) -> None:
    """A rank's import of its share (refused alike on every rank: the pools are in step)."""
    import_session(runner, session_id, share, protocol_version=protocol_version)

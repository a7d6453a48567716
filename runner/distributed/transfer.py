"""A session's snapshot over several devices: gathered onto rank 0 whole, scattered back by heads.

Each rank's pool holds ``heads / P`` heads of every KV block, rank ``r`` the ``r``-th share (the all-to-all
of :mod:`.sequence_parallel` hands them out in that order). A snapshot has one format whatever P: the KV
tensors (``kv/<branch>``, and ``rewind/kv`` for the rewind points' own blocks) of every head,
``[layers, 2, frames, tokens, heads, head_size]``, exactly as a single device exports them. So an export asks every rank for its share of the session's KV (taken from its pool, or
from its parked copy) and concatenates them along the heads; an import slices them and each rank imports its
own share through the one import path. Everything else in a snapshot (counters, the model-owned state, the
server's section) is the same on every rank, since every rank runs the same calls: rank 0's travels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..capabilities import SupportsExport
from ..snapshot import SessionSnapshot, export_session
from ..snapshot_import import import_session
from ..snapshot_rewind import REWIND_KV

HEADS_DIM = 4  # of a KV tensor [layers, K/V, frames, tokens, heads, head_size]


def is_kv(name: str) -> bool:
    """Whether the snapshot's tensor holds KV blocks (the live history's, or its rewind points' beyond it)."""
    return name.startswith("kv/") or name == REWIND_KV


def kv_shard(runner: SupportsExport, session_id: str) -> dict[str, torch.Tensor]:
    """What a rank other than 0 sends for an export: its share of the session's KV, in host memory."""
    snapshot = export_session(runner, session_id)
    return {name: tensor.to("cpu") for name, tensor in snapshot.tensors.items() if is_kv(name)}


def gathered(mine: SessionSnapshot, others: Sequence[dict[str, torch.Tensor]]) -> SessionSnapshot:
    """Rank 0's snapshot with every rank's share of the heads, in rank order (the others' in ``others``)."""
    tensors = {
        name: torch.cat([tensor.to("cpu"), *(shard[name] for shard in others)], dim=HEADS_DIM) if is_kv(name) else tensor
        for name, tensor in mine.tensors.items()
    }
    return SessionSnapshot(dict(mine.header), tensors)


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

"""A session's snapshot over several devices: its heads gathered onto rank 0 a window of blocks at a time, and
scattered back by heads a window at a time.

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
rank 0's travels. An import is the one import path (runner/snapshot_import.py) on every rank, over its share:
rank 0 splits the whole snapshot's blocks by heads as they arrive (:class:`ScatteringWrites`) and sends the
other ranks their shares a window at a time (``SCATTER_WINDOW_BYTES``), so it never holds the session either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import math

import torch

from ..capabilities import SupportsExport
from ..snapshot import SessionSnapshot, SnapshotError
from ..snapshot_import import TensorEntry
from ..snapshot_rewind import REWIND_KV
from ..snapshot_stream import Part, SnapshotPlan, plan_export

HEADS_DIM = 4  # of a KV tensor [layers, K/V, frames, tokens, heads, head_size]
BLOCK_HEADS_DIM = -2  # of one block of it [tokens, heads, head_size]
# How much of the other ranks' shares rank 0 holds at once while it streams a session out.
GATHER_WINDOW_BYTES = 4 * 2**20
# How much of the other ranks' shares rank 0 holds at once while a session streams in.
SCATTER_WINDOW_BYTES = 4 * 2**20


def is_kv(name: str) -> bool:
    """Whether the snapshot's tensor holds KV blocks (the live history's, or its rewind points' beyond it)."""
    return name.startswith("kv/") or name == REWIND_KV


def share_plan(
    runner: SupportsExport, session_id: str, protocol_version: int | None
) -> tuple[SnapshotPlan, dict[str, list[Part]]]:
    """This rank's plan of the session (its share of the heads, read from its pool or its parked host copy a
    block at a time), and each KV tensor's blocks in file order (layer, then K/V, then frame), each read when
    called."""
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


class ScatteringWrites:
    """Rank 0's split of an incoming whole snapshot's bytes (every head) into each rank's share, as they arrive.

    The bytes of a KV tensor come in file order, one whole block ``[tokens, heads, head_size]`` after another:
    each block is split by heads as soon as it is whole, rank 0's share written at once (``mine``: into its
    pool) and the other ranks' queued and sent a window at a time (``others``: one flat byte run per other
    rank, at the same byte offset of each rank's share tensor). Other tensors are the same on every rank and go
    on as they come. So rank 0 holds at most a window of the others' shares and one partial block, whatever the
    session's size (``on_held`` is told the bytes held after each block: the peak is measured).
    """

    def __init__(
        self,
        entries: Sequence[TensorEntry],
        world: int,
        mine: Callable[[int, int, torch.Tensor], None],
        others: Callable[[int, int, list[torch.Tensor]], None],
        on_held: Callable[[int], None],
    ) -> None:
        self._entries = list(entries)
        self._world = world
        self._mine = mine
        self._others = others
        self._on_held = on_held
        self._next: dict[int, int] = {}  # each KV tensor's next byte expected
        self._partial = torch.empty(0, dtype=torch.uint8)  # the start of a whole block not yet complete
        self._tensor: int | None = None  # the KV tensor whose shares are queued
        self._first = 0  # the first queued block's number
        self._queued: list[list[torch.Tensor]] = [[] for _ in range(world - 1)]  # per other rank, block shares

    def write(self, index: int, offset: int, data: torch.Tensor) -> None:
        """Bytes of whole tensor ``index`` (flat uint8) at byte ``offset`` of it."""
        entry = self._entries[index]
        if self._tensor is not None and index != self._tensor:
            self.flush()
        if not is_kv(entry.name):
            self._mine(index, offset, data)
            self._others(index, offset, [data.to("cpu")] * (self._world - 1))
            return
        if offset != self._next.get(index, 0):
            raise SnapshotError(f"the bytes of the snapshot's {entry.name!r} came out of order")
        self._next[index] = offset + data.numel()
        self._tensor = index
        data = data.to("cpu")
        block_bytes = entry.nbytes // math.prod(entry.shape[:3])
        done = 0
        if self._partial.numel():
            done = min(block_bytes - self._partial.numel(), data.numel())
            self._partial = torch.cat([self._partial, data[:done]])
            if self._partial.numel() < block_bytes:
                self._held()
                return
            self._split(index, offset - self._partial.numel() + done, self._partial)
            self._partial = torch.empty(0, dtype=torch.uint8)
        while data.numel() - done >= block_bytes:
            self._split(index, offset + done, data[done : done + block_bytes])
            done += block_bytes
        if done < data.numel():
            self._partial = data[done:].clone()  # a copy: the caller's piece is not kept
            self._held()

    def flush(self) -> None:
        """Send the queued shares (a tensor's end, another tensor's bytes, the import's finish)."""
        if self._tensor is not None and self._queued[0]:
            share_bytes = self._queued[0][0].numel()
            self._others(self._tensor, self._first * share_bytes, [torch.cat(q) for q in self._queued])
        self._queued = [[] for _ in range(self._world - 1)]
        self._tensor = None

    def _split(self, index: int, offset: int, block: torch.Tensor) -> None:
        """One whole block (flat uint8, starting at byte ``offset`` of its tensor) split by heads."""
        entry = self._entries[index]
        tokens, heads = entry.shape[3], entry.shape[4]
        per = heads // self._world
        by_head = block.view(tokens, heads, -1)
        # each its own copy, never a view of the caller's piece
        shares = [by_head[:, r * per : (r + 1) * per].clone(memory_format=torch.contiguous_format).view(-1)
                  for r in range(self._world)]  # fmt: skip
        number = offset // block.numel()
        self._mine(index, number * shares[0].numel(), shares[0])
        if not self._queued[0]:
            self._first = number
        for queue, share in zip(self._queued, shares[1:]):
            queue.append(share)
        self._held()
        if sum(share.numel() for share in self._queued[0]) * (self._world - 1) >= SCATTER_WINDOW_BYTES:
            self.flush()

    def _held(self) -> None:
        self._on_held(self._partial.numel() + sum(t.numel() for queue in self._queued for t in queue))


def share_entries(entries: Sequence[TensorEntry], world: int) -> list[TensorEntry]:
    """Each rank's table of a whole snapshot's tensors: its KV tensors hold ``heads / world`` heads."""
    shares = []
    for entry in entries:
        if is_kv(entry.name):
            shape = list(entry.shape)
            shape[HEADS_DIM] //= world
            entry = TensorEntry(entry.name, entry.dtype, tuple(shape))
        shares.append(entry)
    return shares

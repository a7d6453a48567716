"""The preallocated, paged KV block pool and how it is sized from a budget.

Storage layout is ``[layers, blocks, tokens_per_frame, kv_heads, head_size]``
for K and V separately, so one layer's blocks gather with one ``index_select``.
Block ids are handed out lowest-first and freed ids go to the back of the
free queue (as in vLLM's block pool), which keeps allocation order predictable
for tests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from runner.spec import KVCacheSpec


class PoolBudgetError(ValueError):
    """The memory budget cannot hold even one session."""


class PoolExhausted(RuntimeError):
    """An allocation asked for more blocks than are free (a sizing bug)."""


class BlockStateError(RuntimeError):
    """A block was freed twice or freed without having been allocated."""


@dataclass(frozen=True)
class PoolPlan:
    """How a budget is split: blocks for sessions, one in-flight chunk, scratch."""

    session_capacity: int
    num_blocks: int
    scratch_blocks: int
    block_bytes: int
    per_session_bytes: int
    budget_bytes: int

    @property
    def pool_bytes(self) -> int:
        return (self.num_blocks + self.scratch_blocks) * self.block_bytes


def plan_pool(spec: KVCacheSpec, budget_bytes: int) -> PoolPlan:
    """Largest session count whose resident KV fits ``budget_bytes``.

    Each resident session holds sink + window blocks per branch plus its
    cross-attention and model-owned bytes. The committing chunk's blocks and
    the denoise scratch are counted once, because one forward runs at a time.
    """
    branches = len(spec.kv_branches)
    chunk_blocks = spec.frames_per_chunk * branches
    fixed_bytes = 2 * chunk_blocks * spec.block_bytes
    per_session = (
        spec.resident_frames * branches * spec.block_bytes
        + spec.cross_attention_bytes_per_session
        + spec.model_owned_bytes_per_session
    )
    fitting = (budget_bytes - fixed_bytes) // per_session if budget_bytes > fixed_bytes else 0
    if fitting < 1:
        need = fixed_bytes + per_session
        raise PoolBudgetError(
            f"KV budget of {budget_bytes} bytes cannot hold one session: one session needs "
            f"{need} bytes ({spec.resident_frames} resident frames x {branches} branch(es) x "
            f"{spec.block_bytes} bytes per block, plus one in-flight chunk and scratch). "
            f"Raise the KV budget or shrink the window."
        )
    capacity = min(int(fitting), spec.session_capacity)
    return PoolPlan(
        session_capacity=capacity,
        num_blocks=capacity * spec.resident_frames * branches + chunk_blocks,
        scratch_blocks=chunk_blocks,
        block_bytes=spec.block_bytes,
        per_session_bytes=per_session,
        budget_bytes=budget_bytes,
    )


def resolve_budget_bytes(
    device: torch.device, *, budget_bytes: int | None, memory_fraction: float | None
) -> int:
    """An explicit byte budget wins; else a fraction of free device memory (CUDA only)."""
    if budget_bytes is not None:
        if budget_bytes <= 0:
            raise PoolBudgetError(f"KV budget must be a positive byte count, got {budget_bytes}")
        return budget_bytes
    if device.type == "cuda":
        fraction = 0.9 if memory_fraction is None else memory_fraction
        if not 0.0 < fraction <= 1.0:
            raise PoolBudgetError(f"memory fraction must be in (0, 1], got {fraction}")
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    raise PoolBudgetError(
        f"on {device.type} the KV budget must be given in bytes (no free-memory query on this device)"
    )


class PagedKVPool:
    """Preallocated K/V blocks plus a free queue.

    Blocks ``0 .. num_blocks-1`` are allocatable; the ``scratch_blocks`` after
    them hold the K/V of non-committing denoise forwards and are never in the
    free queue.
    """

    def __init__(self, spec: KVCacheSpec, plan: PoolPlan, device: torch.device) -> None:
        self.spec = spec
        self.plan = plan
        self.device = device
        total = plan.num_blocks + plan.scratch_blocks
        shape = (spec.num_layers, total, spec.tokens_per_frame, spec.num_kv_heads, spec.head_size)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
        self._free: deque[int] = deque(range(plan.num_blocks))
        self._allocated: set[int] = set()
        branches = len(spec.kv_branches)
        first_scratch = plan.num_blocks
        fpc = spec.frames_per_chunk
        self.scratch_ids: dict[str, list[int]] = {
            b.name: list(range(first_scratch + b.local_index * fpc, first_scratch + (b.local_index + 1) * fpc))
            for b in spec.kv_branches
        }
        assert len(self.scratch_ids) == branches
        self.cross_k: dict[str, torch.Tensor] = {}
        self.cross_v: dict[str, torch.Tensor] = {}
        for name, length in spec.cross_attention_lengths.items():
            cshape = (plan.session_capacity, branches, spec.num_layers, length, spec.num_kv_heads, spec.head_size)
            self.cross_k[name] = torch.zeros(cshape, dtype=spec.dtype, device=device)
            self.cross_v[name] = torch.zeros(cshape, dtype=spec.dtype, device=device)
        self._free_slots: deque[int] = deque(range(plan.session_capacity))

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._allocated)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise PoolExhausted(f"asked for {count} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(count)]
        self._allocated.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        bad = [i for i in ids if i not in self._allocated]
        if bad or len(set(ids)) != len(ids):
            raise BlockStateError(f"freeing blocks that are not allocated (double free?): {bad or ids}")
        self._allocated.difference_update(ids)
        self._free.extend(ids)

    def allocate_slot(self) -> int:
        """A cross-attention slot (one per resident session)."""
        if not self._free_slots:
            raise PoolExhausted(f"all {self.plan.session_capacity} session slots are in use")
        return self._free_slots.popleft()

    def free_slot(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.plan.session_capacity:
            raise BlockStateError(f"freeing session slot {slot} that is not in use")
        self._free_slots.append(slot)

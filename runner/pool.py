"""The preallocated, paged KV block pool and how it is sized from a budget.

Storage layout is ``[layers, 2 (K, V), blocks, tokens_per_frame, kv_heads,
head_size]``, so a session's whole history (every layer, K and V) gathers with
one ``index_select`` and a committed chunk scatters with one ``index_copy_``.
Block ids are handed out lowest-first and freed ids go to the back of the
free queue (as in vLLM's block pool), which keeps allocation order predictable
for tests. Blocks are reference counted: a session's live history and its
rewind points (runner/rewind.py), or a branch and its source, hold the same
block once each, and the block goes back to the free queue with its last
reference.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .rewind_schedule import RewindSchedule
from .spec import KVCacheSpec


# The share of free device memory the KV pool takes when no budget is given; the rest is the forward's working
# memory (activations, the decode), which nothing counts in advance.
DEFAULT_MEMORY_FRACTION = 0.9


class PoolBudgetError(ValueError):
    """The memory budget cannot hold even one session."""


class PoolExhausted(RuntimeError):
    """An allocation asked for more blocks than are free (a sizing bug)."""


class BlockStateError(RuntimeError):
    """A block was freed more often than it was referenced, or shared without having been allocated."""


@dataclass(frozen=True)
class PoolPlan:
    """How a budget is split: blocks for sessions, the in-flight chunks, scratch.

    Scratch is one staging row per session a forward may batch
    (``staging_rows``): the visible history plus the current chunk, per branch
    (``resident + chunk`` frames each). ``rewind`` is which chunk boundaries
    each session keeps to rewind to (None: none); their worst case is in
    ``per_session_bytes`` and ``num_blocks``.
    """

    session_capacity: int
    num_blocks: int
    scratch_blocks: int
    block_bytes: int
    per_session_bytes: int
    budget_bytes: int
    staging_rows: int = 1
    rewind: RewindSchedule | None = None
    # what the budget pays once, however many sessions: in-flight chunks, staging rows, the model's fixed state
    fixed_bytes: int = 0

    @property
    def pool_bytes(self) -> int:
        return (self.num_blocks + self.scratch_blocks) * self.block_bytes


def session_frames(spec: KVCacheSpec, rewind: RewindSchedule | None = None) -> int:
    """Blocks per branch one resident session may hold between chunks: sink + window, plus its rewind points'.

    The boundaries a session keeps share blocks with its live history and
    with each other (the sink always; the window where boundaries are closer
    than a window apart), so they add only the frames their windows reach
    beyond the live one (:meth:`RewindSchedule.peak`), never a copy of the
    window per boundary. A spec with ``history_rewrites`` breaks that
    sharing: a boundary before a rewrite keeps the old sink and window, so
    each kept boundary may hold a whole history of its own.
    """
    if rewind is None:
        return spec.resident_frames
    if spec.history_rewrites:
        return (1 + rewind.peak(spec).copies) * spec.resident_frames
    return rewind.peak(spec).frames


def _budget_terms(
    spec: KVCacheSpec, max_batch_sessions: int, rewind: RewindSchedule | None
) -> tuple[int, int, int, int]:
    """``(chunk_blocks, scratch_blocks, fixed_bytes, per_session_bytes)``: what every budget pays once, and per session."""
    if not isinstance(max_batch_sessions, int) or isinstance(max_batch_sessions, bool) or max_batch_sessions < 1:
        raise PoolBudgetError(f"max_batch_sessions must be an integer >= 1, got {max_batch_sessions!r}")
    branches = len(spec.kv_branches)
    # each row's committing chunk, and (history_rewrites) a rewrite's fresh sink + window while the old are held
    in_flight = spec.frames_per_chunk + (spec.resident_frames if spec.history_rewrites else 0)
    chunk_blocks = in_flight * branches * max_batch_sessions
    scratch_blocks = (spec.resident_frames + spec.frames_per_chunk) * branches * max_batch_sessions
    fixed_bytes = (
        (chunk_blocks + scratch_blocks) * spec.block_bytes
        + spec.model_owned_bytes_fixed
        + max_batch_sessions * spec.model_owned_bytes_per_forward_row
    )
    per_session = (
        session_frames(spec, rewind) * branches * spec.block_bytes
        + spec.cross_attention_bytes_per_session
        # the live model-owned state, and a copy of it per rewind point
        + (1 + (0 if rewind is None else rewind.peak(spec).copies)) * spec.model_owned_bytes_per_session
    )
    return chunk_blocks, scratch_blocks, fixed_bytes, per_session


def budget_for_sessions(
    spec: KVCacheSpec, sessions: int, *, max_batch_sessions: int = 1, rewind: RewindSchedule | None = None
) -> int:
    """The smallest byte budget with room for ``sessions`` resident sessions (:func:`plan_pool` inverted).

    For tools that want a pool of a given size (benches, evaluation) rather than
    a pool that fills a memory budget.
    """
    if sessions < 1:
        raise PoolBudgetError(f"a pool needs room for at least one session, got {sessions}")
    _, _, fixed_bytes, per_session = _budget_terms(spec, max_batch_sessions, rewind)
    return fixed_bytes + max(sessions * per_session, 1)


def plan_pool(
    spec: KVCacheSpec, budget_bytes: int, *, max_batch_sessions: int = 1, rewind: RewindSchedule | None = None
) -> PoolPlan:
    """Largest session count whose resident KV fits ``budget_bytes``.

    Each resident session holds sink + window blocks per branch plus its
    cross-attention and model-owned bytes, and with a ``rewind`` schedule the
    blocks and model-state copies its kept boundaries may add at most (its
    rewind points; :func:`session_frames`). One forward runs at a time, but it
    may batch up to ``max_batch_sessions`` sessions, so their committing
    chunks' blocks and their staging rows (the denoise scratch) are counted
    that many times.
    """
    chunk_blocks, scratch_blocks, fixed_bytes, per_session = _budget_terms(spec, max_batch_sessions, rewind)
    branches = len(spec.kv_branches)
    if budget_bytes <= fixed_bytes:
        fitting = 0
    elif per_session == 0:  # no history and no model-owned state: sessions cost nothing between chunks
        fitting = spec.session_capacity
    else:
        fitting = (budget_bytes - fixed_bytes) // per_session
    if fitting < 1:
        need = fixed_bytes + per_session
        raise PoolBudgetError(
            f"KV budget of {budget_bytes} bytes cannot hold one session: one session needs "
            f"{need} bytes ({session_frames(spec, rewind)} resident frames x {branches} branch(es) x "
            f"{spec.block_bytes} bytes per block, plus {max_batch_sessions} in-flight chunk(s) and scratch). "
            f"Raise the KV budget, shrink the window or give rewind a smaller budget."
        )
    capacity = min(int(fitting), spec.session_capacity)
    return PoolPlan(
        session_capacity=capacity,
        num_blocks=capacity * session_frames(spec, rewind) * branches + chunk_blocks,
        scratch_blocks=scratch_blocks,
        block_bytes=spec.block_bytes,
        per_session_bytes=per_session,
        budget_bytes=budget_bytes,
        staging_rows=max_batch_sessions,
        rewind=rewind,
        fixed_bytes=fixed_bytes,
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
        fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        if not 0.0 < fraction <= 1.0:
            raise PoolBudgetError(f"memory fraction must be in (0, 1], got {fraction}")
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    raise PoolBudgetError(
        f"on {device.type} the KV budget must be given in bytes (no free-memory query on this device)"
    )


class PagedKVPool:
    """Preallocated K/V blocks, a free queue, and the forward's staging rows.

    Blocks ``0 .. num_blocks-1`` are allocatable. ``staging[branch]`` is a
    contiguous ``[rows, layers, 2, (resident + chunk) * tokens, heads, size]``
    buffer (the scratch), one row per session of a batched forward: a bound
    session gathers its history into its row once per chunk and writes the
    current chunk's K/V behind it, so attention reads zero-copy slices exactly
    like a dense cache.
    """

    def __init__(self, spec: KVCacheSpec, plan: PoolPlan, device: torch.device) -> None:
        self.spec = spec
        self.plan = plan
        self.device = device
        shape = (spec.num_layers, 2, plan.num_blocks, spec.tokens_per_frame, spec.num_kv_heads, spec.head_size)
        self.kv = torch.zeros(shape, dtype=spec.dtype, device=device)
        staging_tokens = (spec.resident_frames + spec.frames_per_chunk) * spec.tokens_per_frame
        rows = plan.staging_rows
        self.staging: dict[str, torch.Tensor] = {
            b.name: torch.zeros(
                (rows, spec.num_layers, 2, staging_tokens, spec.num_kv_heads, spec.head_size),
                dtype=spec.dtype,
                device=device,
            )
            for b in spec.kv_branches
        }
        # Per-row, per-layer views avoid re-slicing the staging tensors on every call.
        self.staging_layers: list[dict[str, list[torch.Tensor]]] = [
            {b: list(t[row].unbind(0)) for b, t in self.staging.items()} for row in range(rows)
        ]
        # Whose history each row currently holds: (state object id, its history version).
        self.staging_owners: list[tuple[int, int] | None] = [None] * rows
        self._free: deque[int] = deque(range(plan.num_blocks))
        # references per allocated block (a block is allocated while it has one)
        self._refs: dict[int, int] = {}
        branches = len(spec.kv_branches)
        self.cross_k: dict[str, torch.Tensor] = {}
        self.cross_v: dict[str, torch.Tensor] = {}
        for name, length in spec.cross_attention_lengths.items():
            cshape = (plan.session_capacity, branches, spec.num_layers, length, spec.num_kv_heads, spec.head_size)
            self.cross_k[name] = torch.zeros(cshape, dtype=spec.dtype, device=device)
            self.cross_v[name] = torch.zeros(cshape, dtype=spec.dtype, device=device)
        self._free_slots: deque[int] = deque(range(plan.session_capacity))

    @property
    def k(self) -> torch.Tensor:
        """``[layers, blocks, tokens, heads, size]`` view of the keys."""
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def staging_rows(self) -> int:
        return self.plan.staging_rows

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def ref_counts(self) -> dict[int, int]:
        """References per allocated block (a copy; for tests and checks)."""
        return dict(self._refs)

    def allocate(self, count: int) -> list[int]:
        """``count`` free blocks, one reference each."""
        if count > len(self._free):
            raise PoolExhausted(f"asked for {count} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(count)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, ids: Iterable[int]) -> None:
        """One more reference to each of ``ids`` (allocated blocks; an id listed twice gets two)."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._refs]
        if bad:
            raise BlockStateError(f"sharing blocks that are not allocated: {bad}")
        for i in ids:
            self._refs[i] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference per listed id; a block whose last reference goes returns to the free queue.

        Checked before anything changes: dropping more references than a block
        has (a double free) raises and leaves every count as it was.
        """
        drops = Counter(ids)  # in the order ids first appear, so freed ids queue in that order
        bad = sorted(i for i, n in drops.items() if self._refs.get(i, 0) < n)
        if bad:
            raise BlockStateError(f"freeing blocks that are not allocated (double free?): {bad}")
        for i, n in drops.items():
            left = self._refs[i] - n
            if left:
                self._refs[i] = left
            else:
                del self._refs[i]
                self._free.append(i)

    def allocate_slot(self) -> int:
        """A cross-attention slot (one per resident session)."""
        if not self._free_slots:
            raise PoolExhausted(f"all {self.plan.session_capacity} session slots are in use")
        return self._free_slots.popleft()

    def free_slot(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.plan.session_capacity:
            raise BlockStateError(f"freeing session slot {slot} that is not in use")
        self._free_slots.append(slot)

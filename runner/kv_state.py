"""One session's view of the paged pool, handed to a pipeline for one forward.

A chunk is produced by several forward *passes*: denoising passes write the
chunk's K/V to the pool's scratch (staging area) and leave the timeline alone;
the one committing pass also copies them into freshly allocated blocks and
advances it. The session's history is gathered from its blocks into the
staging area once per chunk, so every pass reads contiguous K/V. Frame
positions are absolute and keep counting after old frames leave the window,
so a pipeline can apply RoPE with :attr:`frame_start`; a model with a finite
rotary table stores K unrotated and rotates what it reads with
:meth:`SessionKVState.frame_positions`, which stay inside the table.

Use from a pipeline, per chunk::

    for step in steps:
        state.begin_pass(commit=False)
        ... per layer: k_all, v_all = state.write_and_gather(layer, k, v)
        state.end_pass()
    state.begin_pass(commit=True)
    ...
    state.end_pass()

A batched forward gives each session its own staging row
(:meth:`SessionKVState.prepare_forward`) and holds each committed chunk back
until the runner accepts the whole batch (:meth:`SessionKVState.accept_chunk`);
if the batch fails, :meth:`SessionKVState.abort_forward` returns the chunk's
blocks and leaves the history as it was, so the tick can be retried alone.

A forward may also *rewrite* the committed history before its chunk
(:meth:`SessionKVState.begin_rewrite`: LongLive's re-cache after a prompt
switch recomputes the window's K/V under the new prompt). Copy-on-write: the
rewritten frames go to fresh blocks and replace the old ones in the tables
only when the chunk joins the history, so a failed or aborted forward leaves
the history as it was, and a rewind point or branch that shares the old
blocks keeps them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .pool import PagedKVPool
from .spec import KVCacheSpec


class PassStateError(RuntimeError):
    """A pass method was called out of order; the message names the expected call."""


@dataclass
class HistoryTables:
    """Where a session's history is at a chunk boundary: its block tables and the counters that place them.

    Whoever holds one holds one pool reference to each of its blocks (a
    rewind point, a branch being made) and must hand them on
    (:meth:`SessionKVState.adopt_tables`) or free them (:meth:`blocks`).
    """

    sink: dict[str, list[int]]
    window: dict[str, list[int]]
    frames_committed: int
    chunks_committed: int
    sink_start: int

    def blocks(self) -> list[int]:
        return [i for branch in self.sink for i in self.sink[branch] + self.window[branch]]

    def check_layout(self, spec: KVCacheSpec) -> None:
        """Raise ValueError unless every branch holds what ``spec`` keeps at this boundary: a sink no longer
        than the spec's, and a window of exactly the frames the counter says it keeps (the dense window's, the
        strided tail's). A snapshot's tables are checked so before they place anything."""
        for branch in spec.branch_names:
            sinks, window = len(self.sink[branch]), len(self.window[branch])
            if sinks > min(self.frames_committed, spec.sink_frames):
                raise ValueError(f"branch {branch!r} holds {sinks} sink frames, more than the spec keeps")
            kept = window_frame_indexes(spec, sinks, self.sink_start, self.frames_committed)
            if window != len(kept):
                raise ValueError(
                    f"branch {branch!r} holds {window} window frames where the spec keeps {len(kept)} "
                    f"after {self.frames_committed} frames"
                )


def window_frame_indexes(spec: KVCacheSpec, sinks: int, sink_start: int, frames_committed: int) -> list[int]:
    """Absolute indexes of a history's window blocks, in order: the frames the spec keeps after its ``sinks``
    sink frames (which start at ``sink_start``) once ``frames_committed`` frames are."""
    return spec.kept_history(sink_start + sinks if sinks else 0, frames_committed)


class SessionKVState:
    """Block tables (per branch) and the frame counter of one session."""

    def __init__(self, pool: PagedKVPool, session_id: str) -> None:
        self.pool = pool
        self.spec = pool.spec
        self.session_id = session_id
        self.sink: dict[str, list[int]] = {b: [] for b in self.spec.branch_names}
        self.window: dict[str, list[int]] = {b: [] for b in self.spec.branch_names}
        self.pending: dict[str, list[int]] = {b: [] for b in self.spec.branch_names}
        self.frames_committed = 0
        self.chunks_committed = 0
        # Absolute position of the first sink frame (0: the sink is the rollout's first frames).
        self.sink_start = 0
        self.released = False
        self.staging_row = 0
        # A rewrite of the history waiting for the chunk to join it: per branch, (new sink, new window) blocks.
        self.rewritten: dict[str, tuple[list[int], list[int]]] | None = None
        self._rewrite: tuple[int, bool] | None = None  # the open rewrite pass: (frames, keep_sink)
        self._hold_commit = False
        self._chunk_held = False
        self._in_pass = False
        self._commit = False
        # Bumped whenever the block tables change, so stale staging is regathered.
        self._history_version = 0
        self._history_tokens = 0
        self._chunk_tokens = self.spec.frames_per_chunk * self.spec.tokens_per_frame
        self._pass_tokens = self._chunk_tokens  # tokens the open pass writes: a chunk, or a rewrite's frames
        self._chunk_shape = (self.spec.frames_per_chunk, self.spec.tokens_per_frame)
        self.cross_slot: int | None = pool.allocate_slot() if self.spec.cross_attention_lengths else None
        self.cross_written: set[str] = set()

    # ---- what a pipeline reads -------------------------------------------------

    @property
    def frame_start(self) -> int:
        """Absolute index of the current chunk's first frame (for RoPE)."""
        return self.frames_committed

    @property
    def chunk_index(self) -> int:
        return self.chunks_committed

    @property
    def device(self) -> torch.device:
        """Where this session's K/V lives; pipelines place their per-forward tensors here."""
        return self.pool.device

    def frame_positions(self, branch: str = "main") -> list[int]:
        """Rotary positions of the visible frames in attention order: sink, window, current chunk.

        Absolute while the chunk ends inside the rotary table
        (``spec.max_position_frames``, or always when that is None). Past it,
        the window and the chunk shift down so the chunk ends at the table's
        end: distances inside the window (all a window-only model sees) are
        unchanged, and the sink's distance to the window stops growing. Sink
        frames keep their positions. A model that wants this stores K without
        rotation and rotates the gathered K with these positions. With a
        strided tail (``spec.strided_window_frames``) the window's frames are
        not contiguous: each keeps its own position, shifted alike.
        """
        return self._positions(len(self.sink[branch]), self._window_indexes(branch))

    def history_frame_indexes(self, branch: str = "main") -> list[int]:
        """Absolute indexes of the visible frames in attention order: sink, window, current chunk.

        What a model that masks per layer reads (which frames of the window a
        layer sees, a dilation's phase); unlike :meth:`frame_positions` never
        shifted. The window's are not contiguous with a strided tail.
        """
        sink = [self.sink_start + i for i in range(len(self.sink[branch]))]
        chunk = range(self.frames_committed, self.frames_committed + self.spec.frames_per_chunk)
        return [*sink, *self._window_indexes(branch), *chunk]

    def _window_indexes(self, branch: str) -> list[int]:
        """Absolute indexes of the window's blocks: the kept frames after the sink (a function of the counter)."""
        return window_frame_indexes(self.spec, len(self.sink[branch]), self.sink_start, self.frames_committed)

    def rewrite_positions(self, frames: int, *, keep_sink: bool, branch: str = "main") -> list[int]:
        """Rotary positions a rewrite pass (:meth:`begin_rewrite`) sees: the kept sink, then its ``frames``.

        The same scheme as :meth:`frame_positions` for the chunk that follows, so
        the rewritten K (stored unrotated) reads the same distances later.
        """
        sink = len(self.sink[branch]) if keep_sink else 0
        positions = self._positions(sink, list(range(self.frames_committed - frames, self.frames_committed)))
        return positions[: len(positions) - self.spec.frames_per_chunk]

    def _positions(self, sink: int, window: list[int]) -> list[int]:
        """``sink`` sink frames' positions, then those of the ``window`` frames (absolute) and the current chunk."""
        spec = self.spec
        end = self.frames_committed + spec.frames_per_chunk
        shift = 0 if spec.max_position_frames is None else max(0, end - spec.max_position_frames)
        sink_shift = min(shift, self.sink_start)
        sinks = [self.sink_start + i - sink_shift for i in range(sink)]
        return sinks + [p - shift for p in [*window, *range(self.frames_committed, end)]]

    def history_frames(self, branch: str = "main") -> int:
        """Frames of history visible to the current chunk."""
        return len(self.sink[branch]) + len(self.window[branch])

    @property
    def in_pass(self) -> bool:
        return self._in_pass

    @property
    def chunk_held(self) -> bool:
        """A committed chunk waits for :meth:`accept_chunk` (batched forwards only)."""
        return self._chunk_held

    # ---- the forward ----------------------------------------------------------------

    def prepare_forward(self, *, staging_row: int = 0, hold_commit: bool = False) -> None:
        """Set up the coming forward: which staging row it uses, and whether its chunk waits.

        With ``hold_commit`` the committing pass stores the chunk in its new
        blocks but the chunk joins the history (frame counter, block tables,
        window eviction) only at :meth:`accept_chunk`: a batched forward
        succeeds or fails as a whole, and a failed one must leave every
        session's history as it was.
        """
        if self._in_pass or self._chunk_held:
            raise PassStateError("prepare_forward called inside a forward; expected end_pass or abort_forward first")
        if not 0 <= staging_row < self.pool.staging_rows:
            raise PassStateError(f"staging row {staging_row} does not exist; the pool has {self.pool.staging_rows}")
        self.staging_row = staging_row
        self._hold_commit = hold_commit

    def accept_chunk(self) -> None:
        """Let a held chunk join the history (the batched forward it came from succeeded)."""
        if not self._chunk_held:
            raise PassStateError("accept_chunk called with no held chunk; expected a committing pass first")
        self._chunk_held = False
        self._publish_chunk()

    def abort_forward(self) -> None:
        """Undo the forward's unfinished work so the tick can run again.

        An open pass is closed, a committed-but-held chunk is dropped and the
        chunk's blocks go back to the pool: block tables and frame counter are
        as they were before the forward. Only a held chunk can be undone this way; one that
        joined the history already (``hold_commit=False``) is part of it.
        """
        self._in_pass = False
        self._chunk_held = False
        self._rewrite = None
        pending = [i for b in self.spec.branch_names for i in self.pending[b]] + self._rewritten_blocks()
        self.rewritten = None
        for branch in self.spec.branch_names:
            self.pending[branch] = []
        # The staging row may hold the chunk's K/V: gather afresh next time.
        self._history_version += 1
        self.pool.free(pending)

    # ---- passes -----------------------------------------------------------------

    def begin_pass(self, *, commit: bool) -> None:
        if self.released:
            raise PassStateError(f"session {self.session_id!r} was released; no pass can begin")
        if self._in_pass:
            raise PassStateError("begin_pass called twice; expected end_pass first")
        if self._chunk_held:
            raise PassStateError("begin_pass after this forward's chunk was committed; one commit per forward")
        spec = self.spec
        owner = (id(self), self._history_version)
        if self.pool.staging_owners[self.staging_row] != owner:
            self._gather_history()
            self.pool.staging_owners[self.staging_row] = owner
        if commit:
            for branch in spec.branch_names:
                self.pending[branch] = self.pool.allocate(spec.frames_per_chunk)
        self._commit = commit
        self._pass_tokens = self._chunk_tokens
        self._in_pass = True

    def begin_rewrite(self, frames: int, *, keep_sink: bool) -> None:
        """Open a pass that recomputes the K/V of the last ``frames`` committed frames (before the chunk's passes).

        The pass's keys are the sink (``keep_sink``: its blocks stay as they
        are) and then the ``frames`` frames themselves, written through
        :meth:`write_and_gather` like a chunk (positions:
        :meth:`rewrite_positions`). Without ``keep_sink`` the frames are the
        whole rollout so far (``frames`` = every committed frame, at most sink
        + window) and the sink is rewritten too. At :meth:`end_pass` the
        frames that the history holds (the sink's, the window's) are stored in
        fresh blocks; they replace the old ones when this forward's chunk joins
        the history (:meth:`abort_forward` or a release drops them instead).
        One rewrite per forward, before its first pass.
        """
        if self.released or self._in_pass or self._chunk_held or any(self.pending.values()) or self.rewritten:
            raise PassStateError("begin_rewrite needs a bound session before its chunk's first pass, once per forward")
        spec = self.spec
        if not spec.history_rewrites:
            raise PassStateError("this KV spec does not declare history_rewrites; the pool has no room counted for one")
        branch = spec.branch_names[0]
        sink, window = len(self.sink[branch]), len(self.window[branch])
        room = spec.resident_frames + spec.frames_per_chunk - (sink if keep_sink else 0)
        # frames of the rollout the history can speak for (without a sink, sink_start follows the window: unused)
        committed = self.frames_committed - (self.sink_start if spec.sink_frames else 0)
        low, high = (window, min(room, committed - sink)) if keep_sink else (committed, min(room, committed))
        if not low <= frames <= high:
            what = "the window" if keep_sink else "every committed frame (the sink is rewritten too)"
            raise PassStateError(
                f"a rewrite must cover {what} and fit the staging row: {frames} frames asked, "
                f"{low}..{high} possible (sink {sink}, window {window}, {committed} frames committed)"
            )
        self.pool.staging_owners[self.staging_row] = None  # the row holds the rewrite now
        for b in spec.branch_names:
            kept = self.sink[b] if keep_sink else []
            self._history_tokens = len(kept) * spec.tokens_per_frame
            if kept:
                index = torch.tensor(kept, dtype=torch.long, device=self.pool.device)
                gathered = self.pool.kv.index_select(2, index)
                self.pool.staging[b][self.staging_row, :, :, : self._history_tokens] = gathered.flatten(2, 3)
        self._rewrite = (frames, keep_sink)
        self._pass_tokens = frames * spec.tokens_per_frame
        self._commit = False
        self._in_pass = True

    def _end_rewrite(self) -> None:
        """Store the rewritten sink (unless kept) and window frames in fresh blocks, held until the chunk joins."""
        assert self._rewrite is not None
        frames, keep_sink = self._rewrite
        self._rewrite = None
        spec = self.spec
        tokens = spec.tokens_per_frame
        base = self._history_tokens  # the kept sink's tokens (0 when the sink is rewritten)
        self.rewritten = {}
        for branch in spec.branch_names:
            sink, window = len(self.sink[branch]), len(self.window[branch])
            if keep_sink:
                self.pool.share(self.sink[branch])  # the new tables hold the kept sink too (one reference each)
                new_sink = list(self.sink[branch])
                self.rewritten[branch] = (new_sink, [])
            else:
                new_sink = self.pool.allocate(sink)
                self.rewritten[branch] = (new_sink, [])
                self._store(branch, base, new_sink)
            new_window = self.pool.allocate(window)
            self.rewritten[branch] = (new_sink, new_window)  # recorded before the copy: a failure frees them
            self._store(branch, base + (frames - window) * tokens, new_window)
        self._history_version += 1  # the chunk's passes gather the rewritten history

    def _store(self, branch: str, start: int, ids: list[int]) -> None:
        """Copy the staging row's frames from token ``start`` on into blocks ``ids``."""
        if not ids:
            return
        tokens = self.spec.tokens_per_frame
        staged = self.pool.staging[branch][self.staging_row, :, :, start : start + len(ids) * tokens]
        index = torch.tensor(ids, dtype=torch.long, device=self.pool.device)
        self.pool.kv.index_copy_(2, index, torch.unflatten(staged, 2, (len(ids), tokens)))

    def _rewritten_blocks(self) -> list[int]:
        return [i for sink, window in (self.rewritten or {}).values() for i in sink + window]

    def _visible(self, branch: str) -> list[int]:
        """The history's blocks the next pass reads: the rewritten ones while a rewrite waits."""
        if self.rewritten is not None:
            sink, window = self.rewritten[branch]
            return sink + window
        return self.sink[branch] + self.window[branch]

    def _gather_history(self) -> None:
        """Copy sink + window blocks (all layers, K and V) into this forward's staging row."""
        spec = self.spec
        for branch in spec.branch_names:
            history = self._visible(branch)
            self._history_tokens = len(history) * spec.tokens_per_frame
            if history:
                index = torch.tensor(history, dtype=torch.long, device=self.pool.device)
                gathered = self.pool.kv.index_select(2, index)
                self.pool.staging[branch][self.staging_row, :, :, : self._history_tokens] = gathered.flatten(2, 3)

    def write_and_gather(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, branch: str = "main"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this chunk's K/V for ``layer``; return history + chunk K/V.

        ``k`` and ``v`` are ``[frames_per_chunk * tokens_per_frame, kv_heads,
        head_size]``; the result is ``[visible_tokens, kv_heads, head_size]``
        in frame order (sink, window, current chunk). The results are views of
        the staging area: valid until the next write to the same layer.
        """
        if not self._in_pass:
            raise PassStateError("write_and_gather called outside a pass; expected begin_pass first")
        staging = self.pool.staging_layers[self.staging_row][branch][layer]
        start = self._history_tokens
        end = start + self._pass_tokens
        staging[0, start:end] = k
        staging[1, start:end] = v
        return staging[0, :end], staging[1, :end]

    def end_pass(self) -> None:
        """Close the pass; a committing pass stores the chunk in its new blocks.

        The chunk then joins the history at once, or at :meth:`accept_chunk`
        when the forward holds its commit.
        """
        if not self._in_pass:
            raise PassStateError("end_pass called without begin_pass")
        self._in_pass = False
        if self._rewrite is not None:
            self._end_rewrite()
            return
        if not self._commit:
            return
        start, end = self._history_tokens, self._history_tokens + self._chunk_tokens
        for branch in self.spec.branch_names:
            chunk = torch.unflatten(self.pool.staging[branch][self.staging_row, :, :, start:end], 2, self._chunk_shape)
            index = torch.tensor(self.pending[branch], dtype=torch.long, device=self.pool.device)
            self.pool.kv.index_copy_(2, index, chunk)
        if self._hold_commit:
            self._chunk_held = True
        else:
            self._publish_chunk()

    def _publish_chunk(self) -> None:
        """The stored chunk joins the history: block tables, window eviction, frame counter."""
        spec = self.spec
        if self.rewritten is not None:  # the rewrite joins first: the old blocks lose this history's reference
            old = [i for b in spec.branch_names for i in self.sink[b] + self.window[b]]
            for branch, (sink, window) in self.rewritten.items():
                self.sink[branch], self.window[branch] = sink, window
            self.rewritten = None
            self.pool.free(old)
        if not self.sink[spec.branch_names[0]]:
            self.sink_start = self.frames_committed
        committed = self.frames_committed + spec.frames_per_chunk
        for branch in spec.branch_names:
            new = self.pending[branch]
            self.pending[branch] = []
            indexes = self.history_frame_indexes(branch)  # the sink's, the window's, then the chunk's frames
            self.sink[branch], window = self._split_history(self.sink[branch] + self.window[branch] + new)
            # The window keeps what the spec keeps at the new counter: the dense window's frames and the strided
            # tail's (reset_at_boundary keeps none between chunks, vLLM-Omni's meaning; see KVCacheSpec).
            kept = set(window_frame_indexes(spec, len(self.sink[branch]), self.sink_start, committed))
            placed = list(zip(window, indexes[len(self.sink[branch]) :], strict=True))
            self.window[branch] = [block for block, index in placed if index in kept]
            evicted = [block for block, index in placed if index not in kept]
            if evicted:
                self.pool.free(evicted)
        self._history_version += 1
        self.frames_committed = committed
        self.chunks_committed += 1

    def _split_history(self, blocks: list[int]) -> tuple[list[int], list[int]]:
        """Blocks in frame order -> (sink, window): the first ``sink_frames`` are the sink."""
        return blocks[: self.spec.sink_frames], blocks[self.spec.sink_frames :]

    # ---- cross attention ----------------------------------------------------------

    def cross_kv(self, name: str, layer: int, branch: str = "main") -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of a fixed-length cross-attention cache; see :attr:`cross_written`."""
        if self.cross_slot is None or name not in self.pool.cross_k:
            raise KeyError(f"no cross-attention cache named {name!r} in this spec")
        b = self.spec.branch_names.index(branch)
        return self.pool.cross_k[name][self.cross_slot, b, layer], self.pool.cross_v[name][self.cross_slot, b, layer]

    # ---- chunk boundaries (rewind, branch) ----------------------------------------------

    def share_tables(self) -> HistoryTables:
        """The history as it is now (a chunk boundary), with one more pool reference to each of its blocks.

        Nothing is copied: later chunks only append blocks and drop references,
        never write to a committed block, so the tables keep describing this
        boundary's K/V for as long as their references are held.
        """
        self._check_at_boundary("share_tables")
        tables = self.tables()
        self.pool.share(tables.blocks())
        return tables

    def tables(self) -> HistoryTables:
        """The history's block tables as they are now, copied, with no pool reference of their own."""
        names = self.spec.branch_names
        return HistoryTables(
            sink={b: list(self.sink[b]) for b in names},
            window={b: list(self.window[b]) for b in names},
            frames_committed=self.frames_committed,
            chunks_committed=self.chunks_committed,
            sink_start=self.sink_start,
        )

    def adopt_tables(self, tables: HistoryTables) -> None:
        """Go to the boundary ``tables`` describe, taking over their references; the current history's are dropped."""
        self._check_at_boundary("adopt_tables")
        old = self.held_blocks()
        for branch in self.spec.branch_names:
            self.sink[branch], self.window[branch] = tables.sink[branch], tables.window[branch]
        self.frames_committed = tables.frames_committed
        self.chunks_committed = tables.chunks_committed
        self.sink_start = tables.sink_start
        self._history_version += 1  # the staging row holds another history now
        self.pool.free(old)

    def _check_at_boundary(self, call: str) -> None:
        if self.released or self._in_pass or self._chunk_held or any(self.pending.values()) or self.rewritten:
            raise PassStateError(f"{call} needs a resident session at a chunk boundary (no forward in flight)")

    # ---- release ------------------------------------------------------------------

    def held_blocks(self) -> list[int]:
        return [
            i
            for b in self.spec.branch_names
            for i in self.sink[b] + self.window[b] + self.pending[b]
        ] + self._rewritten_blocks()

    def release(self) -> None:
        """Return every block and the cross slot to the pool; safe to call twice."""
        if self.released:
            return
        self.released = True
        self._in_pass = False
        self._chunk_held = False
        owners = self.pool.staging_owners
        for row, owner in enumerate(owners):
            if owner is not None and owner[0] == id(self):
                owners[row] = None
        held = self.held_blocks()
        self.rewritten, self._rewrite = None, None
        for branch in self.spec.branch_names:
            self.sink[branch], self.window[branch], self.pending[branch] = [], [], []
        try:
            self.pool.free(held)
        finally:
            if self.cross_slot is not None:
                slot, self.cross_slot = self.cross_slot, None
                self.pool.free_slot(slot)


def write_and_gather_rows(
    states: Sequence[SessionKVState], layer: int, k: torch.Tensor, v: torch.Tensor, branch: str = "main"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`SessionKVState.write_and_gather` for a batch whose row ``i`` belongs to ``states[i]``.

    ``k`` and ``v`` are ``[rows, chunk_tokens, kv_heads, head_size]``; the
    result stacks each row's history + chunk into ``[rows, visible_tokens,
    kv_heads, head_size]``, so the sessions' histories must be equally long
    (the runner batches only such sessions). One row, or rows in staging
    rows ``0 .. rows-1`` as the runner's batched forward assigns them, get
    views of the staging area, as :meth:`SessionKVState.write_and_gather`
    does (valid until the next write to the same layer), instead of a copy
    of every row's visible K/V per layer and pass.
    """
    if len(states) == 1:
        k_all, v_all = states[0].write_and_gather(layer, k[0], v[0], branch)
        return k_all[None], v_all[None]
    first = states[0]
    if all(
        state.pool is first.pool
        and state.staging_row == row
        and state._in_pass
        and state._history_tokens == first._history_tokens
        and state._pass_tokens == first._pass_tokens
        for row, state in enumerate(states)
    ):
        # The runner gives a batch's sessions staging rows 0..rows-1: one write for all rows, and the
        # result is a view of those rows (no per-row copies, no stacked copy of every row's history).
        staging = first.pool.staging[branch][: len(states), layer]
        start = first._history_tokens
        end = start + first._pass_tokens
        staging[:, 0, start:end] = k
        staging[:, 1, start:end] = v
        return staging[:, 0, :end], staging[:, 1, :end]
    gathered = [state.write_and_gather(layer, k[row], v[row], branch) for row, state in enumerate(states)]
    return torch.stack([kv[0] for kv in gathered]), torch.stack([kv[1] for kv in gathered])

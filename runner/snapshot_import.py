"""A snapshot written straight into this runner: its KV into the session's own pool blocks, piece by piece.

:class:`SessionImport` is the one import path, whole or streamed
(:func:`import_session` runs it over a snapshot in
memory; app/migration.py over a POST's pieces as they arrive):

1. :meth:`SessionImport.begin`, once the header and tensor table are known:
   checks them against this runner (identity, room, every tensor's name,
   dtype and shape against the spec), allocates the session's blocks (and
   cross-attention slot), makes it resident with the header's counters, and
   allocates the model-owned tensors on the pool's device, and the blocks and
   model tensors of the rewind points it keeps (runner/snapshot_rewind.py;
   the bytes of those it drops go nowhere). Nothing is copied yet, so a
   refusal here costs nothing.
2. :meth:`SessionImport.write`, per piece: the bytes go into the blocks (or
   model-state tensors) they belong to, so the receiving side holds a piece,
   never the snapshot.
3. :meth:`SessionImport.finish`: the model-owned state goes to the pipeline
   and the kept rewind points to the session; it continues from here.

Anything that ends an import early (a refused header, a stream cut short, a
corrupt piece) calls :meth:`SessionImport.abort`, which releases what
:meth:`begin` made through the runner's one release path: the pool is back
where it was. Every step runs where the pool lives (the model worker's
thread in a server).

Resident from :meth:`begin` on, the session counts against the runner's
capacity while its bytes arrive. No tick runs on it (no connection holds it
until the import has finished), but a least-recently-used eviction may take
it: the next :meth:`write` then refuses, and nothing of it is left.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .contract import ModelState, SupportsSessionTransfer
from .kv_state import SessionKVState, window_frame_indexes
from .pool import PoolExhausted
from .capabilities import SupportsExport
from .rewind import Boundary, RewindPoints
from .snapshot import GathersHeads, SessionSnapshot, SnapshotError, SnapshotRefused, check_compatible
from .snapshot_rewind import REWIND_KV, REWIND_MODEL_PREFIX, CarriedPoint, beyond_live, carried_points, choose_kept

MODEL_PREFIX = "model/"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a snapshot's table: its name, dtype and shape (its bytes follow in row-major order)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorEntry:
        return cls(name, tensor.dtype, tuple(tensor.shape))


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (writes go through to it)."""
    return tensor.reshape(-1).view(torch.uint8)


class _Regions:
    """Where one tensor's bytes go: equal-sized contiguous byte views, in the tensor's byte order."""

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        self.views = list(views)
        self.size = self.views[0].numel() if self.views else 0

    def write(self, offset: int, data: torch.Tensor) -> None:
        """``data`` (flat uint8, any device) at byte ``offset`` of the tensor."""
        done = 0
        while done < data.numel():
            index, start = divmod(offset + done, self.size)
            take = min(self.size - start, data.numel() - done)
            self.views[index][start : start + take].copy_(data[done : done + take])
            done += take


class _Dropped(_Regions):
    """Where the bytes of a tensor this runner does not keep go (a rewind point it drops): nowhere."""

    def __init__(self) -> None:
        super().__init__([])

    def write(self, offset: int, data: torch.Tensor) -> None:
        return


class ScatteredImport(Protocol):
    """A session's import into a runtime over several devices, begun on every device: the whole snapshot's bytes
    go in as they arrive and each device takes its heads."""

    def write(self, index: int, offset: int, data: torch.Tensor) -> None:
        """Bytes of tensor ``index`` of the entries (flat uint8) at byte ``offset`` of it, in file order."""

    def finish(self) -> None:
        """Every device hands its share to its pipeline: the session is held."""

    def abort(self) -> None:
        """Every device releases what the import holds."""


@runtime_checkable
class ImportsScattered(GathersHeads, Protocol):
    """A runtime over several devices imports its sessions itself (said here, beside the import: the snapshot
    module names :class:`GathersHeads` and this module imports it)."""

    def begin_import(
        self, session_id: str, header: dict[str, Any], entries: Sequence[TensorEntry], protocol_version: int | None
    ) -> ScatteredImport:
        """Begin making a snapshot (``entries``: its runner's tensors, every head) the held session
        ``session_id``, its heads scattered as its bytes arrive; refuse leaving every device's pool as it was."""


class _Forwarded(_Regions):
    """Where one tensor's bytes go on a runtime over several devices: on to its import (:class:`ScatteredImport`)."""

    def __init__(self, scattered: ScatteredImport, index: int) -> None:
        super().__init__([])
        self.scattered = scattered
        self.index = index

    def write(self, offset: int, data: torch.Tensor) -> None:
        self.scattered.write(self.index, offset, data)


class SessionImport:
    """One session's import into one runner (see the module docstring)."""

    def __init__(
        self,
        session_id: str,
        header: dict[str, Any],
        tensors: Sequence[TensorEntry],
        *,
        protocol_version: int | None = None,
        extras: Mapping[str, int] | None = None,
        elsewhere: Collection[str] = (),
    ) -> None:
        self.session_id = session_id
        self.header = header
        self.tensors = list(tensors)
        self.protocol_version = protocol_version
        # Tensors for the layer above (a start image), by name, with the most bytes each may have: held on the
        # CPU and handed back by finish(). Any other name that is not the runner's is refused.
        self.extras = dict(extras or {})
        # Tensors whose bytes the layer above writes itself (a moved session's recording, to disk): never written
        # here, so never held here.
        self.elsewhere = frozenset(elsewhere)
        self._regions: list[_Regions] = []
        self._model: dict[str, torch.Tensor] = {}  # model-owned tensors, on the pool's device, by name
        self._extra: dict[str, torch.Tensor] = {}
        # a runtime over several devices: the import of every device's share, fed as the bytes arrive
        self._scattered: ScatteredImport | None = None
        self._state: SessionKVState | None = None  # while this import holds the session resident
        self.held = False  # whether it ever did (begin made it resident)
        self._finished = False
        # The rewind points it carries and this runner keeps (runner/snapshot_rewind.py), their model tensors,
        # the snapshot's block numbers -> this pool's blocks, and the blocks allocated for them alone.
        self._points: list[CarriedPoint] = []
        self._point_tensors: dict[str, torch.Tensor] = {}
        self._numbering: list[int] = []
        self._point_blocks: list[int] = []
        self.rewind_carried = 0  # points the snapshot carries
        self.rewind_kept = 0  # of which this runner holds (its schedule, its free blocks; the oldest go first)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def holds(self) -> bool:
        """Whether the session is resident by this import's doing (from begin, through finish, until an abort)."""
        return self._state is not None

    @property
    def resident(self) -> bool:
        """False for a session that had not run its first chunk: nothing goes into the pool."""
        return self.header.get("resident", True) is not False

    # ---- the steps ----------------------------------------------------------------

    def begin(self, runner: SupportsExport) -> None:
        """Check the header and table, then make room (see the module docstring); refuse leaving nothing behind."""
        check_compatible(runner, self.header, self.protocol_version)
        try:
            self._plan(runner)
        except BaseException as exc:
            self.abort(runner)
            raise _as_snapshot_error(exc) from None

    def write(self, runner: SupportsExport, index: int, offset: int, data: torch.Tensor) -> None:
        """Bytes of tensor ``index`` of the table (flat uint8) at byte ``offset`` of it."""
        if self._state is not None and (self._state.released or runner.sessions.kv_state(self.session_id) is not self._state):
            self.abort(runner)
            raise SnapshotRefused(
                f"session {self.session_id!r} was evicted from this replica's pool while it was being imported "
                "(its sessions needed the room)"
            )
        entry = self.tensors[index]
        if offset < 0 or offset + data.numel() > entry.nbytes:
            raise SnapshotError(f"bytes past the end of tensor {entry.name!r}")
        self._regions[index].write(offset, data)

    def finish(self, runner: SupportsExport) -> dict[str, torch.Tensor]:
        """Hand the model-owned state to the pipeline; returns the extras (by name). Aborts on any failure."""
        try:
            if self._state is not None and runner.sessions.kv_state(self.session_id) is not self._state:
                raise SnapshotRefused(f"session {self.session_id!r} was evicted while it was being imported")
            if self._scattered is not None:
                self._scattered.finish()
                self._scattered = None
                self._state = runner.sessions.state(self.session_id)
                self.held = True
            elif self.resident:
                pipeline = runner.sessions.pipeline
                assert isinstance(pipeline, SupportsSessionTransfer)  # _plan checked
                state = ModelState(self.header.get("model_state", {}), dict(self._model))
                pipeline.import_session_state(self.session_id, state)
                self._install_points(runner)
        except BaseException as exc:
            self.abort(runner)
            raise _as_snapshot_error(exc) from None
        self._finished = True
        extras, self._extra, self._model = self._extra, {}, {}
        return extras

    def abort(self, runner: SupportsExport) -> None:
        """Release what :meth:`begin` made (idempotent; nothing once :meth:`finish` has handed it on)."""
        self._regions, self._model, self._extra = [], {}, {}
        self._points, self._point_tensors, self._numbering = [], {}, []
        point_blocks, self._point_blocks = self._point_blocks, []
        state, self._state = self._state, None
        scattered, self._scattered = self._scattered, None
        if self._finished:
            return
        if scattered is not None:
            scattered.abort()
        if point_blocks:
            runner.sessions.pool.free(point_blocks)
        if state is None:
            return
        if runner.sessions.kv_state(self.session_id) is state:
            runner.sessions.release(self.session_id, reset_model=False, reason="close")  # the one release path: blocks, slot, the pipeline's state
        elif not state.released:
            state.release()

    # ---- begin's checks and allocations -------------------------------------------

    def _install_points(self, runner: SupportsExport) -> None:
        """Hand the kept rewind points to the session (each listing of a block is one more reference)."""
        rewinds = runner.sessions.rewinds
        if not self._points or rewinds.schedule is None:
            return
        pool = runner.sessions.pool
        boundaries = []
        for point in self._points:
            tables = point.tables
            mapped = type(tables)(
                sink={b: [self._numbering[n] for n in ids] for b, ids in tables.sink.items()},
                window={b: [self._numbering[n] for n in ids] for b, ids in tables.window.items()},
                frames_committed=tables.frames_committed,
                chunks_committed=tables.chunks_committed,
                sink_start=tables.sink_start,
            )
            model = ModelState(point.model_json, {n: self._point_tensors[k] for n, k in point.model_tensors.items()})
            boundaries.append(Boundary(mapped, model))
        pool.share(i for b in boundaries for i in b.tables.blocks())
        pool.free(self._point_blocks)  # allocate() gave each one reference: the tables hold theirs now
        self._point_blocks = []
        points = RewindPoints(pool, rewinds.schedule)
        points.restore(boundaries)
        rewinds.install(self.session_id, points, rewound=False)

    def _plan_points(self, runner: SupportsExport, by_name: dict[str, int], live: list[int]) -> None:
        """Which of the rewind points the snapshot carries this runner keeps, and where their bytes go; the
        bytes of those it drops are read and discarded."""
        names = set(by_name)
        points, frames = carried_points(
            self.header, live_frames=len(live), spec=runner.sessions.spec, tensor_names=names
        )
        pool = runner.sessions.pool
        kept = choose_kept(points, runner.sessions.rewinds.schedule, live_frames=len(live), free_blocks=pool.num_free)
        self.rewind_carried, self.rewind_kept = len(points), len(kept)
        needed = beyond_live(kept, len(live))
        self._point_blocks = pool.allocate(len(needed))
        self._numbering = live + [-1] * frames  # a dropped point's frames are listed by no kept point
        for number, block in zip(needed, self._point_blocks):
            self._numbering[number] = block
        found = by_name.get(REWIND_KV)
        if found is not None:
            entry, spec = self.tensors[found], runner.sessions.spec
            expected = (spec.num_layers, 2, frames, spec.tokens_per_frame, spec.num_kv_heads, spec.head_size)
            if entry.shape != expected or entry.dtype != spec.dtype:
                raise SnapshotError("the snapshot's rewind KV does not fit this spec")
            layers, kinds = pool.kv.shape[0], pool.kv.shape[1]
            scratch = torch.empty(flat_bytes(pool.kv[0, 0, 0]).numel(), dtype=torch.uint8, device=pool.device)
            self._regions[found] = _Regions([
                flat_bytes(pool.kv[layer, kind, self._numbering[len(live) + frame]])
                if self._numbering[len(live) + frame] >= 0 else scratch
                for layer in range(layers) for kind in range(kinds) for frame in range(frames)
            ])
        wanted = {key for p in kept for key in p.model_tensors.values()}
        for name, index in by_name.items():
            if not name.startswith(REWIND_MODEL_PREFIX):
                continue
            if name not in wanted:
                self._regions[index] = _Dropped()
                continue
            entry = self.tensors[index]
            tensor = self._point_tensors[name] = torch.empty(entry.shape, dtype=entry.dtype, device=pool.device)
            self._regions[index] = _Regions([flat_bytes(tensor)])
        self._points = kept

    def _plan(self, runner: SupportsExport) -> None:
        spec = runner.sessions.spec
        by_name: dict[str, int] = {}
        for index, entry in enumerate(self.tensors):
            if entry.name in by_name:
                raise SnapshotError(f"the snapshot names tensor {entry.name!r} twice")
            by_name[entry.name] = index
        self._regions = [_Regions([]) for _ in self.tensors]
        runner_names = [e.name for e in self.tensors if e.name not in self.extras and e.name not in self.elsewhere]
        for name, index in by_name.items():
            if name in self.extras:
                entry = self.tensors[index]
                if entry.nbytes > self.extras[name]:
                    raise SnapshotError(f"the snapshot's {name!r} has {entry.nbytes} bytes, over {self.extras[name]}")
                self._extra[name] = torch.empty(entry.shape, dtype=entry.dtype)
                self._regions[index] = _Regions([flat_bytes(self._extra[name])])
        if not self.resident:
            if runner_names:
                raise SnapshotError("a snapshot of a session with nothing resident carries tensors")
            return  # its first chunk runs here as a new rollout
        pipeline = runner.sessions.pipeline
        assert isinstance(pipeline, SupportsSessionTransfer)  # the config hash matched one that exports
        if runner.sessions.holds(self.session_id):
            raise SnapshotRefused(f"session {self.session_id!r} is already resident here")
        if isinstance(runner, ImportsScattered):
            self._scatter(runner, runner_names, by_name)
            return
        # a full pool parks its least recently used session when there is park room (runner/parking.py)
        table = runner.sessions
        if len(table.resident()) >= table.capacity and not table.make_room(evict=False):
            raise SnapshotRefused(
                f"no room: all {table.capacity} session slots of this replica's pool are in use"
            )
        kv = self.header.get("kv")
        if not isinstance(kv, dict):
            raise SnapshotError("the snapshot has no KV section")
        counters = {key: _count(kv, key) for key in ("frames_committed", "chunks_committed", "sink_start")}
        pool = runner.sessions.pool
        branches = set(spec.branch_names)
        for name in runner_names:
            kind, _, rest = name.partition("/")
            known = (
                (kind == "kv" and rest in branches)
                or (kind in ("cross_k", "cross_v") and rest in pool.cross_k)
                or name.startswith((MODEL_PREFIX, REWIND_MODEL_PREFIX))
                or name == REWIND_KV
            )
            if not known:
                raise SnapshotError(f"the snapshot carries tensor {name[:80]!r}, which this replica does not know")
        sink_frames = kv.get("sink_frames")
        if not isinstance(sink_frames, dict):
            raise SnapshotError("the snapshot's KV section has no sink_frames")
        state = self._state = SessionKVState(pool, self.session_id)  # takes the cross-attention slot, if any
        live: list[int] = []  # the live blocks in the snapshot's order: its rewind points number them so
        for branch in spec.branch_names:
            found = by_name.get(f"kv/{branch}")
            stored = None if found is None else self.tensors[found]
            frames = 0 if stored is None else stored.shape[2] if len(stored.shape) == 6 else -1
            sinks = _count(sink_frames, branch) if branch in sink_frames else 0
            expected = (spec.num_layers, 2, frames, spec.tokens_per_frame, spec.num_kv_heads, spec.head_size)
            if stored is not None and (stored.shape != expected or stored.dtype != spec.dtype):
                raise SnapshotError(f"the snapshot's KV for branch {branch!r} does not fit this spec")
            if frames > spec.resident_frames or sinks > min(frames, spec.sink_frames):
                raise SnapshotError(f"the snapshot's KV for branch {branch!r} does not fit this spec")
            # the window holds exactly the frames the spec keeps at this counter (a strided tail's too)
            kept = window_frame_indexes(spec, sinks, counters["sink_start"], counters["frames_committed"])
            if frames - sinks != len(kept):
                raise SnapshotError(
                    f"the snapshot's KV for branch {branch!r} holds {frames - sinks} window frames where this "
                    f"spec keeps {len(kept)} after {counters['frames_committed']} frames"
                )
            if found is None:
                continue
            blocks = pool.allocate(frames)
            state.sink[branch], state.window[branch] = blocks[:sinks], blocks[sinks:]
            live += blocks
            # The tensor's bytes are the blocks' in (layer, K/V, frame) order: one region per block of a layer's K or V.
            layers, kinds = pool.kv.shape[0], pool.kv.shape[1]
            self._regions[found] = _Regions(
                [flat_bytes(pool.kv[layer, kind, block]) for layer in range(layers) for kind in range(kinds)
                 for block in blocks]
            )
        if state.cross_slot is not None:
            for name in pool.cross_k:
                for kind, tensors in (("cross_k", pool.cross_k), ("cross_v", pool.cross_v)):
                    found = by_name.get(f"{kind}/{name}")
                    target = tensors[name][state.cross_slot]
                    if found is None or self.tensors[found] != TensorEntry.of(f"{kind}/{name}", target):
                        raise SnapshotError(f"the snapshot's {kind} cache {name!r} does not fit this spec")
                    self._regions[found] = _Regions([flat_bytes(target)])
            written = kv.get("cross_written", [])
            if not isinstance(written, list) or not all(isinstance(n, str) for n in written):
                raise SnapshotError("the snapshot's cross_written is not a list of names")
            state.cross_written = set(written)
        elif any(name.startswith("cross_") for name in runner_names):
            raise SnapshotError("the snapshot carries cross-attention caches; this spec has none")
        self._plan_points(runner, {n: by_name[n] for n in runner_names}, live)
        for name in runner_names:
            if name.startswith(MODEL_PREFIX):  # where the pipeline keeps it (its own .to() is then a no-op)
                entry = self.tensors[by_name[name]]
                tensor = self._model[name[len(MODEL_PREFIX) :]] = torch.empty(
                    entry.shape, dtype=entry.dtype, device=pool.device
                )
                self._regions[by_name[name]] = _Regions([flat_bytes(tensor)])
        state.frames_committed = counters["frames_committed"]
        state.chunks_committed = counters["chunks_committed"]
        state.sink_start = counters["sink_start"]
        runner.sessions.adopt(state)
        self.held = True
        runner.sessions.kv_state(self.session_id)  # asked for, as an export does: a runtime that parks keeps it in the pool


    def _scatter(self, runner: ImportsScattered, runner_names: list[str], by_name: Mapping[str, int]) -> None:
        """A runtime over several devices (:class:`ImportsScattered`): every device begins the import of its share,
        and each piece of the runner's tensors goes on to the runtime as it arrives, split there by heads, so this
        side never holds the session."""
        scattered = self._scattered = runner.begin_import(
            self.session_id, self.header, [self.tensors[by_name[n]] for n in runner_names], self.protocol_version
        )
        for share_index, name in enumerate(runner_names):
            self._regions[by_name[name]] = _Forwarded(scattered, share_index)


def _count(section: Mapping[str, Any], key: str) -> int:
    value = section.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SnapshotError(f"the snapshot's KV {key} is not a count (a non-negative integer)")
    return value


def _as_snapshot_error(exc: BaseException) -> BaseException:
    """A mismatch the checks did not name (a missing key, a wrong type) as a SnapshotError, a pool with too few
    free blocks as a refusal; others as they are."""
    if isinstance(exc, PoolExhausted):
        return SnapshotRefused(f"no room in this replica's pool: {exc}")
    if isinstance(exc, (KeyError, TypeError, ValueError)) and not isinstance(exc, SnapshotError):
        return SnapshotError(f"the snapshot does not fit this replica: {type(exc).__name__}: {exc}")
    return exc


def import_session(
    runner: SupportsExport, session_id: str, snapshot: SessionSnapshot, *, protocol_version: int | None = None
) -> None:
    """Make ``snapshot`` the resident session ``session_id``; refuse, leaving the pool as it was, if it does not fit.

    Never evicts another session: a replica with no free slot (and no park room) refuses. The same import as a
    streamed one, with every tensor's bytes at hand; tensors that are not the runner's (a start image the
    server carried) are left to the caller.
    """
    ours = {
        name: tensor.detach().contiguous()
        for name, tensor in snapshot.tensors.items()
        if name.partition("/")[0] in ("kv", "cross_k", "cross_v", "rewind") or name.startswith(MODEL_PREFIX)
    }
    entries = [TensorEntry.of(name, tensor) for name, tensor in ours.items()]
    job = SessionImport(session_id, snapshot.header, entries, protocol_version=protocol_version)
    job.begin(runner)
    try:
        for index, tensor in enumerate(ours.values()):
            if tensor.numel():
                job.write(runner, index, 0, flat_bytes(tensor))
    except BaseException:
        job.abort(runner)
        raise
    job.finish(runner)

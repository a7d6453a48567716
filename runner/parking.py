"""Parked sessions: a session's device state moved to host memory (or a spill file) and back, bit for bit.

A resident session holds pool blocks (its live history, and the chunk
boundaries it keeps to rewind to, which share blocks with it), perhaps a
cross-attention slot, and model-owned state inside the pipeline. Parking
copies all of it out (:func:`park_payload`): every *distinct* block it
references once, the block tables re-numbered into that copy (so a block the
live history and three boundaries share is copied once and, on restore,
shared again with the same reference counts), the cross slot, and the model
states (the live one and one per boundary; a tensor two boundaries share is
copied once). Then the device blocks go back to the pool. Restoring
(:func:`restore_payload`) allocates fresh blocks, copies the bytes back and
rebuilds the tables; the session continues exactly as if it had never left.

Host copies go to pinned (page-locked) buffers on a CUDA device, issued on a
copy stream that waits for the forward that wrote them; the compute stream
waits for the copy before any later kernel may reuse the freed blocks, so the
worker thread never blocks on the transfer. On CPU the copy is a plain clone.

:class:`ParkingLot` holds parked sessions within a byte budget (host memory)
and, when a spill directory is given, writes those past it to files there
(one safetensors file per session, bounded by its own budget).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .contract import ModelState
from .kv_state import HistoryTables, SessionKVState
from .pool import PagedKVPool
from .rewind import Boundary
from .types import ParkingPolicy

log = logging.getLogger("arstream.runner")

SPILL_METADATA_KEY = "arstream_parked"
# A spill file's name: this naming is the lot's own, and a lot sweeps files of it at start (a killed process's).
SPILL_PREFIX = "parked-"
SPILL_SUFFIX = ".safetensors"


class RestoreFailed(RuntimeError):
    """A parked session could not be restored; it has ended and its pool share is back."""


@dataclass
class ParkedSession:
    """One parked session: its tensors (host memory, or a spill file) and what places them.

    ``layout`` is JSON: the re-numbered live tables and boundary tables (block
    numbers index ``blocks``' third dimension), and per model state its JSON
    and which tensor names it uses. ``chunk_index``, ``history_frames`` and
    ``rewind_held`` answer the runner's questions without a restore.
    """

    session_id: str
    layout: dict[str, Any]
    tensors: dict[str, torch.Tensor] | None
    nbytes: int
    last_used: float
    chunk_index: int
    history_frames: int
    rewind_held: tuple[int, ...] | None
    spill_path: Path | None = None
    # the copy stream's event the host tensors are complete at (CUDA only)
    ready: Any = None

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


def tables_json(tables: HistoryTables, number: dict[int, int]) -> dict[str, Any]:
    return {
        "sink": {b: [number[i] for i in ids] for b, ids in tables.sink.items()},
        "window": {b: [number[i] for i in ids] for b, ids in tables.window.items()},
        "frames_committed": tables.frames_committed,
        "chunks_committed": tables.chunks_committed,
        "sink_start": tables.sink_start,
    }


def tables_from_json(doc: dict[str, Any], blocks: list[int]) -> HistoryTables:
    return HistoryTables(
        sink={b: [blocks[n] for n in ids] for b, ids in doc["sink"].items()},
        window={b: [blocks[n] for n in ids] for b, ids in doc["window"].items()},
        frames_committed=int(doc["frames_committed"]),
        chunks_committed=int(doc["chunks_committed"]),
        sink_start=int(doc["sink_start"]),
    )


class _HostCopier:
    """Copies device tensors into host memory: pinned buffers on a copy stream (CUDA), plain clones elsewhere."""

    def __init__(self, device: torch.device, stream: Any) -> None:
        self.device = device
        self.stream = stream if device.type == "cuda" else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(device))  # the forward that wrote them is done first

    def copy(self, tensor: torch.Tensor, *, owned: bool = False) -> torch.Tensor:
        """A contiguous host copy (a spill file takes only contiguous tensors).

        ``owned``: nothing else writes ``tensor`` (a gathered copy, a rewind point's
        kept state), so a contiguous one already in host memory is kept as it is.
        """
        if owned and tensor.device.type == "cpu" and tensor.is_contiguous():
            return tensor
        stream = self.stream if tensor.device.type == "cuda" else None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=stream is not None)
        if stream is None:
            host.copy_(tensor.detach())
            return host
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
        return host

    def finish(self) -> Any:
        """The event the copies are done at (None on CPU); later compute-stream work waits for it."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(event)  # freed blocks are rewritten only after the copy
        return event


def park_payload(
    pool: PagedKVPool,
    state: SessionKVState,
    boundaries: list[Boundary],
    live_model: ModelState,
    *,
    copy_stream: Any = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
    """``(layout, host tensors, ready event)`` of a session at its chunk boundary; the device state is untouched.

    The caller releases the device state afterwards (blocks back to the pool,
    the pipeline's session closed).
    """
    copier = _HostCopier(pool.device, copy_stream)
    live = state.tables()
    every = [live, *(b.tables for b in boundaries)]
    number: dict[int, int] = {}
    for tables in every:
        for block in tables.blocks():
            number.setdefault(block, len(number))
    tensors: dict[str, torch.Tensor] = {}
    if number:
        index = torch.tensor(list(number), dtype=torch.long, device=pool.device)
        tensors["blocks"] = copier.copy(pool.kv.index_select(2, index), owned=True)
    if state.cross_slot is not None:
        for name in pool.cross_k:
            tensors[f"cross_k/{name}"] = copier.copy(pool.cross_k[name][state.cross_slot])
            tensors[f"cross_v/{name}"] = copier.copy(pool.cross_v[name][state.cross_slot])
    # a tensor several model states share (boundaries keep equal tensors once) is copied once
    by_identity: dict[int, str] = {}
    devices: dict[str, str] = {}
    models = []
    # the live state is the pipeline's (it may reuse its tensors): copied; a boundary's is a kept copy already
    for position, model in enumerate([live_model, *(b.model for b in boundaries)]):
        used = {}
        for name, tensor in model.tensors.items():
            key = by_identity.get(id(tensor))
            if key is None:
                key = by_identity[id(tensor)] = f"model/{len(by_identity)}"
                tensors[key] = copier.copy(tensor, owned=position > 0)
                devices[key] = str(tensor.device)
            used[name] = key
        models.append({"json": copy.deepcopy(model.json), "tensors": used})
    layout = {
        "live": tables_json(live, number),
        "boundaries": [tables_json(b.tables, number) for b in boundaries],
        "models": models,
        "devices": devices,
        "cross_written": sorted(state.cross_written),
    }
    return layout, tensors, copier.finish()


@dataclass
class Restored:
    """A restored session: its KV state (tables installed), its boundaries (oldest first) and live model state."""

    state: SessionKVState
    boundaries: list[Boundary] = field(default_factory=list)
    live_model: ModelState = field(default_factory=lambda: ModelState({}))


def restore_payload(pool: PagedKVPool, session_id: str, layout: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Restored:
    """The session back in ``pool`` with every reference count it had; on any failure nothing stays allocated."""
    state = SessionKVState(pool, session_id)
    spec = pool.spec
    # who holds the blocks' references while this runs: "allocated" (one each), then the tables, then the state
    allocated: list[int] = []
    boundary_tables: list[HistoryTables] = []
    listed: list[int] = []
    stage = "none"
    try:
        stored = tensors.get("blocks")
        if stored is not None and (
            stored.dtype != spec.dtype
            or tuple(stored.shape[:2]) != (spec.num_layers, 2)
            or tuple(stored.shape[3:]) != (spec.tokens_per_frame, spec.num_kv_heads, spec.head_size)
        ):
            raise RestoreFailed("the parked KV does not fit this pool")
        allocated = pool.allocate(0 if stored is None else stored.shape[2])
        stage = "allocated"
        if stored is not None:
            index = torch.tensor(allocated, dtype=torch.long, device=pool.device)
            pool.kv.index_copy_(2, index, stored.to(pool.device, non_blocking=True))
        live = tables_from_json(layout["live"], allocated)
        boundary_tables = [tables_from_json(doc, allocated) for doc in layout["boundaries"]]
        # allocate() gave each block one reference; every further listing is one more (live and boundaries share)
        listed = live.blocks() + [i for t in boundary_tables for i in t.blocks()]
        extra = Counter(listed) - Counter(allocated)
        if set(allocated) != set(listed):
            raise RestoreFailed("the parked block tables do not match the parked blocks")
        pool.share(extra.elements())
        stage = "tables"
        state.adopt_tables(live)
        stage = "state"
        if state.cross_slot is not None:
            for name in pool.cross_k:
                pool.cross_k[name][state.cross_slot] = tensors[f"cross_k/{name}"].to(pool.device)
                pool.cross_v[name][state.cross_slot] = tensors[f"cross_v/{name}"].to(pool.device)
            state.cross_written = set(layout.get("cross_written", []))
        devices = layout["devices"]
        on_device = {key: tensors[key].to(devices[key], non_blocking=True) for key in devices}
        models = [
            ModelState(m["json"], {name: on_device[key] for name, key in m["tensors"].items()}) for m in layout["models"]
        ]
        if len(models) != 1 + len(boundary_tables):
            raise RestoreFailed("the parked model states do not match the parked boundaries")
    except BaseException:
        if stage == "allocated":
            pool.free(allocated)
        elif stage == "tables":
            pool.free(listed)
        elif stage == "state":
            pool.free(i for t in boundary_tables for i in t.blocks())
        state.release()
        raise
    return Restored(state, [Boundary(t, m) for t, m in zip(boundary_tables, models[1:])], models[0])


class ParkingLot:
    """Parked sessions by id, least recently used first, within ``budget_bytes`` of host memory.

    With a ``spill_dir``, a session that does not fit the host budget is
    written to a file there instead, while the files stay within
    ``spill_budget_bytes``. :meth:`room_for` says whether a payload of a size
    fits either; :meth:`put` stores it; :meth:`take` hands it back (reading a
    spilled one) and forgets it.

    The spill directory is one server's own. A process that is killed leaves
    its files there, which nothing counts any more, so a new lot removes every
    file of its naming (``parked-*.safetensors``) it finds before it spills
    (:meth:`_sweep_spill_dir`); other files are left alone.
    """

    def __init__(self, budget_bytes: int = 0, *, spill_dir: str | Path | None = None, spill_budget_bytes: int = 0) -> None:
        if budget_bytes < 0 or spill_budget_bytes < 0:
            raise ValueError("park budgets must be byte counts >= 0")
        self.budget_bytes = budget_bytes
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        self.spill_budget_bytes = spill_budget_bytes if self.spill_dir is not None else 0
        self._parked: OrderedDict[str, ParkedSession] = OrderedDict()
        self.swept_files, self.swept_bytes = self._sweep_spill_dir()

    def _sweep_spill_dir(self) -> tuple[int, int]:
        """Remove the spill files a process before this one left (a new lot has none of its own); ``(files, bytes)``."""
        if self.spill_dir is None or not self.spill_dir.is_dir():
            return 0, 0
        files = bytes_ = 0
        for path in self.spill_dir.glob(f"{SPILL_PREFIX}*{SPILL_SUFFIX}"):
            if path.is_symlink() or not path.is_file():
                continue
            size = path.stat().st_size
            path.unlink(missing_ok=True)
            files, bytes_ = files + 1, bytes_ + size
        if files:
            log.warning("removed %d spill files (%d bytes) a previous process left in %s", files, bytes_, self.spill_dir)
        return files, bytes_

    @classmethod
    def for_policy(cls, policy: ParkingPolicy) -> ParkingLot:
        return cls(policy.budget_bytes, spill_dir=policy.spill_dir, spill_budget_bytes=policy.spill_budget_bytes)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes + self.spill_budget_bytes > 0

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._parked

    def __len__(self) -> int:
        return len(self._parked)

    def get(self, session_id: str) -> ParkedSession | None:
        return self._parked.get(session_id)

    def sessions(self) -> list[str]:
        return list(self._parked)

    @property
    def host_bytes(self) -> int:
        return sum(p.nbytes for p in self._parked.values() if p.spill_path is None)

    @property
    def spilled_bytes(self) -> int:
        return sum(p.nbytes for p in self._parked.values() if p.spill_path is not None)

    @property
    def spilled_sessions(self) -> int:
        return sum(1 for p in self._parked.values() if p.spill_path is not None)

    def room_for(self, nbytes: int) -> bool:
        return self.host_bytes + nbytes <= self.budget_bytes or self.spilled_bytes + nbytes <= self.spill_budget_bytes

    def put(self, parked: ParkedSession) -> None:
        """Keep ``parked`` in host memory, or spill it; :class:`OSError` (a failed write) keeps nothing."""
        if self.host_bytes + parked.nbytes > self.budget_bytes:
            self._spill(parked)
        self._parked[parked.session_id] = parked

    def _spill(self, parked: ParkedSession) -> None:
        assert self.spill_dir is not None and parked.tensors is not None
        parked.wait_ready()
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=SPILL_PREFIX, suffix=SPILL_SUFFIX, dir=self.spill_dir)
        os.close(handle)
        path = Path(name)
        try:
            save_file(parked.tensors, str(path), metadata={SPILL_METADATA_KEY: json.dumps(parked.layout)})
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        parked.spill_path, parked.tensors = path, None

    def take(self, session_id: str) -> tuple[ParkedSession, dict[str, torch.Tensor]]:
        """Remove the session and return it with its tensors (read back when spilled; the file goes)."""
        parked = self._parked.pop(session_id)
        parked.wait_ready()
        if parked.spill_path is None:
            assert parked.tensors is not None
            tensors, parked.tensors = parked.tensors, None
            return parked, tensors
        try:
            return parked, load_file(str(parked.spill_path))
        finally:
            parked.spill_path.unlink(missing_ok=True)

    def peek(self, session_id: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """A parked session's layout and tensors (read from its file when spilled); it stays parked. None: not parked."""
        parked = self._parked.get(session_id)
        if parked is None:
            return None
        parked.wait_ready()
        tensors = parked.tensors if parked.tensors is not None else load_file(str(parked.spill_path))
        return parked.layout, tensors

    def discard(self, session_id: str) -> bool:
        """Forget a parked session (it ended); whether it was parked."""
        parked = self._parked.pop(session_id, None)
        if parked is None:
            return False
        parked.wait_ready()
        if parked.spill_path is not None:
            parked.spill_path.unlink(missing_ok=True)
        return True

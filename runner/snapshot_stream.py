"""A session snapshot in pieces: exported, sent and read without ever holding the whole file.

The bytes are the same safetensors file :func:`snapshot_bytes` writes whole
(:func:`parse_snapshot` reads either), but neither side builds it whole:

- :func:`plan_export` runs on the worker thread at the session's chunk
  boundary and returns a :class:`SnapshotPlan`: the header (its tensor table
  computed from shapes alone) and, per tensor, the *parts* that copy its
  bytes out of the pool or the model's state, each at most about
  :data:`PIECE_BYTES`. A KV part is one frame's block of one layer's K or V,
  read straight from the pool (no gathered copy of the session). The parts
  must be read while the session stays as it was: a session being moved runs
  no tick, so the worker serves them between others' forwards.
- :class:`SnapshotReader` takes the bytes as they arrive, checks the header
  as soon as it is complete (format, tensor table, total size within a
  limit), and says where each byte goes (:class:`Write`): a server writes
  them straight into the session's pool blocks (runner/snapshot_import.py),
  so it holds a piece, never the file nor a copy of the session's tensors.
- The file's last tensor, ``digest/sha256``, is the SHA-256 of every byte
  before it, hashed as the pieces go out (:class:`Seal`); the reader checks
  it at the end (:meth:`SnapshotReader.finish`), so a corrupt piece is
  refused and the import that wrote it released.

So a move's extra memory is a few pieces on either side (measured:
scripts/bench-snapshot-memory.py, docs/deployment.md), instead of the
snapshot three times over (copies, file bytes, request body).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .capabilities import SupportsExport
from .snapshot import GathersHeads, SessionSnapshot, SnapshotError, export_header, parked_copy, read_header
from .snapshot_header import MAX_HEADER_BYTES, METADATA_KEY
from .snapshot_import import SessionImport, TensorEntry
from .snapshot_rewind import REWIND_KV, REWIND_SECTION, export_rewind

PIECE_BYTES = 4 * 2**20

# safetensors' dtype names for the dtypes a session's tensors have.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
BY_NAME = {name: dtype for dtype, name in DTYPES.items()}

# The file's last tensor: the SHA-256 of every byte before it (head and tensors), so a receiver knows that the
# bytes it wrote into its pool are the ones that were sent. The sender hashes as it streams; a file without it
# (written by an older replica) is read without the check.
DIGEST_TENSOR = "digest/sha256"
DIGEST_BYTES = 32


class Seal:
    """The running SHA-256 a snapshot's last tensor carries (hashlib releases the GIL on large pieces)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)

    def digest(self) -> bytes:
        return self._hash.digest()


class SnapshotTooLarge(SnapshotError):
    """More bytes than the receiver takes for one session."""


Part = Callable[[], torch.Tensor]  # returns a slice of one tensor's bytes, in order (any device)


def _span(flat: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return flat[start : start + length]


def _block(kv: torch.Tensor, layer: int, kind: int, block: int) -> torch.Tensor:
    return kv[layer, kind, block]


@dataclass
class TensorPlan:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: list[Part] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class SnapshotPlan:
    """What :func:`plan_export` returns: the header and, per tensor, the parts to read in order."""

    header: dict[str, Any]
    tensors: list[TensorPlan]

    def add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """A whole tensor (model state, a start image), read in pieces of about PIECE_BYTES."""
        flat = tensor.detach().reshape(-1)
        step = max(1, PIECE_BYTES // max(1, flat.element_size()))
        parts: list[Part] = [partial(_span, flat, a, step) for a in range(0, flat.numel(), step)]
        self.tensors.append(TensorPlan(name, tensor.dtype, tuple(tensor.shape), parts))

    def head(self) -> bytes:
        """The file's first bytes: the length and the JSON table (offsets from the shapes), padded to 8."""
        table: dict[str, Any] = {"__metadata__": {METADATA_KEY: json.dumps(self.header, separators=(",", ":"))}}
        offset = 0
        for plan in self.tensors:
            if plan.dtype not in DTYPES:
                raise SnapshotError(f"tensor {plan.name!r} has dtype {plan.dtype}, which a snapshot cannot carry")
            table[plan.name] = {"dtype": DTYPES[plan.dtype], "shape": list(plan.shape),
                                "data_offsets": [offset, offset + plan.nbytes]}
            offset += plan.nbytes
        table[DIGEST_TENSOR] = {"dtype": "U8", "shape": [DIGEST_BYTES], "data_offsets": [offset, offset + DIGEST_BYTES]}
        text = json.dumps(table, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    @property
    def nbytes(self) -> int:
        return len(self.head()) + sum(p.nbytes for p in self.tensors) + DIGEST_BYTES

    def chunks(self) -> Iterator[bytes]:
        """The file's bytes in order, each piece read here (the caller owns the tensors: a test, a tool, or
        :func:`snapshot_bytes`), then the digest; a server's sender reads its pieces on the worker."""
        seal = Seal()
        head = self.head()
        seal.add(head)
        yield head
        for piece in self.pieces():  # one at a time: the file is never whole here either
            data = b"".join(piece_bytes(part()) for part in piece)
            seal.add(data)
            yield data
        yield seal.digest()

    def pieces(self) -> list[list[Part]]:
        """The parts in order, grouped into pieces of about PIECE_BYTES (small blocks travel together: one
        worker call each piece, not each block)."""
        pieces: list[list[Part]] = []
        size = PIECE_BYTES
        for tensor in self.tensors:
            part_bytes = tensor.nbytes // max(1, len(tensor.parts))
            for part in tensor.parts:
                if size + part_bytes > PIECE_BYTES and size > 0:
                    pieces.append([])
                    size = 0
                pieces[-1].append(part)
                size += part_bytes
        return pieces


@runtime_checkable
class PlansGatheredSnapshots(GathersHeads, Protocol):
    """A runtime over several devices plans its sessions' snapshots itself (said here, beside the plan: the snapshot
    module names :class:`GathersHeads` and this module imports it)."""

    def plan_snapshot(self, session_id: str, protocol_version: int | None) -> SnapshotPlan:
        """The same as :func:`plan_export`'s plan, its heads gathered a window of blocks at a time."""


def plan_export(runner: SupportsExport, session_id: str, *, protocol_version: int | None = None) -> SnapshotPlan:
    """The session's snapshot as a plan (see the module docstring); the session stays resident, untouched.

    A runtime over several devices plans it itself: its parts join every device's heads of a block, asking
    the other devices for a window of blocks at a time."""
    if isinstance(runner, PlansGatheredSnapshots):
        return runner.plan_snapshot(session_id, protocol_version)
    if session_id in runner.sessions.lot:  # already a host copy (runner/parking.py): planned from it, not restored
        return plan_parked(runner, session_id, protocol_version=protocol_version)
    header, model = export_header(runner, session_id, protocol_version=protocol_version)
    state = runner.sessions.kv_state(session_id)
    assert state is not None
    plan = SnapshotPlan(header, [])
    pool = runner.sessions.pool
    for branch in runner.sessions.spec.branch_names:
        blocks = state.sink[branch] + state.window[branch]
        if not blocks:
            continue
        layers, kinds = pool.kv.shape[0], pool.kv.shape[1]
        shape = (layers, kinds, len(blocks), *pool.kv.shape[3:])
        # Frame order within each layer's K, then V: the bytes of index_select(2, blocks), one block at a time.
        parts: list[Part] = [
            partial(_block, pool.kv, layer, kind, block)
            for layer in range(layers) for kind in range(kinds) for block in blocks
        ]
        plan.tensors.append(TensorPlan(f"kv/{branch}", pool.kv.dtype, shape, parts))
    if state.cross_slot is not None:
        for name in pool.cross_k:
            plan.add_tensor(f"cross_k/{name}", pool.cross_k[name][state.cross_slot])
            plan.add_tensor(f"cross_v/{name}", pool.cross_v[name][state.cross_slot])
    for name, tensor in model.tensors.items():
        plan.add_tensor(f"model/{name}", tensor)
    live = [i for b in runner.sessions.spec.branch_names for i in state.sink[b] + state.window[b]]
    rewind = export_rewind(live, runner.sessions.rewinds.movable(session_id))
    if rewind is not None:  # its rewind points, read from the pool like the live blocks
        header[REWIND_SECTION] = rewind.section
        if rewind.blocks:
            layers, kinds = pool.kv.shape[0], pool.kv.shape[1]
            shape = (layers, kinds, len(rewind.blocks), *pool.kv.shape[3:])
            parts = [
                partial(_block, pool.kv, layer, kind, block)
                for layer in range(layers) for kind in range(kinds) for block in rewind.blocks
            ]
            plan.tensors.append(TensorPlan(REWIND_KV, pool.kv.dtype, shape, parts))
        for name, tensor in rewind.tensors.items():
            plan.add_tensor(name, tensor)
    return plan


def plan_parked(runner: SupportsExport, session_id: str, *, protocol_version: int | None = None) -> SnapshotPlan:
    """A parked session's snapshot as a plan over its host copy: its KV blocks read from it one at a time, by
    number, so the export holds no second copy of the session beside the parked one."""
    copy = parked_copy(runner, session_id, protocol_version=protocol_version)
    plan = SnapshotPlan(copy.header, [])
    for name, held in copy.tensors.items():
        if isinstance(held, torch.Tensor):
            plan.add_tensor(name, held)
            continue
        blocks = copy.blocks
        assert blocks is not None
        layers, kinds = blocks.shape[0], blocks.shape[1]
        parts: list[Part] = [
            partial(_block, blocks, layer, kind, number)
            for layer in range(layers) for kind in range(kinds) for number in held
        ]
        plan.tensors.append(TensorPlan(name, blocks.dtype, (layers, kinds, len(held), *blocks.shape[3:]), parts))
    return plan


def snapshot_bytes(snapshot: SessionSnapshot) -> bytes:
    """The wire format whole: what :func:`plan_of` streams, its digest included."""
    return b"".join(plan_of(snapshot).chunks())


def parse_snapshot(data: bytes) -> SessionSnapshot:
    """Parse a snapshot's bytes whole: the header first (cheap, bounded), then the tensors; :class:`SnapshotError`
    if malformed (or its digest does not match)."""
    read_header(data)  # its own errors for bytes too short for a header, or a header past its bounds
    reader = SnapshotReader(max_bytes=len(data))
    reader.feed(data)
    return reader.snapshot()


def plan_of(snapshot: SessionSnapshot) -> SnapshotPlan:
    """A snapshot already in memory (an unstarted session's) as a plan."""
    plan = SnapshotPlan(snapshot.header, [])
    for name, tensor in snapshot.tensors.items():
        plan.add_tensor(name, tensor)
    return plan


def piece_bytes(piece: torch.Tensor) -> bytes:
    """A part's bytes (copied to the CPU)."""
    return piece.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class Write:
    """Bytes of the table's tensor ``index`` (see :attr:`SnapshotReader.tensors`) from byte ``offset`` of it."""

    index: int
    offset: int
    data: memoryview

    def as_tensor(self) -> torch.Tensor:
        """The bytes as a flat uint8 tensor (on the CPU; a read-only buffer is copied, a piece at most)."""
        data = self.data if not self.data.readonly else memoryview(bytearray(self.data))
        return torch.frombuffer(data, dtype=torch.uint8) if data.nbytes else torch.empty(0, dtype=torch.uint8)


class SnapshotReader:
    """Reads a snapshot's bytes as they arrive (:meth:`feed`), then :meth:`finish`; :class:`SnapshotError`
    for anything that is not a well-formed snapshot within ``max_bytes``.

    :meth:`feed` returns where each byte goes (:class:`Write`, per tensor of :attr:`tensors`): a server writes
    them straight into the session's pool blocks (runner/snapshot_import.py). With ``hold`` the reader also
    keeps them itself, for :meth:`snapshot` (a snapshot in memory: tests, tools).
    """

    def __init__(
        self, max_bytes: int, check: Callable[[dict[str, Any]], object] | None = None, *, hold: bool = True
    ) -> None:
        self.max_bytes = max_bytes
        # Called with the header as soon as it has come, before any tensor is allocated: refuse early.
        self._check = check
        self._hold = hold
        self._pending = bytearray()  # bytes of the head not yet parsed
        self._head_length: int | None = None
        self.header: dict[str, Any] | None = None
        self.tensors: list[TensorEntry] = []  # the table, in byte order, the digest left out
        self._buffers: list[torch.Tensor] = []  # with hold: each tensor's bytes
        self._seal = Seal()
        self._digest: bytearray | None = None  # the digest's bytes as they come; None: the snapshot has none
        self._current = 0  # index into tensors
        self._filled = 0  # bytes of the current tensor written
        self.received = 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[Write]:
        """Take the next bytes; returns where they go (nothing until the head is complete)."""
        self.received += len(data)
        if self.received > self.max_bytes:
            raise SnapshotTooLarge(f"a session snapshot here is at most {self.max_bytes} bytes")
        view = memoryview(data)
        while self.header is None:
            # Only the head's own bytes are buffered (what follows is written where it belongs, uncopied).
            want = 8 - len(self._pending) if self._head_length is None else 8 + self._head_length - len(self._pending)
            self._pending += view[:want]
            view = view[want:]
            if not self._parse_head():
                if not view.nbytes:
                    return []
                continue
            self._pending = bytearray()
        writes: list[Write] = []
        while view.nbytes:
            self._skip_empty()
            if self._current >= len(self.tensors):
                self._take_digest(view)
                return writes
            entry = self.tensors[self._current]
            take = min(view.nbytes, entry.nbytes - self._filled)
            write = Write(self._current, self._filled, view[:take])
            self._seal.add(write.data)
            if self._hold:
                self._buffers[self._current].numpy()[self._filled : self._filled + take] = np.frombuffer(
                    write.data, dtype=np.uint8
                )
            writes.append(write)
            self._filled += take
            view = view[take:]
            if self._filled == entry.nbytes:
                self._current, self._filled = self._current + 1, 0
        return writes

    def _take_digest(self, view: memoryview) -> None:
        if self._digest is None or len(self._digest) + view.nbytes > DIGEST_BYTES:
            raise SnapshotError("a session snapshot has bytes after its last tensor")
        self._digest += view

    def _parse_head(self) -> bool:
        """Parse the head once it is all here; False while it is not. With ``hold``, allocates the tensors' buffers."""
        if self._head_length is None:
            if len(self._pending) < 8:
                return False
            (self._head_length,) = struct.unpack("<Q", self._pending[:8])
        length = self._head_length
        if length > min(MAX_HEADER_BYTES, self.max_bytes):  # before buffering it: a header is bounded
            raise SnapshotError(
                f"not a session snapshot: header length {length} does not fit (at most {MAX_HEADER_BYTES} bytes)"
            )
        if len(self._pending) < 8 + length:
            return False
        head = bytes(self._pending[: 8 + length])
        header = read_header(head)
        if self._check is not None:
            self._check(header)
        try:  # read_header has bounded and parsed these bytes already: the tensor table is what is left to check
            table = json.loads(head[8:])
            entries = sorted(
                ((k, v) for k, v in table.items() if k != "__metadata__"), key=lambda kv: int(kv[1]["data_offsets"][0])
            )
            total = 8 + length + sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0]) for _k, v in entries)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            raise SnapshotError("not a session snapshot: its tensor table is malformed") from None
        if total > self.max_bytes:
            raise SnapshotTooLarge(f"a session snapshot here is at most {self.max_bytes} bytes; this one has {total}")
        offset = 0
        tensors: list[TensorEntry] = []
        for position, (name, entry) in enumerate(entries):
            try:
                tensor = TensorEntry(
                    str(name), BY_NAME[entry["dtype"]], tuple(int(n) for n in entry["shape"])
                )
                begin, end = (int(n) for n in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SnapshotError(f"not a session snapshot: tensor {str(name)[:80]!r} is described wrongly") from None
            if begin != offset or min(tensor.shape, default=0) < 0 or end - begin != tensor.nbytes:
                raise SnapshotError(f"not a session snapshot: tensor {str(name)[:80]!r}'s offsets do not fit its shape")
            offset = end
            if name == DIGEST_TENSOR:
                if position != len(entries) - 1 or tensor != TensorEntry(DIGEST_TENSOR, torch.uint8, (DIGEST_BYTES,)):
                    raise SnapshotError("not a session snapshot: its digest is not the last 32 bytes")
                self._digest = bytearray()
                continue
            tensors.append(tensor)
        self.header, self.tensors = header, tensors
        self._seal.add(head)
        if self._hold:
            self._buffers = [torch.empty(t.nbytes, dtype=torch.uint8) for t in tensors]
        self._skip_empty()
        return True

    def _skip_empty(self) -> None:
        while self._current < len(self.tensors) and self.tensors[self._current].nbytes == 0:
            self._current += 1

    def finish(self) -> None:
        """Every byte has come and, where the snapshot carries its digest, they are the bytes that were sent;
        :class:`SnapshotError` if the stream ended early or a piece is corrupt."""
        self._skip_empty()
        digest_short = self._digest is not None and len(self._digest) < DIGEST_BYTES
        if self.header is None or self._current < len(self.tensors) or digest_short:
            raise SnapshotError(f"the session snapshot ended early, after {self.received} bytes")
        if self._digest is not None and bytes(self._digest) != self._seal.digest():
            raise SnapshotError("the session snapshot is corrupt: its bytes do not match its SHA-256 digest")

    def snapshot(self) -> SessionSnapshot:
        """The snapshot, once every byte has come (a reader made with ``hold``); see :meth:`finish`."""
        self.finish()
        assert self.header is not None and self._hold
        tensors = {t.name: buffer.view(t.dtype).reshape(t.shape) for t, buffer in zip(self.tensors, self._buffers)}
        return SessionSnapshot(self.header, tensors)


def import_pieces(
    runner: SupportsExport,
    session_id: str,
    pieces: Iterable[bytes | bytearray],
    *,
    max_bytes: int,
    protocol_version: int | None = None,
    finish: bool = True,
) -> SessionImport:
    """Stream ``pieces`` straight into ``runner``'s pool as ``session_id``, in this thread (tests, tools; a
    server runs the same steps with the writes on its worker, app/migration.py). Without ``finish`` the import
    is left open after the last piece (the caller aborts it); an error aborts it."""
    reader = SnapshotReader(max_bytes=max_bytes, hold=False)
    job: SessionImport | None = None
    try:
        for piece in pieces:
            writes = reader.feed(piece)
            if job is None and reader.header is not None:
                job = SessionImport(session_id, reader.header, reader.tensors, protocol_version=protocol_version)
                job.begin(runner)
            for write in writes:
                assert job is not None
                job.write(runner, write.index, write.offset, write.as_tensor())
        if finish:
            reader.finish()
        if job is None:
            raise SnapshotError("the session snapshot ended early, before its header")
        if finish:
            job.finish(runner)
    except BaseException:
        if job is not None:
            job.abort(runner)
        raise
    return job

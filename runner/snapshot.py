"""A session as a portable object: everything it needs to continue in another process.

A :class:`SessionSnapshot` is taken at a chunk boundary (no forward in
flight) and holds

- the session's KV blocks, per branch, in frame order (sink, then window),
  with the frame counters that place them (absolute frame positions keep
  counting, so RoPE and the window go on exactly as before);
- its cross-attention caches, when the spec has any;
- the model-owned state (noise generator, camera, decoder canvas, action or
  VAE caches...), through the pipeline's optional
  :class:`~arstream.runner.contract.SupportsSessionTransfer` hook;
- its rewind points: the blocks they hold beyond the live history, their
  tables and model states (runner/snapshot_rewind.py), which a receiving
  runner keeps as far as its own schedule and free blocks allow;
- an opaque ``session`` section for the layer above (the server puts the
  protocol state there: controls, prompt, seed, pending events, id floors).

On the wire it is one safetensors file (runner/snapshot_stream.py writes and
reads it in pieces; its last tensor is the SHA-256 of the bytes before it): the tensors, and in its metadata a
JSON header (``FORMAT_VERSION``, model name, config hash, runtime, protocol
version, counters, the model's and the server's JSON state). A runner refuses
a snapshot of another model, config, runtime or format with
:class:`SnapshotRefused`, and an import that fails for any reason leaves the
pool as it was (every block allocated for it goes back): whole or streamed, an
import is runner/snapshot_import.py's :class:`SessionImport`.

Bit-identical continuation is the contract: export at chunk ``k``, import
into a fresh runner of the same model, and chunk ``k`` onwards equals what the
uninterrupted session would have produced (tests/runner/test_snapshot.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

from .capabilities import SupportsExport
from .contract import ModelState, SupportsSessionTransfer
from .parking import tables_from_json
from .rewind import Boundary
from .snapshot_header import SnapshotHeaderError, parse_header
from .snapshot_rewind import REWIND_KV, REWIND_SECTION, export_rewind
from .spec import KVCacheSpec


FORMAT_VERSION = 1
RUNTIME_NAME = "arstream"


@runtime_checkable
class GathersHeads(Protocol):
    """A runtime whose sessions' KV blocks are split by heads over its devices, each holding a share.

    A snapshot of one of its sessions is gathered onto the runtime's first device whole (every head, the layout
    a single device exports) and an imported one is scattered (each device takes its heads), so a session moves
    between replicas of any device count. Its :class:`SupportsExport` ``sessions`` is the first device's table
    (which sessions are held and where); these say what the whole session is.
    """

    @property
    def whole_spec(self) -> KVCacheSpec:
        """The KV spec of every head (what a single device's pool holds, and a snapshot's identity names)."""

    @property
    def whole_session_bytes(self) -> int:
        """A resident session's bytes at most, every head (the most an incoming snapshot of it carries)."""

    def export_snapshot(self, session_id: str, protocol_version: int | None) -> SessionSnapshot:
        """The session's snapshot at its chunk boundary, its heads gathered (it stays held)."""


class SnapshotError(ValueError):
    """A snapshot cannot be exported, or its bytes are not a session snapshot."""


class SnapshotRefused(SnapshotError):
    """A well-formed snapshot this runner will not take (other model or config, no room)."""


@dataclass
class SessionSnapshot:
    """One session's portable state; runner/snapshot_stream.py's :func:`snapshot_bytes` and
    :func:`parse_snapshot` are the wire format."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return str(self.header.get("model"))

    @property
    def next_chunk_index(self) -> int:
        return int(self.header["kv"]["chunks_committed"])

    @property
    def resident(self) -> bool:
        """False for a session that had not run its first chunk: it holds no KV or model state to restore."""
        return self.header.get("resident", True) is not False

    @property
    def session(self) -> dict[str, Any]:
        """The server's section (protocol state); empty when only the runner state was taken."""
        return self.header.setdefault("session", {})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def read_header(data: bytes) -> dict[str, Any]:
    """The JSON header of a snapshot's bytes, checked for the format version; nothing else is parsed.

    Bounded in length and depth before parsing (runner/snapshot_header.py)."""
    try:
        header = parse_header(data)
    except SnapshotHeaderError as exc:
        raise SnapshotError(str(exc)) from None
    if not isinstance(header, dict) or header.get("format_version") != FORMAT_VERSION:
        got = header.get("format_version") if isinstance(header, dict) else None
        raise SnapshotRefused(f"snapshot format version {got!r}; this server reads version {FORMAT_VERSION}")
    return header


# ---- identity -----------------------------------------------------------------------------------


def config_hash(runner: SupportsExport) -> str:
    """What must match for a session to continue bit-identically: KV spec, model card, model config and weights."""
    # A replica over several devices names the spec of every head and its card without the device count: a
    # session moves between replicas of any count (its snapshot gathers the heads: runner/distributed/).
    spec = runner.whole_spec if isinstance(runner, GathersHeads) else runner.sessions.spec
    pipeline = runner.sessions.pipeline
    card = {key: value for key, value in runner.model_card().items() if key != "devices"}
    # a spec without a strided tail hashes as it did before the tail existed: a replica of an older release still
    # takes its sessions (and its the newer's)
    skipped = {"session_capacity"} | (set() if spec.strided_window_frames else {"strided_window_frames", "frame_stride"})
    document = {
        "spec": {f.name: repr(getattr(spec, f.name)) for f in fields(spec) if f.name not in skipped},
        "card": card,
        "model": pipeline.transfer_fingerprint() if isinstance(pipeline, SupportsSessionTransfer) else None,
    }
    text = json.dumps(document, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of a module's parameters and buffers, names included: two replicas serving different weights differ."""
    return tensors_digest(module.state_dict())


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors (names, dtypes and bytes), in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        # flattened first: a 0-dim tensor (a scalar parameter) has no byte view of its own
        digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def identity(runner: SupportsExport, protocol_version: int | None) -> dict[str, Any]:
    """What a snapshot must match to be taken here (:func:`check_identity`). Its config hash reads the model's
    weights the first time (the pipeline's fingerprint): ask it on the thread that owns the runtime."""
    return {
        "format_version": FORMAT_VERSION,
        "model": runner.model_card().get("name"),
        "config_hash": config_hash(runner),
        "runtime": RUNTIME_NAME,
        "protocol_version": protocol_version,
    }


def check_compatible(runner: SupportsExport, header: dict[str, Any], protocol_version: int | None = None) -> None:
    """Raise :class:`SnapshotRefused` naming the first difference between the snapshot and this runner."""
    check_identity(identity(runner, protocol_version), header)


def check_identity(mine: dict[str, Any], header: dict[str, Any]) -> None:
    """Raise :class:`SnapshotRefused` naming the first difference between a snapshot's header and ``mine``
    (:func:`identity`; its protocol version None: any)."""
    protocol_version = mine["protocol_version"]
    for key, what in (
        ("format_version", "format version"),
        ("runtime", "runtime"),
        ("model", "model"),
        ("config_hash", "model config (KV spec, card, weights)"),
        ("protocol_version", "protocol version"),
    ):
        if key == "protocol_version" and protocol_version is None:
            continue
        if header.get(key) != mine[key]:
            raise SnapshotRefused(
                f"the session was exported by a replica with another {what}: "
                f"{header.get(key)!r}, this replica has {mine[key]!r}"
            )


# ---- export -------------------------------------------------------------------------------------


def export_header(
    runner: SupportsExport, session_id: str, *, protocol_version: int | None = None
) -> tuple[dict[str, Any], ModelState]:
    """What a snapshot of the session says (its header) and the model-owned state it carries; the KV blocks
    are the session's own (sink, then window, per branch). At its chunk boundary only."""
    pipeline = runner.sessions.pipeline
    if not isinstance(pipeline, SupportsSessionTransfer):
        name = runner.model_card().get("name")
        raise SnapshotError(f"model {name!r} cannot export its sessions (no export_session_state hook)")
    state = runner.sessions.kv_state(session_id)
    if state is None:
        raise SnapshotError(f"session {session_id!r} is not resident; nothing to export")
    if state.in_pass or state.chunk_held or any(state.pending.values()):
        raise SnapshotError(f"session {session_id!r} is inside a forward; export only at a chunk boundary")
    model = pipeline.export_session_state(session_id)
    kv = {
        "frames_committed": state.frames_committed,
        "chunks_committed": state.chunks_committed,
        "sink_start": state.sink_start,
        "sink_frames": {branch: len(state.sink[branch]) for branch in runner.sessions.spec.branch_names},
        "cross_written": sorted(state.cross_written),
    }
    return _header(runner, protocol_version, kv, model.json), model


def _header(runner: SupportsExport, protocol_version: int | None, kv: dict[str, Any], model_json: Any) -> dict[str, Any]:
    header = identity(runner, protocol_version)
    header["kv"] = kv
    header["model_state"] = model_json
    header["session"] = {}
    return header


def export_session(runner: SupportsExport, session_id: str, *, protocol_version: int | None = None) -> SessionSnapshot:
    """The session's state at its chunk boundary; the session stays resident (the caller releases it)."""
    if isinstance(runner, GathersHeads):
        return runner.export_snapshot(session_id, protocol_version)
    if session_id in runner.sessions.lot:
        return export_parked(runner, session_id, protocol_version=protocol_version)
    header, model = export_header(runner, session_id, protocol_version=protocol_version)
    state = runner.sessions.kv_state(session_id)
    assert state is not None
    tensors: dict[str, torch.Tensor] = {}
    for branch in runner.sessions.spec.branch_names:
        blocks = state.sink[branch] + state.window[branch]
        if blocks:
            index = torch.tensor(blocks, dtype=torch.long, device=runner.sessions.pool.device)
            tensors[f"kv/{branch}"] = runner.sessions.pool.kv.index_select(2, index)
    if state.cross_slot is not None:
        for name in runner.sessions.pool.cross_k:
            tensors[f"cross_k/{name}"] = runner.sessions.pool.cross_k[name][state.cross_slot]
            tensors[f"cross_v/{name}"] = runner.sessions.pool.cross_v[name][state.cross_slot]
    for name, tensor in model.tensors.items():
        tensors[f"model/{name}"] = tensor
    live = [i for b in runner.sessions.spec.branch_names for i in state.sink[b] + state.window[b]]
    carry_rewind(header, tensors, runner.sessions.pool.kv, live, runner.sessions.rewinds.movable(session_id))
    return SessionSnapshot(header, tensors)


@dataclass
class ParkedCopy:
    """A parked session's snapshot as its host copy holds it (runner/parking.py): nothing copied out of it yet.

    ``tensors`` are the snapshot's tensors in file order: a KV tensor as the numbers of its blocks in ``blocks``
    (the host copy of every block the session holds, ``[layers, K/V, n, tokens, heads, head_size]``), in order;
    any other as it is held."""

    header: dict[str, Any]
    blocks: torch.Tensor | None
    tensors: dict[str, torch.Tensor | list[int]]


def parked_copy(runner: SupportsExport, session_id: str, *, protocol_version: int | None = None) -> ParkedCopy:
    """The snapshot of a parked session, taken from its host copy (read back whole from its file when it was
    spilled): nothing is restored, and it stays parked (the caller releases it)."""
    held = runner.sessions.lot.peek(session_id)
    if held is None:
        raise SnapshotError(f"session {session_id!r} is not parked; nothing to export")
    layout, parked = held
    live, model = layout["live"], layout["models"][0]
    kv = {
        "frames_committed": live["frames_committed"],
        "chunks_committed": live["chunks_committed"],
        "sink_start": live["sink_start"],
        "sink_frames": {branch: len(live["sink"][branch]) for branch in runner.sessions.spec.branch_names},
        "cross_written": layout["cross_written"],
    }
    tensors: dict[str, torch.Tensor | list[int]] = {}
    for branch in runner.sessions.spec.branch_names:
        numbers = live["sink"][branch] + live["window"][branch]
        if numbers:
            tensors[f"kv/{branch}"] = list(numbers)
    tensors.update({name: t for name, t in parked.items() if name.startswith(("cross_k/", "cross_v/"))})
    for name, key in model["tensors"].items():
        tensors[f"model/{name}"] = parked[key]
    header = _header(runner, protocol_version, kv, model["json"])
    if "blocks" in parked:  # its rewind points were parked with it, numbered into the same host copy
        numbering = list(range(parked["blocks"].shape[2]))
        boundaries = [
            Boundary(tables_from_json(doc, numbering), ModelState(m["json"], {n: parked[k] for n, k in m["tensors"].items()}))
            for doc, m in zip(layout["boundaries"], layout["models"][1:])
        ]
        live_numbers = [i for b in runner.sessions.spec.branch_names for i in live["sink"][b] + live["window"][b]]
        rewind = export_rewind(live_numbers, boundaries)
        if rewind is not None:
            header[REWIND_SECTION] = rewind.section
            if rewind.blocks:
                tensors[REWIND_KV] = list(rewind.blocks)
            tensors.update(rewind.tensors)
    return ParkedCopy(header, parked.get("blocks"), tensors)


def export_parked(runner: SupportsExport, session_id: str, *, protocol_version: int | None = None) -> SessionSnapshot:
    """The snapshot of a parked session whole (its blocks copied out of the host copy); the same snapshot
    :func:`export_session` takes of it resident. A drain streams it from the host copy instead
    (runner/snapshot_stream.py's ``plan_parked``), copying nothing whole."""
    copy = parked_copy(runner, session_id, protocol_version=protocol_version)
    tensors = {}
    for name, held in copy.tensors.items():
        if isinstance(held, list):
            assert copy.blocks is not None
            held = copy.blocks.index_select(2, torch.tensor(held, dtype=torch.long))
        tensors[name] = held
    return SessionSnapshot(copy.header, tensors)


def carry_rewind(
    header: dict[str, Any], tensors: dict[str, torch.Tensor], kv: torch.Tensor, live: list[int], boundaries: list[Boundary]
) -> None:
    """Add the session's rewind points (runner/snapshot_rewind.py) to a whole snapshot: ``kv`` holds the blocks
    (the pool's, or a parked host copy's) that ``live`` (the live history's, in ``kv/{branch}`` order) and the
    boundaries' tables number."""
    rewind = export_rewind(live, boundaries)
    if rewind is None:
        return
    header[REWIND_SECTION] = rewind.section
    if rewind.blocks:
        tensors[REWIND_KV] = kv.index_select(2, torch.tensor(rewind.blocks, dtype=torch.long, device=kv.device))
    tensors.update(rewind.tensors)


def unstarted_snapshot(runner: SupportsExport, *, protocol_version: int | None = None) -> SessionSnapshot:
    """A session that has not run its first chunk (``ready``, no tick yet): nothing is resident, so only its
    identity travels; the peer starts its rollout at chunk 0 from what the server's section carries."""
    header = identity(runner, protocol_version)
    header["resident"] = False
    header["kv"] = {"frames_committed": 0, "chunks_committed": 0, "sink_start": 0, "sink_frames": {}, "cross_written": []}
    header["model_state"] = {}
    header["session"] = {}
    return SessionSnapshot(header, {})


def session_bytes(runner: SupportsExport) -> int:
    """A resident session's bytes at most, every head (an incoming snapshot's size is bounded by it)."""
    if isinstance(runner, GathersHeads):
        return runner.whole_session_bytes
    return runner.sessions.pool.plan.per_session_bytes


def transferable(runtime: object) -> SupportsExport:
    """``runtime`` as one whose sessions can be exported and imported (:class:`SupportsExport`); else
    :class:`SnapshotRefused` (a drain on a runtime that cannot move its sessions says so)."""
    if not isinstance(runtime, SupportsExport):
        raise SnapshotRefused(f"the {type(runtime).__name__} runtime cannot move sessions (it cannot export them)")
    return runtime

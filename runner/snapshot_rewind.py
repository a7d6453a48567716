"""A session's rewind points in its snapshot: a moved session can still go back to moments from before its move.

A snapshot carries the live history as ``kv/{branch}`` (runner/snapshot.py).
The boundaries the session keeps (runner/rewind.py) share most of their
blocks with it; the blocks they hold beyond it travel once, as ``rewind/kv``
(one frame a block, like the live ones). Each boundary travels as its block
tables in the header's ``rewind`` section, numbered into the blocks the
snapshot carries (the live ones first, ``kv/{branch}`` in branch order, then
``rewind/kv``'s), and its model state as JSON there and ``rewind/model/N``
tensors (a tensor two boundaries share travels once).

The receiving runner keeps the points its own schedule keeps, within its
pool's free blocks: when it cannot hold them all it drops the oldest first
(:func:`choose_kept`). The bytes of a dropped point are read and discarded
as they arrive, so taking fewer costs no memory.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from .kv_state import HistoryTables
from .parking import tables_json
from .rewind import Boundary
from .rewind_schedule import RewindSchedule
from .spec import KVCacheSpec

REWIND_SECTION = "rewind"
REWIND_KV = "rewind/kv"
REWIND_MODEL_PREFIX = "rewind/model/"


class RewindSectionError(ValueError):
    """A snapshot's rewind section that does not fit the blocks and tensors it carries (an import refuses it)."""


@dataclass
class RewindExport:
    """What a snapshot carries of a session's rewind points."""

    section: dict[str, Any]  # the header's ``rewind`` section
    blocks: list[int]  # the blocks carried as ``rewind/kv``, in order (pool or parked numbering)
    tensors: dict[str, torch.Tensor]  # ``rewind/model/N``


def export_rewind(live_blocks: list[int], boundaries: list[Boundary]) -> RewindExport | None:
    """The points ``boundaries`` (oldest first) as a snapshot carries them beside ``live_blocks`` (the live
    history's blocks in the order the snapshot's ``kv/{branch}`` tensors hold them); None when there are none."""
    if not boundaries:
        return None
    number = {block: position for position, block in enumerate(live_blocks)}
    beyond: list[int] = []
    for boundary in boundaries:
        for block in boundary.tables.blocks():
            if block not in number:
                number[block] = len(number)
                beyond.append(block)
    tensors: dict[str, torch.Tensor] = {}
    by_identity: dict[int, str] = {}
    points = []
    for boundary in boundaries:
        used = {}
        for name, tensor in boundary.model.tensors.items():
            key = by_identity.get(id(tensor))
            if key is None:
                key = by_identity[id(tensor)] = f"{REWIND_MODEL_PREFIX}{len(by_identity)}"
                tensors[key] = tensor
            used[name] = key
        points.append({
            "tables": tables_json(boundary.tables, number),
            "model": {"json": copy.deepcopy(boundary.model.json), "tensors": used},
        })
    return RewindExport({"frames": len(beyond), "boundaries": points}, beyond, tensors)


@dataclass(frozen=True)
class CarriedPoint:
    """One rewind point a snapshot carries, checked: its tables (in the snapshot's block numbering) and model."""

    tables: HistoryTables
    model_json: Any
    model_tensors: dict[str, str]  # the model state's tensor name -> the snapshot's ``rewind/model/N``

    @property
    def index(self) -> int:
        return self.tables.chunks_committed


def carried_points(
    header: dict[str, Any], *, live_frames: int, spec: KVCacheSpec, tensor_names: set[str]
) -> tuple[list[CarriedPoint], int]:
    """The rewind points a snapshot's header says it carries (oldest first) and how many ``rewind/kv`` frames,
    each checked against the blocks and tensors it has; :class:`RewindSectionError` if they do not fit."""
    section = header.get(REWIND_SECTION)
    if section is None:
        if REWIND_KV in tensor_names or any(n.startswith(REWIND_MODEL_PREFIX) for n in tensor_names):
            raise RewindSectionError("the snapshot carries rewind tensors without its rewind section")
        return [], 0
    try:
        frames = section["frames"]
        if not isinstance(frames, int) or isinstance(frames, bool) or frames < 0:
            raise ValueError("frames is not a count")
        numbers = live_frames + frames
        now = int(header["kv"]["chunks_committed"])
        points: list[CarriedPoint] = []
        for doc in section["boundaries"]:
            tables = doc["tables"]
            if set(tables["sink"]) != set(tables["window"]) or set(tables["sink"]) != set(spec.branch_names):
                raise ValueError("a point's tables name other branches")
            listed = [n for part in ("sink", "window") for ids in tables[part].values() for n in ids]
            if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < numbers for n in listed):
                raise ValueError("a point's tables name blocks the snapshot does not carry")
            counters = [tables[k] for k in ("frames_committed", "chunks_committed", "sink_start")]
            if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counters):
                raise ValueError("a point's counters are not counts")
            point = CarriedPoint(
                HistoryTables(
                    sink={b: list(ids) for b, ids in tables["sink"].items()},
                    window={b: list(ids) for b, ids in tables["window"].items()},
                    frames_committed=counters[0],
                    chunks_committed=counters[1],
                    sink_start=counters[2],
                ),
                copy.deepcopy(doc["model"]["json"]),
                {str(name): str(key) for name, key in doc["model"]["tensors"].items()},
            )
            point.tables.check_layout(spec)  # the frames its counter says it keeps, no other
            if point.index >= now or (points and point.index <= points[-1].index):
                raise ValueError("the points are not in order before the session's next chunk")
            if not set(point.model_tensors.values()) <= tensor_names:
                raise ValueError("a point's model state names tensors the snapshot does not carry")
            points.append(point)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RewindSectionError(f"the snapshot's rewind section is malformed: {type(exc).__name__}: {exc}") from None
    if frames and REWIND_KV not in tensor_names:
        raise RewindSectionError("the snapshot's rewind section counts frames it does not carry")
    return points, frames


def choose_kept(
    points: list[CarriedPoint], schedule: RewindSchedule | None, *, live_frames: int, free_blocks: int
) -> list[CarriedPoint]:
    """The points this runner keeps: those its ``schedule`` keeps (none without one), then, oldest first
    dropped, as many as the blocks they need beyond the live history fit ``free_blocks``."""
    if schedule is None or not points:
        return []
    newest = points[-1].index
    kept = [p for p in points if schedule.keeps(p.index, newest)]
    while kept and len(beyond_live(kept, live_frames)) > free_blocks:
        kept = kept[1:]
    return kept


def beyond_live(points: list[CarriedPoint], live_frames: int) -> list[int]:
    """The ``rewind/kv`` frames (by their numbers, in order) that ``points`` list."""
    return sorted({n for p in points for n in p.tables.blocks() if n >= live_frames})

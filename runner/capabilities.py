"""What a runtime may offer beyond :class:`~arstream.runner.runtimes.Runtime`, as protocols any runtime can
implement: the server asks ``isinstance(runtime, SupportsParking)``, never which class it is.

- :class:`SupportsParking`: sessions can leave device memory for host memory and come back
  (ARStream's runner: runner/session_parking.py).
- :class:`SupportsExport`: sessions can be exported and imported (snapshots, moves between replicas:
  runner/snapshot.py, runner/snapshot_stream.py, runner/snapshot_import.py), which read and write the
  session's blocks in a paged pool through its session table.
- :class:`GathersHeads`: an exporting runtime whose KV is split by heads over several devices
  (runner/distributed/): its snapshots gather the heads, so they have the one format a single device's have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .session_table import SessionTable
from .spec import KVCacheSpec

if TYPE_CHECKING:
    from .snapshot import SessionSnapshot


@runtime_checkable
class SupportsParking(Protocol):
    """A runtime that parks sessions in host memory (``--park-*``)."""

    def park_session(self, session_id: str) -> bool:
        """Park the session now (it detached), where it can be; whether it was parked."""

    def park_idle(self) -> int:
        """Park the sessions idle past the runtime's ``park_after_s``; how many were parked."""


@runtime_checkable
class SupportsExport(Protocol):
    """A runtime whose sessions can be exported and imported at a chunk boundary."""

    @property
    def sessions(self) -> SessionTable:
        """Where its sessions are held (the pool, the spec and the pipeline they run on come with it)."""

    def model_card(self) -> dict[str, Any]:
        """The card a snapshot's identity is taken from (with the runtime's name)."""


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

    def import_snapshot(self, session_id: str, snapshot: SessionSnapshot, protocol_version: int | None) -> None:
        """Make ``snapshot`` (every head) the held session ``session_id``, its heads scattered; refuse leaving
        every device's pool as it was."""

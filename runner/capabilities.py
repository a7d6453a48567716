"""What a runtime may offer beyond :class:`~arstream.runner.runtimes.Runtime`, as protocols any runtime can
implement: the server asks ``isinstance(runtime, SupportsParking)``, never which class it is.

- :class:`SupportsParking`: sessions can leave device memory for host memory and come back
  (ARStream's runner: runner/session_parking.py).
- :class:`SupportsExport`: sessions can be exported and imported (snapshots, moves between replicas:
  runner/snapshot.py, runner/snapshot_stream.py, runner/snapshot_import.py), which read and write the
  session's blocks in a paged pool through its session table.

- :class:`SupervisesRanks`: a replica over several devices, whose other ranks can die or hang
  (runner/distributed/): the server hears of it at once, even while idle.

An exporting runtime whose KV is split by heads over several devices is also a
:class:`~arstream.runner.snapshot.GathersHeads` (beside the snapshot it names).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from .session_table import SessionTable



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
class SupervisesRanks(Protocol):
    """A runtime whose replica spans processes it supervises (``--devices``)."""

    on_rank_lost: Callable[[str], None] | None  # told from another thread that a rank exited or hung

    def check_ranks(self) -> None:
        """On the runtime's thread: raise ``ReplicaLost`` (failing the replica closed) if a rank is lost."""

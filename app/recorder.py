"""Server-side recordings: what a player saw, written chunk by chunk as fragmented MP4 (H.264).

A session records when the operator records every session (``--record-all``) or its ``start`` asks for it
(``start.record``), on a server with a recording directory (``--record-dir``; off without one). Each chunk
the player is sent is encoded again as one fMP4 fragment (:mod:`arstream.app.fmp4`) and appended to the
session's file at once, so a crash leaves a playable file up to its last chunk and no recording is ever held
in memory. A rewind, reset or restart after eviction is a cut: the file ends there and the next chunk begins
the session's next file (its own init segment); a branch is a new session with files of its own.

Files live in one folder per session, named by a digest of the session's share token, so listing and
downloading need that token (``GET /v1/recordings?share=TOKEN``) and the disk never holds a token. A session
moved to another replica (app/migration.py) takes its files along in its snapshot (:meth:`Recordings.hand_over`
here, :meth:`Recordings.receive` there): they land in its folder on the peer, under the share token it has there,
the move is a cut (the peer's first chunk begins the next file), and this replica deletes its copy. Bounds:
bytes per session and bytes on the whole directory (a chunk past either is dropped and counted), a retention
time (finished files older than it are deleted whenever a recording begins or is listed), and a sweep at start
(a restarted server holds no session a token could name, so what a previous process wrote goes).

Writes run on the session's encoder lane (app/worker.py), after its chunk is encoded: in order, one at a time
per session; the byte counts are shared across lanes under a lock.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .fmp4 import FragmentedMP4Stream

if TYPE_CHECKING:
    from .metrics import ServerMetrics

log = logging.getLogger("arstream.recorder")

# A session folder's name (a token digest) and a recording file's name: the sweep removes only these.
FOLDER_PATTERN = re.compile(r"^[0-9a-f]{32}$")
FILE_PATTERN = re.compile(r"^part-\d{4}\.mp4$")
# A moved session's files while they arrive, before its import has finished: swept at start too.
INCOMING_PATTERN = re.compile(r"^incoming-[0-9a-f]{32}$")
# What begins a new rollout or goes back in it: the recording is cut there (PROTOCOL.md, "Recording").
CUTS = ("reset", "evicted", "rewind")


def folder_name(share_token: str) -> str:
    """A session's folder: the first 128 bits of the SHA-256 of its share token."""
    return hashlib.sha256(share_token.encode()).hexdigest()[:32]


class RecordingMetrics:
    """What /metrics counts for recordings: bytes written, chunks dropped by reason."""

    def __init__(self, metrics: ServerMetrics | None = None) -> None:
        self._metrics = metrics

    def recorded(self, size: int) -> None:
        if self._metrics is not None:
            self._metrics.recorded_bytes.inc(size)

    def dropped(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.recording_drops.labels(reason=reason).inc()


@dataclass
class _Open:
    """A session's file being written: its stream (encoder state) and where the next chunk must be."""

    path: Path
    stream: FragmentedMP4Stream
    next_chunk_index: int


@dataclass(frozen=True)
class RecordingFile:
    name: str
    bytes: int
    complete: bool  # its session ended or cut it; false while chunks may still be appended


class Recordings:
    """This replica's recording directory: the sessions recording now, and the byte budgets."""

    def __init__(
        self, directory: Path, *, session_bytes: int, total_bytes: int, retention_s: float, quality: int,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.directory = directory
        self.session_bytes = session_bytes
        self.total_bytes = total_bytes
        self.retention_s = retention_s
        self.quality = quality
        self.metrics = RecordingMetrics(metrics)
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}  # session id -> its file being written
        self._folders: dict[str, Path] = {}  # session id -> its folder (while the session lives)
        self._session_used: dict[str, int] = {}
        self._full: set[str] = set()  # sessions past their byte budget: nothing more is written for them
        self._shipping: dict[str, list[Path]] = {}  # session id -> its files a move is sending: never expired
        directory.mkdir(parents=True, exist_ok=True)
        self.swept = self._sweep()
        self._used = 0

    def _sweep(self) -> int:
        """Remove every recording a previous process left (folders of this naming only); how many folders."""
        swept = 0
        for folder in self.directory.iterdir():
            if folder.is_dir() and (FOLDER_PATTERN.match(folder.name) or INCOMING_PATTERN.match(folder.name)):
                shutil.rmtree(folder, ignore_errors=True)
                swept += 1
        return swept

    # ---- the session side: called on its encoder lane -----------------------------------

    def write(
        self, session_id: str, share_token: str, frames: np.ndarray, *, chunk_index: int, restarted: str | None,
        fps: float,
    ) -> None:
        """Append one chunk's frames (uint8 ``[F, H, W, 3]``) to the recording of the session ``share_token``
        names (its folder made at its first chunk)."""
        with self._lock:
            folder = self._folders.get(session_id)
            if folder is None:
                folder = self._folders[session_id] = self.directory / folder_name(share_token)
            first = session_id not in self._session_used
            self._session_used.setdefault(session_id, 0)
            if session_id in self._full:
                return
            current = self._open.get(session_id)
        if first:
            self.expire()  # a recording begins: the expired ones make room first
        if current is not None and (restarted in CUTS or chunk_index != current.next_chunk_index):
            self._close(session_id)
            current = None
        if current is None:
            folder.mkdir(parents=True, exist_ok=True)
            # One past the highest part there: earlier parts may have expired, and a name is never reused.
            number = max((int(path.name[5:9]) + 1 for path in folder.iterdir() if FILE_PATTERN.match(path.name)), default=0)
            _, height, width, _ = frames.shape
            stream = FragmentedMP4Stream(width, height, quality=self.quality, fps=Fraction(fps).limit_denominator(1001))
            current = _Open(folder / f"part-{number:04d}.mp4", stream, chunk_index)
            with self._lock:
                self._open[session_id] = current
        data = current.stream.encode_chunk(frames)
        with self._lock:
            used = self._session_used.get(session_id, 0)
            over_session = used + len(data) > self.session_bytes
            over_total = self._used + len(data) > self.total_bytes
            if not (over_session or over_total):
                self._session_used[session_id] = used + len(data)
                self._used += len(data)
        if over_session or over_total:
            # The file ends at its last whole chunk; the session writes nothing more (a gap would not play).
            self.metrics.dropped("session_bytes" if over_session else "total_bytes")
            with self._lock:
                self._full.add(session_id)
            self._close(session_id)
            return
        with current.path.open("ab") as file:
            file.write(data)
        current.next_chunk_index = chunk_index + 1
        self.metrics.recorded(len(data))

    def finish(self, session_id: str) -> None:
        """The session ended: its last file is complete and nothing more is written for it."""
        self._close(session_id)
        with self._lock:
            self._shipping.pop(session_id, None)
            self._folders.pop(session_id, None)
            self._session_used.pop(session_id, None)
            self._full.discard(session_id)

    def pause(self, session_id: str) -> None:
        """The session stopped recording: the file being written ends (recording again begins the next one)."""
        self._close(session_id)

    def _close(self, session_id: str) -> None:
        with self._lock:
            current = self._open.pop(session_id, None)
        if current is not None:
            current.stream.close()

    # ---- a move: the files go with the session (app/migration.py) --------------------------

    def hand_over(self, session_id: str, share_token: str) -> list[Path]:
        """The session is being moved: its file being written ends here (the move is a cut) and its files, oldest
        first, are what its snapshot carries. Called once its last chunk before the move has been written."""
        self._close(session_id)
        folder = self.directory / folder_name(share_token)
        files = sorted(path for path in folder.iterdir() if FILE_PATTERN.match(path.name)) if folder.is_dir() else []
        with self._lock:
            self._shipping[session_id] = files
        return files

    def moved_away(self, session_id: str, share_token: str) -> None:
        """The session's files have landed on its new replica: the copy here goes (and its bytes from the count)."""
        self.finish(session_id)
        folder = self.directory / folder_name(share_token)
        if not folder.is_dir():
            return
        freed = sum(path.stat().st_size for path in folder.iterdir() if FILE_PATTERN.match(path.name))
        shutil.rmtree(folder, ignore_errors=True)
        with self._lock:
            self._used = max(0, self._used - freed)

    def receive(self, files: dict[str, int]) -> IncomingRecording | None:
        """Room for a moved session's files (name -> bytes), within both budgets, reserved until the import ends
        (:meth:`IncomingRecording.keep` or :meth:`IncomingRecording.discard`); None, counted as a drop, when
        they do not fit: the session moves without them."""
        size = sum(files.values())
        with self._lock:
            over_session = size > self.session_bytes
            over_total = self._used + size > self.total_bytes
            if not (over_session or over_total):
                self._used += size
        if over_session or over_total:
            self.metrics.dropped("session_bytes" if over_session else "total_bytes")
            return None
        folder = self.directory / f"incoming-{secrets.token_hex(16)}"
        folder.mkdir()
        return IncomingRecording(self, folder, dict(files))

    def _adopt(self, session_id: str, share_token: str, incoming: IncomingRecording) -> None:
        folder = self.directory / folder_name(share_token)
        incoming.folder.rename(folder)  # a fresh share token: no folder of that name exists
        with self._lock:
            self._folders[session_id] = folder
            self._session_used[session_id] = incoming.size
        self.metrics.recorded(incoming.size)

    def _unreserve(self, size: int) -> None:
        with self._lock:
            self._used = max(0, self._used - size)

    # ---- the HTTP side ---------------------------------------------------------------------

    def files(self, share_token: str) -> list[RecordingFile]:
        """The recordings of the session ``share_token`` names, oldest first (none: an unknown token)."""
        self.expire()
        folder = self.directory / folder_name(share_token)
        if not folder.is_dir():
            return []
        with self._lock:
            writing = {current.path for current in self._open.values()}
        return [
            RecordingFile(path.name, path.stat().st_size, path not in writing)
            for path in sorted(folder.iterdir())
            if FILE_PATTERN.match(path.name)
        ]

    def file(self, share_token: str, name: str) -> Path | None:
        """The path of one of the session's recordings, or None (an unknown token or name)."""
        if not FILE_PATTERN.match(name):
            return None
        path = self.directory / folder_name(share_token) / name
        return path if path.is_file() else None

    def expire(self) -> None:
        """Delete the finished files older than the retention time (and folders left empty)."""
        deadline = time.time() - self.retention_s
        with self._lock:
            writing = {current.path for current in self._open.values()}
            writing.update(path for files in self._shipping.values() for path in files)
            live_folders = set(self._folders.values())
        for folder in self.directory.iterdir():
            if not (folder.is_dir() and FOLDER_PATTERN.match(folder.name)):
                continue
            for path in folder.iterdir():
                if FILE_PATTERN.match(path.name) and path not in writing and path.stat().st_mtime <= deadline:
                    size = path.stat().st_size
                    path.unlink(missing_ok=True)
                    with self._lock:
                        self._used = max(0, self._used - size)
            if folder not in live_folders and not any(folder.iterdir()):
                folder.rmdir()


class IncomingRecording:
    """A moved session's recording files arriving in its snapshot, written to a folder of their own as the bytes
    come (never held in memory); the session's folder once its import has finished."""

    def __init__(self, recordings: Recordings, folder: Path, files: dict[str, int]) -> None:
        self.recordings = recordings
        self.folder = folder
        self.files = files
        self.size = sum(files.values())
        self._done = False

    def write(self, name: str, offset: int, data: memoryview) -> None:
        """Bytes of file ``name`` at ``offset`` (a snapshot's bytes come in order: each file is appended to)."""
        path = self.folder / name
        with path.open("r+b" if offset else "wb") as file:
            file.seek(offset)
            file.write(data)

    def keep(self, session_id: str, share_token: str) -> None:
        """The import finished: the files are the session's (listed under ``share_token``), its budget counts them."""
        if not self._done:
            self._done = True
            self.recordings._adopt(session_id, share_token, self)

    def discard(self) -> None:
        """The import ended early: nothing of the files stays, and their reserved bytes are free again."""
        if not self._done:
            self._done = True
            shutil.rmtree(self.folder, ignore_errors=True)
            self.recordings._unreserve(self.size)

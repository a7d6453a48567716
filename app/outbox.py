"""A WebSocket's send queue: what the connection's one writer task sends, in order.

Replies (ack, pong, errors) are bounded by the receive loop, which reads a
message only when there is room for its one reply; a controller's chunks are
bounded by its tick credits; a viewer's chunks by :data:`VIEWER_CHUNK_BACKLOG`
(older ones are skipped, whole, when a newer one comes: a viewer that falls
behind sees the latest chunks, never a slower player). Messages that only
report the latest state (``viewers``) replace their queued predecessor.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .worker import TickOutcome

# Immediate replies queued behind a client that does not read, before the receive loop waits.
REPLY_BACKLOG_LIMIT = 64
# Chunks queued for a viewer that has not taken them; past this, the oldest queued one is skipped.
VIEWER_CHUNK_BACKLOG = 2


@dataclass(frozen=True)
class QueuedText:
    text: str
    is_reply: bool = False
    returns_credit: bool = False
    # Set for messages that say only the latest state: a newer one replaces a queued one of the same kind.
    latest_of: str | None = None


@dataclass(frozen=True)
class QueuedChunk:
    """A controller's chunk: its header and frames are written together, then its credit comes back."""

    outcome: TickOutcome

    @property
    def size(self) -> int:
        return sum(len(frame) for frame in self.outcome.frame_messages)


@dataclass(frozen=True)
class ViewerChunk:
    """A chunk for a viewer: its `chunk` message and frames, both shared by every viewer it goes to.

    ``text`` is the message with ``skipped_before`` 0 (what most viewers get), ``header`` the same as a dict
    for a viewer that skipped some."""

    header: dict[str, object]
    text: str
    frames: tuple[bytes, ...]
    seq: int  # the session's chunks offered to viewers so far (a viewer never takes an older one after a newer)

    @property
    def size(self) -> int:
        return sum(len(frame) for frame in self.frames)


@dataclass(frozen=True)
class QueuedClose:
    """The last thing the writer sends: the dialect's last text (``closed``, ``session.done``...), then the close."""

    code: int
    text: str | None
    reason: str = ""  # the close frame's reason


QueuedItem = QueuedText | QueuedChunk | ViewerChunk | QueuedClose


class Outbox:
    """A connection's send queue; see the module docstring for its bounds."""

    def __init__(self, reply_limit: int = REPLY_BACKLOG_LIMIT) -> None:
        self._items: deque[QueuedItem] = deque()
        self._reply_limit = reply_limit
        self._replies_queued = 0
        self._viewer_chunks = 0
        self._has_items = asyncio.Event()
        self._reply_space = asyncio.Event()
        self._reply_space.set()
        self._closed = False
        self.bytes_queued = 0  # text and frame bytes waiting for the writer
        self.chunks_skipped = 0  # viewer chunks dropped since the writer last took one

    def close(self) -> None:
        """The writer is gone: drop whatever comes next and wake anyone waiting for space."""
        self._closed = True
        self.drop_pending()

    def drop_pending(self) -> None:
        """Forget everything queued (the client is not going to take it) and wake anyone waiting for space."""
        self._items.clear()
        self._replies_queued = 0
        self._viewer_chunks = 0
        self.bytes_queued = 0
        self._reply_space.set()

    @property
    def replies_queued(self) -> int:
        return self._replies_queued

    def push(self, item: QueuedItem) -> None:
        if self._closed:
            return
        if isinstance(item, QueuedText):
            if item.is_reply:
                self._replies_queued += 1
            if item.latest_of is not None:
                self._remove_first(lambda queued: isinstance(queued, QueuedText) and queued.latest_of == item.latest_of)
        elif isinstance(item, ViewerChunk):
            if self._viewer_chunks >= VIEWER_CHUNK_BACKLOG:
                self._remove_first(lambda queued: isinstance(queued, ViewerChunk))
                self.chunks_skipped += 1
            self._viewer_chunks += 1
        self.bytes_queued += _size(item)
        self._items.append(item)
        self._has_items.set()

    def _remove_first(self, matches: Callable[[QueuedItem], bool]) -> None:
        """Drop the oldest queued item that ``matches`` (the queue is short: replies and chunks are bounded)."""
        for queued in self._items:
            if matches(queued):
                self._items.remove(queued)
                self._forget(queued)
                return

    def _forget(self, item: QueuedItem) -> None:
        self.bytes_queued -= _size(item)
        if isinstance(item, QueuedText) and item.is_reply:
            self._replies_queued -= 1
            self._reply_space.set()
        elif isinstance(item, ViewerChunk):
            self._viewer_chunks -= 1

    @property
    def replies_full(self) -> bool:
        """The client has not taken ``reply_limit`` replies: read nothing more from it until it does."""
        return self._replies_queued >= self._reply_limit and not self._closed

    async def wait_reply_space(self) -> None:
        while self.replies_full:
            self._reply_space.clear()
            await self._reply_space.wait()

    def push_reply(self, text: str) -> None:
        # Never waits: the receive loop reads a message only when there is room for its one reply.
        self.push(QueuedText(text, is_reply=True))

    async def get(self) -> QueuedItem:
        while not self._items:
            self._has_items.clear()
            await self._has_items.wait()
        item = self._items.popleft()
        self._forget(item)
        return item


def _size(item: QueuedItem) -> int:
    """Bytes an outbox item will take on the wire (texts are ASCII: ``dumps`` escapes the rest)."""
    if isinstance(item, QueuedText):
        return len(item.text)
    return item.size if isinstance(item, (QueuedChunk, ViewerChunk)) else 0

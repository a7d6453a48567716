"""Bounds on moved sessions streaming in (``POST /v1/cluster/import``): how many at once, and how slowly.

A moved session is resident here from its header on: its pool blocks are
allocated before its bytes arrive (runner/snapshot_import.py). A peer that
sends slowly would hold that room for as long as it keeps the connection
open, so two bounds apply to every import:

- **a cap on imports streaming at once** (``--max-parallel-imports``):
  :class:`ImportSlots`. One more is answered 503 with ``Retry-After`` before
  a byte of it is read; a draining replica retries it until its drain's
  deadline (app/migration.py), so an honest drain of many sessions to one
  peer streams them a few at a time.
- **a deadline per piece** (``--import-piece-timeout-s``):
  :func:`paced_pieces`. Each ``PIECE_BYTES`` of the body (the first, with
  the header, included; the last may be shorter) must have arrived within
  the deadline of the piece before it, however the sender spreads its
  bytes: a byte every few seconds does not keep an import alive. Time this
  side spends writing a piece into the pool is not the sender's and does not
  count. Past it the import ends (408) and everything it held goes back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

from ..runner.snapshot_stream import PIECE_BYTES

# What a refused import's sender waits before it tries again (the drain's retries; HTTP Retry-After).
IMPORT_RETRY_AFTER_S = 1


class ImportSlots:
    """Imports streaming now, at most ``limit`` at once (one event loop's; no lock needed)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_parallel_imports must be >= 1, got {limit}")
        self.limit = limit
        self.streaming = 0
        self.refused_total = 0

    @contextmanager
    def claim(self) -> Iterator[bool]:
        """Whether a slot was free; when it was, it is this import's until the block ends."""
        if self.streaming >= self.limit:
            self.refused_total += 1
            yield False
            return
        self.streaming += 1
        try:
            yield True
        finally:
            self.streaming -= 1

    def refusal(self) -> str:
        return (
            f"this replica is taking {self.streaming} moved sessions already (max_parallel_imports {self.limit}); "
            f"try again in {IMPORT_RETRY_AFTER_S} s"
        )


async def paced_pieces(
    body: AsyncIterator[bytes], gather: Callable[[], bool], piece_timeout_s: float
) -> AsyncIterator[bytearray]:
    """A POST's body in pieces of about PIECE_BYTES once ``gather()`` (it arrives in reads of a few KiB: one
    worker step a piece, not a read), each read as it comes before (the header is checked as soon as it is
    here). TimeoutError when a piece's bytes have not all come ``piece_timeout_s`` after the piece before
    (the module docstring)."""
    loop = asyncio.get_running_loop()
    piece = bytearray()
    counted = 0  # bytes of the piece the deadline is for (reads are yielded one by one before the header)
    due = loop.time() + piece_timeout_s
    reads = aiter(body)
    while True:
        try:
            data = await asyncio.wait_for(anext(reads), max(due - loop.time(), 0.0))
        except StopAsyncIteration:
            break
        piece += data
        counted += len(data)
        if counted >= PIECE_BYTES:
            counted = 0
            due = loop.time() + piece_timeout_s
        if len(piece) >= PIECE_BYTES or not gather():
            handed = loop.time()
            yield piece
            due += loop.time() - handed  # writing it was this side's time, not the sender's
            piece = bytearray()
    if piece:
        yield piece

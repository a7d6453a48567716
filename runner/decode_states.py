"""The bookkeeping every :class:`~arstream.runner.contract.SupportsSplitDecode` pipeline needs for its decoder states.

A streaming decoder carries a state per session from one chunk to the next
(the Wan VAE's feature cache, TAEHV's memory). With a split decode the worker's
decode stage writes it on its own thread while the model thread runs the next
forward, resets, closes, or exports a session, so the state lives here,
behind one lock, tagged with the chunk it follows:

- the forward announces each chunk it leaves to decode (:meth:`DecoderStates.begin`);
- the decode reads the state its chunk follows (:meth:`DecoderStates.before`:
  none for a rollout's chunk 0, else exactly the previous chunk's, or it
  raises) and stores the new one on success, unless a reset or close
  dropped the session meanwhile (:meth:`DecoderStates.finish`); a failed
  decode stores nothing and stays announced, since the runner may retry it
  alone, and a session that fails for good is dropped by its close;
- an export waits until no decode of the session is in flight
  (:meth:`DecoderStates.settled`), so snapshots and rewind points always see
  a whole chunk's state.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

S = TypeVar("S")

# How long an export waits for a decode in flight before it gives up (a stuck decode stage is a server fault).
SETTLE_TIMEOUT_S = 120.0


class DecoderStateError(RuntimeError):
    """A decode found no state for the chunk it follows (its session was dropped, or chunks came out of order)."""


class DecoderStates(Generic[S]):
    def __init__(self) -> None:
        self._cond = threading.Condition()
        # session -> (chunks decoded so far in its rollout, the state after the last of them)
        self._states: dict[str, tuple[int, S]] = {}
        # session -> chunk indices forwarded and not yet decoded, oldest first
        self._pending: dict[str, list[int]] = {}

    def begin(self, session_id: str, chunk_index: int) -> None:
        """The forward of ``chunk_index`` succeeded; its decode is still to come."""
        with self._cond:
            self._pending.setdefault(session_id, []).append(chunk_index)

    def before(self, session_id: str, chunk_index: int) -> S | None:
        """The state chunk ``chunk_index`` decodes from: None at a rollout's start, else the previous chunk's."""
        if chunk_index == 0:
            return None
        with self._cond:
            stored = self._states.get(session_id)
        if stored is None or stored[0] != chunk_index:
            have = "none" if stored is None else f"the state after chunk {stored[0] - 1}"
            raise DecoderStateError(
                f"session {session_id!r}: chunk {chunk_index} decodes from the state after chunk {chunk_index - 1}, "
                f"found {have}"
            )
        return stored[1]

    def finish(self, session_id: str, chunk_index: int, state: S) -> None:
        """The decode of ``chunk_index`` succeeded with the new ``state`` (stored unless the session was dropped)."""
        with self._cond:
            pending = self._pending.get(session_id, [])
            if chunk_index in pending:
                pending.remove(chunk_index)
                if not pending:
                    del self._pending[session_id]
                self._states[session_id] = (chunk_index + 1, state)
            self._cond.notify_all()

    def store(self, session_id: str, chunk_index: int, state: S) -> None:
        """The decode of ``chunk_index`` ran inside its forward (no split): its state, directly."""
        with self._cond:
            self._states[session_id] = (chunk_index + 1, state)

    def settled(self, session_id: str, chunks: int | None = None) -> tuple[int, S] | None:
        """``(chunks decoded, state)`` once no decode of the session is in flight; None when it has none.

        With ``chunks``, the state after that many chunks (a rewind point's), as soon as it is there, even
        with later chunks still to decode; None if the session was dropped or has no such state.
        """

        def ready() -> bool:
            if chunks is None:
                return session_id not in self._pending
            stored = self._states.get(session_id)
            return session_id not in self._pending or (stored is not None and stored[0] >= chunks)

        with self._cond:
            if not self._cond.wait_for(ready, SETTLE_TIMEOUT_S):
                raise DecoderStateError(f"session {session_id!r}: a decode still in flight after {SETTLE_TIMEOUT_S} s")
            stored = self._states.get(session_id)
            if chunks is not None and (stored is None or stored[0] != chunks):
                return None
            return stored

    def in_flight(self, session_id: str) -> bool:
        """A chunk of the session was forwarded and its decode has not succeeded yet."""
        with self._cond:
            return session_id in self._pending

    def drop(self, session_id: str) -> None:
        """Reset or close: the stored state goes, and a decode in flight will not store one."""
        with self._cond:
            self._states.pop(session_id, None)
            self._pending.pop(session_id, None)
            self._cond.notify_all()

    def sessions(self) -> list[str]:
        with self._cond:
            return sorted(set(self._states) | set(self._pending))

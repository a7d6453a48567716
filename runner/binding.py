"""The bookkeeping every pipeline needs for ``bind_session_state``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .kv_state import SessionKVState


class SessionStateBinding:
    """Holds the KV state the runner binds for one forward; pipelines inherit it.

    The state is reachable only inside the runner's bind context, so a
    pipeline cannot keep writing to a session's pages after the forward.
    """

    def __init__(self) -> None:
        self._bound: dict[str, SessionKVState] = {}

    @contextmanager
    def bind_session_state(self, session_id: str, state: SessionKVState) -> Iterator[None]:
        self._bound[session_id] = state
        try:
            yield
        finally:
            self._bound.pop(session_id, None)

    def bound_state(self, session_id: str) -> SessionKVState:
        try:
            return self._bound[session_id]
        except KeyError:
            raise RuntimeError(f"no KV state bound for session {session_id!r}; call inside the runner's forward") from None

"""The wire dialects this server speaks, by WebSocket path (as uvicorn finds its protocols by name).

Each entry makes the :class:`~arstream.app.dialect.Dialect` that serves one
socket on its path; :func:`arstream.app.server.create_app` routes every path
here to a :class:`~arstream.app.live_session.LiveSession` in it. A new dialect
is one module (a :class:`~arstream.app.dialect.Dialect` subclass) and one line
here, or :func:`add_dialect` before the app is made.
"""

from __future__ import annotations

from collections.abc import Callable

from . import protocol1, realtime_video
from .dialect import Dialect

DialectFactory = Callable[[], Dialect]

DIALECTS: dict[str, DialectFactory] = {
    protocol1.PATH: protocol1.Protocol1,
    # vLLM-Omni's realtime video API over the same sessions (PROTOCOL.md, "vLLM-Omni realtime video dialect").
    realtime_video.PATH: realtime_video.RealtimeVideo,
}


def add_dialect(path: str, factory: DialectFactory) -> None:
    """Serve ``path`` in another dialect (apps made from now on); a path already taken is refused."""
    if path in DIALECTS:
        raise ValueError(f"{path} is already served by {DIALECTS[path]!r}")
    DIALECTS[path] = factory


def remove_dialect(path: str) -> None:
    """Stop serving ``path`` in apps made from now on (a test's dialect, when it is done)."""
    DIALECTS.pop(path, None)

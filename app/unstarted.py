"""WebSocket connections that have not started a session yet, counted per client address and in all.

A connection waits from its upgrade until its `start` (or its resume) is
admitted, for up to ``start_timeout_s``. Idle waiting connections, plain or
``?resume=``, are cheap to open and would otherwise fill the server's
connection cap, after which even health checks are refused. So past
``max_unstarted_connections`` in all, or ``max_unstarted_connections_per_client``
from one address (trusted proxies' own address exempt, as for the session
caps), the upgrade is refused with HTTP 503 at once: the TCP connection
closes when the answer is written, so a refused client holds nothing. A
client banned for a frame flood (app/guard.py ``FloodBans``) is refused the
same way: behind a proxy, this is the first place that knows its address.
A connection whose client leaves while its start image waits or decodes
stops counting at once (app/start_image.py), not when the decode returns.
"""

from __future__ import annotations

from collections import Counter

from .guard import FloodBans, RefusalLog
from .settings import Settings


class UnstartedConnections:
    """Who is waiting to start a session; lives on the event loop (no locking)."""

    def __init__(self, settings: Settings, bans: FloodBans, refusals: RefusalLog) -> None:
        self.max_total = settings.max_unstarted_connections
        self.max_per_client = settings.max_unstarted_connections_per_client
        self.bans = bans
        self.trusted = bans.trusted
        self.refusals = refusals
        self._hosts: dict[object, str] = {}  # waiting connection -> its client address
        self._per_host: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return len(self._hosts)

    def waiting_from(self, host: str) -> int:
        """Connections from ``host`` waiting to start a session."""
        return self._per_host[host]

    def refusal(self, host: str) -> str | None:
        """Why one more connection from ``host`` may not wait to start a session, or None (and it is logged)."""
        banned = self.bans.seconds_left(host)
        if banned:
            # Behind a trusted proxy a banned client is only known here, after its request head.
            why = f"this client address flooded frames; no new sessions for {banned:.0f} s (frame_flood_ban_s)"
            self.refusals.note("frame_flood_ban", why)
            return why
        if len(self._hosts) >= self.max_total:
            why = (
                f"{len(self._hosts)} connections are already waiting to start a session "
                f"(max_unstarted_connections {self.max_total}); try again shortly"
            )
            self.refusals.note("max_unstarted_connections", why)
            return why
        waiting = self._per_host[host]
        if self.max_per_client is not None and waiting >= self.max_per_client and host not in self.trusted:
            why = (
                f"this client address already has {waiting} connections waiting to start a session "
                f"(max_unstarted_connections_per_client {self.max_per_client})"
            )
            self.refusals.note("max_unstarted_connections_per_client", why)
            return why
        return None

    def add(self, connection: object, host: str) -> None:
        self._hosts[connection] = host
        self._per_host[host] += 1

    def discard(self, connection: object) -> None:
        """The connection started a session, or went away; nothing if it was not waiting."""
        host = self._hosts.pop(connection, None)
        if host is None:
            return
        self._per_host[host] -= 1
        if not self._per_host[host]:
            del self._per_host[host]

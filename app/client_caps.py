"""The per-client session caps and the room an admitted session makes (docs/public.md, "Sessions, resumes and
detached sessions").

A new session and a resume pass the same checks: the pool, realtime admission and the per-client caps count
every live session (connected, being resumed, or claimed by a branch being made) except the one being resumed,
which never counts against itself. Detached sessions hold KV and count too, but give way to an admitted session
(:meth:`SessionCaps.make_room`). The hub asks these on admission; nothing here awaits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .guard import TrustedProxies
from .resume import Holder, ResumeRegistry
from .settings import Settings


@dataclass(frozen=True)
class ClientCap:
    """One per-client session cap: on one client address, or on one auth token."""

    what: str  # "client address" or "token", for messages
    setting: str
    limit: int
    client_host: str | None
    token_key: str | None

    def covers(self, holder: Holder) -> bool:
        if self.client_host is not None:
            return holder.client_host == self.client_host
        return holder.token_key == self.token_key


def same_client(detached: Holder, connection: Holder) -> bool:
    """Whether a detached session was held by ``connection``'s client address or auth token."""
    if detached.client_host == connection.client_host:
        return True
    return connection.token_key is not None and detached.token_key == connection.token_key


class SessionCaps:
    """Counts the live holders of sessions against the per-client caps and the session capacity."""

    def __init__(
        self,
        settings: Settings,
        trusted_proxies: TrustedProxies,
        resume: ResumeRegistry,
        holders: tuple[Mapping[str, Holder], ...],
        capacity: Callable[[], int],
    ) -> None:
        self.settings = settings
        self.trusted_proxies = trusted_proxies
        self.resume = resume
        # Who holds a live session besides those being resumed, by session id: the connections served and the
        # claims of branches being made (the hub's registries).
        self.holders = holders
        self._capacity = capacity

    def live_holders(self, resuming: str | None = None) -> list[Holder]:
        """Connections holding a live session or resuming one, or claiming one, except those of ``resuming``."""
        held = [*self.resume.resuming.items(), *(item for holders in self.holders for item in holders.items())]
        return [holder for session_id, holder in held if session_id != resuming]

    def caps_of(self, connection: Holder) -> list[ClientCap]:
        """The session caps ``connection``'s client is under: its address's and its token's, where set.

        Addresses of trusted proxies (``forwarded_allow_ips``) are not capped:
        behind one, uvicorn has already put the forwarded client address in
        the connection's scope, and a proxy's own address stands for everyone.
        """
        caps = []
        per_client = self.settings.max_sessions_per_client
        if per_client is not None and connection.client_host not in self.trusted_proxies:
            host = connection.client_host
            caps.append(ClientCap("client address", "max_sessions_per_client", per_client, host, None))
        per_token = self.settings.max_sessions_per_token
        if per_token is not None and connection.token_key is not None:
            caps.append(ClientCap("token", "max_sessions_per_token", per_token, None, connection.token_key))
        return caps

    def refusal(self, connection: Holder, resuming: str | None = None) -> str | None:
        """Why ``connection``'s client address or token may not hold one more live session, or None."""
        holders = self.live_holders(resuming)
        for cap in self.caps_of(connection):
            count = sum(1 for holder in holders if cap.covers(holder))
            if count >= cap.limit:
                return f"this {cap.what} already holds {count} sessions ({cap.setting} {cap.limit})"
        return None

    def transfer_refusal(self, connection: Holder, session_id: str) -> str | None:
        """The caps of a pass of control of ``session_id`` to ``connection``'s client: those of a resume of it."""
        refusal = self.refusal(connection, resuming=session_id)
        if refusal is None:
            self.make_room(connection, session_id)
        return refusal

    def make_room(self, connection: Holder, resuming: str | None) -> None:
        """Release detached sessions until ``connection``'s admitted session fits every bound.

        First the client's own caps (its address's, then its token's live and detached sessions within the cap;
        its longest-detached session goes), then the pool (the client's own detached sessions first, then
        anyone's, longest-detached first). So one client's churn releases its own detached sessions, never
        another's while its own exist. A live session never gives way.
        """
        holders = self.live_holders(resuming)
        detached = [d for d in self.resume.detached() if d.session_id != resuming]
        for cap in self.caps_of(connection):
            live = sum(1 for holder in holders if cap.covers(holder))
            own = [d for d in detached if cap.covers(d)]
            while own and live + len(own) + 1 > cap.limit:
                oldest = own.pop(0)
                detached.remove(oldest)
                self.resume.release(oldest.session_id, f"its {cap.what} started another session ({cap.setting})")
        excess = len(holders) + 1 + len(detached) - self._capacity()
        if excess > 0:
            # sorted() keeps the longest-detached first within the client's own and within the rest
            by_owner = sorted(detached, key=lambda d: not same_client(d, connection))
            for released in by_owner[:excess]:
                self.resume.release(released.session_id, "a new session needed its slot")

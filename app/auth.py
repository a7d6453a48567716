"""Who may open a session: the bearer token and the Origin allow list.

Token: ``Authorization: Bearer T`` or ``?token=T`` (browsers cannot set
headers on a WebSocket). ``--auth-token`` may hold several tokens separated
by commas (one per tenant; ``max_sessions_per_token`` caps each). Origin: a
request without an ``Origin`` header (scripts) passes; so does the page's own
origin, always (the server's own page must work whatever the allow list says);
any other origin must be on ``--allowed-origins`` (normalised at start-up, see
:func:`arstream.app.settings.normalise_origin`). The page's own origin is
this server on the loopback names
(``http://127.0.0.1:PORT``, ``http://localhost:PORT``, ``http://[::1]:PORT``)
and, when the server listens beyond loopback (``--host 0.0.0.0``, a LAN
address), whatever host the page was served as (the Origin's host equals the
request's ``Host``: a phone opening ``http://192.168.1.5:8000/``). A
loopback-only server keeps the strict list, so a web page whose name
resolves to 127.0.0.1 (DNS rebinding) cannot drive it. ``*`` allows every
origin.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

from starlette.datastructures import Headers, QueryParams
from starlette.requests import HTTPConnection

from arstream.app.protocol import excerpt

if TYPE_CHECKING:
    from arstream.app.settings import Settings


def offered_token(headers: Headers, query: QueryParams) -> str | None:
    """The token the request carries: a Bearer header first, else ``?token=``."""
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer":
            return value.strip()
    return query.get("token")


def token_refusal(headers: Headers, query: QueryParams, expected: str | None) -> str | None:
    """Why the request's token is refused, or None when it is accepted (or none is required)."""
    if expected is None:
        return None
    offered = offered_token(headers, query)
    if offered is None:
        return "a token is required (Authorization: Bearer T, or ?token=T)"
    # Every configured token is compared, so the time taken does not say which one nearly matched.
    matches = [hmac.compare_digest(offered.encode(), token.encode()) for token in expected.split(",")]
    if not any(matches):
        return "the token is wrong"
    return None


def token_key(token: str | None) -> str | None:
    """A stable name for a token in counters and logs that does not reveal it."""
    if token is None:
        return None
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def same_host_origins(port: int) -> set[str]:
    return {f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"}


def origin_refusal(
    headers: Headers, allowed: list[str], server_port: int | None, *, beyond_loopback: bool = False
) -> str | None:
    """Why the request's Origin is refused, or None when it is allowed.

    ``beyond_loopback``: the server listens on more than loopback, so with no
    allow list the page's own origin (its host is the request's ``Host``) passes.
    """
    origin = headers.get("origin")
    if origin is None:
        return None
    # Browsers serialise origins in lower case; a proxy or script may not.
    origin = origin.rstrip("/").lower()
    if "*" in allowed or origin in allowed:
        return None
    if server_port and origin in same_host_origins(server_port):
        return None
    scheme, _, authority = origin.partition("://")
    host = headers.get("host", "").lower()
    if beyond_loopback and scheme in ("http", "https") and host and authority == host:
        return None
    if allowed:
        return f"origin '{excerpt(origin)}' is not on --allowed-origins (nor this server's own)"
    if beyond_loopback:
        return f"origin '{excerpt(origin)}' is not this server's own origin; list it in --allowed-origins"
    if scheme in ("http", "https") and server_port and _loopback_host(authority):
        # A page on this machine served from another port: vLLM-Omni's demo page (Gradio, :7860), say.
        return (
            f"origin '{excerpt(origin)}' is a page on this machine served from another port than this server's "
            f"({server_port}); start the server with --allowed-origins {excerpt(origin)} to let it connect"
        )
    own = f"http://127.0.0.1:{server_port}" if server_port else "this server's own address"
    return (
        f"origin '{excerpt(origin)}' is not allowed: only this server's own pages ({own}, or localhost) may "
        "connect; list the page's origin in --allowed-origins (a file:// page has none: open it from the server, "
        "e.g. /examples/client.html)"
    )


def _loopback_host(authority: str) -> bool:
    """Whether an origin's ``host[:port]`` names this machine by a loopback name."""
    host = authority.rsplit(":", 1)[0] if not authority.endswith("]") else authority
    return not listens_beyond_loopback(host)


def listens_beyond_loopback(bind_host: str) -> bool:
    """Whether ``--host`` exposes the server to other machines (not 127.x, ::1 or localhost)."""
    host = bind_host.strip("[]").lower()
    return not (host == "localhost" or host == "::1" or host.startswith("127."))


def upgrade_refusal(ws: HTTPConnection, settings: Settings) -> tuple[str | None, bool]:
    """Why a WebSocket upgrade is refused (the token first, then the origin), and whether it offered no token.

    ``(None, False)`` when it may go on. Every WebSocket route (protocol 1, the realtime video dialect) asks this.
    """
    headers, query = ws.headers, ws.query_params
    refusal = token_refusal(headers, query, settings.auth_token)
    if refusal is not None:
        return refusal, offered_token(headers, query) is None
    server_port = ws.scope.get("server", (None, None))[1]
    beyond_loopback = listens_beyond_loopback(settings.host)
    return origin_refusal(headers, settings.origin_allow_list(), server_port, beyond_loopback=beyond_loopback), False

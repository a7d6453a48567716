"""Who may open a session: the bearer token and the Origin allow list.

Token: ``Authorization: Bearer T`` or ``?token=T`` (browsers cannot set
headers on a WebSocket). ``--auth-token`` may hold several tokens separated
by commas (one per tenant; ``max_sessions_per_token`` caps each). Origin: a
request without an ``Origin`` header (scripts) passes; otherwise the origin
must be on ``--allowed-origins`` (normalised at start-up, see
:func:`arstream.app.settings.normalise_origin`), or, when that is empty, be
this server on the loopback names (``http://127.0.0.1:PORT``,
``http://localhost:PORT``, ``http://[::1]:PORT``). ``*`` allows every origin.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers, QueryParams

from arstream.app.protocol import excerpt


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


def origin_refusal(headers: Headers, allowed: list[str], server_port: int | None) -> str | None:
    """Why the request's Origin is refused, or None when it is allowed."""
    origin = headers.get("origin")
    if origin is None:
        return None
    # Browsers serialise origins in lower case; a proxy or script may not.
    origin = origin.rstrip("/").lower()
    if "*" in allowed:
        return None
    permitted = set(allowed) if allowed else (same_host_origins(server_port) if server_port else set())
    if origin in permitted:
        return None
    return f"origin '{excerpt(origin)}' is not allowed"

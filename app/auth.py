"""Who may open a session: the bearer token and the Origin allow list.

Token: ``Authorization: Bearer T`` or ``?token=T`` (browsers cannot set
headers on a WebSocket). Origin: a request without an ``Origin`` header
(scripts) passes; otherwise the origin must be on ``--allowed-origins``, or,
when that is empty, be this server on the loopback names
(``http://127.0.0.1:PORT``, ``http://localhost:PORT``, ``http://[::1]:PORT``).
``*`` allows every origin.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers, QueryParams


def token_refusal(headers: Headers, query: QueryParams, expected: str | None) -> str | None:
    """Why the request's token is refused, or None when it is accepted (or none is required)."""
    if expected is None:
        return None
    offered: str | None = None
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer":
            offered = value.strip()
    if offered is None:
        offered = query.get("token")
    if offered is None:
        return "a token is required (Authorization: Bearer T, or ?token=T)"
    if not hmac.compare_digest(offered.encode(), expected.encode()):
        return "the token is wrong"
    return None


def same_host_origins(port: int) -> set[str]:
    return {f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"}


def origin_refusal(headers: Headers, allowed: list[str], server_port: int | None) -> str | None:
    """Why the request's Origin is refused, or None when it is allowed."""
    origin = headers.get("origin")
    if origin is None:
        return None
    origin = origin.rstrip("/")
    if "*" in allowed:
        return None
    permitted = set(allowed) if allowed else (same_host_origins(server_port) if server_port else set())
    if origin in permitted:
        return None
    return f"origin {origin!r} is not allowed"

"""ASGI middleware for what every HTTP answer carries: a Host check and the browser security headers.

- :class:`HostCheck` answers only requests whose ``Host`` is one this server
  is meant to be reached by (``allowed_hosts``; by default the loopback names
  when bound to loopback, which defeats DNS rebinding against a local
  server). Others get 400 (HTTP) or a refused upgrade (WebSocket).
- :class:`SecurityHeaders` adds a Content-Security-Policy that lets the demo
  page load only its own files and connect only to its own origin,
  ``nosniff``, no referrer, no framing, and ``Cache-Control`` (the API is
  never cached; the demo's files are revalidated).
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .settings import Settings

LOOPBACK_BINDS = {"127.0.0.1", "localhost", "::1"}
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

CONTENT_SECURITY_POLICY = (
    # media-src blob:: the realtime video page plays fMP4 through a MediaSource, whose URL is a blob: URL.
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' blob:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
STATIC_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]
API_PREFIXES = ("/v1/", "/metrics", "/healthz", "/readyz", "/servingz")


def allowed_host_patterns(settings: Settings) -> list[str] | None:
    """The Host names to answer, or None for any."""
    configured = [host for host in settings.allowed_hosts.split(",") if host]
    if "*" in configured:
        return None
    if configured:
        return configured
    if settings.host in LOOPBACK_BINDS:
        return LOOPBACK_HOSTS
    return None


def host_name(header: str) -> str:
    """``Host`` without its port: ``example.com:80`` -> ``example.com``, ``[::1]:8000`` -> ``[::1]``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if ":" in header else header


def host_allowed(name: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern == name or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


class HostCheck:
    def __init__(self, app: ASGIApp, patterns: list[str] | None) -> None:
        self.app = app
        self.patterns = patterns

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.patterns is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        name = host_name(headers.get(b"host", b"").decode("latin-1"))
        if host_allowed(name, self.patterns):
            await self.app(scope, receive, send)
            return
        body = b"this server does not answer to that Host (allowed_hosts)"
        start_type = "http.response.start" if scope["type"] == "http" else "websocket.http.response.start"
        body_type = "http.response.body" if scope["type"] == "http" else "websocket.http.response.body"
        headers_out = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
        await send({"type": start_type, "status": 400, "headers": headers_out})
        await send({"type": body_type, "body": body})


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_api = scope["path"].startswith(API_PREFIXES)
        cache = b"no-store" if is_api else b"no-cache"

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra: list[Any] = [h for h in STATIC_HEADERS if h[0] not in present]
                if b"cache-control" not in present:
                    extra.append((b"cache-control", cache))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)

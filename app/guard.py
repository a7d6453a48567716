"""The transport's bounds: connection caps, HTTP request heads, WebSocket closes and pongs, quiet refusals.

uvicorn leaves these open, and a stranger can take each one (docs/public.md):

- :class:`ConnectionGuard` counts open TCP connections, in all and per peer
  address (trusted proxies exempt), and drops new ones past either cap at
  once, before a byte is parsed. The default total stays under the process's
  open-file limit, so the server never runs out of descriptors.
- :class:`GuardedHttpProtocol` (uvicorn's httptools protocol) refuses a
  request head larger than ``max_header_bytes`` with 431 and drops a
  connection that has not sent a whole head within ``request_head_timeout_s``
  (slowloris), on the first request and on every keep-alive request after it.
- :class:`GuardedWebSocketProtocol` (uvicorn's websockets-sansio protocol)
  drops a peer that has not completed a close ``close_timeout_s`` after the
  app is done with it (a peer that never reads would otherwise keep its
  unsent bytes forever), and answers at most one ping while the peer is not
  reading what it was sent (RFC 6455 allows answering only the latest), so a
  ping flood cannot grow the send buffer. It counts frames, not only
  messages: a frame that is a whole message is paced by the app (uvicorn
  stops reading until the app has taken it, and the app reads at the
  message rate), but every other frame (a 1-byte fragment, an empty pong) is
  parsed as it comes, so each spends from a per-connection budget
  (``max_frames_per_s``, ``frame_burst``); received bytes are parsed at most
  ``PARSE_SLICE_BYTES`` at a time, and a connection past its budget is
  closed (1008) and read no more. It is also the app's handle on its transport
  (:func:`transport_control`): a refused connection stops being parsed at
  once, a taken-over or non-reading one is dropped.
  It also offers the app a way to lower the connection's message limit
  (ASGI scope extension :data:`MESSAGE_LIMIT_EXTENSION`): a connection opens
  with the limit for `start`, which may carry a start image, and drops to the
  limit for every other message once its session has started.
- :class:`RefusalLog` logs the first refusal of each kind, then one count per
  interval, never one line per attempt.

The protocol classes subclass uvicorn internals (uvicorn >= 0.54, pinned in
pyproject.toml); tests/server/test_hardening_http.py exercises each bound against a
real server.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import re
import resource
import time
from typing import Any
from urllib.parse import unquote_plus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from .limits import TokenBucket
from .settings import RESERVED_FDS, Settings

log = logging.getLogger("arstream.guard")

DEFAULT_MAX_CONNECTIONS = 1000
REFUSAL_LOG_INTERVAL_S = 10.0
HEAD_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
# Scope extension: a callable taking the new largest message in bytes (see GuardedWebSocketProtocol).
MESSAGE_LIMIT_EXTENSION = "arstream.message_limit"
# One query parameter (separator, name, value) in a logged path; the name is compared as the server decodes it.
QUERY_PARAMETER = re.compile(r"([?&])([^=&\s\"?#]*)=([^&\s\"#]*)")
# The page's old share links carried watch/branch tokens in the query (new ones use the fragment, never sent).
SECRET_PARAMETERS = frozenset({"token", "resume", "share", "watch", "branch"})
# Bytes parsed at a time: whole messages in a slice pause reading at the first one, and other frames
# spend from the frame budget one by one, so one call parses at most the budget's worth of tiny frames.
PARSE_SLICE_BYTES = 1024
# What a refused connection may still send (unparsed, discarded) while its refusal goes out: a client that
# sent `start` before reading the refusal is not reset (which could lose the refusal) for that.
REFUSED_DISCARD_BYTES = 65536
TRANSPORT_EXTENSION = "arstream.transport"
# Scope extension: the address of the socket's own peer, which uvicorn's proxy headers leave as it is (the
# scope's "client" is the forwarded address when the peer is a trusted proxy).
SOCKET_PEER_EXTENSION = "arstream.socket_peer"
# Banned addresses (and connection rate budgets) kept before expired ones are swept (a few hundred bytes each).
BAN_TABLE_PRUNE_AT = 4096


def limit_messages(ws: Any, limit_bytes: int) -> None:
    """Have the WebSocket ``ws`` refuse frames over ``limit_bytes`` before buffering them (MESSAGE_LIMIT_EXTENSION)."""
    limit = ws.scope.get("extensions", {}).get(MESSAGE_LIMIT_EXTENSION)
    if limit is not None:
        limit(limit_bytes)


class RefusalLog:
    """Warn once per kind of refusal, then at most once per interval with the count since."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.counts: dict[str, int] = {}  # every refusal since start, by kind (tests read it)
        self._pending: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def note(self, kind: str, detail: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self._pending[kind] = self._pending.get(kind, 0) + 1
        now = time.monotonic()
        last = self._last.get(kind)
        if last is None or now - last >= self.interval_s:
            count = self._pending.pop(kind)
            since = "" if last is None else f" ({count} in the last {now - last:.0f} s)"
            log.warning("refused: %s%s", detail, since)
            self._last[kind] = now


class TrustedProxies:
    """The ``forwarded_allow_ips`` setting as a membership test."""

    def __init__(self, spec: str) -> None:
        entries = [entry.strip() for entry in spec.split(",") if entry.strip()]
        self.everyone = "*" in entries
        self.networks = [ipaddress.ip_network(entry, strict=False) for entry in entries if entry != "*"]

    def __contains__(self, host: object) -> bool:
        if self.everyone:
            return True
        try:
            address = ipaddress.ip_address(str(host))
        except ValueError:
            return False
        return any(address in network for network in self.networks)


def resolved_max_connections(settings: Settings) -> int:
    """The total connection cap, raising the soft open-file limit as far as the hard one allows.

    Raises ValueError when an explicit cap cannot fit under the hard limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = (settings.max_connections or DEFAULT_MAX_CONNECTIONS) + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    available = wanted if soft == resource.RLIM_INFINITY else soft - RESERVED_FDS
    if settings.max_connections is not None:
        if settings.max_connections > available:
            raise ValueError(
                f"max_connections {settings.max_connections} does not fit the open-file limit: {soft} descriptors, "
                f"{RESERVED_FDS} kept for the server, so at most {available}; raise `ulimit -n` or lower the cap"
            )
        return settings.max_connections
    return max(1, min(DEFAULT_MAX_CONNECTIONS, available))


class FloodBans:
    """Client addresses closed over their frame budget: no new connections from them for ``ban_s``.

    Reconnecting is what made a flood cheap to repeat. A direct client's address is refused when it connects
    (:meth:`ConnectionGuard.admit`); behind a trusted proxy the client's forwarded address is refused before
    the WebSocket upgrade (app/unstarted.py), and the proxy's own address, which stands for everyone, is
    never banned.
    """

    def __init__(self, ban_s: float, trusted: TrustedProxies) -> None:
        self.ban_s = ban_s
        self.trusted = trusted
        self._until: dict[str, float] = {}  # client address -> monotonic time its ban ends

    def ban(self, host: str | None) -> None:
        if not host or self.ban_s <= 0 or host in self.trusted:
            return
        now = time.monotonic()
        if len(self._until) >= BAN_TABLE_PRUNE_AT:
            self._until = {h: until for h, until in self._until.items() if until > now}
        self._until[host] = now + self.ban_s

    def seconds_left(self, host: str) -> float:
        """How long ``host`` stays banned (0: it is not)."""
        until = self._until.get(host)
        if until is None:
            return 0.0
        left = until - time.monotonic()
        if left <= 0:
            del self._until[host]
            return 0.0
        return left


class ConnectionGuard:
    """Open TCP connections by peer address; :meth:`admit` says whether one more may stay."""

    def __init__(self, settings: Settings, refusals: RefusalLog, bans: FloodBans) -> None:
        self.max_total = resolved_max_connections(settings)
        self.max_per_peer = settings.max_connections_per_client
        self.trusted = bans.trusted
        self.refusals = refusals
        self.bans = bans
        self._peers: dict[asyncio.BaseTransport, str] = {}
        self._per_peer: dict[str, int] = {}
        self.rate_per_peer = settings.connection_rate_per_client
        self.burst_per_peer = settings.connection_burst_per_client
        self._new_connections: dict[str, TokenBucket] = {}  # client address -> its connection rate budget

    @property
    def open(self) -> int:
        return len(self._peers)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        if transport in self._peers:
            return True  # the same connection, upgraded to a WebSocket
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if len(self._peers) >= self.max_total:
            self.refusals.note("max_connections", f"{self.max_total} connections are open (max_connections)")
            return False
        if self.bans.seconds_left(host):
            self.refusals.note("frame_flood_ban", f"{host} flooded frames; no connections for {self.bans.ban_s:g} s")
            return False
        held = self._per_peer.get(host, 0)
        if self.max_per_peer is not None and held >= self.max_per_peer and host not in self.trusted:
            self.refusals.note(
                "max_connections_per_client",
                f"{host} already holds {held} connections (max_connections_per_client {self.max_per_peer})",
            )
            return False
        if not self._within_rate(host):
            self.refusals.note(
                "connection_rate_per_client",
                f"{host} opens connections faster than {self.rate_per_peer:g}/s (connection_rate_per_client)",
            )
            return False
        self._peers[transport] = host
        self._per_peer[host] = held + 1
        return True

    def _within_rate(self, host: str) -> bool:
        """Spend from ``host``'s connection budget. Bounds what reconnecting costs: a connection refused here
        is closed before any byte of it is read (an address refused for another reason spends nothing)."""
        if self.rate_per_peer is None or host in self.trusted:
            return True
        now = time.monotonic()
        budget = self._new_connections.get(host)
        if budget is None:
            if len(self._new_connections) >= BAN_TABLE_PRUNE_AT:  # forget addresses whose budget has refilled
                self._new_connections = {h: b for h, b in self._new_connections.items() if not b.full(now)}
            budget = self._new_connections[host] = TokenBucket(self.rate_per_peer, self.burst_per_peer, now)
        return budget.try_spend(now)

    def release(self, transport: asyncio.BaseTransport) -> None:
        host = self._peers.pop(transport, None)
        if host is None:
            return
        left = self._per_peer[host] - 1
        if left:
            self._per_peer[host] = left
        else:
            del self._per_peer[host]


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol with connection caps, a head size limit and a head deadline."""

    guard: ConnectionGuard
    max_head_bytes: int
    head_timeout_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._head_done = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._upgraded = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(transport):
            transport.abort()
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if not self._upgraded:
            self.guard.release(self.transport)
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_bytes = 0
        self._head_done = False
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self.guard.refusals.note(
            "request_head_timeout", f"no whole request head within {self.head_timeout_s} s (request_head_timeout_s)"
        )
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self._head_done:
            # Up to the head's end when this read holds it: a body in the same read (the cluster's
            # POST /v1/cluster/import) is not head.
            end = data.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end + 4
            if self._head_bytes > self.max_head_bytes:
                self.guard.refusals.note(
                    "max_header_bytes", f"a request head over {self.max_head_bytes} bytes (max_header_bytes)"
                )
                self._cancel_head_timer()
                self._head_done = True
                self.transport.write(HEAD_TOO_LARGE)
                self.transport.close()
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {SOCKET_PEER_EXTENSION: self.client}  # type: ignore[dict-item]

    def on_headers_complete(self) -> None:
        self._head_done = True
        self._cancel_head_timer()
        super().on_headers_complete()

    def handle_websocket_upgrade(self) -> None:
        self._upgraded = True  # the WebSocket protocol owns the connection (and its guard slot) from here
        super().handle_websocket_upgrade()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()  # a keep-alive connection's next request gets its own deadline


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol that drops peers slow to close, bounds pongs to a non-reading peer and
    frames from any peer, and lets the app stop reading or drop its connection."""

    guard: ConnectionGuard
    close_timeout_s: float
    max_frames_per_s: float
    frame_burst: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.close_timeout = self.close_timeout_s
        self._drop_timer: asyncio.TimerHandle | None = None
        self._ponged_while_paused = False
        self._frames = TokenBucket(self.max_frames_per_s, self.frame_burst, self.loop.time())
        self._over_frame_budget = False
        self._refused = False  # the app refused the connection: nothing more is parsed
        self._discarded_bytes = 0
        self._unparsed = b""  # received while reading was paused for the app, parsed from _unparsed_at on
        self._unparsed_at = 0
        # Set when the TCP connection is gone: the app can stop work done for a client that left (a start
        # image's decode) without reading from the socket.
        self.lost = asyncio.Event()

    # ---- what the app may do with its transport (through the scope's TRANSPORT_EXTENSION) --------

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if getattr(self, "scope", None) is not None:
            self.scope["extensions"][TRANSPORT_EXTENSION] = self  # type: ignore[index]
            self.scope["extensions"][MESSAGE_LIMIT_EXTENSION] = self.limit_messages  # type: ignore[index]

    @property
    def buffered_bytes(self) -> int:
        """Bytes written to the transport that the peer has not taken yet."""
        return 0 if self.disconnected else self.transport.get_write_buffer_size()

    def stop_reading(self) -> None:
        """The app refused this connection and queued its refusal: parse nothing more from the peer.

        The server half-closes once the refusal is out; what the peer still sends is discarded unparsed
        (up to ``REFUSED_DISCARD_BYTES``, then it is dropped), and it is dropped ``close_timeout_s`` from now
        if it has not closed by then.
        """
        if self._refused or self.disconnected:
            return
        self._refused = True
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()  # read to discard: unread bytes would turn our close into a reset
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._drop_after_close_timeout()

    def drop_soon(self) -> None:
        """Drop the connection ``close_timeout_s`` from now unless it has closed by then."""
        self._drop_after_close_timeout()

    def drop_now(self, kind: str, detail: str) -> None:
        """Drop the connection at once (its peer is not reading), noting why in the refusal log."""
        if not self.disconnected:
            self.guard.refusals.note(kind, detail)
            self.transport.abort()

    # ---- frames ------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._discarded_bytes += len(data)
            if self._discarded_bytes > REFUSED_DISCARD_BYTES:
                self.transport.abort()
            return
        if self._unparsed_at < len(self._unparsed):
            data = self._unparsed[self._unparsed_at :] + data  # reading was paused: at most one read is kept
        self._unparsed, self._unparsed_at = data, 0
        self._parse_received()

    def _parse_received(self) -> None:
        """Parse what has come, a slice at a time, until reading pauses (a whole message waits for the
        app: uvicorn parses all it was given, so the rest of a large read is kept for later), the frame
        budget runs out, or the connection closes."""
        view = memoryview(self._unparsed)
        start = self._unparsed_at
        while start < len(view):
            if self.read_paused or self._refused or self._over_frame_budget or self.transport.is_closing():
                break
            super().data_received(view[start : start + PARSE_SLICE_BYTES])
            start += PARSE_SLICE_BYTES
        if start >= len(view):
            self._unparsed, self._unparsed_at = b"", 0
        else:
            self._unparsed_at = start

    async def receive(self) -> Any:
        message = await super().receive()
        if self._unparsed_at < len(self._unparsed) and not self.read_paused:
            self._parse_received()  # the app took what was queued: go on with what was kept
        return message

    def _frame_allowed(self) -> bool:
        """Spend one frame from the budget; past it, close the connection (1008) and read no more."""
        if self._over_frame_budget:
            return False
        if self._frames.delay(self.loop.time()) <= 0:
            return True
        self._over_frame_budget = True
        # The client's address: behind a trusted proxy uvicorn has put the forwarded one in the scope.
        client = getattr(self, "scope", {}).get("client") or self.transport.get_extra_info("peername")
        self.guard.bans.ban(str(client[0]) if client else None)
        reason = f"over {self.max_frames_per_s:g} fragments and control frames/s (max_frames_per_s)"
        self.guard.refusals.note(
            "frame_budget",
            f"a WebSocket peer sent more than {self.frame_burst} fragments and control frames at once "
            f"or {self.max_frames_per_s:g}/s (max_frames_per_s, frame_burst)",
        )
        self.conn.fail(1008, reason)  # a close frame when the connection is open; the parser stops
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.queue.put_nowait({"type": "websocket.disconnect", "code": 1008, "reason": reason})
        self.close_sent = True
        self.transport.close()
        self._drop_after_close_timeout()
        return False

    # A frame that is a whole message (fin set) is not counted: reading pauses until the app takes it.
    def handle_text(self, event: Any) -> None:
        if event.fin or self._frame_allowed():
            super().handle_text(event)

    def handle_bytes(self, event: Any) -> None:
        if event.fin or self._frame_allowed():
            super().handle_bytes(event)

    def handle_cont(self, event: Any) -> None:
        if self._frame_allowed():
            super().handle_cont(event)

    def handle_pong(self, event: Any) -> None:
        if self._frame_allowed():
            super().handle_pong(event)

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.guard.admit(transport)  # admitted as HTTP already; records it if it came another way

    def limit_messages(self, max_bytes: int) -> None:
        """From the next frame on, refuse messages over ``max_bytes`` (close 1009) before buffering them."""
        if hasattr(self.conn, "max_message_size"):  # websockets >= 15 (a (message, fragment) pair before that)
            self.conn.max_message_size = max_bytes
        else:
            self.conn.max_size = max_bytes

    def connection_lost(self, exc: Exception | None) -> None:
        if self._drop_timer is not None:
            self._drop_timer.cancel()
            self._drop_timer = None
        self.guard.release(self.transport)
        self.lost.set()
        super().connection_lost(exc)

    def resume_writing(self) -> None:
        self._ponged_while_paused = False
        super().resume_writing()

    def handle_ping(self) -> None:
        output = self.conn.data_to_send()
        if not self._frame_allowed():
            return
        if not self.writable.is_set():
            # The peer is not reading what it was sent; answer one ping until it catches up.
            if self._ponged_while_paused:
                return
            self._ponged_while_paused = True
        self.transport.write(b"".join(output))

    def _drop_after_close_timeout(self) -> None:
        if self._drop_timer is None and not self.disconnected:
            self._drop_timer = self.loop.call_later(self.close_timeout_s, self._drop)

    def _drop(self) -> None:
        self._drop_timer = None
        if not self.disconnected:
            self.guard.refusals.note(
                "close_timeout", f"a WebSocket peer did not complete its close within {self.close_timeout_s} s"
            )
            self.transport.abort()

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message.get("type") == "websocket.close":
            self._drop_after_close_timeout()
        elif message.get("type") == "websocket.http.response.body" and not message.get("more_body", False):
            # A refusal before the upgrade is a finished handshake; uvicorn would log it as an app error.
            self.handshake_complete = True

    async def run_asgi(self) -> None:
        await super().run_asgi()
        self._drop_after_close_timeout()  # the app is done: the peer has close_timeout_s to let go


def transport_control(scope: Any) -> GuardedWebSocketProtocol | None:
    """The guarded protocol serving a WebSocket scope (None when the server runs without the guard)."""
    control = scope.get("extensions", {}).get(TRANSPORT_EXTENSION)
    return control if isinstance(control, GuardedWebSocketProtocol) else None


def socket_peer_host(scope: Any) -> str:
    """The host of the socket's own peer: a proxy's own address, never one it forwarded (the scope's
    ``client`` when the server runs without the guard)."""
    peer = scope.get("extensions", {}).get(SOCKET_PEER_EXTENSION) or scope.get("client")
    return str(peer[0]) if peer else ""


def protocol_classes(
    settings: Settings, refusals: RefusalLog, bans: FloodBans
) -> tuple[type[GuardedHttpProtocol], type[GuardedWebSocketProtocol], ConnectionGuard]:
    """This server's HTTP and WebSocket protocol classes, sharing one :class:`ConnectionGuard`."""
    guard = ConnectionGuard(settings, refusals, bans)
    http = type(
        "ARStreamHttpProtocol",
        (GuardedHttpProtocol,),
        {
            "guard": guard,
            "max_head_bytes": settings.max_header_bytes,
            "head_timeout_s": settings.request_head_timeout_s,
        },
    )
    ws = type(
        "ARStreamWebSocketProtocol",
        (GuardedWebSocketProtocol,),
        {
            "guard": guard,
            "close_timeout_s": settings.close_timeout_s,
            "max_frames_per_s": settings.max_frames_per_s,
            "frame_burst": settings.frame_burst,
        },
    )
    return http, ws, guard


def _redact_parameter(match: re.Match[str]) -> str:
    separator, name, _ = match.groups()
    # Decoded as the server decodes a query (percent escapes, + for space): `?%74oken=` is `?token=`.
    if unquote_plus(name).strip().lower() in SECRET_PARAMETERS:
        return f"{separator}{name}=<redacted>"
    return match.group()


def redact_query(text: str) -> str:
    """``text`` with the value of every query parameter that names a token or resume token replaced."""
    return QUERY_PARAMETER.sub(_redact_parameter, text) if "=" in text else text


def printable(text: str) -> str:
    """``text`` with control characters escaped: a client-chosen path cannot start a forged log line."""
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class RedactSecrets(logging.Filter):
    """Replaces token and resume values in log lines (uvicorn logs request paths with their query, in any
    spelling the client chose) and escapes control characters in the strings a client chose."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(printable(redact_query(arg)) if isinstance(arg, str) else arg for arg in record.args)
        if isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


def redact_uvicorn_logs() -> None:
    """Install :class:`RedactSecrets` on uvicorn's access and error loggers (once)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())


RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def quiet_resource_errors(loop: asyncio.AbstractEventLoop, refusals: RefusalLog) -> None:
    """Route the loop's out-of-descriptors reports (one per failed accept) through :class:`RefusalLog`."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
            refusals.note("out_of_resources", f"{context.get('message', 'accept failed')}: {exc}")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)

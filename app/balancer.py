"""What HAProxy learns from a replica: its HAProxy agent check (docs/deployment.md, "How HAProxy routes").

HAProxy counts only the connections it holds itself: after a restart or a
reload (the old process keeps its WebSocket tunnels), or beside another
balancer, a replica's slots can be taken by sessions the asking balancer has
never seen. So the replica tells it, over the agent check (a TCP port: connect,
read one line), what it may send:

* ``down #reason`` while the replica cannot start sessions at all (loading, a
  failed model, shutting down), ``up`` otherwise;
* ``maxconn:N``, with N = the slots free for new sessions plus the sessions
  the asking balancer already holds here (HAProxy compares N with its own count
  of connections to the server, so N - held is what it may add). A connection
  counts as held once its session is admitted: before that it is about to take
  one of the free slots, and counting it in both would offer a slot twice;
* weight ``0%`` when N is 0 (HAProxy's maxconn 0 would mean "no limit"; its
  statistics show weight 0), ``100%`` otherwise. A server at weight 0
  still takes resumes (they are persistent). Weights, not the ``drain`` and
  ``ready`` words: ``ready`` would cancel a drain or maintenance an operator set.

Which connections the asking balancer holds: HAProxy stamps every session
request it forwards, and every health check, with ``X-ARStream-Balancer:
HOST/PID`` (one value per HAProxy process). The agent's TCP connection carries
no header, so the replica takes the newest balancer process it has heard
health-checking from the agent connection's address as the one asking.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

log = logging.getLogger("arstream.balancer")

BALANCER_HEADER = "x-arstream-balancer"
# A balancer id is HAProxy's host name and process id; anything else is ignored (it comes from the network).
BALANCER_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}/[0-9]{1,10}$")
# Balancer ids remembered per address: old processes (a reload) and restarts; the newest wins.
KNOWN_IDS_PER_ADDRESS = 8
# A reason after "down#" is free text to HAProxy; keep it one short printable line.
REASON_CHARS = re.compile(r"[^ -~]")


def balancer_id(header: str | None) -> str | None:
    """The header's balancer id, or None when it is missing or not a HOST/PID id."""
    if header is None or not BALANCER_ID.match(header):
        return None
    return header


class BalancerLedger:
    """Open session connections per balancer process, and which process is newest at each address."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # balancer id -> one "is its session admitted yet" check per open session connection
        self._open: dict[str, list[Callable[[], bool]]] = {}
        # address -> {balancer id: when first heard}; insertion order is first-heard order
        self._heard: dict[str, dict[str, float]] = {}

    def heard(self, address: str, header: str | None) -> None:
        """A health check from ``address`` carried ``header`` (the balancer process checking)."""
        balancer = balancer_id(header)
        if balancer is None:
            return
        ids = self._heard.setdefault(address, {})
        if balancer not in ids:
            ids[balancer] = self._clock()
            while len(ids) > KNOWN_IDS_PER_ADDRESS:
                del ids[next(iter(ids))]

    def newest_at(self, address: str) -> str | None:
        ids = self._heard.get(address)
        if not ids:
            return None
        return max(ids, key=ids.__getitem__)

    @contextmanager
    def connection(self, header: str | None, admitted: Callable[[], bool]) -> Iterator[None]:
        """Count one open session connection for the balancer process that forwarded it (if any); it is held
        while ``admitted()`` says its session is live here."""
        balancer = balancer_id(header)
        if balancer is None:
            yield
            return
        open_here = self._open.setdefault(balancer, [])
        open_here.append(admitted)
        try:
            yield
        finally:
            open_here.remove(admitted)
            if not open_here:
                del self._open[balancer]

    def held_by_newest_at(self, address: str) -> int:
        """Admitted sessions whose connections came through the newest balancer process heard from ``address``."""
        balancer = self.newest_at(address)
        return sum(admitted() for admitted in self._open.get(balancer, ())) if balancer is not None else 0


class AgentView(Protocol):
    """What the agent check reads of the replica (the hub is one)."""

    ready: bool
    shutting_down: bool
    not_ready_reason: str

    def free_slots(self) -> int:
        """Sessions the replica would admit now: its KV slots (or realtime capacity) less those held or resuming."""


def agent_reply(replica: AgentView, ledger: BalancerLedger, address: str) -> str:
    """The agent check's line for the balancer at ``address`` (module docstring)."""
    if replica.shutting_down or not replica.ready:
        reason = REASON_CHARS.sub("?", replica.not_ready_reason or "not ready")[:120]
        return f"down #{reason}\n"
    maxconn = replica.free_slots() + ledger.held_by_newest_at(address)
    if maxconn == 0:
        return "up 0%\n"
    return f"up 100% maxconn:{maxconn}\n"


async def start_agent(replica: AgentView, ledger: BalancerLedger, host: str, port: int) -> asyncio.Server:
    """Listen for HAProxy's agent checks: each connection gets one line, then is closed (nothing is read)."""

    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else ""
        try:
            writer.write(agent_reply(replica, ledger, address).encode("ascii"))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, host, port)
    log.info("agent check for HAProxy on port %d", server.sockets[0].getsockname()[1])
    return server

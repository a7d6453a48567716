"""Where the server's ICE host candidates live: the UDP ports (``--webrtc-udp-ports``) and the address they carry
(``--webrtc-advertised-address``).

aiortc gathers its candidates through aioice, whose ``Connection`` binds each host address on port 0 (whatever port
the kernel gives) and has no setting for a range. So :func:`bound_host_candidates` gives one peer connection's aioice
connections a host-candidate gathering of their own, as an attribute of those instances (nothing in aioice or aiortc
is patched process-wide, and a peer connection without these settings gathers as aioice does): each socket is bound
to a free port of the range, and its candidate carries the advertised address when there is one. Server-reflexive
and relayed candidates, when ICE servers are configured, are still gathered by aioice itself.

The adapter follows aioice 0.13's gathering (``Connection.get_component_candidates`` and the ``_protocols`` list its
``close()`` closes, reached through aiortc's ``RTCIceGatherer._connection``); :func:`unavailable_reason` refuses the
settings at start-up with another aioice series, and tests/server/test_webrtc_ports.py checks the ports in the
answer's candidates.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import random
import socket
from dataclasses import dataclass
from typing import Any

# The aioice series whose gathering the adapter follows (pyproject.toml pins the webrtc extra to it).
AIOICE_SERIES = "0.13."


class PortsExhausted(Exception):
    """No free port of the range for a peer connection's host candidates."""


@dataclass(frozen=True)
class HostCandidates:
    """The ports a peer connection's host candidates may bind (None: any) and the address they carry (None: each
    local address its own)."""

    ports: range | None = None
    advertised_address: str | None = None

    @property
    def adapted(self) -> bool:
        """Whether gathering differs from aioice's own."""
        return self.ports is not None or self.advertised_address is not None

    def describe_ports(self) -> str:
        return "any" if self.ports is None else f"{self.ports.start}-{self.ports.stop - 1}"


def unavailable_reason() -> str | None:
    """Why the settings cannot apply on this install (no aioice, another series), or None."""
    try:
        import aioice
    except ImportError:
        return "needs the webrtc extra (aiortc)"
    version = str(getattr(aioice, "__version__", ""))
    if not version.startswith(AIOICE_SERIES):
        return f"follows aioice {AIOICE_SERIES}x's candidate gathering, and aioice {version or '?'} is installed"
    return None


def bound_host_candidates(peer_connection: Any, where: HostCandidates) -> None:
    """Make each ICE gatherer of ``peer_connection`` (after its remote description is set: the offer's transports
    exist; before its local one: nothing gathered yet) bind its host candidates as ``where`` says."""
    gatherers = {id(g): g for g in _ice_gatherers(peer_connection)}
    for gatherer in gatherers.values():
        connection = gatherer._connection  # aioice.Connection
        aioice_gathering = connection.get_component_candidates

        async def gather(component: int, addresses: list[str], timeout: int = 5, *, connection: Any = connection,
                         aioice_gathering: Any = aioice_gathering) -> list[Any]:
            hosts = await _bind_host_candidates(connection, component, addresses, where)
            # Server-reflexive and relayed candidates (configured ICE servers), as aioice gathers them.
            return hosts + list(await aioice_gathering(component, [], timeout))

        connection.get_component_candidates = gather


def _ice_gatherers(peer_connection: Any) -> list[Any]:
    transports = [t.sender.transport for t in peer_connection.getTransceivers()]
    if peer_connection.sctp is not None:
        transports.append(peer_connection.sctp.transport)
    return [t.transport.iceGatherer for t in transports if t is not None]


async def _bind_host_candidates(connection: Any, component: int, addresses: list[str],
                                where: HostCandidates) -> list[Any]:
    """One host candidate per local address (or one on the advertised address), each on a socket bound to a free
    port of the range; PortsExhausted (with nothing left bound) when one cannot get a port."""
    from aioice import turn
    from aioice.candidate import Candidate, candidate_foundation, candidate_priority
    from aioice.ice import StunProtocol

    if not addresses:  # the relay-only policy gathers no host candidates
        return []
    if where.advertised_address is not None:
        family = ipaddress.ip_address(where.advertised_address).version
        binds = [("0.0.0.0" if family == 4 else "::", where.advertised_address)]
    else:
        binds = [(address, address) for address in addresses]
    loop = asyncio.get_running_loop()
    protocols: list[Any] = []
    candidates = []
    try:
        for bind_address, shown_address in binds:
            try:
                sock = _bind_in_range(bind_address, where.ports)
            except OSError:  # an address that cannot be bound at all is left out, as aioice does
                continue
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, turn.UDP_SOCKET_BUFFER_SIZE)
            _, protocol = await loop.create_datagram_endpoint(lambda: StunProtocol(connection), sock=sock)
            protocols.append(protocol)
            port = sock.getsockname()[1]
            protocol.local_candidate = Candidate(
                foundation=candidate_foundation("host", "udp", shown_address),
                component=component,
                transport="udp",
                priority=candidate_priority(component, "host"),
                host=shown_address,
                port=port,
                type="host",
            )
            candidates.append(protocol.local_candidate)
    except BaseException:
        for protocol in protocols:
            await protocol.close()
        raise
    connection._protocols += protocols  # closed with the connection
    return candidates


def _bind_in_range(address: str, ports: range | None) -> socket.socket:
    """A UDP socket bound to ``address`` on a free port of ``ports`` (tried from a random one on, so that peers
    coming and going spread over the range), or on any port."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    candidates = [0] if ports is None else _rotated(ports)
    for port in candidates:
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((address, port))
        except OSError as exc:
            sock.close()
            if ports is None or exc.errno != errno.EADDRINUSE:
                raise
            continue
        sock.setblocking(False)
        return sock
    assert ports is not None
    raise PortsExhausted(f"no free UDP port in {ports.start}-{ports.stop - 1} (--webrtc-udp-ports) for this peer "
                         "connection; try again later")


def _rotated(ports: range) -> list[int]:
    start = random.randrange(len(ports))
    return [*ports[start:], *ports[:start]]

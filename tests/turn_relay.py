"""A real TURN relay for the tests: Debian's coturn (``turnserver``) on loopback, in the foreground, its configuration
and log in a folder of the test's, with coturn's shared-secret credentials (use-auth-secret), as
deploy/coturn/turnserver.conf configures it (tests/server/test_webrtc_turn.py, tests/browser/test_webrtc_turn_browser.py).

scripts/test.sh installs coturn; a test that needs it skips (``needs_turnserver``) only where it is missing.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

TURNSERVER = shutil.which("turnserver")
needs_turnserver = pytest.mark.skipif(
    TURNSERVER is None, reason="coturn's turnserver is not installed (scripts/test.sh installs the coturn package)"
)

RELAY_PORTS = 16  # coturn's relayed ports: one per allocation
START_GUARD_S = 30.0  # hang guard only


@dataclass
class Relay:
    port: int  # coturn's listening port (UDP and TCP)
    secret: str  # its static-auth-secret
    relay_ports: range  # the ports its relayed addresses take

    def ice_servers(self) -> list[dict[str, object]]:
        """The server's ``--webrtc-ice-servers`` for this relay (credentials from ``--webrtc-turn-secret``)."""
        return [{"urls": [f"turn:127.0.0.1:{self.port}?transport=udp"]}]


def free_udp_ports(count: int) -> int:
    """The first of ``count`` neighbouring UDP ports free on every IPv4 address, below Linux's ephemeral range."""
    for low in range(32768 - count, 20000, -count):
        held = []
        try:
            for port in range(low, low + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                held.append(sock)
                sock.bind(("0.0.0.0", port))
            return low
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} neighbouring UDP ports are free")


def free_tcp_and_udp_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = int(tcp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


def stun_answers(port: int) -> bool:
    """Whether a STUN Binding request to 127.0.0.1:port gets its response (coturn's UDP listener is up)."""
    from aioice import stun

    request = stun.Message(message_method=stun.Method.BINDING, message_class=stun.Class.REQUEST)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.5)
        sock.sendto(bytes(request), ("127.0.0.1", port))
        try:
            data = sock.recv(2048)
        except OSError:
            return False
    return stun.parse_message(data).transaction_id == request.transaction_id


@contextmanager
def running_relay(folder: Path) -> Iterator[Relay]:
    """coturn on loopback until the block ends; returns once it answers STUN."""
    assert TURNSERVER is not None
    port, secret = free_tcp_and_udp_port(), secrets.token_hex(16)
    low = free_udp_ports(RELAY_PORTS)
    config = folder / "turnserver.conf"
    config.write_text("\n".join([
        "listening-ip=127.0.0.1",
        f"listening-port={port}",
        "relay-ip=127.0.0.1",
        f"min-port={low}",
        f"max-port={low + RELAY_PORTS - 1}",
        "realm=arstream.test",
        "use-auth-secret",
        f"static-auth-secret={secret}",
        "fingerprint",
        "no-tls",
        "no-dtls",
        "no-cli",
        "no-stdout-log",
        "simple-log",
        f"log-file={folder / 'turn.log'}",
        f"pidfile={folder / 'turnserver.pid'}",
        f"userdb={folder / 'turndb'}",
        "",
    ]))
    # In the foreground (coturn daemonises only when asked), its log in the folder.
    process = subprocess.Popen([TURNSERVER, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_GUARD_S
        while not stun_answers(port):
            if process.poll() is not None or time.monotonic() > deadline:
                log = next(iter(folder.glob("turn*.log")), None)
                raise RuntimeError(f"turnserver did not start: {log.read_text() if log else 'no log'}")
        yield Relay(port, secret, range(low, low + RELAY_PORTS))
    finally:
        process.terminate()
        process.wait(START_GUARD_S)

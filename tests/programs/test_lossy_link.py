"""The lossy link (programs/lossy_link.py): real kernel UDP and TCP between its two namespaces, delayed and
dropped by its relay at the rates asked for, and namespaces that go away with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from arstream.programs import lossy_link
from arstream.programs.lossy_link import LinkRates, LinkUnavailable, LossyLink, socket_in

REASON = lossy_link.unavailable_reason()
needs_link = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PORT = 9000
DATAGRAMS = 300
HANG_GUARD_S = 30.0


@pytest.fixture(scope="module")
def link() -> Iterator[LossyLink]:
    if REASON:
        pytest.skip(REASON)
    with LossyLink(LinkRates(), seed=7) as made:
        yield made


def send_numbered(link: LossyLink, count: int) -> list[int]:
    """``count`` numbered datagrams from the client side to the server side; the numbers that arrived, in order."""
    receiver = socket_in(link.server_namespace, socket.SOCK_DGRAM)
    sender = socket_in(link.client_namespace, socket.SOCK_DGRAM)
    got: list[int] = []
    with receiver, sender:
        receiver.bind((link.server_address, PORT))
        receiver.settimeout(HANG_GUARD_S)

        def receive() -> None:  # read as they come: a full receive buffer would drop them too
            while (data := receiver.recvfrom(16)[0]) != b"end":
                got.append(int.from_bytes(data, "big"))

        reader = threading.Thread(target=receive, name="receiver")
        reader.start()
        for number in range(count):
            sender.sendto(number.to_bytes(4, "big"), (link.server_address, PORT))
            time.sleep(0.001)  # within the device's queue however slowly the relay is scheduled
        # "end" until it arrives (the link may drop it too)
        while reader.is_alive():
            sender.sendto(b"end", (link.server_address, PORT))
            reader.join(timeout=0.05)
    return got


@needs_link
def test_every_datagram_passes_in_order_without_loss_and_about_a_fifth_drop_at_20_percent(link: LossyLink) -> None:
    link.set_rates(LinkRates(delay_s=0.005, jitter_s=0.004))
    got = send_numbered(link, DATAGRAMS)
    assert got == list(range(DATAGRAMS))  # jitter never reorders

    before = link.counts()["to_server"]
    link.set_rates(LinkRates(delay_s=0.005, loss=0.2))
    got = send_numbered(link, DATAGRAMS)
    after = link.counts()["to_server"]
    assert got == sorted(got) and len(set(got)) == len(got)
    # Binomial(300, 0.8): 240 expected, a standard deviation of about 7.
    assert 200 <= len(got) <= 280
    dropped = after["dropped"] - before["dropped"]
    assert dropped >= DATAGRAMS - len(got)  # (and some "end"s, sent until one arrived)


@needs_link
def test_a_round_trip_takes_at_least_twice_the_delay(link: LossyLink) -> None:
    link.set_rates(LinkRates(delay_s=0.1))
    echo = socket_in(link.server_namespace, socket.SOCK_DGRAM)
    client = socket_in(link.client_namespace, socket.SOCK_DGRAM)
    with echo, client:
        echo.bind((link.server_address, PORT + 1))
        echo.settimeout(HANG_GUARD_S)
        client.settimeout(HANG_GUARD_S)
        trips = []
        for number in range(3):
            started = time.monotonic()
            client.sendto(bytes([number]), (link.server_address, PORT + 1))
            data, address = echo.recvfrom(16)
            echo.sendto(data, address)
            assert client.recvfrom(16)[0] == bytes([number])
            trips.append(time.monotonic() - started)
    # A lower bound the relay guarantees (a packet is held for its delay), not a timing race.
    assert min(trips) >= 0.2


@needs_link
def test_tcp_delivers_everything_across_a_lossy_link(link: LossyLink) -> None:
    link.set_rates(LinkRates(delay_s=0.005, loss=0.05))
    payload = os.urandom(200_000)
    listener = socket_in(link.server_namespace, socket.SOCK_STREAM)
    client = socket_in(link.client_namespace, socket.SOCK_STREAM)
    received = bytearray()
    before = sum(direction["dropped"] for direction in link.counts().values())
    with listener, client:
        listener.bind((link.server_address, PORT + 2))
        listener.listen(1)
        listener.settimeout(HANG_GUARD_S)
        client.settimeout(HANG_GUARD_S)
        client.connect((link.server_address, PORT + 2))
        accepted, _ = listener.accept()
        with accepted:
            accepted.settimeout(HANG_GUARD_S)
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)
            while chunk := accepted.recv(65536):
                received += chunk
    assert bytes(received) == payload
    assert sum(direction["dropped"] for direction in link.counts().values()) > before  # TCP resent what was lost


@needs_link
def test_the_program_removes_its_namespaces_on_ctrl_c() -> None:
    program = subprocess.Popen(
        [sys.executable, "-m", "arstream.programs.lossy_link", "--delay-ms", "10"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert program.stdout is not None
    with program.stdout:
        lines = [program.stdout.readline() for _ in range(3)]
        try:
            assert lines[2].startswith("Ctrl-C"), lines
            made = [f"{lossy_link.NAMESPACE_PREFIX}{program.pid}-{side}" for side in "sc"]
            assert set(made) <= set(lossy_link._namespaces())
            program.send_signal(signal.SIGINT)
            assert program.wait(timeout=HANG_GUARD_S) == 0
            assert not set(made) & set(lossy_link._namespaces())
        finally:
            if program.poll() is None:
                program.kill()
                program.wait()


def test_it_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LinkUnavailable, match="needs root"):
        LossyLink(LinkRates()).__enter__()

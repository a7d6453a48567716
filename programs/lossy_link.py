"""A lossy network link between two network namespaces, for measuring the server as a phone on Wi-Fi sees it.

    sudo python -m arstream.programs.lossy_link --delay-ms 40 --jitter-ms 5 --loss 0.03
    # then, in other shells:  ip netns exec <server side> arstream serve --host 0.0.0.0 ...
    #                         ip netns exec <client side> arstream client --url ws://10.203.0.1:PORT/...

Linux's netem would do this in the kernel, but not every kernel has it; a TUN device is nearly always there.
So the link is two namespaces, each with one TUN device as its only way out, and a relay process
between the two devices: each IP packet read from one device is dropped at random (``loss``), or written to
the other device after ``delay`` plus a random ``jitter``. Real kernel TCP and UDP run over it, both ways,
each direction delayed alike (a round trip takes twice the delay). Jitter never reorders a direction's packets
(a packet never leaves before the one read ahead of it), so TCP sees loss and delay but no reordering. The
random draws come from a seeded generator per direction. Rates may change while the link carries traffic.

Needs root and ``/dev/net/tun``; the namespaces are removed on exit (Ctrl-C and SIGTERM included), and ones
left by a process that is gone (killed with SIGKILL) are removed at the next start.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import multiprocessing
import multiprocessing.process
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from types import FrameType, TracebackType

TUN_PATH = "/dev/net/tun"
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_SIZE = 65536
NAMESPACE_PREFIX = "lossy-"
# The two ends' addresses (point to point: each namespace has only its own TUN device and loopback).
SERVER_ADDRESS = "10.203.0.1"
CLIENT_ADDRESS = "10.203.0.2"
MTU = 1500
IDLE_WAIT_S = 0.2  # the relay looks at its stop flag at least this often
CLONE_NEWNET = 0x40000000
IPV6_OFF = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]


class LinkUnavailable(RuntimeError):
    """This machine cannot make the link (not root, or no TUN device)."""


def unavailable_reason() -> str | None:
    """Why the link cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "the lossy link needs root (network namespaces and TUN devices)"
    if not os.path.exists(TUN_PATH):
        return f"the lossy link needs {TUN_PATH} (the tun kernel module)"
    if shutil.which("ip") is None:
        return "the lossy link needs the ip command (Debian's iproute2)"
    return None


DIRECTIONS = ("to_client", "to_server")


@dataclass
class Direction:
    """One way across the link: packets read from ``source`` are written to ``target``."""

    index: int  # in DIRECTIONS, and its passed/dropped pair in the shared counts
    source: int
    target: int
    rng: random.Random
    last_due: float = 0.0


@dataclass
class LinkRates:
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0

    def check(self) -> None:
        if self.delay_s < 0 or self.jitter_s < 0 or not 0 <= self.loss <= 1:
            raise ValueError(f"delay and jitter must be >= 0 and loss in [0, 1]: {self}")


@dataclass(order=True)
class _Due:
    at: float
    sequence: int
    target: int = field(compare=False)
    packet: bytes = field(compare=False)


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", "-n", namespace, *args] if namespace else ["ip", *args]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")


def _open_tun(name: str) -> int:
    fd = os.open(TUN_PATH, os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def socket_in(namespace: str, kind: socket.SocketKind) -> socket.socket:
    """An IPv4 socket of ``namespace``'s network stack, for this process (tests; no child process needed).

    A socket belongs to the namespace its creating thread was in, so a short-lived thread enters the
    namespace (setns changes only the calling thread's), creates it, and ends.
    """
    made: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/var/run/netns/{namespace}", "rb") as handle:
                if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {namespace}")
            made.append(socket.socket(socket.AF_INET, kind))
        except BaseException as error:  # handed to the caller's thread
            made.append(error)

    thread = threading.Thread(target=make, name=f"socket-in-{namespace}")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _namespaces() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans() -> list[str]:
    """Remove namespaces this module made in a process that no longer runs (one killed with SIGKILL)."""
    removed = []
    for name in _namespaces():
        found = re.fullmatch(rf"{NAMESPACE_PREFIX}(\d+)-[sc]", name)
        if found and not _alive(int(found.group(1))):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
            removed.append(name)
    return removed


class LossyLink:
    """Two namespaces, ``server_namespace`` and ``client_namespace``, joined by a delaying, dropping relay.

    A context manager; ``run_in(namespace, command)`` prefixes a command to run on one side.
    """

    def __init__(self, rates: LinkRates, *, seed: int = 1) -> None:
        rates.check()
        self.rates = rates
        self.seed = seed
        tag = f"{NAMESPACE_PREFIX}{os.getpid()}"
        # One link per process at a time: the names carry the pid so that orphans can be told apart.
        self.server_namespace = f"{tag}-s"
        self.client_namespace = f"{tag}-c"
        self.server_address = SERVER_ADDRESS
        self.client_address = CLIENT_ADDRESS
        self._fds: list[int] = []
        self._made: list[str] = []
        # The relay is a process of its own, so that no interpreter lock in its user (a browser driver, a
        # test's threads) holds packets past their time. Rates and counts are shared with it.
        forked = multiprocessing.get_context("fork")
        self._rates = forked.Array("d", [rates.delay_s, rates.jitter_s, rates.loss])
        self._counts = forked.Array("q", [0] * 2 * len(DIRECTIONS), lock=False)  # passed, dropped per direction;
        # the relay is their one writer
        self._stop = forked.Event()
        self._relay: multiprocessing.process.BaseProcess | None = None

    def set_rates(self, rates: LinkRates) -> None:
        """New rates for packets read from now on (those already delayed keep their times)."""
        rates.check()
        self.rates = rates
        with self._rates.get_lock():
            self._rates[:] = [rates.delay_s, rates.jitter_s, rates.loss]

    def counts(self) -> dict[str, dict[str, int]]:
        """Packets passed and dropped in each direction so far."""
        values = self._counts[:]
        return {name: {"passed": values[2 * i], "dropped": values[2 * i + 1]} for i, name in enumerate(DIRECTIONS)}

    @staticmethod
    def run_in(namespace: str, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", namespace, *command]

    def __enter__(self) -> LossyLink:
        reason = unavailable_reason()
        if reason:
            raise LinkUnavailable(reason)
        remove_orphans()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _make(self) -> None:
        ends = [(self.server_namespace, self.server_address, self.client_address),
                (self.client_namespace, self.client_address, self.server_address)]
        for namespace, address, peer in ends:
            _ip("netns", "add", namespace)
            self._made.append(namespace)
            device = f"t{namespace}"[:15]
            # Made here and moved: its file descriptor keeps working from this (the root) namespace.
            self._fds.append(_open_tun(device))
            _ip("link", "set", device, "netns", namespace)
            _ip("link", "set", "lo", "up", namespace=namespace)
            # IPv4 only: no IPv6 neighbour or router traffic of its own on the link, so counts are the users'.
            subprocess.run(self.run_in(namespace, ["sysctl", "-qw", *IPV6_OFF]),
                           capture_output=True, check=False)
            _ip("link", "set", device, "mtu", str(MTU), "up", namespace=namespace)
            _ip("addr", "add", address, "peer", peer, "dev", device, namespace=namespace)
        server_fd, client_fd = self._fds
        directions = [
            Direction(0, server_fd, client_fd, random.Random(f"{self.seed}-{DIRECTIONS[0]}")),
            Direction(1, client_fd, server_fd, random.Random(f"{self.seed}-{DIRECTIONS[1]}")),
        ]
        self._relay = multiprocessing.get_context("fork").Process(
            target=self._run_relay, args=(directions,), name="lossy-link-relay", daemon=True
        )
        self._relay.start()

    def close(self) -> None:
        self._stop.set()
        if self._relay is not None:
            self._relay.join(timeout=5)
            if self._relay.is_alive():
                self._relay.kill()
                self._relay.join()
            self._relay = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, check=False)
        self._made = []

    def _run_relay(self, directions: list[Direction]) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the relay, then cleans up
        due: list[_Due] = []
        sequence = 0
        by_fd = {d.source: d for d in directions}
        counts = self._counts
        while not self._stop.is_set():
            now = time.monotonic()
            while due and due[0].at <= now:
                item = heapq.heappop(due)
                try:
                    os.write(item.target, item.packet)
                except OSError:
                    pass  # the device went down (closing) or its queue is full: a drop, as a real link's
            wait = IDLE_WAIT_S if not due else max(0.0, min(IDLE_WAIT_S, due[0].at - time.monotonic()))
            readable, _, _ = select.select(list(by_fd), [], [], wait)
            now = time.monotonic()
            delay_s, jitter_s, loss = self._rates[:]
            for fd in readable:
                direction = by_fd[fd]
                while True:
                    try:
                        packet = os.read(fd, READ_SIZE)
                    except (BlockingIOError, OSError):
                        break
                    if direction.rng.random() < loss:
                        counts[2 * direction.index + 1] += 1
                        continue
                    counts[2 * direction.index] += 1
                    jitter = direction.rng.uniform(-jitter_s, jitter_s) if jitter_s else 0.0
                    # Never before the packet read ahead of it: jitter without reordering.
                    at = max(now + max(0.0, delay_s + jitter), direction.last_due)
                    direction.last_due = at
                    heapq.heappush(due, _Due(at, sequence, direction.target, packet))
                    sequence += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=40.0, help="one way, each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform, +/- this, added to the delay")
    parser.add_argument("--loss", type=float, default=0.0, help="fraction of packets dropped, each direction")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rates = LinkRates(args.delay_ms / 1000, args.jitter_ms / 1000, args.loss)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        with LossyLink(rates, seed=args.seed) as link:
            print(f"server side: ip netns exec {link.server_namespace} ...  (address {link.server_address})")
            print(f"client side: ip netns exec {link.client_namespace} ...  (address {link.client_address})")
            print("Ctrl-C removes both namespaces.", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                print(f"\npackets: {link.counts()}")
    except LinkUnavailable as error:
        raise SystemExit(f"lossy_link: {error}") from None


if __name__ == "__main__":
    main()

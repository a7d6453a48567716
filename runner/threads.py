"""How many torch intra-op threads to use on a CPU host."""

from __future__ import annotations

import os


def default_torch_threads() -> int:
    """The cores nobody else is using now, less one, and at least one.

    torch's worker threads spin-wait for their peers; when any of them shares a
    core with another busy thread (the server's event loop, frame encoding, a
    second process), every parallel op waits for the slowest. Measured on a
    2-core host: tiny-world with 2 threads beside one busy process ran 7-17x
    slower than with 1 thread (0.79 vs 8.3 fps). So the count starts from the
    cores this process may run on and takes off what the 1-minute load average
    says other work already holds.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    free = int(cores - busy)
    return max(1, min(cores - 1, free))

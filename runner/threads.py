"""How many torch intra-op threads to use on a CPU host."""

from __future__ import annotations

import os


def default_torch_threads() -> int:
    """One core fewer than the machine has, at least one.

    torch's worker threads spin-wait for their peers; when any of them shares a
    core with another busy thread (the server's event loop, frame encoding, a
    second process), every parallel op waits for the slowest. Measured on a
    2-core host: tiny-world with 2 threads beside one busy process ran 7-17x
    slower than with 1 thread.
    """
    return max(1, (os.cpu_count() or 1) - 1)

"""app/memory.py: freed frame memory stays in the process instead of being faulted in afresh each round."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Frames made on one thread (the model worker) and freed on another (an encoder), round after round,
# counting the page faults of the rounds after a warm-up. Each variant runs in its own process, because
# the allocator's settings are process-wide.
ROUNDS = textwrap.dedent(
    """
    import resource, sys, threading
    import numpy as np
    from arstream.app.memory import keep_freed_memory

    if sys.argv[1] == "keep":
        assert keep_freed_memory()

    def rounds(n):
        held = []
        for _ in range(n):
            held.append([np.ones((352, 640, 3), np.uint8) for _ in range(8)])
            if len(held) > 2:
                freer = threading.Thread(target=held.pop(0).clear)
                freer.start()
                freer.join()

    def worker(result):
        rounds(5)  # warm-up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        rounds(40)
        result.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    result = []
    thread = threading.Thread(target=worker, args=(result,))  # one long-lived thread, as the model worker is
    thread.start()
    thread.join()
    print(result[0])
    """
)


def page_faults(variant: str) -> int:
    done = subprocess.run([sys.executable, "-c", ROUNDS, variant], capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


def test_kept_memory_is_reused_without_page_faults() -> None:
    default, kept = page_faults("default"), page_faults("keep")
    # 40 rounds of 8 x 660 KB frames: the default allocator faults pages back in (thousands); kept memory does not.
    assert kept * 4 < default, (kept, default)

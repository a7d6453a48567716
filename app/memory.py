"""Keep freed memory in the process, so the worker does not fault in fresh pages for every chunk.

Each round hands a chunk of frames per session from the model worker to the
encoder threads, which free them a few milliseconds later (640x352 frames
from 8 sessions are about 11 MB a round). glibc's malloc serves blocks that
large with ``mmap`` or returns them to the kernel on ``free`` (its thresholds
adapt only to blocks freed by the thread that allocated them), so the next
round's frames fault in and zero fresh pages: measured at about 5 ms of a
60 ms round on this CPU. Fixing both thresholds high keeps such blocks in the
allocator's free lists, so the process's resident memory stays at its
high-water mark instead (``--no-keep-freed-memory`` turns this off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("arstream.memory")

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 1024 * 2**20


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no glibc mallopt (%s): freed memory is returned as the C library decides", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))

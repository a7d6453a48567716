"""Model-neutral AR-diffusion runtime: paged KV pool, sessions, fail-closed forwards.

The names below are the runtime's public API (an out-of-tree model imports them
from here). They load on first use, so importing a light submodule
(``arstream.runner.types``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ARPipeline": "contract",
    "SupportsBatchedChunks": "contract",
    "SupportsWarmup": "contract",
    "SessionKVState": "kv_state",
    "write_and_gather_rows": "kv_state",
    "PagedKVPool": "pool",
    "PoolBudgetError": "pool",
    "plan_pool": "pool",
    "ARRunner": "runner",
    "RunnerStats": "stats",
    "RuntimeCounters": "stats",
    "KVBranch": "spec",
    "KVCacheSpec": "spec",
    "SpecError": "spec",
    "ChunkResult": "types",
    "RewindUnavailable": "types",
    "StartImage": "types",
    "TickFailure": "types",
    "TickRequest": "types",
    "TickResult": "types",
    "UnsupportedConfiguration": "types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

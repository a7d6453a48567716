"""Model-neutral AR-diffusion runtime: paged KV pool, sessions, fail-closed forwards."""

from arstream.runner.contract import ARPipeline, SupportsBatchedChunks, SupportsWarmup
from arstream.runner.kv_state import SessionKVState, write_and_gather_rows
from arstream.runner.pool import PagedKVPool, PoolBudgetError, plan_pool
from arstream.runner.runner import ARRunner, RunnerStats, UnsupportedConfiguration
from arstream.runner.spec import KVBranch, KVCacheSpec, SpecError
from arstream.runner.types import ChunkResult, TickFailure, TickRequest, TickResult

__all__ = [
    "ARPipeline",
    "ARRunner",
    "ChunkResult",
    "KVBranch",
    "KVCacheSpec",
    "PagedKVPool",
    "PoolBudgetError",
    "RunnerStats",
    "SessionKVState",
    "SpecError",
    "SupportsBatchedChunks",
    "SupportsWarmup",
    "TickFailure",
    "TickRequest",
    "TickResult",
    "UnsupportedConfiguration",
    "plan_pool",
    "write_and_gather_rows",
]

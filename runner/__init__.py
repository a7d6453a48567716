"""Model-neutral AR-diffusion runtime: paged KV pool, sessions, fail-closed forwards."""

from runner.contract import ARPipeline, SupportsWarmup
from runner.kv_state import SessionKVState
from runner.pool import PagedKVPool, PoolBudgetError, plan_pool
from runner.runner import ARRunner, RunnerStats, UnsupportedConfiguration
from runner.spec import KVBranch, KVCacheSpec, SpecError
from runner.types import ChunkResult, TickRequest

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
    "SupportsWarmup",
    "TickRequest",
    "UnsupportedConfiguration",
    "plan_pool",
]

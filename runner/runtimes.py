"""Which AR runtime drives a pipeline: ARStream's own :class:`ARRunner`, or vLLM-Omni's runner.

Both answer the interface the worker uses (:class:`Runtime`), so the server,
its sessions, stats and failures work the same on either. ``vllm-omni`` needs
the optional extra ``arstream[vllm-omni]``; see docs/vllm-omni.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .capabilities import SupportsParking
from .contract import ARPipeline
from .spec import KVCacheSpec
from .stats import RunnerStats, RuntimeCounters
from .types import (
    RUNTIMES,
    ChunkResult,
    RuntimeOptions,
    TickRequest,
    TickResult,
    UnsupportedConfiguration,
)
from .vllm_omni.native import NativePipeline, vllm_omni_available


class Runtime(Protocol):
    """What the server calls on a runtime: the worker's rounds and control jobs, the hub's load, a drain's check.

    Twelve members, each with a caller in ``app/``. The concrete runtimes have more (``execute_tick``,
    ``reset_session``, ``rewind_points``, ``resident_sessions``, the pool's ``spec`` and ``counters``) for
    tests, benches and snapshots, which hold the concrete class; a member joins this interface only when the
    server needs it from every runtime.
    """

    on_evict: Callable[[str], None] | None
    warmup_round_s: dict[int, float]

    @property
    def batch_limit(self) -> int:
        """The most sessions one :meth:`execute` call runs as one forward."""

    def warmup(self) -> int:
        """Run the pipeline's warm-up requests through the real path; leaves the pool as it was. Chunks run."""

    def model_card(self) -> dict[str, Any]: ...

    def prepare_prompt(self, prompt: str) -> str:
        """A client's prompt as the model reads it (contract.SupportsPromptPreparation); thread-safe."""

    def execute(self, ticks: Sequence[TickRequest]) -> list[TickResult]:
        """One round: a result for each tick, in order; a failed session fails alone."""

    def is_resident(self, session_id: str) -> bool: ...

    def next_chunk_index(self, session_id: str) -> int: ...

    def branch_session(self, source_id: str, boundary: int | None, new_session_id: str) -> int:
        """A new resident session continuing from ``source_id``'s boundary (shared blocks, copied model state);
        ``boundary`` None is where the source is now. Returns the boundary.

        Raises :class:`~arstream.runner.types.RewindUnavailable` if the boundary is not held (or the runtime
        cannot branch), the usual capacity error if there is no room; called on the worker thread.
        """

    def close_session(self, session_id: str) -> None: ...

    def stats(self) -> RunnerStats: ...


class InspectableRuntime(Runtime, Protocol):
    """:class:`Runtime` and what tests, benches and the conformance suite drive or read on either runtime
    (one tick at a time, the pool's figures); the server calls none of it."""

    spec: KVCacheSpec
    counters: RuntimeCounters
    blocks_free_at_start: int

    @property
    def session_capacity(self) -> int: ...

    def execute_tick(self, tick: TickRequest) -> ChunkResult:
        """One tick alone; raises what its forward raises."""

    def reset_session(self, session_id: str) -> None: ...

    def rewind_points(self, session_id: str) -> tuple[int, int] | None:
        """``(oldest, newest)`` chunk boundaries ``TickRequest.rewind_to`` may name now; None when rewind is off."""

    def resident_sessions(self) -> list[str]: ...


@runtime_checkable
class SplitDecodeRuntime(Protocol):
    """A runtime whose chunks may come back undecoded (``ChunkResult.pending``), for the worker's decode stage."""

    split_decode: bool
    device: torch.device

    def decode_chunks(self, results: Sequence[ChunkResult]) -> list[TickResult]:
        """Decode pending chunks; safe on another thread while ``execute`` runs."""

    def fail_session(self, session_id: str, reason: str = ...) -> None:
        """Release a session whose decode failed (on the runtime's thread)."""

    def complete_boundaries(self) -> None:
        """Rewind points recorded while a decode was in flight get its decoder state (on the runtime's thread)."""


class RuntimeClass(Protocol):
    """A runtime's class, as the table names it: it builds itself over a pipeline, refusing what it cannot run."""

    @classmethod
    def for_pipeline(cls, pipeline: Any, options: RuntimeOptions) -> InspectableRuntime:
        """An ARPipeline, or a NativePipeline for a runtime that serves those (``RuntimeEntry.serves_native``)."""


@dataclass(frozen=True)
class RuntimeEntry:
    """One row of :data:`RUNTIMES_BY_NAME`: where the class is (imported only when chosen: vllm-omni's
    module imports vLLM), and why it cannot run here, if it cannot (checked before that import)."""

    path: str  # "module:Class"
    unavailable: Callable[[], str | None] = lambda: None
    # whether it serves pipelines registered in vLLM-Omni itself (NativePipeline, ``vllm-omni:<name>``)
    serves_native: bool = False

    def load(self) -> RuntimeClass:
        module, _, name = self.path.partition(":")
        runtime_class: RuntimeClass = getattr(importlib.import_module(module), name)
        return runtime_class


def _vllm_omni_missing() -> str | None:
    if vllm_omni_available():
        return None
    return (
        "the vllm-omni runtime needs vLLM-Omni: pip install 'arstream[vllm-omni]' "
        "(then uninstall torchvision, torchaudio and torchcodec on a CPU torch; see docs/vllm-omni.md)"
    )


# ``--runtime NAME`` -> its class, as uvicorn finds its protocols (a name, then "module:Class").
RUNTIMES_BY_NAME: dict[str, RuntimeEntry] = {
    "arstream": RuntimeEntry("arstream.runner.runner:ARRunner"),
    "vllm-omni": RuntimeEntry(
        "arstream.runner.vllm_omni.entry:VllmOmniRuntime", unavailable=_vllm_omni_missing, serves_native=True
    ),
}


def build_runtime(name: str, pipeline: ARPipeline | NativePipeline, **options: Any) -> InspectableRuntime:
    """The runtime named ``name`` over ``pipeline``; ``options`` are :class:`~arstream.runner.types.RuntimeOptions`'
    fields. The server holds the result as a :class:`Runtime`.

    A :class:`NativePipeline` (``vllm-omni:<name>``, registered in vLLM-Omni itself) runs only on vllm-omni;
    rewind is ARRunner's only (vllm-omni refuses rewinds), and so is ``split_decode``.
    """
    entry = RUNTIMES_BY_NAME.get(name)
    if entry is None:
        raise UnsupportedConfiguration(f"unknown runtime {name!r}; expected one of {list(RUNTIMES)}")
    if (reason := entry.unavailable()) is not None:
        raise UnsupportedConfiguration(reason)
    if isinstance(pipeline, NativePipeline) and not entry.serves_native:
        raise UnsupportedConfiguration(
            f"model {pipeline.name!r} is a pipeline registered in vLLM-Omni: serve it with --runtime vllm-omni"
        )
    chosen = RuntimeOptions(**options)
    if len(chosen.devices) > 1:  # a replica over several devices (runner/distributed/)
        if name != "arstream":
            raise UnsupportedConfiguration(f"--devices: only the arstream runtime spans devices, not {name!r}")
        from .distributed.runtime import DistributedRuntime

        return DistributedRuntime.for_pipeline(pipeline, chosen)
    return entry.load().for_pipeline(pipeline, chosen)


def shard_planned_pipeline(pipeline: ARPipeline, world: int) -> KVCacheSpec:
    """Give a pipeline built on the meta device one rank's share of the heads of a replica over ``world`` devices,
    as each rank's is given (every rank holds the same share), so that its ``kv_cache_spec`` is what one device's
    pool holds; no process group is joined (a plan runs no forward). Returns the spec of every head (a share an
    earlier plan gave it is undone first). Refused, naming the counts, where ``world`` does not divide the heads,
    or the pipeline cannot split them."""
    from .distributed.sequence_parallel import SequenceParallel, check_heads_divide

    shard, unshard = getattr(pipeline, "shard_heads", None), getattr(pipeline, "unshard_heads", None)
    if callable(unshard):
        unshard()
    whole = pipeline.kv_cache_spec()
    if world == 1:
        return whole
    if not callable(shard):
        name = pipeline.model_card().get("name")
        raise UnsupportedConfiguration(
            f"model {name!r} cannot split its attention heads over devices (matrix-game-2, longlive and "
            "krea-realtime can)"
        )
    check_heads_divide(whole.num_kv_heads, world)
    shard(SequenceParallel(0, world))
    return whole


def park_session(runtime: Runtime | None, session_id: str) -> None:
    """Park one session in host memory now, where the runtime parks (:class:`SupportsParking`)."""
    if isinstance(runtime, SupportsParking):
        runtime.park_session(session_id)


def park_idle(runtime: Runtime | None) -> None:
    """Park the sessions idle past the runtime's ``park_after_s``, where the runtime parks."""
    if isinstance(runtime, SupportsParking):
        runtime.park_idle()

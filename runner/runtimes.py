"""Which AR runtime drives a pipeline: ARStream's own :class:`ARRunner`, or vLLM-Omni's runner.

Both answer the interface the worker uses (:class:`Runtime`), so the server,
its sessions, stats and failures work the same on either. ``vllm-omni`` needs
the optional extra ``arstream[vllm-omni]``; see docs/vllm-omni.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from arstream.runner.contract import ARPipeline
from arstream.runner.parking import ParkingPolicy
from arstream.runner.runner import ARRunner, rewind_for
from arstream.runner.spec import KVCacheSpec
from arstream.runner.stats import RunnerStats, RuntimeCounters
from arstream.runner.types import RUNTIMES, ChunkResult, TickRequest, TickResult, UnsupportedConfiguration
from arstream.runner.vllm_omni.native import NativePipeline, vllm_omni_available


class Runtime(Protocol):
    """What the worker, the hub and the benches call on a runner."""

    spec: KVCacheSpec
    counters: RuntimeCounters
    on_evict: Callable[[str], None] | None
    warmup_round_s: dict[int, float]

    @property
    def batch_limit(self) -> int: ...

    @property
    def session_capacity(self) -> int: ...

    def execute(self, ticks: Sequence[TickRequest]) -> list[TickResult]: ...

    def execute_tick(self, tick: TickRequest) -> ChunkResult: ...

    def reset_session(self, session_id: str) -> None: ...

    def close_session(self, session_id: str) -> None: ...

    def is_resident(self, session_id: str) -> bool: ...

    def next_chunk_index(self, session_id: str) -> int: ...

    def rewind_points(self, session_id: str) -> tuple[int, int] | None:
        """``(oldest, newest)`` chunk boundaries ``TickRequest.rewind_to`` may name now; None when rewind is off."""

    def branch_session(self, source_id: str, boundary: int | None, new_session_id: str) -> int:
        """A new resident session continuing from ``source_id``'s boundary (shared blocks, copied model state);
        ``boundary`` None is where the source is now. Returns the boundary.

        Raises :class:`~arstream.runner.types.RewindUnavailable` if the boundary is not held (or the runtime
        cannot branch), the usual capacity error if there is no room; called on the worker thread.
        """

    def resident_sessions(self) -> list[str]: ...

    def warmup(self) -> int: ...

    def stats(self) -> RunnerStats: ...

    def model_card(self) -> dict[str, Any]: ...


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


def build_runtime(
    name: str,
    pipeline: ARPipeline | NativePipeline,
    *,
    device: torch.device | str = "cpu",
    kv_budget_bytes: int | None = None,
    memory_fraction: float | None = None,
    max_batch_sessions: int = 1,
    rewind_seconds: float = 0.0,
    rewind_budget_bytes: int = 0,
    split_decode: bool = False,
    parking: ParkingPolicy | None = None,
) -> Runtime:
    """The runner named ``name`` over ``pipeline``, its pool built from the same budget settings.

    A :class:`NativePipeline` (``vllm-omni:<name>``, registered in vLLM-Omni itself) runs only on vllm-omni.
    ``rewind_seconds`` is how far back a session may rewind, in seconds of play, within
    ``rewind_budget_bytes`` per session (ARRunner only: vllm-omni refuses rewinds; docs/rewind.md).
    ``split_decode`` runs a pipeline's decode apart from its forward (ARRunner only; :class:`SplitDecodeRuntime`).
    ``parking`` moves idle sessions to host memory (ARRunner only: runner/parking.py; vllm-omni holds its own).
    """
    options: dict[str, Any] = dict(
        device=device,
        kv_budget_bytes=kv_budget_bytes,
        memory_fraction=memory_fraction,
        max_batch_sessions=max_batch_sessions,
    )
    if name == "arstream":
        if isinstance(pipeline, NativePipeline):
            raise UnsupportedConfiguration(
                f"model {pipeline.name!r} is a pipeline registered in vLLM-Omni: serve it with --runtime vllm-omni"
            )
        rewind = rewind_for(pipeline, seconds=rewind_seconds, budget_bytes=rewind_budget_bytes)
        return ARRunner(pipeline, rewind=rewind, split_decode=split_decode, parking=parking, **options)
    if name == "vllm-omni":
        if not vllm_omni_available():
            raise UnsupportedConfiguration(
                "the vllm-omni runtime needs vLLM-Omni: pip install 'arstream[vllm-omni]' "
                "(then uninstall torchvision, torchaudio and torchcodec on a CPU torch; see docs/vllm-omni.md)"
            )
        if isinstance(pipeline, NativePipeline):
            from arstream.runner.vllm_omni.native import build_native_runner

            return build_native_runner(pipeline, **options)
        from arstream.runner.vllm_omni.runtime import VllmOmniRunner

        return VllmOmniRunner(pipeline, **options)
    raise UnsupportedConfiguration(f"unknown runtime {name!r}; expected one of {list(RUNTIMES)}")


def park_session(runtime: Runtime | None, session_id: str) -> None:
    """Park one session in host memory now, where it can be (ARStream's runner only: other runtimes do not park)."""
    if isinstance(runtime, ARRunner):
        runtime.park_session(session_id)


def park_idle(runtime: Runtime | None) -> None:
    """Park the sessions idle past the runtime's ``park_after_s`` (ARStream's runner only)."""
    if isinstance(runtime, ARRunner):
        runtime.park_idle()

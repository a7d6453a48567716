"""VllmOmniRunner: vLLM-Omni's ``ARDiffusionModelRunner``, in-process, behind ARRunner's interface.

The worker drives a runner through a small interface (``execute``,
``execute_tick``, ``reset_session``, ``close_session``, ``is_resident``,
``warmup``, ``stats``, ``model_card``, ``batch_limit``, ``on_evict``).
This class answers it with vLLM-Omni's runner doing the work: the pool,
sessions, LRU eviction and fail-closed forwards are vLLM-Omni's own
(``load_model`` with the pipeline adapter, ``execute_model`` per tick with
the tick in its protocol, ``reset_session`` and ``close_session``). What it
adds is only what the server needs to observe: results per tick, eviction
notices, counters and pool statistics read from vLLM-Omni's block pool.

vLLM-Omni's runner serves one request per forward (``max_num_seqs=1``), so
there is no cross-session batching here: ``batch_limit`` is 1.

Where the two runtimes differ by design, this one behaves as vLLM-Omni does
(docs/vllm-omni.md lists the cases; the conformance suite asserts them): a
close hook that raises while a session is evicted fails the tick that needed
the room; a ``KeyboardInterrupt`` inside a forward leaves that session
resident with its uncommitted blocks; a forward that commits no chunk is
accepted.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..contract import ARPipeline, SupportsWarmup, prepare_prompt
from ..chunks import WARMUP_SESSION_ID
from ..spec import KVCacheSpec
from ..stats import RunnerStats, RuntimeCounters
from ..types import UnsupportedConfiguration
from ..types import ChunkResult, RewindUnavailable, TickFailure, TickRequest, TickResult
from .deprecations import ignoring_their_deprecations, importing_vllm

with importing_vllm():  # about 10 s and 0.9 GB
    from vllm.config import VllmConfig
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.experimental.ar_diffusion.kv_cache.config import ARDiffusionKVConfig
    from vllm_omni.experimental.ar_diffusion.runner import ARDiffusionModelRunner

    from .pipeline import adapter_class, to_omni_request

log = logging.getLogger("arstream.runner.vllm_omni")

RUNTIME = "vllm-omni"
REWIND_REFUSAL = (
    "the vllm-omni runtime cannot rewind or branch a session: vLLM-Omni's block pool has no shared "
    "(reference-counted) blocks to keep chunk boundaries in; serve with --runtime arstream for rewind and branch"
)

DEFAULT_CUDA_MEMORY_FRACTION = 0.9  # ARStream's default, so one setting means the same on both runtimes


def kv_config(
    device: torch.device, budget_bytes: int | None, memory_fraction: float | None
) -> tuple[int | None, ARDiffusionKVConfig]:
    """(byte budget, vLLM-Omni's KV config) for ARStream's budget settings, which mean the same on both runtimes.

    An explicit byte count, or a fraction of free device memory. vLLM-Omni
    sizes its pool from free device memory times a fraction; with a byte
    count the runner is told that count is what is free, at fraction 1.
    """
    if budget_bytes is None and device.type == "cpu":
        raise UnsupportedConfiguration("on cpu the KV budget must be given in bytes (no free-memory query)")
    fraction = 1.0 if budget_bytes is not None else (memory_fraction or DEFAULT_CUDA_MEMORY_FRACTION)
    return budget_bytes, ARDiffusionKVConfig(enable=True, gpu_memory_fraction=fraction)


def budgeted_runner_class(budget_bytes: int | None) -> type[ARDiffusionModelRunner]:
    """vLLM-Omni's runner, told the byte budget instead of querying free memory when one is given."""

    class BudgetedRunner(ARDiffusionModelRunner):  # type: ignore[misc]  # vllm-omni is untyped here (not installed)
        def _available_memory_bytes(self) -> int:
            return budget_bytes if budget_bytes is not None else super()._available_memory_bytes()

    return BudgetedRunner


def build_model_runner(
    pipeline: ARPipeline, *, device: torch.device, budget_bytes: int | None, memory_fraction: float | None
) -> Any:
    """vLLM-Omni's AR-Diffusion runner with ``pipeline`` loaded (through the adapter) and its pool built."""
    budget, config = kv_config(device, budget_bytes, memory_fraction)
    od_config = OmniDiffusionConfig(
        model_class_name="OmniPipelineAdapter",
        dtype=pipeline.kv_cache_spec().dtype,
        enforce_eager=True,  # no torch.compile / graph capture: the adapter's pipeline is eager
        model_config={"ar_diffusion_kv_config": config},
    )
    # Loading imports more of vLLM lazily; see ignoring_their_deprecations.
    with ignoring_their_deprecations():
        runner = budgeted_runner_class(budget)(VllmConfig(), od_config, device)
        runner.load_model(load_format="custom_pipeline", custom_pipeline_name=adapter_class(pipeline, device))
    return runner


class VllmOmniRunner:
    """ARRunner's interface over vLLM-Omni's ``ARDiffusionModelRunner``; see the module docstring."""

    batches = False
    batch_limit = 1

    def __init__(
        self,
        pipeline: ARPipeline,
        *,
        device: torch.device | str = "cpu",
        kv_budget_bytes: int | None = None,
        memory_fraction: float | None = None,
        max_batch_sessions: int = 1,
    ) -> None:
        if not isinstance(pipeline, ARPipeline):
            raise UnsupportedConfiguration(f"{type(pipeline).__name__} does not implement the ARPipeline contract")
        self.pipeline = pipeline
        if max_batch_sessions != 1:
            log.info("vllm-omni runs one session per forward; max_batch_sessions=%d is not used", max_batch_sessions)
        device = torch.device(device)
        model_runner = build_model_runner(
            pipeline, device=device, budget_bytes=kv_budget_bytes, memory_fraction=memory_fraction
        )
        self._attach(model_runner, pipeline.kv_cache_spec(), device)

    def _attach(self, model_runner: Any, spec: KVCacheSpec, device: torch.device) -> None:
        """Observe ``model_runner`` (loaded, its pool built) whose sessions have the geometry ``spec``."""
        self.device = device
        self.spec = spec
        self.model_runner = model_runner
        self.kv_cache = self.model_runner.kv_cache
        self.blocks_free_at_start = self.blocks_free
        self.counters = RuntimeCounters()
        self.on_evict: Callable[[str], None] | None = None
        # median seconds of one warm-up step, by sessions per step (always 1 here), filled by warmup()
        self.warmup_round_s: dict[int, float] = {}
        log.info(
            "vLLM-Omni KV pool: %d blocks of %d bytes (+%d scratch), capacity %d sessions, sink %d, window %d",
            self.blocks_total,
            self.block_bytes,
            self.kv_cache.scratch_num_blocks,
            self.session_capacity,
            self.spec.sink_frames,
            self.spec.window_frames,
        )

    # ---- pool and sessions (read from vLLM-Omni) ---------------------------------------

    @property
    def block_bytes(self) -> int:
        return self.kv_cache.spec.page_size_bytes * self.spec.num_layers

    @property
    def blocks_total(self) -> int:
        """Allocatable blocks: vLLM's block pool keeps one (the null block) for itself."""
        return self.kv_cache.managed_num_blocks - 1

    @property
    def blocks_free(self) -> int:
        return self.kv_cache.manager.block_pool.get_num_free_blocks()

    @property
    def session_capacity(self) -> int:
        return self.kv_cache.session_capacity

    def _sessions(self) -> dict[str, Any]:
        # vLLM-Omni keeps its sessions in LRU order in this OrderedDict; it has no public accessor.
        return self.model_runner._sessions

    def resident_sessions(self) -> list[str]:
        """Session ids from least to most recently used."""
        return list(self._sessions())

    def is_resident(self, session_id: str) -> bool:
        return session_id in self._sessions()

    def frames_committed(self, session_id: str) -> int:
        state = self._sessions().get(session_id)
        if state is None:
            return 0
        adapter = state.adapter(self.spec.branch_names[0])
        return adapter.absolute_num_computed_tokens // self.spec.tokens_per_frame

    def next_chunk_index(self, session_id: str) -> int:
        """The ``chunk_index`` the session's next chunk will have (0 when it is not resident: a new rollout)."""
        return self.frames_committed(session_id) // self.spec.frames_per_chunk

    def history_frames(self, session_id: str) -> int:
        """Frames of history the session's next chunk sees (0 for a session that is not resident)."""
        return min(self.frames_committed(session_id), self.spec.resident_frames)

    def reset_session(self, session_id: str) -> None:
        self.model_runner.reset_session(session_id)

    def close_session(self, session_id: str) -> None:
        self.model_runner.close_session(session_id)

    def rewind_points(self, session_id: str) -> tuple[int, int] | None:
        return None

    def branch_session(self, source_id: str, boundary: int | None, new_session_id: str) -> int:
        raise RewindUnavailable(REWIND_REFUSAL)

    # ---- execution ----------------------------------------------------------------

    def execute(self, ticks: Sequence[TickRequest]) -> list[TickResult]:
        """One result per tick, in order; each tick is one vLLM-Omni request (reset, forward, close)."""
        results: list[TickResult] = []
        for tick in ticks:
            try:
                results.append(self.execute_tick(tick))
            except Exception as exc:  # noqa: BLE001 - reported in the tick's place, as ARRunner does
                results.append(TickFailure(tick.session_id, tick.request_id, exc))
        return results

    def execute_tick(self, tick: TickRequest) -> ChunkResult:
        """Run one tick through ``execute_model``; raises what vLLM-Omni raises (its session then released)."""
        if tick.rewind_to is not None:  # before anything changes: the session stays as it is
            raise RewindUnavailable(REWIND_REFUSAL)
        before = self.resident_sessions()
        fresh = tick.reset or self.frames_committed(tick.session_id) == 0
        chunk_index = 0 if fresh else self.next_chunk_index(tick.session_id)
        started = time.perf_counter()
        try:
            output = self.model_runner.execute_model(self._request(tick, chunk_index))
            frames = self._frames(output, tick)
        except Exception:
            self.counters.failures_total += 1
            raise
        finally:
            self._notice_evictions(before, tick.session_id)
        compute_s = time.perf_counter() - started
        self.counters.chunks(compute_s)
        return ChunkResult(
            session_id=tick.session_id,
            request_id=tick.request_id,
            chunk_index=chunk_index,
            frames=frames,
            compute_s=compute_s,
            new_rollout=fresh,
            applied_event_ids=tick.applied_event_ids,
        )

    def _request(self, tick: TickRequest, chunk_index: int) -> Any:
        return to_omni_request(tick, chunk_index)

    def _frames(self, output: Any, tick: TickRequest) -> np.ndarray:
        """The chunk's frames from what ``execute_model`` returned (the adapter checked them in the forward)."""
        frames: np.ndarray = output.output.numpy()
        return frames

    def _notice_evictions(self, before: list[str], session_id: str) -> None:
        """Sessions that were resident before a tick and are gone after it (not the tick's own) were evicted."""
        resident = set(self.resident_sessions())
        for gone in before:
            if gone not in resident and gone != session_id:
                self.counters.evictions_total += 1
                if self.on_evict is not None:
                    self.on_evict(gone)

    def warmup(self) -> int:
        """Run the pipeline's warm-up ticks through ``execute_model``; return the chunks run.

        One synthetic session (vLLM-Omni runs one per forward), released
        afterwards; :attr:`warmup_round_s` keeps the median step for realtime
        admission, as ARRunner's does. The pool must end as it began.
        """
        ticks = self._warmup_ticks()
        if not ticks:
            return 0
        free_before = self.blocks_free
        steps: list[float] = []
        try:
            for tick in ticks:
                started = time.perf_counter()
                self.execute_tick(tick)
                steps.append(time.perf_counter() - started)
            if steps:
                self.warmup_round_s[1] = statistics.median(steps)
        finally:
            self.close_session(WARMUP_SESSION_ID)
            self.counters.forget_warmup()
        if self.blocks_free != free_before:
            raise RuntimeError(f"warm-up did not restore the KV pool (free {free_before} -> {self.blocks_free})")
        return len(steps)

    def _warmup_ticks(self) -> list[TickRequest]:
        if not isinstance(self.pipeline, SupportsWarmup):
            return []
        return list(self.pipeline.warmup_requests(WARMUP_SESSION_ID))

    def stats(self) -> RunnerStats:
        free = self.blocks_free
        return RunnerStats.build(
            spec=self.spec,
            counters=self.counters,
            blocks_total=self.blocks_total,
            blocks_free=free,
            blocks_used=self.blocks_total - free,
            scratch_blocks=self.kv_cache.scratch_num_blocks,
            block_bytes=self.block_bytes,
            pool_bytes=self.kv_cache.num_blocks_total * self.block_bytes,
            session_capacity=self.session_capacity,
            sessions_resident=len(self._sessions()),
            batch_limit=self.batch_limit,
        )

    def model_card(self) -> dict[str, Any]:
        """The pipeline's card without ``start_images``: a start image cannot travel in vLLM-Omni's tick."""
        card = {key: value for key, value in self.pipeline.model_card().items() if key != "start_images"}
        return {**card, "runtime": RUNTIME}

    def prepare_prompt(self, prompt: str) -> str:
        """A client's prompt as the model reads it (the server calls it as the prompt arrives, on its own thread)."""
        return prepare_prompt(self.pipeline, prompt)

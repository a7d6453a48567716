"""ARStream's CPU platform for vLLM and vLLM-Omni, so vLLM-Omni's AR-Diffusion runner runs in-process on CPU.

Both libraries pick their platform from entry-point plugins. On a host
without an accelerator neither finds one (the vLLM wheel is a CUDA build), and
their fallback "unspecified" platforms leave abstract the seven hooks the
diffusion runner calls on every load and forward: peak-memory bookkeeping
(``reset_peak_memory_stats``, ``max_memory_reserved``,
``max_memory_allocated``), the device barrier (``synchronize``), the free
memory that sizes the KV pool (``get_free_memory``), the load-time memory
profiler's ``get_current_memory_usage`` (asked of vLLM's platform) and
``supports_torch_inductor``; for vLLM-Omni's own pipelines (LingBot-World)
also the device count and process-group backend of its single-rank
distributed set-up, and the diffusion attention backend (omni_platform.py).
On CPU each has a plain answer: work is
synchronous, there is no caching allocator to report on, host memory is what
is free, and the runner runs eager.

This module imports only vLLM, not vLLM-Omni: vLLM may import it while it is
still resolving its own platform, before vLLM-Omni can be imported. The
vLLM-Omni platform (:mod:`arstream.runner.vllm_omni.omni_platform`) adds the
same hooks to vLLM-Omni's base class.
"""

from __future__ import annotations

import psutil
import torch
from vllm.platforms.interface import PlatformEnum, UnspecifiedPlatform


class CPUHooks:
    """The hooks, as class methods, for either library's platform class."""

    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    # The process group vLLM-Omni's model code needs (tensor/sequence-parallel groups of one rank) runs on gloo.
    dist_backend = "gloo"

    @classmethod
    def get_device_count(cls) -> int:
        """One device, the host: vLLM-Omni's distributed set-up maps ranks onto devices by this count."""
        return 1

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Nothing to select on the host."""

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def reset_peak_memory_stats(cls, device: torch.types.Device | None = None) -> None:
        """No allocator statistics on CPU: nothing to reset."""

    @classmethod
    def max_memory_reserved(cls, device: torch.types.Device | None = None) -> int:
        """Resident memory of this process (the closest CPU analogue of a reserved pool)."""
        return psutil.Process().memory_info().rss

    @classmethod
    def max_memory_allocated(cls, device: torch.types.Device | None = None) -> int:
        return psutil.Process().memory_info().rss

    @classmethod
    def synchronize(cls) -> None:
        """CPU kernels finish before they return: the barrier has nothing to wait for."""

    @classmethod
    def get_free_memory(cls, device: torch.types.Device | None = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device: torch.types.Device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(psutil.Process().memory_info().rss)

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False


class ARStreamCPUPlatform(CPUHooks, UnspecifiedPlatform):  # type: ignore[misc]  # vllm is untyped here (not installed)
    """vLLM's platform on a CPU-only host (``vllm.platform_plugins`` entry point)."""

    _enum = PlatformEnum.OOT

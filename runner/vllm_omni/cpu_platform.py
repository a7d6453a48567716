"""A vLLM-Omni platform for running its AR-Diffusion runner in-process on CPU.

vLLM-Omni's base platform leaves seven hooks abstract that its diffusion
runner calls on every load and forward: peak-memory bookkeeping
(``reset_peak_memory_stats``, ``max_memory_reserved``,
``max_memory_allocated``), the device barrier (``synchronize``), the free
memory that sizes the KV pool (``get_free_memory``), vLLM's
``get_current_memory_usage`` (the load-time memory profiler) and
``supports_torch_inductor``. On CPU each has a plain answer: work is
synchronous, there is no caching allocator to report on, host memory is what
is free, and the runner runs eager (no inductor compile on the serving path).
"""

from __future__ import annotations

import psutil
import torch
from vllm_omni.platforms.interface import OmniPlatformEnum, UnspecifiedOmniPlatform


class ARStreamCPUOmniPlatform(UnspecifiedOmniPlatform):
    """vLLM-Omni's unspecified (CPU) platform plus the hooks its runners need."""

    _omni_enum = OmniPlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def reset_peak_memory_stats(cls, device: torch.device | None = None) -> None:
        """No allocator statistics on CPU: nothing to reset."""

    @classmethod
    def max_memory_reserved(cls, device: torch.device | None = None) -> int:
        """Resident memory of this process (the closest CPU analogue of a reserved pool)."""
        return psutil.Process().memory_info().rss

    @classmethod
    def max_memory_allocated(cls, device: torch.device | None = None) -> int:
        return psutil.Process().memory_info().rss

    @classmethod
    def synchronize(cls) -> None:
        """CPU kernels finish before they return: the barrier has nothing to wait for."""

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(psutil.Process().memory_info().rss)

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

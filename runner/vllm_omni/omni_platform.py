"""vLLM-Omni's platform on a CPU-only host (``vllm_omni.platform_plugins`` entry point); see cpu_platform.py."""

from __future__ import annotations

from vllm.platforms.interface import PlatformEnum
from vllm_omni.platforms.interface import OmniPlatformEnum, UnspecifiedOmniPlatform

from arstream.runner.vllm_omni.cpu_platform import CPUHooks


class ARStreamCPUOmniPlatform(CPUHooks, UnspecifiedOmniPlatform):
    """vLLM-Omni's unspecified (CPU) platform plus the hooks its AR-Diffusion runner needs."""

    _omni_enum = OmniPlatformEnum.OOT
    _enum = PlatformEnum.OOT

"""vLLM-Omni's platform on a CPU-only host (``vllm_omni.platform_plugins`` entry point); see cpu_platform.py."""

from __future__ import annotations

from vllm.platforms.interface import PlatformEnum
from vllm_omni.platforms.interface import OmniPlatformEnum, UnspecifiedOmniPlatform

from arstream.runner.vllm_omni.cpu_platform import CPUHooks

# Imported by vLLM-Omni's attention selector when a layer is built (not here: the platform is still resolving).
CPU_ATTENTION_BACKEND = "arstream.runner.vllm_omni.cpu_attention.CPUSDPABackend"


class ARStreamCPUOmniPlatform(CPUHooks, UnspecifiedOmniPlatform):  # type: ignore[misc]  # vllm-omni untyped here
    """vLLM-Omni's unspecified (CPU) platform plus the hooks its AR-Diffusion runner and pipelines need."""

    _omni_enum = OmniPlatformEnum.OOT
    _enum = PlatformEnum.OOT

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        """The only diffusion attention the host runs (the base platform leaves this unimplemented)."""
        if selected_backend not in (None, "", "TORCH_SDPA", "SDPA"):
            raise ValueError(f"ARStream's CPU platform runs only SDPA attention, not {selected_backend!r}")
        return CPU_ATTENTION_BACKEND

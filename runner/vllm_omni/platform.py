"""Entry points for ``vllm.platform_plugins`` and ``vllm_omni.platform_plugins``: ARStream's CPU platform.

Each returns its platform's qualified name only where torch sees no CUDA
device, so GPU hosts keep vLLM's and vLLM-Omni's own CUDA platforms. This
module is cheap to import: both libraries load it while they resolve their
platform, before the platform class itself is imported.
"""

from __future__ import annotations

VLLM_PLATFORM = "arstream.runner.vllm_omni.cpu_platform.ARStreamCPUPlatform"
OMNI_PLATFORM = "arstream.runner.vllm_omni.omni_platform.ARStreamCPUOmniPlatform"


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def register_vllm() -> str | None:
    """vLLM's platform on a CPU-only host, else None (the plugin stays inactive)."""
    return VLLM_PLATFORM if _cpu_only() else None


def register_omni() -> str | None:
    """vLLM-Omni's platform on a CPU-only host, else None (the plugin stays inactive)."""
    return OMNI_PLATFORM if _cpu_only() else None

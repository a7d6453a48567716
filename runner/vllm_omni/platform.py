"""The ``vllm_omni.platform_plugins`` entry point: ARStream's CPU platform for vLLM-Omni.

vLLM-Omni picks its platform from plugins; with no accelerator it falls back to
an unspecified platform on which the AR-Diffusion runner cannot run (its memory
and synchronisation hooks are abstract). This plugin activates
:class:`~arstream.runner.vllm_omni.cpu_platform.ARStreamCPUOmniPlatform` only
where torch sees no CUDA device, so GPU hosts keep vLLM-Omni's own CUDA
platform. Importing this module is cheap: vLLM-Omni loads it while it resolves
its platform, before the platform class is imported.
"""

from __future__ import annotations

CPU_PLATFORM = "arstream.runner.vllm_omni.cpu_platform.ARStreamCPUOmniPlatform"


def register() -> str | None:
    """The platform's qualified name where this host has no CUDA device, else None (not activated)."""
    import torch

    if torch.cuda.is_available():
        return None
    return CPU_PLATFORM

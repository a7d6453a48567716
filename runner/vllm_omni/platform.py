"""Entry points for ``vllm.platform_plugins`` and ``vllm_omni.platform_plugins``: ARStream's CPU platform.

The plugins are installed with ARStream, so vLLM and vLLM-Omni call them in
any environment that has ARStream, for any program. They answer only for
ARStream's own runtime: each returns its platform's qualified name only after
:func:`activate_cpu_platform` ran in this process (ARStream's vllm-omni
runtime calls it before it imports vLLM) and only where torch sees no CUDA
device. Anywhere else (plain vLLM in the same environment, a GPU host) they
return None and vLLM's and vLLM-Omni's own platform resolution runs as if
ARStream were not installed.

This module is cheap to import: both libraries load it while they resolve
their platform, before the platform class itself is imported.
"""

from __future__ import annotations

VLLM_PLATFORM = "arstream.runner.vllm_omni.cpu_platform.ARStreamCPUPlatform"
OMNI_PLATFORM = "arstream.runner.vllm_omni.omni_platform.ARStreamCPUOmniPlatform"

_active = False


def activate_cpu_platform() -> None:
    """Let the plugins answer in this process; call before anything imports vLLM (it resolves its platform then)."""
    global _active
    _active = True


def _wanted() -> bool:
    if not _active:
        return False
    import torch

    return not torch.cuda.is_available()


def register_vllm() -> str | None:
    """vLLM's platform for ARStream's runtime on a CPU-only host, else None (the plugin stays inactive)."""
    return VLLM_PLATFORM if _wanted() else None


def register_omni() -> str | None:
    """vLLM-Omni's platform for ARStream's runtime on a CPU-only host, else None (the plugin stays inactive)."""
    return OMNI_PLATFORM if _wanted() else None

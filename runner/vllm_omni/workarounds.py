"""What vLLM-Omni 0.30.0 needs on a CPU-only host that it has no supported way for, each in one place.

Each is named after the vLLM-Omni behaviour it works around, and
``tests/vllm_omni_lane/test_vllm_omni_lingbot.py`` checks that behaviour is still there:
when vLLM-Omni changes it, that test fails and the workaround can go.
(The tests' tiny LingBot-World also needs its transformer config let through:
``tests/tiny_lingbot_world.py``. The other gaps have supported answers: the platform hooks, the attention
backend and the device count live in ARStream's CPU platform plugin, and the
process groups are made with vLLM-Omni's own calls in distributed.py.)
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from functools import partial
from typing import Any

import torch

TORCHVISION_STUB_REASON = (
    "torchvision is not importable here; ARStream put a stub in its place because vLLM-Omni's wan2_2 package, "
    "which LingBot-World imports, imports torchvision.transforms.functional at import time (LingBot never calls it)"
)


def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, TORCHVISION_STUB_REASON)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []

    def missing(attribute: str) -> Any:
        raise AttributeError(f"{name}.{attribute}: {TORCHVISION_STUB_REASON}")

    module.__getattr__ = missing  # type: ignore[method-assign]
    return module


def stub_torchvision_if_missing() -> bool:
    """Put an attribute-less torchvision in ``sys.modules`` when the real one does not import; True if it did.

    WORKAROUND (vLLM-Omni 0.30.0): ``vllm_omni.diffusion.models.wan2_2``
    imports ``torchvision.transforms.functional`` in its package ``__init__``,
    and LingBot-World's pipeline imports from that package. On a CPU host the
    registry's torchvision is a CUDA build that does not import beside the
    CPU torch (the vLLM-Omni lane uninstalls it). Any use of the stub raises
    with the reason; where torchvision imports, nothing is stubbed.
    """
    try:
        importlib.import_module("torchvision.transforms.functional")
        return False
    except (ImportError, OSError, RuntimeError):
        for name in list(sys.modules):
            if name == "torchvision" or name.startswith("torchvision."):
                del sys.modules[name]
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        sys.modules[name] = _stub_module(name)
    for parent, child in (("torchvision", "transforms"), ("torchvision.transforms", "functional")):
        setattr(sys.modules[parent], child, sys.modules[f"{parent}.{child}"])
    return True


def _rotary_per_head(rotary: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``RotaryEmbeddingWan.forward_native`` with cos/sin broadcast over the heads, as the CUDA kernel does."""
    return rotary.forward_native(x, cos.unsqueeze(-2), sin.unsqueeze(-2))


def fix_host_rotary(module: torch.nn.Module) -> int:
    """Give each of ``module``'s ``RotaryEmbeddingWan`` a host path that rotates per head; return how many.

    WORKAROUND (vLLM-Omni 0.30.0): ``RotaryEmbeddingWan.forward_native``, the
    path its custom-op dispatch takes on a platform without a kernel, treats
    cos/sin as ``[..., heads, head_dim / 2]`` while its callers (LingBot-World's
    attention) pass the ``[tokens, head_dim / 2]`` its CUDA and NPU kernels
    take: it fails to broadcast, or rotates wrongly when tokens == heads. Only
    this pipeline's modules are changed (their dispatched method), not the
    class; a module dispatched to a kernel is left alone.
    """
    with _importing():
        from vllm_omni.diffusion.layers.rope import RotaryEmbeddingWan
    fixed = 0
    for sub in module.modules():
        if isinstance(sub, RotaryEmbeddingWan) and sub._forward_method == sub.forward_native:
            sub._forward_method = partial(_rotary_per_head, sub)
            fixed += 1
    return fixed


def _importing() -> Any:
    from .deprecations import importing_vllm

    return importing_vllm()

"""The diffusion attention backend ARStream's CPU platform names (``get_diffusion_attn_backend_cls``)."""

from __future__ import annotations

from typing import Any

import torch
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CPUSDPAImpl(SDPAImpl):  # type: ignore[misc]  # vLLM-Omni is untyped (and absent outside its lane)
    """vLLM-Omni's SDPA attention, dispatched on the host.

    vLLM-Omni's ``AttentionImpl.forward`` picks a ``forward_<device>`` by
    platform and has no branch for an out-of-tree (CPU) platform: it raises
    ``NotImplementedError``. SDPA's CUDA method is plain
    ``torch.nn.functional.scaled_dot_product_attention``, which runs on any
    device, so the host uses it.
    """

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata: Any = None) -> Any:
        return self.forward_cuda(query, key, value, attn_metadata)


class CPUSDPABackend(SDPABackend):  # type: ignore[misc]  # as above
    """The SDPA backend with :class:`CPUSDPAImpl`: the answer this platform gives for diffusion attention."""

    @staticmethod
    def get_impl_cls() -> type[SDPAImpl]:
        return CPUSDPAImpl

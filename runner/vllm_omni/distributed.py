"""vLLM-Omni's distributed state for one in-process rank, set up the way its own diffusion worker does.

vLLM-Omni's model code (LingBot-World's parallel linear layers, its
sequence-parallel plan, its KV-transfer manager) asks for the world, tensor-
and sequence-parallel groups that ``DiffusionWorker.init_device`` creates in
each worker process. ARStream runs vLLM-Omni's runner in-process as a single
rank, so it makes the same two calls (``init_distributed_environment`` and
``initialize_model_parallel``, vLLM-Omni's own functions) for a world of one,
over a loopback TCP rendezvous on a free port and the platform's process-group
backend (gloo on ARStream's CPU platform). Once per process: the groups are
process-wide, and every runtime built later reuses them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .deprecations import importing_vllm

with importing_vllm():
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm_omni.diffusion.forward_context import set_forward_context


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def worker_context(vllm_config: Any, od_config: Any) -> Iterator[None]:
    """The config context vLLM-Omni's diffusion worker holds while it sets up and loads (layers read it when built)."""
    with (
        set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config),
        set_current_vllm_config(vllm_config),
    ):
        yield


def ensure_single_rank(vllm_config: Any, od_config: Any) -> None:
    """Create vLLM-Omni's process groups for a world of one rank, unless this process has them."""
    if model_parallel_is_initialized():
        return
    with worker_context(vllm_config, od_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}"
        )
        initialize_model_parallel()

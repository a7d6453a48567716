"""``--runtime vllm-omni``'s row of the runtime table: which of vLLM-Omni's runners serves a pipeline.

An ARStream pipeline runs through the adapter (:class:`~.runtime.VllmOmniRunner`); one registered in
vLLM-Omni itself (``vllm-omni:<name>``) is loaded by vLLM-Omni (:class:`~.native_runner.NativeOmniRunner`).
Rewind and the decode split are ARRunner's: either refuses rewinds when asked (RewindUnavailable).
"""

from __future__ import annotations

from ..contract import ARPipeline
from ..types import RuntimeOptions
from .native import NativePipeline
from .native_runner import NativeOmniRunner
from .runtime import VllmOmniRunner


class VllmOmniRuntime:
    """The class the runtime table names for ``vllm-omni``: it builds the runner that fits the pipeline."""

    @classmethod
    def for_pipeline(cls, pipeline: ARPipeline | NativePipeline, options: RuntimeOptions) -> VllmOmniRunner:
        if isinstance(pipeline, NativePipeline):
            return NativeOmniRunner(pipeline, **options.pool())
        return VllmOmniRunner(pipeline, **options.pool())

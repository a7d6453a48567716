"""vLLM-Omni as a runtime: ARStream's pipelines on vLLM-Omni's AR-Diffusion runner.

Importing this package is cheap; the submodules that import vllm_omni are imported only
when the vllm-omni runtime is chosen (the extra ``arstream[vllm-omni]`` installs it).
"""

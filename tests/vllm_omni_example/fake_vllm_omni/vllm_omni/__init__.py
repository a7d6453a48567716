"""A fake of vLLM-Omni for running its example client in tests (see tests/vllm_omni_example/NOTICE.md)."""

#!/usr/bin/env bash
# The vLLM-Omni lane (docs/vllm-omni.md): installs arstream[vllm-omni] into its own venv
# (.venv-vllm, about 6.4 GB), then runs the conformance suite against ARStream's runner and the
# server tests on --runtime vllm-omni. Called by CI (.ci/run) after the main suite; the main
# test command (scripts/test.sh) never installs vLLM. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
# torch pinned first so pip takes the local CPU build rather than a CUDA one.
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q -e ".[test,vllm-omni]"
# vllm pulls CUDA builds of these three; they fail to import beside the CPU torch, and
# vLLM-Omni imports them when they are present. Nothing here uses them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec

# One pytest run: the conformance suite and adapter tests, then the server tests with every
# server they start on the vllm-omni runtime (Settings reads ARSTREAM_RUNTIME), except the one
# about cross-session batching, which vLLM-Omni's runner does not do (one session per forward). -p imports the
# runtime (and so vLLM, about 10 s) once at start-up, before any test's start-up guard runs.
ARSTREAM_RUNTIME=vllm-omni exec "$VENV/bin/python" -m pytest -q -m "not browser" -p arstream.runner.vllm_omni.runtime \
    tests/server/test_conformance_vllm_omni.py tests/vllm_omni_lane/test_vllm_omni_adapter.py tests/vllm_omni_lane/test_vllm_omni_server.py \
    tests/vllm_omni_lane/test_vllm_omni_native.py tests/vllm_omni_lane/test_vllm_omni_lingbot.py \
    tests/server/test_server_flow.py tests/server/test_server_session.py tests/server/test_server_worker.py tests/server/test_resume.py \
    --deselect "tests/server/test_server_flow.py::test_a_round_of_sessions_runs_as_one_batch_and_a_failing_one_fails_alone" \
    "$@"

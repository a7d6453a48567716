"""The vLLM-Omni adapter's own pieces: spec conversion, ticks as requests, platforms, fail-closed chunk checks.

Needs vLLM-Omni (``scripts/test-vllm-omni.sh``); the main suite skips this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed; scripts/test-vllm-omni.sh runs these tests")

from arstream.models.fake import FakeKVPipeline  # noqa: E402
from arstream.runner.chunks import ChunkShapeError  # noqa: E402
from arstream.runner.types import UnsupportedConfiguration  # noqa: E402
from arstream.runner.runtimes import build_runtime  # noqa: E402
from arstream.runner.spec import KVBranch, KVCacheSpec  # noqa: E402
from arstream.runner.types import RewindUnavailable, TickFailure, TickRequest  # noqa: E402
from arstream.runner.vllm_omni import platform  # noqa: E402
from arstream.runner.vllm_omni.pipeline import tick_from_request, to_omni_request  # noqa: E402
from arstream.runner.vllm_omni.runtime import VllmOmniRunner  # noqa: E402
from arstream.runner.vllm_omni.spec import to_omni_spec  # noqa: E402

BUDGET = 8 << 20


def test_spec_converts_one_to_one() -> None:
    spec = KVCacheSpec(
        num_layers=3,
        num_kv_heads=2,
        head_size=8,
        tokens_per_frame=5,
        frames_per_chunk=3,
        sink_frames=2,
        window_frames=9,
        kv_branches=(KVBranch("cond", 0), KVBranch("uncond", 1)),
        session_capacity=7,
        model_owned_bytes_per_session=1234,
    )
    omni = to_omni_spec(spec)
    assert (omni.num_layers, omni.num_kv_heads, omni.head_size, omni.tokens_per_frame) == (3, 2, 8, 5)
    assert (omni.frames_per_block, omni.sink_frames, omni.window_frames) == (3, 2, 9)
    assert [(b.name, b.local_index) for b in omni.kv_branches] == [("cond", 0), ("uncond", 1)]
    assert (omni.session_capacity, omni.model_owned_state_bytes_per_session) == (7, 1234)


def test_cross_attention_specs_are_refused_with_the_reason() -> None:
    spec = KVCacheSpec(
        num_layers=1,
        num_kv_heads=1,
        head_size=4,
        tokens_per_frame=2,
        frames_per_chunk=1,
        sink_frames=0,
        window_frames=2,
        cross_attention_lengths={"text": 8},
    )
    with pytest.raises(UnsupportedConfiguration, match="cross-attention.*'text'"):
        to_omni_spec(spec)


@pytest.mark.parametrize(
    "declared", [{"history_rewrites": True}, {"model_owned_bytes_fixed": 1}, {"model_owned_bytes_per_forward_row": 1}]
)
def test_a_spec_whose_capacity_terms_vllm_omni_lacks_is_refused(declared: dict[str, Any]) -> None:
    spec = KVCacheSpec(
        num_layers=1, num_kv_heads=1, head_size=4, tokens_per_frame=2, frames_per_chunk=1, sink_frames=0,
        window_frames=2, **declared,
    )
    with pytest.raises(UnsupportedConfiguration, match="--runtime arstream"):
        to_omni_spec(spec)


def test_a_strided_window_is_refused_when_the_runtime_is_built() -> None:
    # vLLM-Omni keeps one contiguous window: it would show the model frames the spec drops
    pipeline = FakeKVPipeline(window_frames=4, strided_window_frames=12, frame_stride=3)
    with pytest.raises(UnsupportedConfiguration, match="cannot keep a strided window.*--runtime arstream"):
        build_runtime("vllm-omni", pipeline, kv_budget_bytes=BUDGET)


def test_a_tick_survives_vllm_omnis_tick_protocol() -> None:
    tick = TickRequest(
        session_id="s-1",
        request_id=42,
        controls={"keys": ["w", "a"], "camera": {"yaw": 0.5}},
        prompt="a forest",
        prompt_transition_chunks=2,  # rides beside vLLM-Omni's tick (its protocol has no field for it)
        seed=9,
        reset=True,
        close=True,
        applied_event_ids=(3, 4),
    )
    request = to_omni_request(tick, chunk_index=5)
    assert request.sampling_params.extra_args["ar_diffusion_tick"]["chunk_index"] == 5
    assert tick_from_request(request) == tick


def test_both_libraries_run_on_arstreams_cpu_platform() -> None:
    from vllm import platforms as vllm_platforms
    from vllm_omni.platforms import current_omni_platform

    from arstream.runner.vllm_omni.cpu_platform import ARStreamCPUPlatform
    from arstream.runner.vllm_omni.omni_platform import ARStreamCPUOmniPlatform

    assert platform.register_vllm() == platform.VLLM_PLATFORM
    assert platform.register_omni() == platform.OMNI_PLATFORM
    assert isinstance(current_omni_platform, ARStreamCPUOmniPlatform)
    assert isinstance(vllm_platforms.current_platform, ARStreamCPUPlatform)
    assert current_omni_platform.get_free_memory() > 0 and not current_omni_platform.supports_torch_inductor()


def test_the_plugins_answer_only_after_arstreams_runtime_activated_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "_active", False)
    assert platform.register_vllm() is None and platform.register_omni() is None


def test_plain_vllm_resolves_its_own_platform_with_arstream_installed() -> None:
    """A program that is not ARStream's runtime gets vLLM's and vLLM-Omni's own platforms, not ARStream's."""
    import subprocess
    import sys

    code = (
        "from vllm.platforms import current_platform as p\n"
        "from vllm_omni.platforms import current_omni_platform as o\n"
        "print(type(p).__module__, type(p).__name__, type(o).__module__, type(o).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    vllm_module, vllm_name, omni_module, omni_name = done.stdout.split()[-4:]
    assert not vllm_module.startswith("arstream") and not omni_module.startswith("arstream"), done.stdout
    assert vllm_module.startswith("vllm.") and omni_module.startswith("vllm_omni."), done.stdout


def test_the_factory_builds_either_runtime_and_names_the_choices() -> None:
    assert isinstance(build_runtime("vllm-omni", FakeKVPipeline(), kv_budget_bytes=BUDGET), VllmOmniRunner)
    with pytest.raises(UnsupportedConfiguration, match="expected one of"):
        build_runtime("vllm", FakeKVPipeline(), kv_budget_bytes=BUDGET)


class WrongFramesPipeline(FakeKVPipeline):
    """Test fake: returns one frame too few when the controls say so."""

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        frames = super().generate_chunk(tick)
        return frames[:-1] if tick.controls.get("short") else frames


def test_a_wrong_chunk_fails_closed_and_the_pool_comes_back() -> None:
    pipeline = WrongFramesPipeline()
    runner = VllmOmniRunner(pipeline, kv_budget_bytes=BUDGET)
    assert runner.warmup() == 3 and runner.stats().blocks_free == runner.blocks_free_at_start
    runner.execute_tick(TickRequest(session_id="s", request_id=0))
    controls: dict[str, Any] = {"short": True}
    (result,) = runner.execute([TickRequest(session_id="s", request_id=1, controls=controls)])
    assert isinstance(result, TickFailure) and isinstance(result.error, ChunkShapeError)
    assert not runner.is_resident("s") and runner.stats().blocks_free == runner.blocks_free_at_start
    assert pipeline.events[-1] == ("close", "s") and runner.stats().failures_total == 1


def test_rewind_and_branch_are_refused_with_the_reason_and_change_nothing() -> None:
    runner = VllmOmniRunner(FakeKVPipeline(), kv_budget_bytes=BUDGET)
    runner.execute_tick(TickRequest(session_id="s", request_id=0))
    free = runner.stats().blocks_free
    assert runner.rewind_points("s") is None
    (result,) = runner.execute([TickRequest(session_id="s", request_id=1, rewind_to=0)])
    assert isinstance(result, TickFailure) and isinstance(result.error, RewindUnavailable)
    assert "cannot rewind or branch" in str(result.error) and "--runtime arstream" in str(result.error)
    with pytest.raises(RewindUnavailable, match="cannot rewind or branch"):
        runner.branch_session("s", 1, "b")
    assert runner.next_chunk_index("s") == 1 and not runner.is_resident("b") and runner.stats().blocks_free == free


def test_bench_runner_compares_the_two_runtimes(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from arstream.cli import main

    assert main(["bench", "runner", "--runtime", "vllm-omni", "--chunks", "3", "--repeats", "2", "--threads", "1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["runtime"] == "vllm-omni" and summary["repeats"] == 2
    assert summary["vllm_omni_ms_per_chunk"] > 0 and summary["arstream_ms_per_chunk"] > 0
    assert summary["vllm_omni_over_arstream_ratio"] > 0

"""LingBot-World, vLLM-Omni's own world model, served by ``--runtime vllm-omni`` (a tiny random-weight checkpoint).

The checkpoint (``tests/tiny_lingbot_world.py``) is the published layout at
tiny sizes; vLLM-Omni builds, loads and runs it (its pre-processing, its
runner, its per-session streaming decoder). Then: each workaround of
runner/vllm_omni/workarounds.py and lingbot.py against the vLLM-Omni
behaviour it exists for, so a vLLM-Omni that changes the behaviour fails here.

Needs vLLM-Omni (``scripts/test-vllm-omni.sh``); the main suite skips this module.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed; scripts/test-vllm-omni.sh runs these tests")

from arstream.runner.vllm_omni.workarounds import fix_host_rotary, stub_torchvision_if_missing  # noqa: E402

stub_torchvision_if_missing()  # before the pipeline module imports: its wan2_2 sibling imports torchvision

from PIL import Image  # noqa: E402
from servers import fake_settings, running_server, session_client  # noqa: E402
from tiny_lingbot_world import (  # noqa: E402
    HEIGHT,
    TRANSFORMER,
    WIDTH,
    build_tiny_lingbot_world,
    tiny_transformers_allowed,
)
from vllm_omni.diffusion.models.lingbot_world import pipeline as lingbot_pipeline  # noqa: E402
from vllm_omni.diffusion.models.lingbot_world.transformer import CausalLingBotWorldTransformer3DModel  # noqa: E402

from arstream.models.registry import load_pipeline  # noqa: E402
from arstream.runner.runtimes import build_runtime  # noqa: E402
from arstream.runner.types import TickFailure, TickRequest  # noqa: E402
from arstream.runner.vllm_omni.native_runner import NativeOmniRunner  # noqa: E402
from arstream.runner.vllm_omni.spec import omni_session_bytes, omni_session_capacity  # noqa: E402

NAME = "vllm-omni:LingBotWorldCausalDMDPipeline"
BUDGET = 256 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lingbot_world(tmp_path_factory.mktemp("lingbot-world"))


@pytest.fixture(scope="module")
def options(checkpoint: Path) -> dict[str, Any]:
    return {"model": str(checkpoint), "height": HEIGHT, "width": WIDTH}


@pytest.fixture
def runner(options: dict[str, Any]) -> Iterator[NativeOmniRunner]:
    with tiny_transformers_allowed():
        built = build_runtime("vllm-omni", load_pipeline(NAME, **options), kv_budget_bytes=BUDGET)
    assert isinstance(built, NativeOmniRunner)
    yield built


def _png(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


async def _rollout(
    url: str, keys: list[list[str]], start: dict[str, Any]
) -> list[tuple[dict[str, Any], list[np.ndarray]]]:
    chunks = []
    async with session_client(url, start={"seed": 11, "codec": "raw", **start}) as client:
        for tick_id, held in enumerate(keys, start=1):
            await client.send(type="tick", tick_id=tick_id, controls={"keys": held})
            chunk, decoded = await client.recv_chunk()
            chunks.append((chunk, [pixels for _header, pixels in decoded]))
    return chunks


def test_lingbot_world_is_served_over_the_wire_and_close_frees_the_pool(options: dict[str, Any]) -> None:
    settings = fake_settings(model=NAME, model_options=options, runtime="vllm-omni", kv_budget_bytes=BUDGET)
    keys = [["w"], ["w", "j"], ["a"], [], ["d", "i"]]
    picture = np.zeros((40, 90, 3), dtype=np.uint8)
    picture[:, 45:] = 255  # a client's own start picture, any size: LingBot resizes it
    with tiny_transformers_allowed(), running_server(settings) as server:
        card = server.get("/v1/model").json()
        assert card["runtime"] == "vllm-omni" and card["name"] == NAME
        assert (card["width"], card["height"], card["fps"]) == (WIDTH, HEIGHT, 16)
        assert (card["first_chunk_frames"], card["frames_per_chunk"]) == (9, 12)
        assert card["start_images"] == ["horizon"] and card["reads_prompt"] is True
        assert set(card["controls"]["properties"]["keys"]["items"]["enum"]) == set("wasdijkl")
        kv = server.stats()["kv"]
        # vLLM-Omni's pool, sized from the pipeline's own spec: its session limit (2) binds at this budget.
        assert kv["session_capacity"] == 2 and kv["sink_frames"] == TRANSFORMER["sink_size"]
        free_at_start = kv["blocks_free"]

        default = asyncio.run(_rollout(server.ws_url, keys, {}))
        own = asyncio.run(_rollout(server.ws_url, keys[:2], {"image": {"data": _png(picture)}}))
        stats = server.settled(free_at_start)

    assert [chunk["chunk_index"] for chunk, _ in default] == list(range(len(keys)))
    assert [len(frames) for _, frames in default] == [9] + [12] * (len(keys) - 1)
    assert all(f.shape == (HEIGHT, WIDTH, 3) and f.dtype == np.uint8 for _, frames in default for f in frames)
    # the conditioning picture is the session's: another picture, other frames from the first chunk on
    assert not np.array_equal(default[0][1][0], own[0][1][0])
    assert stats["chunks"]["total"] >= len(keys) + 2 and stats["kv"]["sessions_resident"] == 0


def test_chunks_continue_the_rollout_and_reset_starts_it_again(runner: NativeOmniRunner) -> None:
    free = runner.blocks_free
    ticks = [TickRequest(session_id="s", request_id=i, seed=3, controls={"keys": ["w"]}) for i in range(3)]
    first = [runner.execute_tick(tick) for tick in ticks]
    assert [r.chunk_index for r in first] == [0, 1, 2] and [len(r.frames) for r in first] == [9, 12, 12]
    again = runner.execute_tick(TickRequest(session_id="s", request_id=3, seed=3, controls={"keys": ["w"]}, reset=True))
    assert again.chunk_index == 0 and again.new_rollout and np.array_equal(again.frames, first[0].frames)
    runner.execute_tick(TickRequest(session_id="s", request_id=4, seed=3, close=True))
    assert not runner.is_resident("s") and runner.blocks_free == free
    assert runner.ticks.pipeline._streaming_decode_states == {}


def test_a_failed_decode_closes_the_session(runner: NativeOmniRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    free = runner.blocks_free
    runner.execute_tick(TickRequest(session_id="s", request_id=0, seed=3))

    def broken_decode(latents: torch.Tensor, *, session_id: str | None = None) -> np.ndarray:
        raise RuntimeError("decoder failed (test fake)")

    monkeypatch.setattr(runner.ticks.pipeline, "_decode_chunk_to_pixels", broken_decode)
    (result,) = runner.execute([TickRequest(session_id="s", request_id=1, seed=3)])
    assert isinstance(result, TickFailure) and "decoder failed" in str(result.error)
    assert not runner.is_resident("s") and runner.blocks_free == free and runner.stats().failures_total == 1
    assert "s" not in runner.ticks.pipeline._ar_sessions


def test_capacity_is_vllm_omnis_from_the_real_kv_size_and_the_pipelines_session_limit(
    options: dict[str, Any],
) -> None:
    with tiny_transformers_allowed():
        native = load_pipeline(NAME, **options)
        roomy = build_runtime("vllm-omni", native, kv_budget_bytes=BUDGET)
        spec = roomy.spec
        assert roomy.session_capacity == spec.session_capacity == 2  # LingBot's own limit binds
        one = omni_session_bytes(spec)
        tight = build_runtime("vllm-omni", native, kv_budget_bytes=2 * one)  # fixed part + one session, not two
    assert omni_session_capacity(spec, 2 * one) == tight.session_capacity == 1
    # The same arithmetic at the published checkpoint's geometry (docs/vllm-omni.md): 21.4 GiB of KV a session.
    full = replace(spec, num_layers=40, num_kv_heads=40, head_size=128, tokens_per_frame=1560, dtype=torch.bfloat16,
                   sink_frames=9, window_frames=9, cross_attention_lengths={}, model_owned_bytes_per_session=0)
    assert round(omni_session_bytes(full) / 2**30, 1) == 21.4


def test_dreamzero_is_refused_with_the_reason(tmp_path: Path) -> None:
    native = load_pipeline("vllm-omni:DreamZeroPipeline", model=str(tmp_path))
    with pytest.raises(Exception, match="robot policy|does not import here"):
        build_runtime("vllm-omni", native, kv_budget_bytes=BUDGET)


# ---- each workaround against the vLLM-Omni behaviour it is for -------------------------------


def test_request_mode_ticks_still_return_only_latents(runner: NativeOmniRunner) -> None:
    """lingbot.decode_chunk calls the private per-session decode because request-mode ticks stop at latents."""
    request = runner.ticks.request(TickRequest(session_id="p", request_id=0, seed=1), chunk_index=0)
    request.sampling_params.output_type = "np"
    with pytest.raises(ValueError, match="output_type='latent'"):
        runner.model_runner.execute_model(request)
    assert callable(lingbot_pipeline.LingBotWorldCausalDMDPipeline._decode_chunk_to_pixels)


def test_the_transformer_still_accepts_only_the_14b_config() -> None:
    """tests/tiny_lingbot_world.py lets the tiny config through because from_config refuses it."""
    with pytest.raises(ValueError, match="LingBot checkpoint config"):
        CausalLingBotWorldTransformer3DModel.from_config(TRANSFORMER)


def test_wan2_2_still_imports_torchvision() -> None:
    """The torchvision stub exists because LingBot's wan2_2 sibling imports it at import time."""
    import vllm_omni.diffusion.models.wan2_2 as wan2_2

    source = (Path(wan2_2.__file__).parent / "pipeline_wan2_2_i2v.py").read_text()
    assert "import torchvision.transforms.functional" in source


def test_the_host_rotary_path_still_misbroadcasts_and_the_fix_rotates_per_head() -> None:
    from vllm_omni.diffusion.layers.rope import RotaryEmbeddingWan

    tokens, heads, dim = 5, 3, 8
    x = torch.randn(1, tokens, heads, dim)
    angle = torch.randn(tokens, dim // 2)
    rotary = RotaryEmbeddingWan(is_neox_style=False, half_head_dim=True)
    with pytest.raises(RuntimeError):
        rotary.forward_native(x, angle.cos(), angle.sin())
    assert fix_host_rotary(rotary) == 1
    pairs = torch.view_as_complex(x.reshape(1, tokens, heads, dim // 2, 2))
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)[None, :, None]).flatten(-2)
    torch.testing.assert_close(rotary(x, angle.cos(), angle.sin()), expected)


def test_vllm_omnis_attention_still_has_no_host_dispatch() -> None:
    """ARStream's CPU platform names its own SDPA backend because vLLM-Omni's dispatch raises on the host."""
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

    from arstream.runner.vllm_omni.cpu_attention import CPUSDPAImpl

    q, k, v = (torch.randn(1, 6, 2, 4) for _ in range(3))
    with pytest.raises(NotImplementedError):
        SDPAImpl(num_heads=2, head_size=4, softmax_scale=0.5).forward(q, k, v)
    out = CPUSDPAImpl(num_heads=2, head_size=4, softmax_scale=0.5).forward(q, k, v)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.5
    )
    torch.testing.assert_close(out, reference.transpose(1, 2))

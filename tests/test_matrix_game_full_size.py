"""The published geometry (1.3b config, 352x640, 880 tokens per latent frame) on the meta device: shapes only.

The CPU cannot run 1.3B parameters in a test, but tensors without storage
can: two sessions batched through the paged runner state for three chunks
(the window full, then sliding), and the VAE decoder cache a session holds.
"""

import torch

from arstream.models.matrix_game.config import get_config
from arstream.models.matrix_game.controls import extend, windows
from arstream.models.matrix_game.dit import CausalWanDiT
from arstream.models.matrix_game.kv import ActionHistory, PagedChunkContext, action_history_bytes
from arstream.models.wan.sampler import sample_chunk
from arstream.models.wan.vae import StreamingVAE, build_vae, cache_bytes
from arstream.runner.kv_state import SessionKVState
from arstream.runner.pool import PagedKVPool, plan_pool
from arstream.runner.spec import KVCacheSpec

META = torch.device("meta")


def test_the_1_3b_dit_runs_batched_rows_through_the_paged_state() -> None:
    cfg = get_config("1.3b")
    with META:
        model = CausalWanDiT(cfg).to(torch.bfloat16)
    assert 1.6e9 < sum(p.numel() for p in model.parameters()) < 1.65e9  # Wan2.1-1.3B + 15 action modules
    spec = KVCacheSpec(
        num_layers=30, num_kv_heads=12, head_size=128, tokens_per_frame=880, frames_per_chunk=3,
        sink_frames=0, window_frames=6, dtype=torch.bfloat16, max_position_frames=1024,
    )  # fmt: skip
    assert spec.block_bytes == 2 * 30 * 880 * 1536 * 2
    pool = PagedKVPool(spec, plan_pool(spec, 8 << 30, max_batch_sessions=2), META)
    states = [SessionKVState(pool, "a"), SessionKVState(pool, "b")]
    histories = [ActionHistory(), ActionHistory()]
    controls = extend(None, {"keys": ["w"]}, cfg.first_chunk_frames, cfg)
    shape = (2, 16, 3, 44, 80)
    with torch.inference_mode():
        context = model.image_context(torch.zeros(2, 257, 1280, device=META, dtype=torch.bfloat16))
        for chunk in range(3):
            if chunk:
                controls = extend(controls, {"keys": ["a"], "camera": {"yaw": 0.1}}, cfg.video_frames_per_chunk, cfg)
            for row, state in enumerate(states):
                state.prepare_forward(staging_row=row, hold_commit=True)
            ctx = PagedChunkContext(states, histories, cfg)
            mouse, keyboard = windows(controls, range(3 * chunk, 3 * chunk + 3), cfg)
            cond = torch.zeros(2, 20, 3, 44, 80, device=META)
            mouse_in, keyboard_in = mouse[None].expand(2, -1, -1).to(META), keyboard[None].expand(2, -1, -1, -1).to(META)
            latents = sample_chunk(
                lambda x, t: model(x, t, cond, context, mouse_in, keyboard_in, ctx),  # noqa: B023 - called in this pass
                ctx, torch.zeros(shape, device=META), lambda: torch.zeros(shape, device=META),
                cfg.denoise_timesteps, cfg.timestep_shift,
            )  # fmt: skip
            histories = ctx.updated_histories()
            for state in states:
                state.accept_chunk()
            assert latents.shape == shape
    assert [s.history_frames() for s in states] == [3, 3]
    assert histories[0].frames == 3 and histories[0].nbytes() == action_history_bytes(cfg, torch.bfloat16)
    mouse_k = histories[0].layers[0][0]
    assert mouse_k.shape == (880, 3, 16, 64)


def test_a_sessions_vae_cache_at_352x640() -> None:
    cfg = get_config("1.3b")
    with META:
        vae = StreamingVAE(build_vae(cfg).to(torch.bfloat16))
        latents = torch.zeros(1, 16, 3, 44, 80)
        first, cache = vae.decode(latents, None)
        later, cache = vae.decode(latents, cache)
    assert first.shape == (1, 3, 9, 352, 640) and later.shape == (1, 3, 12, 352, 640)
    assert 1000 * 2**20 < cache_bytes(cache) < 1040 * 2**20  # about 1 GB per session in bf16


def test_the_clip_vision_tower_gives_257_tokens_of_1280() -> None:
    from arstream.models.matrix_game.clip import ClipImageEncoder

    cfg = get_config("1.3b")
    with META:
        encoder = ClipImageEncoder(cfg.clip)
        tokens = encoder.encode(torch.zeros(3, cfg.height, cfg.width))
    assert tokens.shape == (257, 1280)
    assert 6.3e8 < sum(p.numel() for p in encoder.parameters()) < 6.4e8  # ViT-H/14's vision tower


def test_the_gta_variant_takes_two_keys_and_keeps_one_history_frame() -> None:
    from arstream.models.matrix_game.controls import controls_schema

    cfg = get_config("1.3b-gta")
    assert controls_schema(cfg)["properties"]["keys"]["items"]["enum"] == ["w", "s"]
    assert cfg.local_attn_size - cfg.frames_per_chunk == 1
    with META:
        model = CausalWanDiT(cfg)
    assert model.state_dict()["blocks.0.action_model.keyboard_embed.0.weight"].shape == (128, 2)

"""Block math against an independent implementation: diffusers' WanTransformer3DModel with the same weights.

The action module has no counterpart in diffusers, so the oracle model has
none (``action.blocks=()``); everything else of a full-sequence forward is
compared: patch embedding, timestep embedding and projection, 3-D rotary
positions, modulation, qk RMS norms, self- and cross-attention, FFN, output
head and unpatchify. Matrix-Game cross-attends to the image context (the CLIP
projection, ``img_emb``), which is fed to diffusers' blocks as they are.
"""

import pytest
import torch
from diffusers import WanTransformer3DModel

from arstream.models.matrix_game.config import ActionConfig, get_config
from arstream.models.matrix_game.dit import CausalWanDiT


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


class FullSequence:
    """Every frame sees every frame: a plain bidirectional forward, as diffusers' model runs it."""

    self_mask = None
    action_mask = None

    def __init__(self, frames: int) -> None:
        self.query_positions = self.key_positions = self.action_key_positions = torch.arange(frames)[None]

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


def diffusers_state(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (Wan original) parameter names -> diffusers' names; ``img_emb`` has no counterpart."""
    renames = [  # first match wins
        ("head.head.", "proj_out."),
        ("head.modulation", "scale_shift_table"),
        ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
        ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
        ("time_projection.1.", "condition_embedder.time_proj."),
        (".self_attn.o.", ".attn1.to_out.0."),
        (".cross_attn.o.", ".attn2.to_out.0."),
        (".self_attn.norm_", ".attn1.norm_"),
        (".cross_attn.norm_", ".attn2.norm_"),
        (".self_attn.", ".attn1.to_"),
        (".cross_attn.", ".attn2.to_"),
        (".norm3.", ".norm2."),
        (".ffn.0.", ".ffn.net.0.proj."),
        (".ffn.2.", ".ffn.net.2."),
        (".modulation", ".scale_shift_table"),
    ]
    out = {}
    for key, value in ours.items():
        if key.startswith("img_emb."):
            continue
        for old, new in renames:
            if old in key:
                key = key.replace(old, new)
                break
        out[key] = value
    return out


def test_full_sequence_forward_equals_diffusers_wan_transformer() -> None:
    cfg = get_config("tiny", action=ActionConfig(blocks=()))
    ours = CausalWanDiT(cfg)
    ours.init_random(11)
    theirs = WanTransformer3DModel(
        patch_size=cfg.patch_size,
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_dim,
        out_channels=cfg.out_dim,
        text_dim=cfg.dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=cfg.eps,
        rope_max_seq_len=cfg.rope_frames,
    ).eval()
    theirs.condition_embedder.text_embedder = torch.nn.Identity()  # the context comes in projected already
    theirs.load_state_dict(diffusers_state(ours.state_dict()), strict=True)

    generator = torch.Generator().manual_seed(3)
    frames = 5
    x = torch.randn(1, 16, frames, cfg.latent_height, cfg.latent_width, generator=generator)
    cond = torch.randn(1, 20, frames, cfg.latent_height, cfg.latent_width, generator=generator)
    clip = torch.randn(1, cfg.clip_tokens, cfg.clip_dim, generator=generator)
    mouse = torch.zeros(1, frames, 1)
    keyboard = torch.zeros(1, frames, 1, 1)
    with torch.inference_mode():
        context = ours.image_context(clip)
        for t in (937.5, 0.0):
            got = ours(x, torch.full((1, frames), t), cond, context, mouse, keyboard, FullSequence(frames))
            want = theirs(torch.cat([x, cond], dim=1), torch.tensor([t]), context, return_dict=False)[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # negative control: shifting our rotary frame positions changes nothing (rotary is relative) ...
        shifted = FullSequence(frames)
        shifted.query_positions = shifted.key_positions = torch.arange(frames)[None] + 7
        same = ours(x, torch.full((1, frames), 500.0), cond, context, mouse, keyboard, shifted)
        want = theirs(torch.cat([x, cond], dim=1), torch.tensor([500.0]), context, return_dict=False)[0]
        torch.testing.assert_close(same, want, rtol=1e-4, atol=1e-4)
        # ... but reversing them does
        reversed_ = FullSequence(frames)
        reversed_.query_positions = reversed_.key_positions = torch.arange(frames).flip(0)[None]
        other = ours(x, torch.full((1, frames), 500.0), cond, context, mouse, keyboard, reversed_)
        assert not torch.allclose(other, want, atol=1e-3)

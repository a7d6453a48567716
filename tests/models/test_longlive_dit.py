"""One LongLive DiT forward equals diffusers' ``WanTransformer3DModel`` (text-to-video) with the same weights.

The weights go through diffusers' own converter from Wan's layout
(``convert_wan_transformer_to_diffusers``), so the published parameter names
are checked too. Dense: every frame sees every frame, positions 0..F-1.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from longlive_reference import DenseContext

from arstream.models.longlive.config import get_config
from arstream.models.longlive.dit import LongLiveDiT

FRAMES = 3


def diffusers_twin(model: LongLiveDiT) -> Any:
    cfg = model.cfg
    twin: Any = WanTransformer3DModel(  # type: ignore[no-untyped-call]
        patch_size=cfg.patch_size, num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_dim, out_channels=cfg.out_dim, text_dim=cfg.text.dim, freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=cfg.eps, rope_max_seq_len=cfg.rope_frames,
    )  # fmt: skip
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = convert_wan_transformer_to_diffusers(weights)  # type: ignore[no-untyped-call]
    twin.load_state_dict(state, strict=True)
    return twin.eval()


@pytest.mark.parametrize("timestep", [0.0, 937.5])
def test_one_dit_forward_equals_diffusers_wan_transformer(timestep: float) -> None:
    cfg = get_config("tiny")
    torch.manual_seed(0)
    model = LongLiveDiT(cfg)
    model.init_random(3)
    model.eval()
    twin = diffusers_twin(model)
    x = torch.randn(1, cfg.in_dim, FRAMES, cfg.latent_height, cfg.latent_width)
    tokens = torch.randn(7, cfg.text.dim)  # a prompt's real umT5 outputs; both pad to text_len with zeros
    padded = torch.zeros(1, cfg.text_len, cfg.text.dim)
    padded[0, :7] = tokens
    with torch.inference_mode():
        ours = model(x, torch.full((1, FRAMES), timestep), model.cross_kv(model.text_context(tokens)), DenseContext(FRAMES))
        theirs = twin(x, torch.tensor([timestep]), padded, return_dict=False)[0]
    assert ours.shape == theirs.shape
    assert float((ours - theirs).abs().max()) <= 1e-4
    # negative control: the prompt matters, so equal outputs are not an accident of an ignored context
    with torch.inference_mode():
        other = twin(x, torch.tensor([timestep]), torch.zeros_like(padded), return_dict=False)[0]
    assert float((ours - other).abs().max()) >= 1e-3

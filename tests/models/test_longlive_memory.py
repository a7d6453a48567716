"""LongLive 1.3B's memory on the meta device (480x832, bf16): what docs/models.md quotes, and the runner's capacity.

Built on the meta device: shapes and byte counts without memory. The
pipeline measures its own VAE cache (a steady-state decode of zeros) and
declares the KV spec; the runner's pool plan and stats must agree with the
figures the docs give.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from transformers import UMT5EncoderModel

from arstream.models.longlive.config import get_config
from arstream.models.longlive.dit import LongLiveDiT
from arstream.models.longlive.pipeline import LongLivePipeline
from arstream.models.longlive.text import TextEncoder, byte_tokenizer, umt5_config
from arstream.models.wan.vae import StreamingVAE, build_vae
from arstream.runner.runner import ARRunner

MIB, GIB = 2**20, 2**30
META = torch.device("meta")


def meta_pipeline(config: str = "1.3b") -> LongLivePipeline:
    cfg = get_config(config)
    encoder: Any
    vae: Any
    with META:
        model = LongLiveDiT(cfg).to(torch.bfloat16)
        encoder = UMT5EncoderModel(umt5_config(cfg.text))
        vae = build_vae(cfg)
    encoder, vae = encoder.to(torch.bfloat16), vae.to(torch.bfloat16)
    return LongLivePipeline(model, StreamingVAE(vae), TextEncoder(encoder, byte_tokenizer(), cfg.text_len), device=META)


def test_the_1_3b_figures_and_the_pool_plan_agree() -> None:
    pipeline = meta_pipeline()
    spec = pipeline.kv_cache_spec()
    assert (spec.tokens_per_frame, spec.sink_frames, spec.window_frames, spec.resident_frames) == (1560, 3, 9, 9)
    assert spec.block_bytes == 2 * 30 * 1560 * 1536 * 2 and round(spec.block_bytes / MIB, 1) == 274.2
    assert round(spec.resident_frames * spec.block_bytes / GIB, 2) == 2.41
    default = pipeline.prompts.get(pipeline.default_prompt)
    kv_bytes = sum(t.numel() * t.element_size() for kv in default.kv for t in kv)
    assert kv_bytes == 2 * 30 * 512 * 1536 * 2 and kv_bytes / MIB == 90.0
    vae_mib = pipeline.vae_cache_bytes / MIB
    assert 1700 < vae_mib < 1900, vae_mib  # the decoder's feature cache at 480x832 (docs/models.md: 1801 MiB)
    per_session = spec.resident_frames * spec.block_bytes + spec.model_owned_bytes_per_session
    budget = 100 * GIB
    runner = ARRunner(pipeline, device=META, kv_budget_bytes=budget)
    stats = runner.stats()
    # fixed: per batch row, a chunk and a re-cached history in flight (3 + 9 blocks), a staging row (12) and the
    # prompt a switching row moves to; once, the prompt cache's 4 unreferenced entries (94 MiB each)
    prompt = pipeline.prompt_bytes
    assert round(prompt / MIB) == 94 and spec.model_owned_bytes_fixed == 4 * prompt
    fixed = (3 + 9 + 12) * spec.block_bytes + prompt + 4 * prompt
    assert runner.plan.per_session_bytes == per_session
    assert stats.session_capacity == min(8, (budget - fixed) // per_session)
    assert round(per_session / GIB, 2) == 4.27


@pytest.mark.parametrize(("config", "resident", "kv_gib", "session_gib"),
                         [("causal-forcing-1.3b", 18, 4.82, 6.68), ("causal-forcing-framewise-1.3b", 20, 5.36, 7.21)])
def test_causal_forcings_figures(config: str, resident: int, kv_gib: float, session_gib: float) -> None:
    """Self-Forcing's 21-frame window: 18 resident blocks chunk-wise, 20 frame-wise (the window counts the chunk)."""
    pipeline = meta_pipeline(config)
    spec = pipeline.kv_cache_spec()
    assert (spec.sink_frames, spec.window_frames, spec.resident_frames) == (0, 21, resident)
    assert round(spec.resident_frames * spec.block_bytes / GIB, 2) == kv_gib
    runner = ARRunner(pipeline, device=META, kv_budget_bytes=100 * GIB)
    assert runner.plan.per_session_bytes == spec.resident_frames * spec.block_bytes + spec.model_owned_bytes_per_session
    assert round(runner.plan.per_session_bytes / GIB, 2) == session_gib

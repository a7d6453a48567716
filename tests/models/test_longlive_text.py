"""LongLive's text conditioning: Wan's umT5 weights through transformers' ``UMT5EncoderModel``.

A reference of Wan's own T5 encoder (written from ``wan/modules/t5.py``: T5
attention without scaling, a relative position bias per layer, the gated
tanh-GELU FFN, RMS norms) reads the weights in Wan's layout; ours maps them
onto transformers' names. Both must agree to 1e-5, and encoding only the real
tokens must equal the padded, masked run Wan makes.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from transformers import UMT5EncoderModel

from arstream.models.longlive.config import TextEncoderConfig, get_config
from arstream.models.longlive.text import (
    TextEncoder,
    byte_tokenizer,
    clean_prompt,
    transformers_to_wan_t5,
    umt5_config,
    wan_t5_to_transformers,
)
from arstream.models.wan.checkpoint import CheckpointError, load_into

CFG = get_config("tiny")


def wan_bucket(rel: torch.Tensor, buckets: int, max_dist: int) -> torch.Tensor:
    half = buckets // 2
    out = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    large = exact + (torch.log(rel.float() / exact) / math.log(max_dist / exact) * (half - exact)).long()
    return out + torch.where(rel < exact, rel, large.clamp(max=half - 1))


def wan_t5_reference(w: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor, cfg: TextEncoderConfig) -> torch.Tensor:
    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + cfg.eps) * weight

    def gelu(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))

    x = w["token_embedding.weight"][ids]
    b, length = ids.shape
    n, c = cfg.num_heads, cfg.head_dim
    rel = torch.arange(length)[None] - torch.arange(length)[:, None]
    for i in range(cfg.num_layers):
        p = f"blocks.{i}."
        bias = w[p + "pos_embedding.embedding.weight"][wan_bucket(rel, cfg.num_buckets, cfg.max_distance)]
        bias = bias.permute(2, 0, 1)[None].masked_fill(mask.view(b, 1, 1, -1) == 0, torch.finfo(x.dtype).min)
        h = norm(x, w[p + "norm1.weight"])
        q, k, v = (F.linear(h, w[p + f"attn.{name}.weight"]).view(b, -1, n, c) for name in "qkv")
        attn = F.softmax(torch.einsum("binc,bjnc->bnij", q, k) + bias, dim=-1)
        x = x + F.linear(torch.einsum("bnij,bjnc->binc", attn, v).reshape(b, -1, n * c), w[p + "attn.o.weight"])
        h = norm(x, w[p + "norm2.weight"])
        ffn = F.linear(h, w[p + "ffn.fc1.weight"]) * gelu(F.linear(h, w[p + "ffn.gate.0.weight"]))
        x = x + F.linear(ffn, w[p + "ffn.fc2.weight"])
    return norm(x, w["norm.weight"])


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    torch.manual_seed(0)
    model = UMT5EncoderModel(umt5_config(CFG.text))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)
        model.shared.weight.copy_(model.encoder.embed_tokens.weight)
    return TextEncoder(model, byte_tokenizer(), CFG.text_len)


def test_the_mapped_encoder_equals_wan_t5_on_wans_weights(encoder: TextEncoder) -> None:
    wan = transformers_to_wan_t5(encoder.model.state_dict())
    assert sorted(wan_t5_to_transformers(wan)) == sorted(encoder.model.state_dict())
    ids = torch.tensor([encoder.token_ids("A small boat on a wide, grey sea")])
    ours = encoder.encode("A small boat on a wide, grey sea")
    theirs = wan_t5_reference(wan, ids, torch.ones_like(ids), CFG.text)[0]
    assert float((ours - theirs).abs().max()) <= 1e-5
    # the mapping matters: a model loaded with two layers' attention swapped gives other outputs
    swapped = dict(wan)
    swapped["blocks.0.attn.q.weight"], swapped["blocks.1.attn.q.weight"] = wan["blocks.1.attn.q.weight"], wan["blocks.0.attn.q.weight"]
    assert float((wan_t5_reference(swapped, ids, torch.ones_like(ids), CFG.text)[0] - ours).abs().max()) > 1e-3


def test_encoding_the_real_tokens_only_equals_wans_padded_masked_run(encoder: TextEncoder) -> None:
    prompt = "Two hikers on a ridge at dawn"
    real = encoder.encode(prompt)
    ids = encoder.token_ids(prompt)
    padded = torch.tensor([ids + [0] * (CFG.text_len - len(ids))])
    mask = (torch.arange(CFG.text_len) < len(ids)).long()[None]
    with torch.inference_mode():
        full = encoder.model(input_ids=padded, attention_mask=mask).last_hidden_state[0]
    assert real.shape == (len(ids), CFG.text.dim)
    assert float((real - full[: len(ids)]).abs().max()) <= 1e-5


def test_prompts_are_cleaned_and_truncated_like_wans(encoder: TextEncoder) -> None:
    assert clean_prompt("  caf\u00c3\u00a9 &amp;amp;  dogs\n\tat   night ") == "café & dogs at night"
    ids = encoder.token_ids("x" * 500)
    assert len(ids) == CFG.text_len and ids[-1] == 1  # truncated, EOS kept last
    assert clean_prompt("a  b") == clean_prompt(" a b ") == "a b"  # the tokens are of the cleaned prompt


def test_a_text_encoder_file_that_does_not_fit_names_the_keys(encoder: TextEncoder) -> None:
    wan = transformers_to_wan_t5(encoder.model.state_dict())
    del wan["blocks.1.ffn.fc2.weight"]
    with pytest.raises(CheckpointError, match=r"umt5\.pth does not fit the model: missing keys: encoder\.block\.1\.layer\.1\.DenseReluDense\.wo"):
        load_into(UMT5EncoderModel(umt5_config(CFG.text)), wan_t5_to_transformers(wan), Path("umt5.pth"))


def test_without_transformers_or_tokenizers_loading_longlive_fails_with_one_line_naming_them() -> None:
    """What the GPU check's longlive phase reports on a machine whose copy lacks the extra."""
    import subprocess
    import sys

    blocked = "import sys; sys.modules['transformers'] = None; sys.modules['tokenizers'] = None\n"
    probe = blocked + (
        "try:\n"
        "    import arstream.models.longlive.loading\n"
        "except ImportError as error:\n"
        "    print(f'{type(error).__name__}: {error}')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.splitlines() == [
        "ImportError: longlive needs transformers, tokenizers, not installed here: pip install 'arstream[longlive]'"
    ], done.stdout + done.stderr

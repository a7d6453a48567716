"""Wan's text conditioning: prompt cleaning, umT5 tokens, transformers' ``UMT5EncoderModel`` with Wan's weights.

Wan cleans a prompt (``ftfy``, HTML entities, runs of whitespace), tokenizes
it with umT5's tokenizer (EOS appended, truncated to ``text_len`` tokens) and
encodes it with umT5-XXL's encoder, keeping the real tokens' outputs (Wan
zeroes the padding's; the DiT pads with zeros again). Here the encoder
runs on the real tokens only: with no padding there is nothing to mask, and
the outputs equal the padded, masked run's (tests/models/test_longlive_text.py).

Wan publishes the encoder in its own layout (``models_t5_umt5-xxl-enc-bf16.pth``:
``token_embedding``, ``blocks.N.attn.q``, ``blocks.N.ffn.gate.0``...);
:func:`wan_t5_to_transformers` maps it onto transformers' names.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import torch

from .config import TextEncoderConfig
from .extra import check_longlive_extra

check_longlive_extra()

import ftfy  # noqa: E402 - after the check, which names what is missing

from ..quantize import quiet_torchao_import  # noqa: E402

with quiet_torchao_import():  # transformers imports torchao where it is installed
    from transformers import (
        AutoTokenizer,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
        UMT5Config,
        UMT5EncoderModel,
    )

# Where Wan keeps umT5's tokenizer beside its weights (a transformers tokenizer directory).
TOKENIZER_DIR = "google/umt5-xxl"


def clean_prompt(text: str) -> str:
    """Wan's ``clean='whitespace'``: ftfy, HTML entities unescaped (twice), whitespace runs collapsed."""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


def umt5_config(cfg: TextEncoderConfig) -> UMT5Config:
    """umT5's encoder as Wan builds it: gated tanh-GELU FFN, a relative position bias in every layer, no dropout."""
    return UMT5Config(
        vocab_size=cfg.vocab_size,
        d_model=cfg.dim,
        d_kv=cfg.head_dim,
        d_ff=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        relative_attention_num_buckets=cfg.num_buckets,
        relative_attention_max_distance=cfg.max_distance,
        layer_norm_epsilon=cfg.eps,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
    )


_BLOCK_NAMES = {
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm1.weight": "layer.0.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
}


def wan_t5_to_transformers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wan's umT5 encoder keys -> ``UMT5EncoderModel``'s; a key Wan's layout does not have is kept as it is
    (so the loader's exact-fit check names it)."""
    mapped: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "token_embedding.weight":
            mapped["shared.weight"] = value
            mapped["encoder.embed_tokens.weight"] = value
        elif key == "norm.weight":
            mapped["encoder.final_layer_norm.weight"] = value
        elif (match := re.fullmatch(r"blocks\.(\d+)\.(.+)", key)) and match.group(2) in _BLOCK_NAMES:
            mapped[f"encoder.block.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"] = value
        else:
            mapped[key] = value
    return mapped


def transformers_to_wan_t5(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`wan_t5_to_transformers` (for writing files in Wan's layout)."""
    inverse = {hf: wan for wan, hf in _BLOCK_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "shared.weight":
            out["token_embedding.weight"] = value
        elif key == "encoder.final_layer_norm.weight":
            out["norm.weight"] = value
        elif (match := re.fullmatch(r"encoder\.block\.(\d+)\.(.+)", key)) and match.group(2) in inverse:
            out[f"blocks.{match.group(1)}.{inverse[match.group(2)]}"] = value
    return out


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with umT5's special tokens (pad 0, EOS 1, unk 2) for random-weight models and tests.

    Real weights come with umT5's own tokenizer (:data:`TOKENIZER_DIR`); this
    one only needs a vocabulary of 259 ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<pad>", "</s>", "<unk>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(specials + sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast: PreTrainedTokenizerFast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    return fast


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """A transformers tokenizer directory (``tokenizer.json``, or umT5's ``spiece.model``), read locally only."""
    if not directory.is_dir():
        from ..wan.checkpoint import CheckpointError

        raise CheckpointError(f"no tokenizer directory {directory} (umT5's tokenizer, {TOKENIZER_DIR} in Wan's layout)")
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return tokenizer


class TextEncoder:
    """One per process, on the model's device: cleaned prompt -> umT5 outputs of its real tokens ``[L, dim]``."""

    def __init__(self, model: UMT5EncoderModel, tokenizer: PreTrainedTokenizerBase, text_len: int) -> None:
        self.model = model.eval()  # type: ignore[no-untyped-call]
        self.tokenizer = tokenizer
        self.text_len = text_len

    def token_ids(self, prompt: str) -> list[int]:
        """A cleaned prompt's tokens as Wan takes them: EOS appended, at most ``text_len``. The prompt was cleaned
        once, as it arrived (:func:`clean_prompt`, the pipeline's ``prepare_prompt``), as Wan cleans it once."""
        encoded: Any = self.tokenizer(prompt, truncation=True, max_length=self.text_len, add_special_tokens=True)
        return list(encoded["input_ids"])

    @torch.inference_mode()
    def encode(self, prompt: str) -> torch.Tensor:
        device = next(self.model.parameters()).device
        ids = torch.tensor([self.token_ids(prompt)], device=device)
        return self.model(input_ids=ids).last_hidden_state[0]

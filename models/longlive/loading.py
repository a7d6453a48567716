"""``load_longlive``: the LongLive pipeline from a checkpoint directory, or with seeded random weights.

:func:`load_parts` (the DiT, umT5, the VAE) is shared with the other text-to-video Wans (Krea Realtime).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .extra import check_longlive_extra

check_longlive_extra()  # before transformers is imported (here and by the modules below)

from ..quantize import check_weights_option, quantize_blocks, quiet_torchao_import  # noqa: E402 - after the check

with quiet_torchao_import():  # transformers imports torchao where it is installed
    from transformers import UMT5EncoderModel

from . import checkpoint as ckpt  # noqa: E402
from .config import LongLiveConfig, get_config
from .dit import LongLiveDiT
from .pipeline import LongLivePipeline
from .text import TOKENIZER_DIR, TextEncoder, byte_tokenizer, load_tokenizer, umt5_config
from ..wan.checkpoint import find_file, load_vae
from ..wan.components import component, held_as
from ..wan.loading import check_weights_source, torch_dtype
from ..wan.vae import StreamingVAE, build_vae


DitLoader = Callable[[LongLiveDiT, Path], LongLiveDiT]


@dataclass
class WanT2VParts:
    """A text-to-video Wan's modules, loaded and on their devices, and what the pipeline declares about them."""

    model: LongLiveDiT
    vae: StreamingVAE
    text: TextEncoder
    components: list[Any]
    kv_dtype: torch.dtype | None


def load_parts(
    cfg: LongLiveConfig,
    device: torch.device,
    *,
    family: str,
    load_dit: DitLoader,
    checkpoint: str | None,
    random_init: bool,
    seed: int = 0,
    dtype: str | None = None,
    t5_file: str | None = None,
    vae_file: str | None = None,
    tokenizer: str | None = None,
    weights: str | None = None,
    kv_dtype: str | None = None,
    text_encoder_device: str | None = None,
    prepare_dit: Callable[[LongLiveDiT], object] | None = None,
) -> WanT2VParts:
    """The DiT (read by ``load_dit`` from the checkpoint directory), umT5 and the Wan VAE, or seeded random weights.

    bf16 on CUDA, fp32 on the CPU (``dtype`` overrides); the text encoder runs
    in the same dtype, on the model's device or on ``text_encoder_device``
    (the CPU, another GPU: it runs only when a prompt is first seen, and its
    outputs come to the model's device). With ``random_init`` and no
    ``tokenizer`` directory the prompts go through a byte-level tokenizer.
    Nothing is downloaded.

    ``weights`` ``int8``, ``fp8`` or ``w8a8`` quantizes the DiT's block weights after
    loading (:mod:`arstream.models.quantize`); the KV pool holds ``kv_dtype``
    (default: ``dtype``). On the meta device nothing is read or initialised:
    the pipeline has the shapes and bytes of one on a GPU (``arstream plan``).
    ``prepare_dit``: what the family does to its DiT once it is loaded, before it is quantized (Krea fuses q/k/v).
    """
    planning = device.type == "meta"
    if not planning:
        check_weights_source(family, checkpoint, random_init)
    check_weights_option(weights, device)
    weights_dtype = torch_dtype(dtype, "bfloat16" if device.type in ("cuda", "meta") else "float32", "dtype")
    cache_dtype = None if kv_dtype is None else torch_dtype(kv_dtype, "", "kv_dtype")
    try:
        text_device = device if text_encoder_device is None else torch.device(text_encoder_device)
    except RuntimeError as exc:
        raise ValueError(f"text_encoder_device: {exc}") from None
    encoder: Any  # transformers' and diffusers' modules are untyped here
    vae: Any
    tokens: Any
    with torch.device("meta"):  # built without memory, then filled: never default-initialised nor held twice
        model = LongLiveDiT(cfg)
        encoder = UMT5EncoderModel(umt5_config(cfg.text))
    if planning:  # shapes and bytes only: nothing read, nothing initialised
        with torch.device("meta"):
            vae = build_vae(cfg)
        tokens = byte_tokenizer()
    else:
        # Random weights are materialised where they run, in their dtype, and filled a parameter at a time from
        # the CPU's seeded draws (init_random): the host holds one parameter's draw, never the model in float32
        # (Krea 14B's DiT and umT5 would be 80 GB of host memory per rank). A checkpoint is read on the CPU.
        if checkpoint is None:
            model = model.to(dtype=weights_dtype).to_empty(device=device)
            encoder = encoder.to(dtype=weights_dtype).to_empty(device=text_device)
        else:
            model = model.to_empty(device="cpu")
            encoder = encoder.to_empty(device="cpu")
        # to_empty gives each module its own copy of a shared parameter: umT5's token embedding (2.1 GB at XXL in
        # bf16) would be held twice, as shared.weight and encoder.embed_tokens.weight; tie it back to one
        encoder.tie_weights()
        vae = build_vae(cfg)
    if checkpoint is not None and not planning:
        directory = Path(checkpoint)
        model = load_dit(model, directory)
        ckpt.load_text_encoder(encoder, find_file(directory, t5_file, (ckpt.T5_FILE,), "umT5 encoder"))
        load_vae(vae, find_file(directory, vae_file, (ckpt.VAE_FILE,), "VAE"))
        tokens = load_tokenizer(Path(tokenizer) if tokenizer else directory / TOKENIZER_DIR)
    elif not planning:
        model.init_random(seed)
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for param in encoder.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        torch.manual_seed(seed)
        vae = build_vae(cfg)  # diffusers' own random init, seeded
        tokens = load_tokenizer(Path(tokenizer)) if tokenizer else byte_tokenizer()
    model = model.to(device=device, dtype=weights_dtype)
    if prepare_dit is not None:
        prepare_dit(model)
    quantize_blocks(model, weights)
    encoder = encoder.to(device=device if planning else text_device, dtype=weights_dtype)
    vae = vae.to(device=device)
    if weights_dtype != torch.float32:
        # torch's own cast: diffusers' to() warns on every cast to a dtype that the VAE "should keep some modules in
        # float32", naming none (it has none), on every start and plan; nothing here is quantized or offloaded
        torch.nn.Module.to(vae, dtype=weights_dtype)  # in place
    plain = held_as(weights_dtype)
    components = [
        component("dit", model, device, held_as(weights_dtype, weights)),
        component("text_encoder", encoder, text_device, plain),
        component("vae", vae, device, plain),
    ]
    return WanT2VParts(model, StreamingVAE(vae), TextEncoder(encoder, tokens, cfg.text_len), components, cache_dtype)


def load_longlive(
    device: torch.device | str = "cpu",
    *,
    config: str = "1.3b",
    checkpoint: str | None = None,
    random_init: bool = False,
    seed: int = 0,
    dtype: str | None = None,
    dit_file: str | None = None,
    dit_entry: str | None = None,
    lora_file: str | None = None,
    no_lora: bool = False,
    t5_file: str | None = None,
    vae_file: str | None = None,
    tokenizer: str | None = None,
    default_prompt: str | None = None,
    prompt_cache: int = 4,
    session_capacity: int = 8,
    weights: str | None = None,
    kv_dtype: str | None = None,
    text_encoder_device: str | None = None,
) -> LongLivePipeline:
    """Build LongLive from a directory in the published layout (:mod:`.checkpoint`), or ``random_init``
    (:func:`load_parts`: dtypes, quantized weights, the text encoder's device, planning on the meta device)."""
    cfg = get_config(config)

    def dit(model: LongLiveDiT, directory: Path) -> LongLiveDiT:
        path = find_file(directory, dit_file, (cfg.dit_file,), "LongLive DiT")
        ckpt.load_dit(model, path, dit_entry or cfg.dit_entry)
        lora = lora_file or cfg.lora_file
        if lora is not None and not no_lora:
            path = find_file(directory, lora, (lora,), "LoRA")
            model = ckpt.merge_lora(model, ckpt.read_lora(path), path, cfg)
        return model

    device = torch.device(device)
    parts = load_parts(cfg, device, family="longlive", load_dit=dit, checkpoint=checkpoint, random_init=random_init,
                       seed=seed, dtype=dtype, t5_file=t5_file, vae_file=vae_file, tokenizer=tokenizer,
                       weights=weights, kv_dtype=kv_dtype, text_encoder_device=text_encoder_device)  # fmt: skip
    pipeline = LongLivePipeline(
        parts.model,
        parts.vae,
        parts.text,
        device=device,
        session_capacity=session_capacity,
        prompt_cache=prompt_cache,
        default_prompt=default_prompt,
        kv_dtype=parts.kv_dtype,
        components=parts.components,
    )
    pipeline.random_weights = checkpoint is None
    return pipeline

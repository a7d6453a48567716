"""The image encoder of Matrix-Game's conditioning: the vision tower of Wan's CLIP (open-clip XLM-RoBERTa ViT-H/14).

Only the vision tower runs: the start image (resized to 224x224, CLIP's mean
and std) goes through the patch embedding, the class token and positions, a
pre-norm, and all transformer blocks but the last; those 257 tokens of 1280
channels are what the DiT's ``img_emb`` projects into its cross-attention
context. Parameter names are the published file's (``visual.*`` in
``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``); the text tower's
keys in that file are not needed and not loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ClipConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps).type_as(x)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.to_qkv(x).view(b, s, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, c))


class AttentionBlock(nn.Module):
    def __init__(self, dim: int, mlp_ratio: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.norm1 = LayerNorm(dim, eps=eps)
        self.attn = SelfAttention(dim, num_heads)
        self.norm2 = LayerNorm(dim, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ClipConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.dim
        patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(3, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.cls_embedding = nn.Parameter(torch.randn(1, 1, dim) / dim**0.5)
        self.pos_embedding = nn.Parameter(torch.randn(1, patches + 1, dim) / dim**0.5)
        self.pre_norm = LayerNorm(dim, eps=cfg.eps)
        self.transformer = nn.Sequential(
            *(AttentionBlock(dim, cfg.mlp_ratio, cfg.num_heads, cfg.eps) for _ in range(cfg.num_layers))
        )
        # in the published file; unused for the conditioning tokens (kept so the keys load strictly)
        self.post_norm = LayerNorm(dim, eps=cfg.eps)
        self.head = nn.Parameter(torch.randn(dim, cfg.out_dim) / dim**0.5)

    def penultimate_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised ``[B, 3, S, S]`` images -> ``[B, patches + 1, dim]`` after all blocks but the last."""
        x = self.patch_embedding(images.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_embedding.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        return self.transformer[:-1](self.pre_norm(x))


class ClipImageEncoder(nn.Module):
    """``visual`` as in the published CLIP file, plus CLIP's preprocessing."""

    def __init__(self, cfg: ClipConfig) -> None:
        super().__init__()
        self.visual = VisionTransformer(cfg)

    @torch.inference_mode()
    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """``[3, H, W]`` in [-1, 1] -> the ``[tokens, dim]`` conditioning features (float32)."""
        size = self.visual.cfg.image_size
        resized = F.interpolate(image[None].float(), size=(size, size), mode="bicubic", align_corners=False)
        mean = torch.tensor(CLIP_MEAN, device=image.device).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD, device=image.device).view(1, 3, 1, 1)
        return self.visual.penultimate_tokens((resized * 0.5 + 0.5 - mean) / std)[0].float()

"""A dense reference for Waypoint, written function by function from ``world_engine`` (Overworld), commit
208c909824d906bf441122b7c40b9b4e1050d7c3: ``src/model/world_model.py``, ``attn.py``, ``nn.py``,
``kv_cache.py``, ``src/world_engine.py`` (``append_frame``, ``gen_frame``) and ``src/ae_nn.py`` / ``src/ae.py``
(the decoder and the encoder); Waypoint-1.5's seed encode from the later ``src/ae.py``
(``ChunkedStreamingTAEHV.encode``) over ``taehv_reference``'s encoder.

Its own code, sharing nothing with ``arstream.models.waypoint`` but the weights
it reads (the published key names; the decoder's weight-normed as published):
a per-layer ring-buffer cache plus a tail slot for the current frame, a written
mask, K stored rotated with absolute frame positions, and a frozen flag that
keeps the denoising passes from writing to the ring, as ``LayerKVCache.upsert``
does. Every ``global_attn_period``-th layer from ``global_attn_offset`` gets
``global_window`` frames of ring in buckets of ``global_pinned_dilation``
frames, written only on frames whose index is a multiple of the dilation; the
others ``local_window`` frames (``StaticKVCache``). Attention is masked SDPA
over the whole ring (flex attention's block mask as a dense mask).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


def mlp(w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w[f"{prefix}.fc1.weight"])), w[f"{prefix}.fc2.weight"])


def noise_conditioner(w: dict[str, torch.Tensor], sigma: torch.Tensor) -> torch.Tensor:
    """``NoiseConditioner.forward``: sigma [B, N] -> [B, N, d]."""
    freq = torch.logspace(0, -1, steps=256, base=10_000.0, dtype=torch.float32)
    s = sigma.reshape(-1).float() * 1000
    phase = s[:, None] * freq[None, :]
    emb = torch.cat((torch.sin(phase), torch.cos(phase)), dim=-1) * 2**0.5
    return mlp(w, "denoise_step_emb.mlp", emb).view(*sigma.shape, -1)


def ada_rmsnorm(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    b, nm, d = x.shape
    n = scale.size(1)
    x4 = x.view(b, n, nm // n, d)
    return (rms_norm(x4) * (1 + scale.unsqueeze(2)) + bias.unsqueeze(2)).view(b, nm, d)


def ada_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    b, nm, d = x.shape
    n = gate.size(1)
    return (x.view(b, n, nm // n, d) * gate.unsqueeze(2)).view(b, nm, d)


def rotary_freqs(dim: int, kind: str, positions: torch.Tensor, max_freq: float = 10.0) -> torch.Tensor:
    """``rotary_embedding_torch.RotaryEmbedding(dim, freqs_for=kind).forward(positions)``: [P, dim]."""
    if kind == "lang":
        freqs = 1.0 / (10_000 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    else:
        freqs = torch.linspace(1.0, max_freq / 2, dim // 2) * math.pi
    angles = torch.einsum("p,f->pf", positions.float(), freqs)
    return torch.stack((angles, angles), dim=-1).flatten(-2)  # each frequency twice, side by side


def ortho_rope_freqs(H: int, W: int, T: int, head_dim: int) -> torch.Tensor:
    """``OrthoRoPE.get_freqs``: [T*H*W, head_dim/2] (x, y, t)."""
    max_freq = min(H, W) * 0.8
    fx = rotary_freqs(head_dim // 8, "pixel", torch.linspace(-1 + 1 / W, 1 - 1 / W, W), max_freq)
    fy = rotary_freqs(head_dim // 8, "pixel", torch.linspace(-1 + 1 / H, 1 - 1 / H, H), max_freq)
    ft = rotary_freqs(head_dim // 4, "lang", torch.arange(T))
    rows = []
    for t in range(T):
        for y in range(H):
            for x in range(W):
                rows.append(torch.cat([fx[x], fy[y], ft[t]]))
    return torch.stack(rows)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, t: int, H: int, W: int) -> torch.Tensor:
    """``RoPE.forward`` for one frame at time ``t``: x [B, h, H*W, D]."""
    idx = t * H * W + torch.arange(H * W)
    c, s = cos[idx][None, None], sin[idx][None, None]
    x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).type_as(x)


class LayerKVCache:
    """``LayerKVCache``: a ring of ``L`` tokens (``L / tpf / dilation`` frame slots) plus a tail slot for the
    current frame."""

    def __init__(self, heads: int, L: int, dh: int, tpf: int, dilation: int = 1) -> None:
        assert (L // tpf) % dilation == 0 and L % tpf == 0
        self.tpf, self.L, self.dilation = tpf, L, dilation
        self.capacity = L + tpf
        self.num_buckets = (L // tpf) // dilation
        self.kv = torch.zeros(2, 1, heads, self.capacity, dh)
        self.written = torch.zeros(self.capacity, dtype=torch.bool)
        self.written[L:] = True

    def upsert(self, kv: torch.Tensor, t: int, frozen: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bucket = (t + self.dilation - 1) // self.dilation
        ring = torch.arange(self.tpf) + (bucket % self.num_buckets) * self.tpf
        tail = torch.arange(self.tpf) + self.L
        write_step = t % self.dilation == 0
        self.kv[:, :, :, tail] = kv
        mask = self.written.clone()
        if write_step:
            mask[ring] = False  # the slot this frame overwrites (the oldest kept frame) is not attended
        if not frozen:
            slots = ring if write_step else tail  # off the dilation's beat a frame is not kept
            self.kv[:, :, :, slots] = kv
            self.written[slots] = True
        return self.kv[0], self.kv[1], mask


class ReferenceWaypoint:
    """``WorldEngine`` without prompts: ``gen_frame`` over a :class:`LayerKVCache` per layer."""

    def __init__(self, cfg: Any, weights: dict[str, torch.Tensor], decoder_file: dict[str, torch.Tensor],
                 window: int | None = None) -> None:
        self.cfg, self.w, self.dec = cfg, weights, decoder_file
        self.H, self.W = cfg.height, cfg.width
        self.tpf = self.H * self.W
        self.dh = cfg.d_model // cfg.n_heads
        freqs = ortho_rope_freqs(self.H, self.W, cfg.n_frames, self.dh)
        self.cos, self.sin = freqs.cos(), freqs.sin()
        self.caches = []
        for i in range(cfg.n_layers):  # ``window`` given: every layer that many frames, undilated
            frames, dilation = self.layer_frames(i) if window is None else (window, 1)
            self.caches.append(LayerKVCache(cfg.n_kv_heads, frames * self.tpf, self.dh, self.tpf, dilation))
        self.frame_ts = 0

    def layer_frames(self, i: int) -> tuple[int, int]:
        """``StaticKVCache``'s ring length (frames) and dilation for layer ``i``."""
        cfg = self.cfg
        period = cfg.global_attn_period
        if (i - cfg.global_attn_offset % period) % period == 0:
            return cfg.global_window, cfg.global_pinned_dilation
        return cfg.local_window, 1

    def attn(
        self, i: int, x: torch.Tensor, t: int, v1: torch.Tensor | None, frozen: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg, w, p = self.cfg, self.w, f"transformer.blocks.{i}.attn"
        b, T, _ = x.shape
        q = F.linear(x, w[f"{p}.q_proj.weight"]).view(b, T, cfg.n_heads, self.dh).transpose(1, 2)
        k = F.linear(x, w[f"{p}.k_proj.weight"]).view(b, T, cfg.n_kv_heads, self.dh).transpose(1, 2)
        v = F.linear(x, w[f"{p}.v_proj.weight"]).view(b, T, cfg.n_kv_heads, self.dh).transpose(1, 2)
        if cfg.value_residual:
            v1 = v if v1 is None else v1
            v = torch.lerp(v, v1.view_as(v), w[f"{p}.v_lamb"])
        q, k = rms_norm(q), rms_norm(k)
        q, k = rope(q, self.cos, self.sin, t, self.H, self.W), rope(k, self.cos, self.sin, t, self.H, self.W)
        k_all, v_all, mask = self.caches[i].upsert(torch.stack([k, v]), t, frozen)
        y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask[None, None, None, :],
                                           enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        if cfg.gated_attn:
            gates = torch.sigmoid(F.linear(x[..., : cfg.n_heads], w[f"{p}.gate_proj.weight"]))
            y = y * gates.permute(0, 2, 1).unsqueeze(-1)
        return F.linear(y.transpose(1, 2).reshape(b, T, -1), w[f"{p}.out_proj.weight"]), v1

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, t: int, ctrl: torch.Tensor, frozen: bool) -> torch.Tensor:
        """``WorldModel.forward`` with B = N = 1: x [1, 1, C, h, w] -> velocity of the same shape."""
        cfg, w = self.cfg, self.w
        B, N, C, Hl, Wl = x.shape
        ph, pw = cfg.patch
        cond = noise_conditioner(w, sigma)
        ctrl_emb = mlp(w, "ctrl_emb.mlp", ctrl)
        h = F.conv2d(x.reshape(B * N, C, Hl, Wl), w["patchify.weight"], stride=(ph, pw))
        h = h.view(B, N, cfg.d_model, self.H, self.W).permute(0, 1, 3, 4, 2).reshape(B, N * self.tpf, cfg.d_model)
        v1 = None
        for i in range(cfg.n_layers):
            p = f"transformer.blocks.{i}"
            c = cond + w[f"{p}.cond_head.bias_in"] if f"{p}.cond_head.bias_in" in w else cond
            s0, b0, g0, s1, b1, g1 = (F.linear(F.silu(c), w[f"{p}.cond_head.cond_proj.{j}.weight"]) for j in range(6))
            res = h
            a, v1 = self.attn(i, ada_rmsnorm(h, s0, b0), t, v1, frozen)
            h = ada_gate(a, g0) + res
            if f"{p}.ctrl_mlpfusion.mlp.fc1.weight" in w:
                wx, wc = w[f"{p}.ctrl_mlpfusion.mlp.fc1.weight"].chunk(2, dim=1)
                hx = rms_norm(h).view(B, N, -1, cfg.d_model)
                z = F.silu(F.linear(hx, wx) + F.linear(rms_norm(ctrl_emb), wc).unsqueeze(2))
                h = F.linear(z, w[f"{p}.ctrl_mlpfusion.mlp.fc2.weight"]).flatten(1, 2) + h
            h = ada_gate(mlp(w, f"{p}.mlp", ada_rmsnorm(h, s1, b1)), g1) + h
        ab = F.linear(F.silu(cond), w["out_norm.fc.weight"])
        a, b_ = ab.repeat_interleave(self.tpf, dim=1).chunk(2, dim=-1)
        h = F.silu(rms_norm(h) * (1 + a) + b_)
        out = F.linear(h, w["unpatchify.weight"], w["unpatchify.bias"])
        out = out.view(B, N, self.H, self.W, C, ph, pw).permute(0, 1, 4, 2, 5, 3, 6)
        return out.reshape(B, N, C, Hl, Wl)

    def gen_frame(self, noise: torch.Tensor, ctrl: torch.Tensor) -> torch.Tensor:
        """``WorldEngine.gen_frame`` (return_img=False): noise [C, h, w], ctrl [n_buttons + 3] -> clean latent."""
        x = noise[None, None]
        c = ctrl[None, None]
        t = self.frame_ts
        self.frame_ts += 1
        sigmas = torch.tensor(self.cfg.scheduler_sigmas)
        for sig, dsig in zip(sigmas, sigmas.diff()):
            x = x + dsig * self.forward(x, sig.expand(1, 1), t, c, frozen=True)
        self.forward(x, torch.zeros(1, 1), t, c, frozen=False)
        return x[0, 0]

    def append_frame(self, latent: torch.Tensor, ctrl: torch.Tensor | None = None) -> None:
        """``WorldEngine.append_frame`` after its encode: the clean latent [C, h, w] through the cache pass at
        sigma 0, at the next frame time, with ``ctrl`` (None, as Biome calls it: ``CtrlInput()``, all zeros)."""
        c = torch.zeros(1, 1, self.cfg.n_buttons + 3) if ctrl is None else ctrl[None, None]
        t = self.frame_ts
        self.frame_ts += 1
        self.forward(latent[None, None], torch.zeros(1, 1), t, c, frozen=False)

    def decode(self, latent: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """``ae_nn.Decoder`` then ``InferenceAE.decode``: latent [C, h, w] -> uint8 [H, W, 3]."""
        return reference_decode(self.dec, self.cfg.ae, latent[None], size)[0]


def _conv(d: dict[str, torch.Tensor], name: str, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    g, v = d[f"{name}.parametrizations.weight.original0"], d[f"{name}.parametrizations.weight.original1"]
    weight = torch._weight_norm(v, g, 0)
    return F.conv2d(x, weight, d.get(f"{name}.bias"), padding=weight.shape[-1] // 2, groups=groups)


def _res_block(d: dict[str, torch.Tensor], q: str, y: torch.Tensor) -> torch.Tensor:
    hidden = d[f"{q}.conv1.parametrizations.weight.original1"].shape[0]
    h = F.leaky_relu(_conv(d, f"{q}.conv1", y))
    h = F.leaky_relu(_conv(d, f"{q}.conv2", h, groups=max(1, hidden // 16)))
    return y + _conv(d, f"{q}.conv3", h)


def reference_encode(d: dict[str, torch.Tensor], conf: dict[str, Any], pixels: torch.Tensor,
                     square: tuple[int, int]) -> torch.Tensor:
    """``InferenceAE.encode`` and ``ae_nn.Encoder``: uint8 [H, W, 3] -> latent [C, h, w]. ``square`` is
    ``LandscapeToSquare``'s size (512x512 in the published code; the tiny test file's own)."""
    rgb = pixels[None].permute(0, 3, 1, 2).float().div(255).mul(2).sub(1)
    in_ch = d["conv_in.proj.parametrizations.weight.original1"].shape[1]
    if rgb.shape[1] < in_ch:
        rgb = torch.cat([rgb, torch.zeros(1, in_ch - rgb.shape[1], *rgb.shape[2:])], dim=1)
    x = _conv(d, "conv_in.proj", F.interpolate(rgb[:, :in_ch], square, mode="bicubic"))
    for s, count in enumerate(conf["encoder_blocks_per_stage"]):
        y = x
        for r in range(count):
            y = _res_block(d, f"blocks.{s}.blocks.{r}", y)
        y = _conv(d, f"blocks.{s}.down.proj", F.interpolate(y, scale_factor=0.5, mode="bicubic"))
        x = y + F.pixel_unshuffle(_conv(d, f"residuals.{s}.proj", x), 2)
    out = _conv(d, "conv_out.proj", x)
    b, c, h, w = x.shape
    groups = c // out.shape[1]
    average = x.view(b, groups, c // groups, h, w).mean(dim=1) * groups**0.5
    return (average + out)[0]


def reference_taehv_seed(holder: Any, pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Biome's seed for Waypoint-1.5 (the picture expanded to four frames) through ``ChunkedStreamingTAEHV.encode``
    on a fresh stream: [0, 1], resized (bilinear) to the encode size, TAEHV's encoder -> latent [C, h, w]."""
    from taehv_reference import encode_clip

    img = pixels[None].expand(4, -1, -1, -1)
    rgb = img[None].permute(0, 1, 4, 2, 3).float().div(255)
    if tuple(rgb.shape[-2:]) != size:
        rgb = F.interpolate(rgb[0], size=size, mode="bilinear", align_corners=False)[None]
    return encode_clip(holder, rgb)[0, 0]


def reference_decode(d: dict[str, torch.Tensor], conf: dict[str, Any], z: torch.Tensor,
                     size: tuple[int, int]) -> torch.Tensor:
    ch_max = conf["ch_max"]
    reps = ch_max // conf["latent_channels"]
    b, c, hh, ww = z.shape
    res = z.unsqueeze(2).expand(b, c, reps, hh, ww).reshape(b, c * reps, hh, ww) * reps**-0.5
    x = _conv(d, "conv_in.proj", z) + res
    stages = len(conf["decoder_blocks_per_stage"])
    counts = list(conf["decoder_blocks_per_stage"])
    for s in range(stages):
        p = f"blocks.{s}"
        y = _conv(d, f"{p}.up.proj", x) if f"{p}.up.proj.parametrizations.weight.original0" in d else x
        y = F.interpolate(y, scale_factor=2.0, mode="bicubic")
        for r in range(counts[s]):
            y = _res_block(d, f"{p}.blocks.{r}", y)
        x = y + F.pixel_shuffle(_conv(d, f"residuals.{s}.proj", x), 2)
    x = F.interpolate(_conv(d, "conv_out.proj", F.silu(x)), size, mode="bicubic")
    x = ((x / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1)[..., :3]


def reference_taehv_frames(holder: Any, latents: list[torch.Tensor], size: tuple[int, int]) -> list[torch.Tensor]:
    """Waypoint-1.5's ``ChunkedStreamingTAEHV.decode`` over a session's latents [C, h, w], written from the later
    ``world_engine``'s ``src/ae.py``: the stream is primed by decoding the first latent ``frames_to_trim`` (three)
    times and dropping what comes out; then each latent gives four frames, resized (bilinear) to ``size`` and
    rounded to bytes. Here the whole session is one dense clip of the published TAEHV (``taehv_reference``), whose
    own trim drops the first three frames; the primes' other frames are dropped by count."""
    from taehv_reference import decode_clip

    primes = 3
    clip = torch.stack([latents[0]] * primes + list(latents))[None]
    video = decode_clip(holder, clip)[0]  # [4 * (primes + n) - 3, 3, H, W]
    video = video[4 * primes - 3 :]
    if tuple(video.shape[-2:]) != size:
        video = F.interpolate(video, size=size, mode="bilinear", align_corners=False)
    pixels = (video.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    return [pixels[i : i + 4] for i in range(0, pixels.shape[0], 4)]

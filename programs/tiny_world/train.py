"""``arstream train tiny-world``: the recipe that produced the shipped weights.

Two kinds of step, both run chunk by chunk through :class:`DenseChunkKV` with
exactly the inference attention structure (sink + sliding window + the chunk):

* **Diffusion forcing** (teacher forcing with noisy context). Every chunk of a
  ground-truth trajectory runs twice in one batched pass: a *query* copy at a
  random diffusion time, whose clean-frame prediction is the loss, and a
  *context* copy at a low context-noise level, whose K/V become the history
  later chunks attend to (what the committing pass does at inference).
* **Self forcing**. After one ground-truth chunk the model rolls out its own
  chunks with the real few-step sampler (no gradient); at each chunk a query
  copy is trained against the ground truth on the pixels the ground-truth
  chunk showed (the rest of the view is the model's own invention, so it has
  no target). The model learns to denoise on top of its own imperfect history.

Half of the trajectories start a rollout at frame 0; the other half continue
at a random far position with a stale sink frame from elsewhere on the map,
as a long-running session does. Checkpoints (model, EMA, optimiser, RNG) are
written every few minutes and on exit; ``--resume`` continues from one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...cli import main_for
from ...models.tiny_world.model import NUM_DIRECTIONS, TinyWorldConfig, TinyWorldDiT
from ...models.tiny_world.sampling import DenseChunkKV, commit_chunk, from_uint8, sample_chunk
from ...models.tiny_world.weights import load_model, save_weights
from ...models.tiny_world.world import PALETTE, ProceduralWorld, keys_for_direction

STILL = 4
# palette colours are >= 0.39 apart in squared [-1, 1] units (rock-grass): at 0.1 a pixel on its colour costs < 0.02
CLASS_TEMPERATURE = 0.1


@dataclass
class Batch:
    frames: torch.Tensor  # canvases [B, L, C, C, 3] in [-1, 1]
    directions: torch.Tensor  # [B, L]
    cells: torch.Tensor  # [B, L, 2] world cell of each canvas's corner (unwrapped)
    stale_sink: torch.Tensor | None  # [B, F, C, C, 3] canvases of an old chunk elsewhere, or None
    stale_directions: torch.Tensor | None
    stale_cells: torch.Tensor | None
    frame_start: int  # absolute index of frames[:, 0]


class TrajectorySampler:
    """Random camera walks over a fixed set of seeded worlds."""

    def __init__(
        self, world_seeds: list[int], cfg: TinyWorldConfig, rng: np.random.Generator, still_share: float = 0.2
    ) -> None:
        self.worlds = [ProceduralWorld(s) for s in world_seeds]
        self.cfg = cfg
        self.rng = rng
        self.still_share = still_share

    def _directions(self, chunks: int) -> list[int]:
        out = []
        current = self._random_direction()
        for _ in range(chunks):
            if self.rng.random() < 0.3:
                current = self._random_direction()
            out.extend([current] * self.cfg.frames_per_chunk)
        return out

    def _random_direction(self) -> int:
        if self.rng.random() < self.still_share:
            return STILL
        return int(self.rng.choice([d for d in range(NUM_DIRECTIONS) if d != STILL]))

    def _walk(self, world: ProceduralWorld, chunks: int) -> tuple[np.ndarray, list[int], np.ndarray]:
        """Canvases, directions and canvas cells of one random walk."""
        dirs = self._directions(chunks)
        x, y = (int(v) for v in self.rng.integers(0, world.size, size=2))
        _frames, cams = world.rollout(x, y, [keys_for_direction(d) for d in dirs])
        p = self.cfg.patch_size
        cells = np.floor_divide(cams, p)
        canvases = np.stack([world.render(cx * p, cy * p, self.cfg.canvas_size) for cx, cy in cells])
        return canvases, dirs, cells

    def sample(self, batch: int, chunks: int, stale: bool) -> Batch:
        frames, dirs, cells, old_frames, old_dirs, old_cells = [], [], [], [], [], []
        fpc = self.cfg.frames_per_chunk
        for _ in range(batch):
            world = self.worlds[int(self.rng.integers(len(self.worlds)))]
            f, d, c = self._walk(world, chunks)
            frames.append(f)
            dirs.append(d)
            cells.append(c)
            if stale:
                of, od, oc = self._walk(world, 1)
                old_frames.append(of)
                old_dirs.append(od)
                old_cells.append(oc)
        frame_start = 0
        if stale:
            # a long-running session: log-uniform position, chunk aligned, past the window
            low = self.cfg.sink_frames + self.cfg.history_frames + fpc
            frame_start = int(math.exp(self.rng.uniform(math.log(low), math.log(20_000))))
            frame_start -= frame_start % fpc
        return Batch(
            # as_tensor, not from_numpy: it lands on the default device (see --device)
            frames=from_uint8(torch.as_tensor(np.stack(frames))),
            directions=torch.tensor(dirs),
            cells=torch.as_tensor(np.stack(cells)),
            stale_sink=from_uint8(torch.as_tensor(np.stack(old_frames))) if stale else None,
            stale_directions=torch.tensor(old_dirs) if stale else None,
            stale_cells=torch.as_tensor(np.stack(old_cells)) if stale else None,
            frame_start=frame_start,
        )


def sample_times(batch: int, cfg: TinyWorldConfig, gen: torch.Generator) -> torch.Tensor:
    """Mostly the sampler's own times (few-step quality), some uniform in (0, 1]."""
    grid = torch.tensor(cfg.denoise_times)
    on_grid = grid[torch.randint(len(grid), (batch,), generator=gen)]
    uniform = torch.rand(batch, generator=gen).clamp_min(0.02)
    return torch.where(torch.rand(batch, generator=gen) < 0.7, on_grid, uniform)


def sample_context_noise(batch: int, cfg: TinyWorldConfig, gen: torch.Generator) -> torch.Tensor:
    """Half exactly the inference level, half spread over [0, 2x] for robustness."""
    spread = torch.rand(batch, generator=gen) * 2 * cfg.context_noise
    return torch.where(torch.rand(batch, generator=gen) < 0.5, torch.full((batch,), cfg.context_noise), spread)


def noised(clean: torch.Tensor, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    t = t[:, None, None, None, None]
    return (1 - t) * clean + t * torch.randn(clean.shape, generator=gen)


def class_loss(pred: torch.Tensor, clean: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of each predicted pixel's class, read off its distance to the five palette colours.

    Logits are ``-|pred - colour|^2 / CLASS_TEMPERATURE``, the target the ground
    truth's class. Unlike the squared error, which is content to sit halfway
    between two colours where the model is unsure, this pays for every pixel
    that is closer to a wrong colour than to the right one, and it weighs
    every class alike however dark or light its colour. ``mask`` ``[..., 1]``
    keeps only pixels with a target.
    """
    palette = from_uint8(torch.as_tensor(PALETTE))
    dist_pred = ((pred[..., None, :] - palette) ** 2).sum(-1)
    target = ((clean[..., None, :] - palette) ** 2).sum(-1).argmin(-1)
    ce = F.cross_entropy(-dist_pred.flatten(0, -2) / CLASS_TEMPERATURE, target.flatten(), reduction="none")
    if mask is None:
        return ce.mean()
    m = mask.flatten()
    return (ce * m).sum() / m.sum().clamp_min(1.0)


def prime_history(model: TinyWorldDiT, kv: DenseChunkKV, batch: Batch, gen: torch.Generator) -> None:
    """For a continuing session: commit an old chunk from elsewhere, keep its first frame as the sink."""
    if batch.stale_sink is None or batch.stale_directions is None or batch.stale_cells is None:
        return  # the three are set together (a stale chunk), or none
    commit_chunk(model, kv, batch.stale_sink, batch.stale_directions, batch.stale_cells, gen)
    kv.jump_to(batch.frame_start)


def diffusion_forcing_loss(
    model: TinyWorldDiT, batch: Batch, gen: torch.Generator, class_weight: float = 0.0
) -> torch.Tensor:
    cfg = model.cfg
    b = batch.frames.shape[0]
    fpc = cfg.frames_per_chunk
    chunks = batch.frames.shape[1] // fpc
    kv = DenseChunkKV(cfg, b)
    prime_history(model, kv, batch, gen)
    losses = []
    for c in range(chunks):
        sl = slice(c * fpc, (c + 1) * fpc)
        clean = batch.frames[:, sl]
        dirs = batch.directions[:, sl]
        positions = torch.arange(kv.frame_start, kv.frame_start + fpc)
        # a continuing session's first chunk has only the stale sink: context only, no loss
        train_query = batch.stale_sink is None or c > 0
        commit = c < chunks - 1
        rows_x, rows_t = [], []
        if train_query:
            t = sample_times(b, cfg, gen)
            rows_x.append(noised(clean, t, gen))
            rows_t.append(t)
        if commit:
            level = sample_context_noise(b, cfg, gen)
            rows_x.append(noised(clean, level, gen))
            rows_t.append(level)
        if not rows_x:
            continue
        x = torch.cat(rows_x)
        t = torch.cat(rows_t)[:, None].expand(-1, fpc)
        kv.begin_pass(commit=commit, commit_rows=slice(x.shape[0] - b, x.shape[0]))
        cells = batch.cells[:, sl].repeat(len(rows_x), 1, 1)
        pred = model(x, t, dirs.repeat(len(rows_x), 1), positions, cells, kv.kv, output_rows=b if train_query else 0)
        kv.end_pass()
        if train_query:
            loss = F.mse_loss(pred, clean)
            if class_weight:
                loss = loss + class_weight * class_loss(pred, clean)
            losses.append(loss)
    return torch.stack(losses).mean()


def visibility_mask(origins: np.ndarray, ref_origins: np.ndarray, size: int) -> torch.Tensor:
    """``[B, L, size, size]``: which pixels of each square crop show world seen in any reference crop.

    ``origins`` ``[B, L, 2]`` and ``ref_origins`` ``[B, K, 2]`` are the crops'
    top-left world pixels ``(x, y)``.
    """
    b, length = origins.shape[:2]
    mask = np.zeros((b, length, size, size), dtype=bool)
    grid = np.arange(size)
    for i in range(b):
        for j in range(length):
            for rx, ry in ref_origins[i]:
                cols = (origins[i, j, 0] + grid - rx >= 0) & (origins[i, j, 0] + grid - rx < size)
                rows = (origins[i, j, 1] + grid - ry >= 0) & (origins[i, j, 1] + grid - ry < size)
                mask[i, j] |= rows[:, None] & cols[None, :]
    return torch.as_tensor(mask)


def self_forcing_loss(
    model: TinyWorldDiT, batch: Batch, gen: torch.Generator, class_weight: float = 0.0
) -> torch.Tensor:
    cfg = model.cfg
    b = batch.frames.shape[0]
    fpc = cfg.frames_per_chunk
    chunks = batch.frames.shape[1] // fpc
    kv = DenseChunkKV(cfg, b)
    with torch.no_grad():
        prime_history(model, kv, batch, gen)
        commit_chunk(model, kv, batch.frames[:, :fpc], batch.directions[:, :fpc], batch.cells[:, :fpc], gen)
    origins = batch.cells.cpu().numpy() * cfg.patch_size
    mask = visibility_mask(origins, origins[:, :fpc], cfg.canvas_size)[..., None].float()
    losses = []
    for c in range(1, chunks):
        sl = slice(c * fpc, (c + 1) * fpc)
        clean = batch.frames[:, sl]
        dirs = batch.directions[:, sl]
        t = sample_times(b, cfg, gen)
        positions = torch.arange(kv.frame_start, kv.frame_start + fpc)
        kv.begin_pass(commit=False)
        cells = batch.cells[:, sl]
        pred = model(noised(clean, t, gen), t[:, None].expand(-1, fpc), dirs, positions, cells, kv.kv)
        kv.end_pass()
        m = mask[:, sl]
        loss = ((pred - clean) ** 2 * m).sum() / (m.sum() * 3).clamp_min(1.0)
        if class_weight:
            loss = loss + class_weight * class_loss(pred, clean, m)
        losses.append(loss)
        if c < chunks - 1:
            with torch.no_grad():
                sample_chunk(model, kv, dirs, cells, gen)
    return torch.stack(losses).mean()


FIRST_TRAINING_WORLD = 1000  # training worlds are seeds 1000, 1001, ...; evaluation uses seeds below


def training_worlds(count: int) -> list[int]:
    return list(range(FIRST_TRAINING_WORLD, FIRST_TRAINING_WORLD + count))


class StopOnSignal:
    """Set by SIGTERM or SIGINT: the training loop checkpoints and exits after its current step."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum: int, _frame: Any) -> None:
        self.requested = True


def resume_path(resume: Path | None, out: Path) -> Path | None:
    """The checkpoint ``--resume`` names: a path, or 'auto' for OUT/checkpoint.pt when it exists."""
    if resume is not None and str(resume) == "auto":
        auto = out / "checkpoint.pt"
        return auto if auto.exists() else None
    return resume


def add_run_arguments(p: argparse.ArgumentParser, *, out: Path, log_every: int) -> None:
    """The options every tiny-world trainer shares: worlds, seeds, threads, output, checkpoints, logging."""
    p.add_argument("--worlds", type=int, default=48, help="number of seeded training worlds")
    p.add_argument("--still-share", type=float, default=0.2, help="share of trajectory segments with no key held")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--resume", type=Path, default=None, help="checkpoint to continue from ('auto': OUT/checkpoint.pt if present)")
    p.add_argument("--checkpoint-every-s", type=float, default=240.0)
    p.add_argument("--log-every", type=int, default=log_every)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def ema_decay(step: int, target: float) -> float:
    return min(target, (1 + step) / (10 + step))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--steps", type=int, default=1850, help="total optimiser steps (the learning-rate schedule's length)")
    p.add_argument("--stop-at", type=int, default=None, help="checkpoint and stop at this step (to resume later)")
    p.add_argument("--self-forcing-from", type=int, default=900, help="step at which self-forcing steps begin")
    p.add_argument("--self-forcing-share", type=float, default=0.5, help="share of steps that self-force after that")
    p.add_argument("--chunks", type=int, default=4, help="chunks per diffusion-forcing trajectory")
    p.add_argument("--rollout-chunks", type=int, default=6, help="chunks per self-forcing rollout")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--self-forcing-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ema", type=float, default=0.998)
    p.add_argument("--device", default="cpu", help="torch device to train on (default cpu; e.g. cuda)")
    add_run_arguments(p, out=Path("checkpoints/tiny_world"), log_every=10)
    p.add_argument(
        "--snapshot-every", type=int, default=0, help="also export the EMA weights to OUT/snapshots/step-N every N"
    )
    p.add_argument("--config", type=Path, default=None, help="JSON with TinyWorldConfig overrides")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from these safetensors weights (config.json beside them); layers the config adds start fresh",
    )
    p.add_argument(
        "--head-lr", type=float, default=None, help="learning rate of layers --init-from lacks (default --lr)"
    )
    p.add_argument("--class-loss", type=float, default=0.0, help="weight of the per-pixel palette-class cross-entropy")


def init_from(model: TinyWorldDiT, weights: Path) -> set[str]:
    """Load the weights' tensors into ``model`` (same config but for the output head); returns the new layers' names."""
    source, _training = load_model(weights)
    own = model.state_dict()
    loaded = source.state_dict()
    mismatched = [n for n in loaded if n not in own or own[n].shape != loaded[n].shape]
    if mismatched:
        raise SystemExit(f"{weights}: tensors {mismatched[:5]} do not fit the model being trained")
    model.load_state_dict(loaded, strict=False)
    fresh = {n for n, _ in model.named_parameters() if n not in loaded}
    print(f"initialised from {weights}; fresh layers: {sorted(fresh)}", flush=True)
    return fresh


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def export(out: Path, ema: TinyWorldDiT, meta: dict[str, Any]) -> None:
    save_weights(ema, out / "tiny_world.safetensors", out / "config.json", meta)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type != "cpu":
        # Every factory call (zeros, arange, tensor, as_tensor, randn) then makes its tensor on the device:
        # the model, the KV caches, batches and noise, with no change to the training code.
        torch.set_default_device(device)
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = json.loads(args.config.read_text()) if args.config else {}
    cfg = TinyWorldConfig.from_dict(overrides)

    torch.manual_seed(args.seed)
    model = TinyWorldDiT(cfg)
    fresh = set(dict(model.named_parameters()))
    if args.init_from is not None:
        fresh = init_from(model, args.init_from)
    ema = TinyWorldDiT(cfg)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    head_lr = args.lr if args.head_lr is None else args.head_lr
    named = dict(model.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if n not in fresh], "lr_scale": 1.0},
        {"params": [p for n, p in named.items() if n in fresh], "lr_scale": head_lr / args.lr},
    ]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    step = 0
    train_seconds = 0.0

    resume = resume_path(args.resume, args.out)
    if resume is not None:
        ckpt = torch.load(resume, weights_only=False, map_location="cpu")  # load_state_dict copies to the device
        if ckpt["config"] != cfg.to_dict():
            raise SystemExit(f"{resume}: checkpoint config {ckpt['config']} differs from {cfg.to_dict()}")
        model.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        rng.bit_generator.state = ckpt["np_rng"]
        gen.set_state(ckpt["torch_gen"])
        random.setstate(ckpt["py_rng"])
        step = ckpt["step"]
        train_seconds = ckpt["train_seconds"]
        print(f"resumed from {resume} at step {step} ({train_seconds / 60:.1f} min trained)", flush=True)

    sampler = TrajectorySampler(training_worlds(args.worlds), cfg, rng, args.still_share)
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny-world: {params / 1e6:.2f} M parameters, config {json.dumps(cfg.to_dict())}", flush=True)
    print(f"training: {json.dumps({k: str(v) for k, v in vars(args).items()})}", flush=True)

    stop = StopOnSignal()

    def checkpoint() -> None:
        state = {
            "config": cfg.to_dict(),
            "model": model.state_dict(),
            "ema": ema.state_dict(),
            "opt": opt.state_dict(),
            "np_rng": rng.bit_generator.state,
            "torch_gen": gen.get_state(),
            "py_rng": random.getstate(),
            "step": step,
            "train_seconds": train_seconds,
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        save_checkpoint(args.out / "checkpoint.pt", state)
        export(args.out, ema, {"step": step, "train_seconds": round(train_seconds, 1)})

    run_start = time.perf_counter()
    run_start_step = step
    last_ckpt = time.perf_counter()
    recent: list[float] = []
    last_step = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    while step < last_step and not stop.requested:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args) * group["lr_scale"]
        stale = rng.random() < 0.5
        self_force = step >= args.self_forcing_from and rng.random() < args.self_forcing_share
        model.train()
        if self_force:
            batch = sampler.sample(args.self_forcing_batch_size, args.rollout_chunks, stale)
            loss = self_forcing_loss(model, batch, gen, args.class_loss)
        else:
            batch = sampler.sample(args.batch_size, args.chunks, stale)
            loss = diffusion_forcing_loss(model, batch, gen, args.class_loss)
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            decay = ema_decay(step, args.ema)
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        step += 1
        if args.snapshot_every and step % args.snapshot_every == 0:
            meta = {"step": step, "train_seconds": round(train_seconds, 1)}
            export(args.out / "snapshots" / f"step-{step}", ema, meta)
        dt = time.perf_counter() - t0
        train_seconds += dt
        recent.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - run_start
            per_step = elapsed / max(1, step - run_start_step)
            eta = per_step * (args.steps - step)
            print(
                f"step {step}/{args.steps} loss {np.mean(recent):.4f} lr {lr_at(step, args):.2e} "
                f"{'mixed' if step > args.self_forcing_from else 'diffusion-forcing'} "
                f"elapsed {elapsed / 60:.1f} min (total {train_seconds / 60:.1f}) "
                f"{per_step:.2f} s/step ETA {eta / 60:.1f} min",
                flush=True,
            )
            recent = []
        if time.perf_counter() - last_ckpt > args.checkpoint_every_s:
            checkpoint()
            last_ckpt = time.perf_counter()
    checkpoint()
    print(f"saved {args.out / 'checkpoint.pt'} and {args.out / 'tiny_world.safetensors'} at step {step}", flush=True)
    return 0


main = main_for("train", "tiny-world")

if __name__ == "__main__":
    sys.exit(main())

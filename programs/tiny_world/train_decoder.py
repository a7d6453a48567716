"""``arstream train tiny-world-decoder``: train the frame decoder (decoder.py) on a frozen transformer.

The transformer (``--init-from``, default the shipped weights) stays as it is.
Training pairs come from it, under the conditions the decoder meets when
serving: random camera walks over the training worlds, each chunk's estimate
made by the real few-step sampler from noise while the KV history holds the
earlier chunks' ground truth (what a decoded, palette-true history looks
like). For each frame the decoder reads that estimate, the ground truth of the
previous frame moved into the frame's cells, and its mask, and is trained with
a per-pixel cross-entropy against the ground truth's classes, on the pixels
the history held (where the estimate could know the truth; cells entering
the view are the transformer's invention, and training the decoder to guess
their truth would teach it the map's most common colour instead of drawing
what the estimate shows). A walk's first chunk makes no pairs for the same
reason. Two augmentations: a share of frames (``--drop-previous``) is shown
without its previous frame, as at the start of a rollout, and a share
(``--unrelated``) gets another frame's estimate, so the decoder learns to keep
the previous picture where it exists even when the estimate wanders; the
eight flips and rotations of the square canvas augment every batch.

The pairs are made once and kept in ``OUT/pairs.pt``; checkpoints (decoder,
optimiser, step) go to ``OUT/checkpoint.pt`` every few minutes and on exit,
``--resume auto`` continues. The result, transformer plus decoder, is exported
as ``OUT/tiny_world.safetensors`` + ``OUT/config.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ...cli import main_for
from ...models.tiny_world.decoder import NUM_CLASSES, align_previous, nearest_class, palette_canvas
from .metrics import total_variation
from ...models.tiny_world.model import TinyWorldDiT
from ...models.tiny_world.sampling import DenseChunkKV, commit_chunk, estimate_chunk, sample_chunk
from .train import (
    StopOnSignal,
    TrajectorySampler,
    add_run_arguments,
    resume_path,
    save_checkpoint,
    training_worlds,
)
from ...models.tiny_world.weights import DEFAULT_WEIGHTS, load_model, save_weights
from ...models.tiny_world.world import CLASS_SHARES


def make_pairs(
    model: TinyWorldDiT, sampler: TrajectorySampler, frames: int, chunks: int, batch: int, seed: int
) -> dict[str, torch.Tensor]:
    """``frames`` training frames: the sampler's estimate, the previous ground truth moved into place, mask, target."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    fpc = cfg.frames_per_chunk
    estimates, previous, masks, targets = [], [], [], []
    made = 0
    started = time.perf_counter()
    with torch.inference_mode():
        while made < frames:
            trajectory = sampler.sample(batch, chunks, stale=False)
            kv = DenseChunkKV(cfg, batch)
            for c in range(chunks):
                span = slice(c * fpc, (c + 1) * fpc)
                truth, dirs, cells = trajectory.frames[:, span], trajectory.directions[:, span], trajectory.cells[:, span]
                estimate = estimate_chunk(model, kv, dirs, cells, gen)
                commit_chunk(model, kv, truth, dirs, cells, gen)
                if c == 0:
                    # Without a history the transformer invents a place, not this one: nothing to learn from.
                    continue
                for f in range(fpc):
                    i = c * fpc + f
                    shifted, mask = align_previous(
                        trajectory.frames[:, i - 1], trajectory.cells[:, i - 1], cells[:, f], cfg.patch_size
                    )
                    estimates.append(estimate[:, f].half())
                    previous.append(nearest_class(shifted).to(torch.uint8))
                    masks.append(mask[..., 0].to(torch.bool))
                    targets.append(nearest_class(truth[:, f]).to(torch.uint8))
            made += batch * (chunks - 1) * fpc
            elapsed = time.perf_counter() - started
            print(f"pairs {made}/{frames} ({elapsed:.0f} s)", flush=True)
    return {
        "estimate": torch.cat(estimates)[:frames],
        "previous": torch.cat(previous)[:frames],
        "mask": torch.cat(masks)[:frames],
        "target": torch.cat(targets)[:frames],
    }


def dihedral(x: torch.Tensor, k: int) -> torch.Tensor:
    """One of the eight flips/rotations of ``[N, C, C, ...]`` canvases (spatial dims 1 and 2)."""
    if k & 4:
        x = x.transpose(1, 2)
    return torch.rot90(x, k & 3, dims=(1, 2))


def decoder_batch(
    pairs: dict[str, torch.Tensor],
    index: torch.Tensor,
    drop_previous: float,
    unrelated: float,
    entering_weight: float,
    rng: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    """Inputs, target and loss weight of one batch (see the module docstring for the augmentations)."""
    palette = palette_canvas()
    estimate = pairs["estimate"][index].float()
    previous = palette[pairs["previous"][index].long()]
    known = pairs["mask"][index].float()[..., None]
    target = pairs["target"][index].long()
    # Some frames get another frame's estimate: where the previous frame exists it is the truth, so the
    # decoder learns to keep it even when the transformer's estimate wanders (a still camera stays still).
    swap = torch.rand(len(index), generator=rng) < unrelated
    estimate[swap] = estimate.roll(1, 0)[swap]
    weight = known[..., 0] + entering_weight * (1 - known[..., 0])
    # Others are shown without their previous frame, as at the start of a rollout.
    drop = (torch.rand(len(index), generator=rng) < drop_previous) & ~swap
    known[drop] = 0
    k = int(torch.randint(8, (1,), generator=rng))
    return dihedral(estimate, k), dihedral(previous, k), dihedral(known, k), dihedral(target, k), dihedral(weight, k)


def rollout_class_shares(
    model: TinyWorldDiT, sampler: TrajectorySampler, walks: int, chunks: int, seed: int
) -> np.ndarray:
    """Class shares of every canvas the model generates (decoder included) along ``walks`` random walks."""
    cfg = model.cfg
    fpc = cfg.frames_per_chunk
    trajectory = sampler.sample(walks, chunks, stale=False)
    kv = DenseChunkKV(cfg, walks)
    gen = torch.Generator().manual_seed(seed)
    previous = None
    counts = np.zeros(NUM_CLASSES)
    with torch.inference_mode():
        for c in range(chunks):
            span = slice(c * fpc, (c + 1) * fpc)
            cells = trajectory.cells[:, span]
            canvases = sample_chunk(model, kv, trajectory.directions[:, span], cells, gen, previous)
            previous = (canvases[:, -1], cells[:, -1])
            counts += np.bincount(nearest_class(canvases).flatten().numpy(), minlength=NUM_CLASSES)
    return counts / counts.sum()


def calibrate(
    model: TinyWorldDiT, world_seeds: list[int], walks: int, chunks: int, rounds: int, seed: int
) -> TinyWorldDiT:
    """Fit the decoder's class prior for unseen content so that generated walks have the map's class shares.

    The decoder is trained only where the estimate could know the truth, so
    for content nobody has seen (cells entering the view, a rollout's first
    frame) it draws whatever colour the transformer's uncertain estimate is
    nearest to. Each round rolls out the same walks on training worlds and
    moves each class's logit offset by the log ratio of the map's share to the
    generated share; the offsets of the round with the smallest total
    variation are kept.
    """
    target = np.array(CLASS_SHARES)
    bias = np.zeros(NUM_CLASSES)
    best: tuple[float, tuple[float, ...]] | None = None
    for round_ in range(rounds + 1):
        model.cfg = replace(model.cfg, decoder_class_bias=tuple(float(b) for b in bias))
        sampler = TrajectorySampler(world_seeds, model.cfg, np.random.default_rng(seed), still_share=0.2)
        shares = rollout_class_shares(model, sampler, walks, chunks, seed)
        tv = total_variation(shares, target)
        print(
            f"calibration round {round_}: bias {np.round(bias, 2).tolist()} "
            f"shares {np.round(shares, 3).tolist()} TV {tv:.3f}",
            flush=True,
        )
        if best is None or tv < best[0]:
            best = (tv, model.cfg.decoder_class_bias)
        bias = bias + np.log(target / np.maximum(shares, 1e-4))
    assert best is not None
    model.cfg = replace(model.cfg, decoder_class_bias=best[1])
    return model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--init-from", type=Path, default=DEFAULT_WEIGHTS, help="transformer weights (default: shipped)")
    p.add_argument("--channels", type=int, default=16, help="decoder width (default 16)")
    p.add_argument("--pairs", type=int, default=8192, help="training frames to make (default 8192, as shipped)")
    p.add_argument("--clip-chunks", type=int, default=5, help="chunks per camera walk when making pairs (>= 2)")
    p.add_argument("--pair-batch", type=int, default=16, help="walks per batched sampler call when making pairs")
    p.add_argument("--steps", type=int, default=2500, help="total optimiser steps (the learning-rate schedule's length)")
    p.add_argument("--stop-at", type=int, default=None, help="checkpoint and stop at this step (to resume later)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--drop-previous", type=float, default=0.15, help="share of frames trained without a previous frame")
    p.add_argument(
        "--entering-weight",
        type=float,
        default=0.0,
        help="loss weight of cells entering the view (their truth is partly a guess; 1: weighed like the rest)",
    )
    p.add_argument("--unrelated", type=float, default=0.3, help="share of frames trained with another frame's estimate")
    p.add_argument("--keep-logit", type=float, default=3.0, help="decoder_keep_logit of the exported model")
    p.add_argument(
        "--unseen-window",
        type=int,
        default=7,
        help="decoder_unseen_window of the exported model, set after the calibration (default 7, as shipped; 0: none)",
    )
    p.add_argument(
        "--view-prior",
        type=float,
        default=1.0,
        help="decoder_view_prior of the exported model, set after the calibration (default 1, as shipped; 0: none)",
    )
    p.add_argument(
        "--calibrate-rounds",
        type=int,
        default=2,
        help="rounds fitting the class prior of unseen content (default 2, as shipped; 0: none)",
    )
    p.add_argument("--calibrate-walks", type=int, default=24, help="walks per calibration round")
    p.add_argument("--calibrate-chunks", type=int, default=40, help="chunks per calibration walk")
    add_run_arguments(p, out=Path("checkpoints/tiny_world_decoder"), log_every=25)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    transformer, training = load_model(args.init_from)
    cfg = replace(transformer.cfg, decoder_channels=args.channels)
    model = TinyWorldDiT(cfg)
    model.load_state_dict(transformer.state_dict(), strict=False)
    model.requires_grad_(False)
    decoder = model.decoder
    decoder.requires_grad_(True)
    pairs_path = args.out / "pairs.pt"
    if pairs_path.is_file():
        pairs = torch.load(pairs_path)
        print(f"pairs: {len(pairs['target'])} from {pairs_path}", flush=True)
    else:
        rng = np.random.default_rng(args.seed)
        sampler = TrajectorySampler(training_worlds(args.worlds), cfg, rng, args.still_share)
        pairs = make_pairs(transformer, sampler, args.pairs, args.clip_chunks, args.pair_batch, args.seed)
        save_checkpoint(pairs_path, pairs)
    optimiser = torch.optim.AdamW(decoder.parameters(), lr=args.lr, weight_decay=0.0)
    rng = torch.Generator().manual_seed(args.seed + 1)
    step = 0
    resume = resume_path(args.resume, args.out)
    if resume is not None:
        state = torch.load(resume)
        decoder.load_state_dict(state["decoder"])
        optimiser.load_state_dict(state["optimiser"])
        rng.set_state(state["rng"])
        step = state["step"]
        print(f"resumed from {resume} at step {step}", flush=True)
    stop = StopOnSignal()

    def checkpoint() -> None:
        state = {"decoder": decoder.state_dict(), "optimiser": optimiser.state_dict(), "rng": rng.get_state(), "step": step}
        save_checkpoint(args.out / "checkpoint.pt", state)

    count = len(pairs["target"])
    last_checkpoint = started = time.perf_counter()
    running = 0.0
    last_step = min(args.steps, args.stop_at or args.steps)
    while step < last_step and not stop.requested:
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimiser.param_groups:
            group["lr"] = lr
        index = torch.randint(count, (args.batch_size,), generator=rng)
        estimate, previous, mask, target, weight = decoder_batch(
            pairs, index, args.drop_previous, args.unrelated, args.entering_weight, rng
        )
        logits = decoder(estimate, previous, mask)
        per_pixel = F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="none")
        loss = (per_pixel * weight.flatten()).sum() / weight.sum().clamp_min(1.0)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        step += 1
        running += loss.item()
        if step % args.log_every == 0:
            elapsed = time.perf_counter() - started
            print(f"step {step}/{args.steps} loss {running / args.log_every:.4f} lr {lr:.2e} {elapsed:.0f} s", flush=True)
            running = 0.0
        if time.perf_counter() - last_checkpoint > args.checkpoint_every_s:
            checkpoint()
            last_checkpoint = time.perf_counter()
    checkpoint()
    model.eval()
    # The class offsets are fitted without the window and the view prior, as shipped (they are set below),
    # whatever the transformer's config (--init-from) carries.
    model.cfg = replace(model.cfg, decoder_keep_logit=args.keep_logit, decoder_unseen_window=0, decoder_view_prior=0.0)
    if args.calibrate_rounds and step >= args.steps:  # the finished model, not a --stop-at or interrupted one
        calibrate(model, training_worlds(args.worlds), args.calibrate_walks, args.calibrate_chunks, args.calibrate_rounds, args.seed + 2)
    model.cfg = replace(model.cfg, decoder_unseen_window=args.unseen_window, decoder_view_prior=args.view_prior)
    decoder_meta = {
        "step": step,
        "pairs": count,
        "channels": args.channels,
        "calibrate_rounds": args.calibrate_rounds,
        "unseen_window": args.unseen_window,
        "view_prior": args.view_prior,
    }
    meta = {**training, "decoder": {**decoder_meta, "init_from": str(args.init_from)}}
    save_weights(model, args.out / "tiny_world.safetensors", args.out / "config.json", meta)
    print(f"exported {args.out / 'tiny_world.safetensors'} at step {step}", flush=True)
    return 0


main = main_for("train", "tiny-world-decoder")

if __name__ == "__main__":
    sys.exit(main())

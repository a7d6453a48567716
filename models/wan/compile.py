"""Compiled forwards (``arstream serve --compile``): torch.compile of each DiT block, traced before the server is ready.

Every block of a Wan DiT runs the same code on its own weights, so one
compiled graph serves them all. torch.compile builds lazily, on the first
call with each input shape; the server's warm-up (runner warm-up requests, at
every batch size the scheduler will use) makes those calls before ``/readyz``
says ready, so no client meets the minute of compilation. A hook on the DiT
logs each new shape as it is compiled ("compiling ...") and how long it took,
which is the progress an operator sees.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any

import torch
from torch import nn

log = logging.getLogger("arstream.compile")


class CompileUnavailable(RuntimeError):
    """torch.compile cannot build here (on the CPU, inductor needs a C++ compiler)."""


def check_compiler(device: torch.device) -> None:
    if device.type == "cpu" and shutil.which("g++") is None and shutil.which("c++") is None:
        raise CompileUnavailable("--compile on the CPU needs a C++ compiler (g++) for torch's inductor; none is on PATH")


def compile_blocks(model: nn.Module, device: torch.device) -> None:
    """Compile ``model.blocks`` in place (each block's forward), and log compilation progress per input shape."""
    check_compiler(device)
    blocks: Any = model.blocks
    for block in blocks:
        block.compile()
    progress = _CompileProgress(len(blocks))
    model.register_forward_pre_hook(progress.before)
    model.register_forward_hook(progress.after)
    log.info("compiling: %d DiT blocks compile on their first forward of each shape (the warm-up)", len(blocks))


class _CompileProgress:
    """Logs each DiT forward that compiled: the first of each latent shape, and any that took past ``NOTE_S``.

    torch.compile also rebuilds a graph when a history length first changes
    (then it marks that size dynamic), so a slow forward of a known shape is a
    compile too.
    """

    NOTE_S = 2.0

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.seen: set[tuple[int, ...]] = set()
        self.started = 0.0
        self.forwards = 0

    @staticmethod
    def _shape(args: tuple[Any, ...]) -> list[int]:
        return list(args[0].shape) if args and isinstance(args[0], torch.Tensor) else []

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        shape = tuple(self._shape(args))
        if shape not in self.seen:
            self.seen.add(shape)
            log.info("compiling: DiT forward for latents %s (shape %d)", list(shape), len(self.seen))
        self.started = time.perf_counter()

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.forwards += 1
        took = time.perf_counter() - self.started
        if took > self.NOTE_S:
            log.info("compiling: forward %d (latents %s) took %.1f s", self.forwards, self._shape(args), took)

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
    """Logs the first forward of each input shape: the one that compiles."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.seen: set[tuple[int, ...]] = set()
        self.started: dict[tuple[int, ...], float] = {}

    @staticmethod
    def _shape(args: tuple[Any, ...]) -> tuple[int, ...]:
        return tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else ()

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        shape = self._shape(args)
        if shape not in self.seen:
            self.seen.add(shape)
            self.started[shape] = time.perf_counter()
            log.info("compiling: DiT forward for latents %s (shape %d)", list(shape), len(self.seen))

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        started = self.started.pop(self._shape(args), None)
        if started is not None:
            log.info("compiling: latents %s done in %.1f s", list(self._shape(args)), time.perf_counter() - started)

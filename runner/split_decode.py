"""Split decode: a round's chunks decoded apart from their forward, so the decode can overlap the next one.

With ``split_decode=True`` and a pipeline that implements
:class:`~arstream.runner.contract.SupportsSplitDecode`, the runner's
``execute`` runs the forwards only and its chunks carry ``pending`` (what to
decode) instead of frames; :meth:`SplitDecoder.decode` decodes them, on
another thread while the next forward runs (the worker's decode stage). It
touches no session: a session whose own decode fails comes back as a
:class:`TickFailure`, and the runner releases it on its own thread.

:class:`DecodesInFlight` says which sessions have a decode in flight (the rewinds and the parking ask). A rank of
a replica over several devices counts one from its forward until the caller joins it, not until it ends: rank 0
decodes, the other ranks never do (:meth:`SplitDecoder.forget`), and every rank must choose the same session to
park whatever the decode's timing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from .chunks import ChunkShapeError, check_frames
from .contract import SupportsSplitDecode
from .stats import RuntimeCounters
from .types import ChunkResult, PendingDecode, TickFailure, TickResult

log = logging.getLogger("arstream.runner")


class SplitDecoder:
    """Decodes pending chunks with the pipeline's ``decode_latents``; safe beside the runner's forward."""

    def __init__(
        self,
        pipeline: SupportsSplitDecode,
        *,
        video_frames: Callable[[int], int],
        counters: RuntimeCounters,
        device: torch.device,
        sync: Callable[[torch.device], None],
    ) -> None:
        self.pipeline = pipeline
        self.video_frames = video_frames
        self.counters = counters
        self.device = device
        self._sync = sync

    def decode(self, results: Sequence[ChunkResult]) -> list[TickResult]:
        """Decode one round's pending chunks (distinct sessions); a chunk without ``pending`` passes as it is.

        If the decode of the whole round raises, each chunk is decoded again
        alone (the pipeline stores a decoder state only on success), so only a
        session whose own decode fails gets a :class:`TickFailure`.
        """
        out: list[TickResult] = list(results)
        todo = [i for i, r in enumerate(results) if r.pending is not None]
        if not todo:
            return out
        try:
            self._decode_into(out, results, todo)
            return out
        except Exception as exc:  # noqa: BLE001 - reported in the tick's place, or retried alone
            if len(todo) == 1:
                r = results[todo[0]]
                out[todo[0]] = TickFailure(r.session_id, r.request_id, exc)
                return out
            log.warning("decoding %d chunks together failed (%s: %s); each alone", len(todo), type(exc).__name__, exc)
        for i in todo:
            try:
                self._decode_into(out, results, [i])
            except Exception as exc:  # noqa: BLE001 - only this session fails
                out[i] = TickFailure(results[i].session_id, results[i].request_id, exc)
        return out

    def _decode_into(self, out: list[TickResult], results: Sequence[ChunkResult], rows: list[int]) -> None:
        started = time.perf_counter()
        chunks = [results[i].pending for i in rows]
        frames = self._decode([c for c in chunks if c is not None], [results[i] for i in rows])
        decode_s = time.perf_counter() - started
        self.counters.decodes(decode_s, len(rows))
        for i, chunk in zip(rows, frames):
            r = results[i]
            out[i] = replace(r, frames=chunk, pending=None, decode_s=decode_s, compute_s=r.compute_s + decode_s)

    def _decode(self, chunks: list[PendingDecode], results: list[ChunkResult]) -> list[np.ndarray]:
        frames = self.pipeline.decode_latents(chunks)
        if not isinstance(frames, list) or len(frames) != len(chunks):
            raise ChunkShapeError(f"decode_latents must return a list of {len(chunks)} frame arrays")
        for chunk, result in zip(frames, results):
            check_frames(chunk, self.video_frames(result.chunk_index))
        self._sync(self.device)
        return frames

    def forget(self, results: Sequence[ChunkResult]) -> list[TickResult]:
        """A runner that never decodes (a rank other than 0): its chunks' latents are dropped with the decoder's
        state of their sessions, and they come back with neither frames nor ``pending``."""
        chunks = [r.pending for r in results if r.pending is not None]
        if chunks:
            self.pipeline.forget_decodes(chunks)
            self.counters.decodes_forgotten_total += len(chunks)
        return [replace(r, pending=None) for r in results]


class DecodesInFlight:
    """Whether a session has a decode in flight: the pipeline's own answer (until the decode ends), or, for a rank
    of a replica (``in_step``), from its forward until :meth:`joined` names it (the caller joined that decode)."""

    def __init__(self, pipeline: object, *, split_decode: bool, in_step: bool) -> None:
        self._pipeline = pipeline if split_decode and isinstance(pipeline, SupportsSplitDecode) else None
        self.in_step = in_step and self._pipeline is not None
        self._forwarded: set[str] = set()

    def __call__(self, session_id: str) -> bool:
        if self.in_step:
            return session_id in self._forwarded
        return self._pipeline is not None and self._pipeline.decode_in_flight(session_id)

    def forwarded(self, session_id: str) -> None:
        if self.in_step:
            self._forwarded.add(session_id)

    def joined(self, session_ids: Sequence[str]) -> None:
        self._forwarded.difference_update(session_ids)

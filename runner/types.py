"""The runner's request and result types: what crosses the worker boundary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

# The runtimes `arstream serve --runtime` offers (their classes: arstream.runner.runtimes.RUNTIMES_BY_NAME).
RuntimeName = Literal["arstream", "vllm-omni"]
RUNTIMES: tuple[RuntimeName, ...] = ("arstream", "vllm-omni")


@dataclass(frozen=True)
class ParkingPolicy:
    """When a runner parks sessions, and where (``arstream serve --park-*``; docs/deployment.md, "Parking";
    runner/session_parking.py).

    ``budget_bytes`` of host memory hold parked sessions (0: parking is off);
    ``after_s`` is how long a session may stay idle before it is parked (None:
    only when its slot is needed, or when the server says so, e.g. it detached);
    ``spill_dir`` and ``spill_budget_bytes``: where and how much past the host
    budget goes to disk.
    """

    budget_bytes: int = 0
    after_s: float | None = None
    spill_dir: str | None = None
    spill_budget_bytes: int = 0

    def __post_init__(self) -> None:
        if self.budget_bytes < 0 or self.spill_budget_bytes < 0:
            raise ValueError("park budgets must be byte counts >= 0")
        if self.after_s is not None and self.after_s < 0:
            raise ValueError(f"park_after_s must be >= 0 seconds, got {self.after_s}")
        if self.spill_budget_bytes and self.spill_dir is None:
            raise ValueError("a spill budget needs a spill directory (park_spill_dir)")


@dataclass(frozen=True)
class RuntimeOptions:
    """What every runtime is built with, from the server's settings; each uses what applies to it."""

    device: torch.device | str = "cpu"
    kv_budget_bytes: int | None = None
    memory_fraction: float | None = None
    max_batch_sessions: int = 1
    # how far back a session may rewind, in seconds of play, within rewind_budget_bytes (ARRunner; docs/rewind.md)
    rewind_seconds: float = 0.0
    rewind_budget_bytes: int = 0
    # run a pipeline's decode apart from its forward (ARRunner; runtimes.SplitDecodeRuntime)
    split_decode: bool = False
    # a rank of a replica over several devices (runner/distributed/): False on the ranks other than 0, which never
    # decode (runner/split_decode.py: SplitDecoder.forget); in_step: a decode counts as in flight until the
    # caller joins it (ARRunner.join_decodes), so that every rank parks alike whatever the decode's timing
    decodes: bool = True
    in_step: bool = False
    # move idle, detached and least recently used sessions to host memory (ARRunner; runner/parking.py)
    parking: ParkingPolicy | None = None
    # a replica over several devices (``--devices``; runner/distributed/): one device per rank, rank 0 first, and
    # how every other rank loads the model for itself (called with its device; picklable: it crosses processes)
    devices: tuple[str, ...] = ()
    load_pipeline: Callable[[str], Any] | None = None
    # how long a rank may stay silent (no heartbeat), and a collective wait, before the replica is lost
    collective_timeout_s: float = 60.0

    def pool(self) -> dict[str, Any]:
        """The pool's sizing, as every runtime's constructor takes it."""
        return {
            "device": self.device,
            "kv_budget_bytes": self.kv_budget_bytes,
            "memory_fraction": self.memory_fraction,
            "max_batch_sessions": self.max_batch_sessions,
        }


class UnsupportedConfiguration(ValueError):
    """The pipeline or settings ask for something this runner does not do."""


class ReplicaLost(RuntimeError):
    """A replica over several devices lost a rank (it died, hung past the deadline or went its own way).

    The replica fails closed: every session on it ends with this as its reason, its KV pool is released, its
    process group is torn down, and the server stops being ready and exits non-zero for its supervisor.
    """


class RewindUnavailable(ValueError):
    """A rewind or branch names a chunk boundary the session does not hold (or the runtime keeps none).

    Raised before anything changes: the session keeps its state and the tick
    runs nothing. In :meth:`~arstream.runner.runner.ARRunner.execute` it is a
    :class:`TickFailure` whose session was *not* released (the one such case).
    """


def centre_crop_box(width: int, height: int, frame_width: int, frame_height: int) -> tuple[int, int, int, int]:
    """The centred box of a ``width`` x ``height`` picture with the frame's aspect (left, top, right, bottom).

    Matrix-Game's ``_resizecrop``, rounded as PIL's ``crop`` rounds: the part of a start image a model shows.
    """
    if height / width > frame_height / frame_width:
        new_w, new_h = width, int(width * frame_height / frame_width)
    else:
        new_w, new_h = int(height * frame_width / frame_height), height
    box = ((width - new_w) / 2, (height - new_h) / 2, (width + new_w) / 2, (height + new_h) / 2)
    left, top, right, bottom = (round(v) for v in box)
    return left, top, right, bottom


@dataclass(frozen=True)
class StartImage:
    """A session's start image, chosen when the session starts.

    Either one the model offers by ``name`` (listed in its card) or the
    client's own ``pixels``: uint8 ``[H, W, 3]`` RGB, already decoded and
    bounded by the transport, which keeps only what a model uses: the
    centred part of the frame's aspect (:func:`centre_crop_box`) resized to
    the model's frame (``width`` x ``height`` of its card).
    ``digest`` identifies the content (e.g. a SHA-256 of the pixels or of the
    name) so a pipeline can cache what it derives from an image.
    """

    digest: str
    name: str | None = None
    pixels: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TickRequest:
    """Ask for one chunk of one session.

    ``controls`` and ``prompt`` are the session's current values, already
    validated by the transport. ``reset`` releases the session's KV and model
    state before the chunk runs; ``close`` releases it after. ``start_image``
    is the session's start image (None: the model's default); a pipeline that
    takes one reads it when a rollout begins, so every tick carries it.
    ``rewind_to`` b takes the session back to its chunk boundary b (the state
    after its chunks 0..b-1) before the chunk runs, after a ``reset``; the
    chunk then has ``chunk_index`` b. A boundary the session does not hold
    raises :class:`RewindUnavailable` and nothing changes.
    ``prompt_transition_chunks`` is how many chunks a model whose card says
    ``prompt_switch: "blend"`` blends into ``prompt`` when it differs from the
    one it is on (:mod:`arstream.runner.prompt_blend`); others ignore it.
    """

    session_id: str
    request_id: int
    controls: dict[str, Any] = field(default_factory=dict)
    prompt: str | None = None
    prompt_transition_chunks: int = 0
    seed: int | None = None
    reset: bool = False
    close: bool = False
    applied_event_ids: tuple[int, ...] = ()
    start_image: StartImage | None = None
    rewind_to: int | None = None


@dataclass(frozen=True)
class PendingDecode:
    """A chunk whose forward ran (KV committed, model state advanced) and whose frames are still to decode.

    ``payload`` is the pipeline's own (its latents); the runner only carries it to
    :meth:`~arstream.runner.contract.SupportsSplitDecode.decode_latents`.
    """

    session_id: str
    chunk_index: int
    payload: Any


# The frames of a ChunkResult whose decode is still to run (``pending`` holds what to decode).
NOT_DECODED = np.zeros((0, 0, 0, 3), dtype=np.uint8)


@dataclass(frozen=True)
class ChunkResult:
    """One generated chunk.

    ``frames`` is uint8 ``[F, H, W, 3]``. ``chunk_index`` counts chunks since
    the session's rollout began; 0 means a new rollout (first chunk, reset or
    after the session was evicted). ``compute_s`` is the bound forward's wall
    time including the device sync (and, with a split decode, ``decode_s``, the
    decode's). ``restarted`` is ``"rewind"`` when the
    tick asked for ``rewind_to`` (else None; the transport names resets and
    evictions itself). ``rewind_points`` is ``(oldest, newest)``: the
    boundaries a later ``rewind_to`` may name (newest is ``chunk_index + 1``,
    where the session now is); None when the runtime keeps none.
    ``rewind_held`` lists every boundary held between the two (older ones are
    thinned out, docs/rewind.md), oldest first.
    """

    session_id: str
    request_id: int
    chunk_index: int
    frames: np.ndarray
    compute_s: float
    new_rollout: bool
    applied_event_ids: tuple[int, ...] = ()
    restarted: Literal["rewind"] | None = None
    rewind_points: tuple[int, int] | None = None
    # With a split decode (ARRunner(split_decode=True)): the chunk to decode; ``frames`` is NOT_DECODED until then.
    pending: PendingDecode | None = None
    decode_s: float = 0.0
    rewind_held: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TickFailure:
    """A tick whose forward raised; the runner released its session (fail closed).

    Except when ``error`` is a :class:`RewindUnavailable`: then nothing ran and
    the session is as it was.

    :meth:`arstream.runner.runner.ARRunner.execute` returns it in the failed tick's
    place, so the other ticks of the same call keep their results.
    """

    session_id: str
    request_id: int
    error: Exception


TickResult = ChunkResult | TickFailure

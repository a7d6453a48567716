"""What a rank other than 0 runs: the same pipeline and runner over its share of the heads, driven by rank 0.

Rank 0 sends each call it makes on its own runner (a round's ticks, a close, a park, the warm-up, the join of
a decode, its share of a snapshot's export or import: :mod:`.transfer`) down a pipe
before making it; this rank makes the same call on its runner, so both allocate the same block ids, draw the
same seeded noise and meet in the same collectives, and answers with a digest of what came out (each tick's
outcome, the pool's free blocks) that rank 0 checks against its own. It never decodes: only rank 0 sends frames. The pipe closing (rank 0 is gone) ends it.
It beats a heartbeat all along (:mod:`.liveness`): rank 0 kills a rank that stops.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import torch
import torch.distributed as dist

from ..contract import ARPipeline
from ..types import RuntimeOptions, TickFailure
from .liveness import start_heartbeat
from .sequence_parallel import SequenceParallel
from ..snapshot_stream import Part
from ..snapshot_import import SessionImport
from .transfer import block_copy, share_layout, share_plan

log = logging.getLogger("arstream.runner.distributed")

# How long a rank may take to load its model and build its pool before the replica gives up on starting.
START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankPlan:
    """Everything a rank needs to join the replica (picklable: it crosses into a spawned process)."""

    rank: int
    world: int
    init_method: str  # tcp://host:port of rank 0's rendezvous
    options: RuntimeOptions
    torch_threads: int

    @property
    def device(self) -> torch.device:
        return torch.device(self.options.devices[self.rank])

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def join_group(plan: RankPlan) -> dist.ProcessGroup:
    """Join the replica's process group; the group returned is the forward's, whose collectives fail past
    ``collective_timeout_s`` (the rendezvous itself waits up to ``START_TIMEOUT_S``: the ranks load at their pace)."""
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    dist.init_process_group(
        plan.backend,
        init_method=plan.init_method,
        rank=plan.rank,
        world_size=plan.world,
        timeout=timedelta(seconds=START_TIMEOUT_S),
    )
    group = dist.new_group(backend=plan.backend, timeout=timedelta(seconds=plan.options.collective_timeout_s))
    assert group is not None
    return group


def rank_options(plan: RankPlan) -> RuntimeOptions:
    """The runner options of one rank: its own device, and its own spill folder (the ranks' shards differ)."""
    parking = plan.options.parking
    if parking is not None and parking.spill_dir is not None:
        parking = replace(parking, spill_dir=os.path.join(parking.spill_dir, f"rank{plan.rank}"))
    # Rank 0 decodes (apart from the forward with the server's --decode-overlap); the others never do. Every rank
    # counts a decode in flight until rank 0 joins it, so that a rank's runner is a deterministic function of the
    # calls it is given, whenever rank 0's decode ends.
    if plan.rank == 0:
        return replace(plan.options, device=plan.device, parking=parking, in_step=True)
    return replace(plan.options, device=plan.device, parking=parking, decodes=False, in_step=plan.options.split_decode)


def shard_pipeline(pipeline: ARPipeline, plan: RankPlan, group: dist.ProcessGroup) -> SequenceParallel:
    """Give the pipeline this rank's share of the heads (the caller checked that it can be sharded)."""
    parallel = SequenceParallel(plan.rank, plan.world, group)
    pipeline.shard_heads(parallel)  # type: ignore[attr-defined]
    return parallel


def digest(result: Any) -> Any:
    """What rank 0 compares between ranks: each tick's outcome, or a plain return value."""
    if isinstance(result, list):
        return [
            ("failed", type(r.error).__name__) if isinstance(r, TickFailure) else ("chunk", r.chunk_index)
            for r in result
        ]
    if result is None or isinstance(result, (bool, int, str, tuple)):
        return result
    return type(result).__name__


def _sessions_moved_on(name: str, args: tuple[Any, ...]) -> list[str]:
    """The sessions a call changes (a chunk, a reset, a close), whose planned export is then over."""
    if name == "execute":
        return [tick.session_id for tick in args[0]]
    return [args[0]] if name in ("close_session", "reset_session") else []


def rank_main(plan: RankPlan, conn: Connection, heartbeat: Synchronized[float]) -> None:
    """A spawned rank's whole life: beat, join, load, shard, build the runner, then serve rank 0's calls."""
    from ..runner import ARRunner

    start_heartbeat(heartbeat, plan.options.collective_timeout_s)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{plan.rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(plan.torch_threads)
    group = join_group(plan)
    try:
        assert plan.options.load_pipeline is not None
        pipeline = plan.options.load_pipeline(str(plan.device))
        assert isinstance(pipeline, ARPipeline)
        shard_pipeline(pipeline, plan, group)
        options = rank_options(plan)
        runner = ARRunner.for_pipeline(pipeline, options)
    except BaseException as exc:  # noqa: BLE001 - rank 0 says why the replica did not start
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        dist.destroy_process_group()
        return
    conn.send(("ready", runner.pool.num_free))
    exports: dict[str, dict[str, list[Part]]] = {}  # each planned export's blocks, until the session's next call
    imports: dict[str, SessionImport] = {}  # each incoming session's import, until it finishes or aborts
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone: nothing is left to serve
            break
        if name == "stop":
            break
        try:
            if name == "pool_shape":
                result: Any = tuple(runner.pool.kv.shape)
            elif name == "plan_share":  # its share of a session's export, read a window of blocks at a time
                session_id, protocol_version = args
                _, exports[session_id] = share_plan(runner, session_id, protocol_version)
                result = share_layout(exports[session_id])
            elif name == "share_blocks":
                session_id, tensor, start, count = args
                conn.send(("blocks", [block_copy(part) for part in exports[session_id][tensor][start : start + count]]))
                continue
            elif name == "import_begin":  # its share of an incoming session: begun, then its bytes a window at a time
                session_id, header, entries, protocol_version = args
                job = SessionImport(session_id, header, entries, protocol_version=protocol_version)
                job.begin(runner)  # a refusal leaves nothing behind
                imports[session_id] = job
                result = None
            elif name == "import_write":
                session_id, index, offset, data = args
                imports[session_id].write(runner, index, offset, data)
                result = None
            elif name == "import_finish":
                imports.pop(args[0]).finish(runner)
                result = None
            elif name == "import_abort":
                aborted = imports.pop(args[0], None)
                if aborted is not None:
                    aborted.abort(runner)
                result = None
            elif name == "decode_counts":
                result = (runner.counters.decodes_total, runner.counters.decodes_forgotten_total)
            else:
                result = getattr(runner, name)(*args)
                if name == "execute":  # only rank 0's frames are sent: this rank drops its chunks' latents
                    result = runner.decode_chunks(result)
                for session_id in _sessions_moved_on(name, args):  # an export of it is over (its pin too)
                    exports.pop(session_id, None)
            conn.send(("ok", (digest(result), runner.pool.num_free)))
        except Exception as exc:  # noqa: BLE001 - rank 0 checks that it raised the same
            conn.send(("raised", type(exc).__name__))
    dist.destroy_process_group()

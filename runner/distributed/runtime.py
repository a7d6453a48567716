"""Rank 0's runtime for a replica over several devices (``arstream serve --devices cpu,cpu``, ``cuda:0,cuda:1``).

Rank 0 is the server's process: it keeps the scheduler, the batching and the protocol, and holds an
:class:`~arstream.runner.runner.ARRunner` over its share of the heads. It starts one process per other device
(:mod:`.rank`) and supervises them. Every call that changes a runner's state (a round's ticks, a close, a
branch, a park, the warm-up) goes to every rank first and then runs on rank 0; the ranks meet in the forward's
collectives (:mod:`.sequence_parallel`) and each answers with a digest of its outcome, which must match rank 0's.

Faults fail closed. A rank that exits, hangs (its heartbeat silent for ``collective_timeout_s``: the watchdog
of :mod:`.liveness` kills it, which ends whatever rank 0 waited on) or answers differently loses the replica:
every session ends with :class:`~arstream.runner.types.ReplicaLost` as its reason, rank 0's pool is released,
the other ranks are killed and the process group is torn down; every later call says the same (the server then
stops being ready and exits non-zero). A rank lost while the replica is idle is told to the server
(``on_rank_lost``), which then calls :meth:`DistributedRuntime.check_ranks` on its own thread.
"""

from __future__ import annotations

import logging
import functools
import multiprocessing
import socket
import threading
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from ..contract import ARPipeline
from ..runner import ARRunner
from ..session_table import SessionTable
from ..snapshot import SessionSnapshot, SnapshotError, SnapshotRefused, identity
from ..snapshot_import import SessionImport, TensorEntry
from ..snapshot_stream import Part, SnapshotPlan, TensorPlan
from ..spec import KVCacheSpec
from ..stats import RunnerStats, RuntimeCounters
from ..types import ChunkResult, ReplicaLost, RuntimeOptions, TickFailure, TickRequest, TickResult, UnsupportedConfiguration
from .liveness import RankProcess, Watchdog
from .rank import START_TIMEOUT_S, RankPlan, digest, join_group, rank_main, rank_options, shard_pipeline
from .sequence_parallel import SequenceParallel, check_heads_divide
from .transfer import (
    HEADS_DIM,
    GatheredBlocks,
    ScatteringWrites,
    is_kv,
    share_entries,
    share_layout,
    share_plan,
    snapshot_of,
)

log = logging.getLogger("arstream.runner.distributed")


class DistributedRuntime:
    """A replica over ``len(options.devices)`` ranks, seen by the server as one runtime."""

    @classmethod
    def for_pipeline(cls, pipeline: object, options: RuntimeOptions) -> DistributedRuntime:
        if not isinstance(pipeline, ARPipeline):
            raise UnsupportedConfiguration(f"{type(pipeline).__name__} is not an ARPipeline: it cannot span devices")
        return cls(pipeline, options)

    def __init__(self, pipeline: ARPipeline, options: RuntimeOptions) -> None:
        world = len(options.devices)
        if world < 2:
            raise UnsupportedConfiguration(f"a replica over several devices needs two or more, got {options.devices}")
        if options.load_pipeline is None:
            raise UnsupportedConfiguration("a replica over several devices needs a way for its other ranks to load the model")
        if not callable(getattr(pipeline, "shard_heads", None)):
            name = pipeline.model_card().get("name")
            raise UnsupportedConfiguration(
                f"model {name!r} cannot split its attention heads over devices (matrix-game-2, longlive and "
                "krea-realtime can)"
            )
        spec = pipeline.kv_cache_spec()
        check_heads_divide(spec.num_kv_heads, world)
        if spec.cross_attention_lengths:
            raise UnsupportedConfiguration("a pipeline whose pool holds cross-attention K/V cannot span devices yet")
        kinds = {torch.device(d).type for d in options.devices}
        if len(kinds) != 1:
            raise UnsupportedConfiguration(f"a replica's devices must all be of one kind, got {options.devices}")
        self.world = world
        self.whole_spec: KVCacheSpec = spec  # before sharding: every head (a snapshot's identity names it)
        self.timeout_s = options.collective_timeout_s
        self.lost: str | None = None
        # told (from the watchdog's thread too) that a rank exited or hung, or the replica was lost: the server
        # then calls check_ranks on its own thread, so the replica fails at once, busy or idle
        self.on_rank_lost: Callable[[str], None] | None = None
        self._ranks: list[RankProcess] = []
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        plans = [RankPlan(r, world, init_method, options, torch.get_num_threads()) for r in range(world)]
        context = multiprocessing.get_context("spawn")
        for plan in plans[1:]:
            here, there = context.Pipe()
            heartbeat = context.Value("d", 0.0, lock=False)
            process = context.Process(
                target=rank_main, args=(plan, there, heartbeat), name=f"arstream-rank{plan.rank}", daemon=True
            )
            process.start()
            there.close()
            self._ranks.append(RankProcess(plan.rank, process, here, heartbeat))
        try:
            group = join_group(plans[0])
            self.parallel: SequenceParallel = shard_pipeline(pipeline, plans[0], group)
            self.local = ARRunner.for_pipeline(pipeline, rank_options(plans[0]))
            for other in self._ranks:
                kind, value = self._reply(other, START_TIMEOUT_S)
                if kind != "ready":
                    raise UnsupportedConfiguration(f"rank {other.rank} ({options.devices[other.rank]}) did not start: {value}")
        except BaseException:
            self._stop_ranks()
            raise
        self._watchdog = Watchdog(self._ranks, self.timeout_s, self._rank_lost)
        self._watchdog.start()
        # Only rank 0 decodes, apart from the forward where the pipeline can (runtimes.SplitDecodeRuntime): the
        # sessions its decode stage decoded since the last join, which every rank is then told of
        self.split_decode: bool = self.local.split_decode
        self._decoded: list[str] = []
        self._decoded_lock = threading.Lock()
        # the most bytes of the ranks' shares rank 0 held at once to stream a session out (benches and tests)
        self.export_peak_held_bytes = 0
        # the most bytes of an incoming session rank 0 held at once to split it by heads (benches and tests)
        self.import_peak_held_bytes = 0
        # rank 0's, the same objects (the warm-up fills its round times in place)
        self.spec: KVCacheSpec = self.local.spec
        self.counters: RuntimeCounters = self.local.counters
        self.blocks_free_at_start: int = self.local.blocks_free_at_start
        self.warmup_round_s: dict[int, float] = self.local.warmup_round_s
        log.info("replica over %d devices (%s): each holds %d of the %d attention heads of every KV block",
                 world, ",".join(options.devices), self.local.spec.num_kv_heads, spec.num_kv_heads)

    # ---- the server's interface (runtimes.Runtime) ------------------------------------------

    @property
    def on_evict(self) -> Callable[[str], None] | None:
        return self.local.on_evict

    @on_evict.setter
    def on_evict(self, callback: Callable[[str], None] | None) -> None:
        self.local.on_evict = callback

    @property
    def batch_limit(self) -> int:
        return self.local.batch_limit

    @property
    def session_capacity(self) -> int:
        return self.local.session_capacity

    @property
    def device(self) -> torch.device:
        return self.local.device

    def warmup(self) -> int:
        ran: int = self._everywhere("warmup")
        return ran

    def model_card(self) -> dict[str, Any]:
        return {**self.local.model_card(), "devices": self.world}

    def prepare_prompt(self, prompt: str) -> str:
        return self.local.prepare_prompt(prompt)

    def execute(self, ticks: Sequence[TickRequest]) -> list[TickResult]:
        if self.lost is not None:
            return [TickFailure(t.session_id, t.request_id, ReplicaLost(self.lost)) for t in ticks]
        try:
            results: list[TickResult] = self._everywhere("execute", list(ticks))
        except ReplicaLost as lost:
            return [TickFailure(t.session_id, t.request_id, lost) for t in ticks]
        return results

    def execute_tick(self, tick: TickRequest) -> ChunkResult:
        (result,) = self.execute([tick])
        if isinstance(result, TickFailure):
            raise result.error
        return result

    def is_resident(self, session_id: str) -> bool:
        return self.lost is None and self.local.is_resident(session_id)

    def next_chunk_index(self, session_id: str) -> int:
        return self.local.next_chunk_index(session_id)

    def branch_session(self, source_id: str, boundary: int | None, new_session_id: str) -> int:
        branched: int = self._everywhere("branch_session", source_id, boundary, new_session_id)
        return branched

    def close_session(self, session_id: str) -> None:
        self._everywhere("close_session", session_id)

    def reset_session(self, session_id: str) -> None:
        self._everywhere("reset_session", session_id)

    def rewind_points(self, session_id: str) -> tuple[int, int] | None:
        return self.local.rewind_points(session_id)

    def resident_sessions(self) -> list[str]:
        return self.local.resident_sessions()

    def park_session(self, session_id: str) -> bool:
        parked: bool = self._everywhere("park_session", session_id)
        return parked

    def park_idle(self) -> int:
        """Rank 0's clock decides which sessions are idle; the other ranks park those by name."""
        if self.lost is not None:
            return 0
        before = set(self.local.parking.sessions())
        count = self.local.park_idle()
        for session_id in [s for s in self.local.parking.sessions() if s not in before]:
            self._send("park_session", (session_id,))
            self._collect("park_session", None)
        return count

    def stats(self) -> RunnerStats:
        return self.local.stats()

    # ---- the decode, on rank 0 only (runtimes.SplitDecodeRuntime) ----------------------------------------

    def decode_chunks(self, results: Sequence[ChunkResult]) -> list[TickResult]:
        """Rank 0 decodes the round (on the worker's decode stage, beside the next forward: no collective)."""
        with self._decoded_lock:
            self._decoded.extend(r.session_id for r in results if r.pending is not None)
        return self.local.decode_chunks(results)

    def fail_session(self, session_id: str, reason: str = "decode_failed") -> None:
        """A session whose decode failed on rank 0 ends on every rank."""
        self._after_decode("fail_session", session_id, reason)

    def complete_boundaries(self) -> None:
        """The decode in flight was joined: every rank stops counting its sessions' decodes as in flight (so they
        may park alike) and gives their rewind points the decoder's state (rank 0's; the others have none)."""
        with self._decoded_lock:
            joined, self._decoded = self._decoded, []
        self._after_decode("join_decodes", joined)

    def _after_decode(self, name: str, *args: Any) -> None:
        """A call of the worker's decode join: a replica lost here is told to the server (``on_rank_lost``) rather
        than raised, so that the outcomes of the decode just joined still go out."""
        if self.lost is None:
            try:
                self._everywhere(name, *args)
            except ReplicaLost:
                pass

    def rank_decode_counts(self) -> list[tuple[int, int]]:
        """Each rank's chunks decoded apart from their forward and chunks forgotten undecoded, rank 0 first."""
        counts = [(self.counters.decodes_total, self.counters.decodes_forgotten_total)]
        for other in self._ranks:
            self._send_to(other, ("decode_counts", ()))
            kind, value = self._reply(other)
            if kind != "ok":
                self._lose(f"rank {other.rank} failed to say its decode counts: {value}")
            counts.append(tuple(value[0]))
        return counts

    # ---- moving sessions (SupportsExport; snapshot_stream.PlansGatheredSnapshots; the format: .transfer) ------------

    @property
    def sessions(self) -> SessionTable:
        """Rank 0's table: which sessions are held, and where (the other ranks' are the same)."""
        return self.local.sessions

    @property
    def whole_session_bytes(self) -> int:
        return self.local.plan.per_session_bytes * self.world

    def plan_snapshot(self, session_id: str, protocol_version: int | None) -> SnapshotPlan:
        """The session's snapshot as a plan in the format a single device exports, its KV blocks read whole by
        joining every rank's heads a window at a time (:mod:`.transfer`); every rank keeps the session as it is
        until its next chunk (the plans pin it alike)."""
        self._send("plan_share", (session_id, protocol_version))
        try:
            mine, blocks = share_plan(self.local, session_id, protocol_version)
        except Exception as exc:
            self._collect("plan_share", ("raised", type(exc).__name__))
            raise
        self._collect("plan_share", ("ok", (share_layout(blocks), self.local.pool.num_free)))
        # the identity of every head, not rank 0's share
        plan = SnapshotPlan({**mine.header, **identity(self, protocol_version)}, [])
        for tensor in mine.tensors:
            if not is_kv(tensor.name):
                plan.tensors.append(tensor)
                continue
            fetch = functools.partial(self._share_blocks, session_id, tensor.name)
            reader = GatheredBlocks(blocks[tensor.name], fetch, self._held_for_export)
            shape = list(tensor.shape)
            shape[HEADS_DIM] *= self.world
            parts: list[Part] = [functools.partial(reader.block, i) for i in range(len(blocks[tensor.name]))]
            plan.tensors.append(TensorPlan(tensor.name, tensor.dtype, tuple(shape), parts))
        return plan

    def export_snapshot(self, session_id: str, protocol_version: int | None) -> SessionSnapshot:
        """The session's snapshot whole, read from :meth:`plan_snapshot`."""
        return snapshot_of(self.plan_snapshot(session_id, protocol_version))

    def _share_blocks(self, session_id: str, name: str, start: int, count: int) -> list[list[torch.Tensor]]:
        """Every other rank's share of blocks ``start`` to ``start + count`` of a planned KV tensor."""
        self._send("share_blocks", (session_id, name, start, count))
        shares: list[list[torch.Tensor]] = []
        for other in self._ranks:
            kind, value = self._reply(other)
            if kind != "blocks" or len(value) != count:
                self._lose(f"rank {other.rank} sent no share of session {session_id!r}'s {name}: {kind}")
            shares.append(value)
        return shares

    def _held_for_export(self, nbytes: int) -> None:
        self.export_peak_held_bytes = max(self.export_peak_held_bytes, nbytes)

    def begin_import(
        self, session_id: str, header: dict[str, Any], entries: Sequence[TensorEntry], protocol_version: int | None
    ) -> RanksImport:
        """Every rank begins the import of its share of a whole snapshot (``entries``: its runner's tensors, every
        head); refused alike on every rank, leaving every pool as it was. The bytes then arrive through the
        returned import's ``write``, split by heads a window at a time (:class:`.transfer.ScatteringWrites`)."""
        heads = self.whole_spec.num_kv_heads
        for entry in entries:
            if is_kv(entry.name) and (len(entry.shape) != 6 or entry.shape[HEADS_DIM] != heads):
                raise SnapshotError(f"the snapshot's {entry.name!r} does not hold the model's {heads} heads")
        # each share names the ranks' own identity (a pool of heads / P), which each rank's import checks
        shares = share_entries(entries, self.world)
        share_header = {**header, **identity(self.local, protocol_version)}
        job = SessionImport(session_id, share_header, shares, protocol_version=protocol_version)
        self._stepped("import_begin", (session_id, share_header, shares, protocol_version), lambda: job.begin(self.local))
        return RanksImport(self, session_id, job, entries)

    def _import_write(self, session_id: str, index: int, offset: int, shares: list[torch.Tensor]) -> None:
        """The other ranks' shares of bytes of a tensor, each at ``offset`` of its own; a rank whose import refused
        them (its session was evicted meanwhile) refuses the import."""
        if self.lost is not None:
            raise ReplicaLost(self.lost)
        for other in self._ranks:
            self._send_to(other, ("import_write", (session_id, index, offset, shares[other.rank - 1])))
        refused = None
        for other in self._ranks:
            kind, value = self._reply(other)
            if kind != "ok":
                refused = f"rank {other.rank} refused the bytes of session {session_id!r}: {value}"
        if refused is not None:
            raise SnapshotRefused(refused)

    def _held_for_import(self, nbytes: int) -> None:
        self.import_peak_held_bytes = max(self.import_peak_held_bytes, nbytes)

    # ---- what tests and benches read ------------------------------------------------------------

    def rank_pool_shapes(self) -> list[tuple[int, ...]]:
        """Each rank's KV pool shape ``[layers, 2, blocks, tokens, heads, head_size]``, rank 0 first."""
        shapes = [tuple(self.local.pool.kv.shape)]
        for other in self._ranks:
            self._send_to(other, ("pool_shape", ()))
            kind, value = self._reply(other)
            if kind != "ok":
                self._lose(f"rank {other.rank} failed to say its pool's shape: {value}")
            shapes.append(tuple(value[0]))
        return shapes

    def rank_processes(self) -> list[BaseProcess]:
        return [other.process for other in self._ranks]

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group (the server's exit; a lost replica has done it already)."""
        self._stop_ranks()

    # ---- the ranks in step ------------------------------------------------------------------

    def _everywhere(self, name: str, *args: Any) -> Any:
        """``name(*args)`` on every rank's runner (the others first, then rank 0); rank 0's result, or what it
        raised (a refusal raised alike on every rank, such as a rewind that is not held, is no fault)."""
        return self._stepped(name, args, lambda: getattr(self.local, name)(*args))

    def _stepped(self, name: str, args: tuple[Any, ...], here: Callable[[], Any]) -> Any:
        """Call ``name`` on every other rank, then ``here`` on rank 0; check that the ranks came out alike."""
        self._send(name, args)
        try:
            result = here()
        except Exception as exc:
            self._collect(name, ("raised", type(exc).__name__))
            raise
        self._collect(name, ("ok", (digest(result), self.local.pool.num_free)))
        return result

    def _send(self, name: str, args: tuple[Any, ...]) -> None:
        if self.lost is not None:
            raise ReplicaLost(self.lost)
        for other in self._ranks:
            self._send_to(other, (name, args))

    def _send_to(self, other: RankProcess, message: tuple[str, Any]) -> None:
        """Send a call down a rank's pipe (a hung rank's full pipe blocks here until the watchdog kills it)."""
        if not other.process.is_alive():
            self._lose(other.exit_reason())
        try:
            other.conn.send(message)
        except OSError:
            self._lose(other.exit_reason())

    def _collect(self, name: str, expected: tuple[str, Any] | None) -> None:
        """Each other rank's answer to the call just sent; lose the replica on a rank that is gone, hung, or
        came out other than rank 0 (``expected``; None: only that it answered)."""
        for other in self._ranks:
            answer = self._reply(other)
            if expected is not None and answer != expected:
                self._lose(f"rank {other.rank} went its own way in {name}: {answer} where rank 0 had {expected}")

    def _reply(self, other: RankProcess, timeout_s: float | None = None) -> tuple[str, Any]:
        """The rank's next answer. A rank that beats its heartbeat is working (a long warm-up or compile too), so
        only ``timeout_s`` bounds the wait (the start's); a hung one is killed by the watchdog, which ends it."""
        try:
            if not other.conn.poll(timeout_s):
                self._lose(f"rank {other.rank} did not answer within {timeout_s:g} s")
            kind, value = other.conn.recv()
        except (EOFError, OSError):
            self._lose(other.exit_reason())
        return kind, value

    def _rank_lost(self, reason: str) -> None:
        if self.on_rank_lost is not None:
            self.on_rank_lost(reason)

    def _lose(self, reason: str) -> None:
        """Fail the replica closed (see the module docstring), then raise :class:`ReplicaLost`."""
        if self.lost is None:
            self.lost = f"the replica lost a device: {reason}"
            log.error("%s; every session on this replica ends and the replica stops", self.lost)
            if hasattr(self, "local"):
                table = self.local.sessions
                for session_id in [*table.resident(), *self.local.parking.sessions()]:
                    table.fail(session_id, "replica_lost")
            self._stop_ranks(kill=True)
            self._rank_lost(self.lost)  # the server hears of it even if this call's own caller drops it
        raise ReplicaLost(self.lost)

    def check_ranks(self) -> None:
        """Raise :class:`ReplicaLost` (failing the replica first) if a rank died or hung since the last call."""
        if self.lost is not None:
            raise ReplicaLost(self.lost)
        for other in self._ranks:
            if not other.process.is_alive():
                self._lose(other.exit_reason())

    def _stop_ranks(self, kill: bool = False) -> None:
        """End the other ranks: asked to stop, or (``kill``: the replica is lost) killed at once, a stopped one
        too. Then leave the group."""
        for other in self._ranks:
            if not kill:
                try:
                    other.conn.send(("stop", ()))
                except OSError:
                    pass
                other.process.join(5.0)
            other.kill()
            other.conn.close()
        self._ranks = []
        if hasattr(self, "_watchdog"):
            self._watchdog.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


class RanksImport:
    """One session's import over the ranks (:meth:`DistributedRuntime.begin_import`): rank 0's own import of its
    share, fed with rank 0's heads of each block, while the other ranks' go to their imports a window at a time."""

    def __init__(self, runtime: DistributedRuntime, session_id: str, job: SessionImport, entries: Sequence[TensorEntry]):
        self._runtime = runtime
        self._session_id = session_id
        self._job = job
        self._writes = ScatteringWrites(
            entries,
            runtime.world,
            mine=lambda index, offset, data: job.write(runtime.local, index, offset, data),
            others=functools.partial(runtime._import_write, session_id),
            on_held=runtime._held_for_import,
        )

    def write(self, index: int, offset: int, data: torch.Tensor) -> None:
        """Bytes of whole tensor ``index`` (flat uint8) at byte ``offset`` of it."""
        self._writes.write(index, offset, data)

    def finish(self) -> None:
        """The last shares go out, then every rank hands its share of the session to its pipeline."""
        self._writes.flush()
        runtime = self._runtime

        def finish_here() -> None:
            self._job.finish(runtime.local)  # no extras: those stay with the whole snapshot's import

        runtime._stepped("import_finish", (self._session_id,), finish_here)

    def abort(self) -> None:
        """Every rank releases what its import holds (its pool back where it was)."""
        runtime = self._runtime
        if runtime.lost is None:
            runtime._stepped("import_abort", (self._session_id,), lambda: self._job.abort(runtime.local))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port

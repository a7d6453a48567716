"""``arstream plan``: what a model costs on a GPU, and how many sessions fit, without loading its weights.

The model is built on the meta device (its loader reads no file and fills no
tensor: shapes and bytes only), with the options ``serve`` would be given. Its
components' bytes are their tensors' storage (a quantized layer by its data
and scales); the KV pool, rewind points and parking are sized by the runner
itself, an :class:`~arstream.runner.runner.ARRunner` on the meta device with
the budget a server on that GPU would give it: ``--memory-fraction`` (0.9) of
what the GPU has left after the weights and the CUDA context. What the
forward's activations and the decode's working memory take is not counted
beforehand: the rest of the GPU is left for it (the plan prints an estimate of
the forward's share from the shapes, and a note where it looks larger).

With serve's ``--devices`` (one replica over P devices) the plan is each
device's: the model is given one rank's share of the heads as a rank is, so
every device holds the weights whole and ``heads / P`` of every KV block, and
its pool is sized by the runner as a rank's is. A P that does not divide the
model's heads is refused, naming both counts.

``arstream serve`` on a CUDA device prints the same plan before it loads the
model, and refuses one that cannot hold a session, naming what to change.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .settings import Settings
    from ..runner.runner import ARRunner
    from ..runner.spec import KVCacheSpec

log = logging.getLogger("arstream.plan")

# Memory a CUDA process holds before any tensor (the context, cuBLAS and cuDNN handles), measured on H100s as
# 0.5-0.6 GiB; the plan takes it off the GPU before the weights.
CUDA_CONTEXT_BYTES = 600 * 2**20
SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
# Where the plan's device is the GPU being planned for (the meta device stands in for it while planning).
GPU = "gpu"
# What the refusal offers, in the order it is worth trying.
REMEDIES = (
    ('weights "int8" in --model-options', "the DiT's block weights in half the bytes"),
    ('text_encoder_device "cpu" in --model-options', "umT5 (LongLive, Self-Forcing, Krea) off the GPU"),
    ("--rewind-seconds 0", "no rewind points"),
    ("--max-batch-sessions 1", "one staging row and one in-flight chunk"),
    ('kv_dtype "float16" or a smaller session_capacity', ""),
    ("a GPU with more memory, or --devices", ""),
)
# What models with a text encoder call the option that moves it off the GPU.
TEXT_ENCODER_MODELS = ("longlive", "krea-realtime")


class PlanError(ValueError):
    """The plan cannot be made: an unknown size, or a model whose loader cannot build on the meta device."""


def parse_size(text: str) -> int:
    """``24GiB``, ``80 GB``, ``141GB``, ``1e9`` bytes: GB and MB are powers of ten, GiB and MiB of two."""
    match = SIZE.match(text)
    if match is None:
        raise PlanError(f"expected a size such as 24GiB or 80GB, got {text!r}")
    value, unit = float(match.group(1)), (match.group(2) or "B").lower()
    return int(value * UNITS[unit])


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Component:
    name: str
    device: str  # GPU, or where an option put it (cpu, cuda:1)
    weights: str
    bytes: int

    @property
    def on_gpu(self) -> bool:
        return self.device == GPU


@dataclass
class FitPlan:
    """What one GPU of ``gpu_memory_bytes`` holds of a model served with ``settings``, times ``devices`` replicas.

    Over several devices a replica (``replica_devices`` P) the figures are each device's: the weights whole, the
    KV (``device_kv_heads`` of ``kv_heads`` heads) and the pool a rank's, ``session_capacity`` the replica's.
    """

    model: str
    options: dict[str, Any]
    gpu_memory_bytes: int
    devices: int  # replicas (--replicas), each over replica_devices GPUs
    components: list[Component]
    kv_budget_bytes: int
    memory_fraction: float
    session_capacity: int = 0  # per GPU; 0: not one session fits
    session_cap: int = 0  # the pipeline's own cap (the session_capacity option)
    block_bytes: int = 0
    kv_dtype: str = ""
    resident_frames: int = 0
    kv_window: str = ""  # the frames a session keeps between chunks, in words (KVCacheSpec.kept_window_text)
    branches: int = 1
    per_session_bytes: int = 0  # KV, model-owned state, rewind points
    model_owned_per_session: int = 0
    fixed_bytes: int = 0  # in-flight chunks, staging, model-owned fixed: paid once
    pool_bytes: int = 0  # the KV pool's blocks and staging rows, as the runner allocates them
    rewind: str = "off"
    park_sessions: int = 0
    replica_devices: int = 1  # P: serve's --devices
    device_kind: str = "GPU"  # what the plan's devices are: "CPU" where --devices names CPUs only (cpu,cpu)
    picture: str = ""  # the card's frame size (WxH): a test config's is plain to see
    kv_heads: int = 0  # the model's attention heads (every KV block's, whole)
    device_kv_heads: int = 0  # what each device of the replica holds of them
    activation_bytes: int | None = None  # estimated, one batched session on one device (None: not a Wan DiT)
    batch_rows: int = 0  # sessions a forward batches
    refusal: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_weights_bytes(self) -> int:
        return sum(c.bytes for c in self.components if c.on_gpu)

    @property
    def sessions(self) -> int:
        return self.session_capacity * self.devices

    @property
    def gpus(self) -> int:
        return self.devices * self.replica_devices

    @property
    def left_bytes(self) -> int:
        """What the GPU has after the context and the weights: the KV budget and the rest."""
        return max(self.gpu_memory_bytes - CUDA_CONTEXT_BYTES - self.gpu_weights_bytes, 0)

    def text(self) -> str:
        """The plan as ``arstream plan`` and ``arstream serve`` print it."""
        where = f"{self.devices} GPU(s)"
        if self.replica_devices > 1:
            where = f"{self.devices} replica(s), each over {self.replica_devices} devices"
        device = self.device_kind if self.replica_devices == 1 else "device"
        lines = [
            f"plan: {self.model} {json.dumps(self.options)} at {self.picture} "
            f"on {where} of {gib(self.gpu_memory_bytes)}",
            "  component      device   weights                               bytes",
        ]
        for c in self.components:
            where_held = self.device_kind.lower() if c.on_gpu else c.device
            lines.append(f"  {c.name:<14} {where_held:<8} {c.weights:<36} {gib(c.bytes):>11}")
        held = f"the {device}" if self.replica_devices == 1 else "each device"
        lines.append(f"  weights on {held}: {gib(self.gpu_weights_bytes)}; CUDA context {gib(CUDA_CONTEXT_BYTES)}")
        if self.replica_devices > 1:
            lines.append(
                f"  over {self.replica_devices} devices (--devices): each holds the weights whole and "
                f"{self.device_kv_heads} of the {self.kv_heads} attention heads of every KV block"
            )
        lines.append(
            f"  KV budget: {self.memory_fraction:g} of what is left = {gib(self.kv_budget_bytes)} "
            "(the rest: activations and the decode's working memory)"
        )
        if self.block_bytes and self.refusal is None:
            kv = self.resident_frames * self.branches * self.block_bytes
            on_each = "" if self.replica_devices == 1 else " on each device"
            lines.append(
                f"  per session{on_each}: {gib(self.per_session_bytes)} = KV {gib(kv)} ({self.resident_frames} frames x "
                f"{gib(self.block_bytes)}, {self.kv_dtype}) + model-owned {gib(self.model_owned_per_session)}"
                f" + rewind points {gib(self.per_session_bytes - kv - self.model_owned_per_session)}"
            )
            lines.append(f"  KV a session keeps between chunks: {self.kv_window}")
            lines.append(f"  once per {device}: {gib(self.fixed_bytes)} (in-flight chunks, staging rows, shared state)")
        if self.activation_bytes is not None:
            lines.append(
                f"  activations (estimated from the shapes): {gib(self.activation_bytes)} a batched session in one "
                f"block's forward on each {device}, {gib(self.activation_bytes * self.batch_rows)} for "
                f"{self.batch_rows}; the KV budget leaves {gib(self.left_bytes - self.kv_budget_bytes)}"
            )
        lines.append(f"  rewind: {self.rewind}")
        lines.append(f"  parking: {self.park_sessions} session(s) in host memory (--park-budget-bytes)")
        lines.extend(f"  note: {note}" for note in self.notes)
        if self.refusal is not None:
            lines.append(f"  does not fit: {self.refusal}")
        else:
            capped = " (the session_capacity option's cap)" if self.session_capacity == self.session_cap else ""
            if self.replica_devices == 1:
                lines.append(
                    f"  sessions: {self.session_capacity} per GPU{capped}, {self.sessions} on {self.devices} GPU(s)"
                )
            else:
                lines.append(
                    f"  sessions: {self.session_capacity} per replica{capped} (its devices hold the same blocks), "
                    f"{self.sessions} on {self.devices} replica(s) of {self.replica_devices} devices ({self.gpus} {self.device_kind}s)"
                )
        return "\n".join(lines)


def planned_device(device: Any, text_device: str) -> str:
    return GPU if str(device) == "meta" else text_device


def fit_plan(settings: Settings, *, gpu_memory_bytes: int, devices: int = 1, pipeline: Any = None) -> FitPlan:
    """The plan for ``settings.model`` with ``settings.model_options`` on ``devices`` GPUs of ``gpu_memory_bytes``
    (``devices`` replicas, each over ``settings.devices``' P GPUs where it names several).

    ``pipeline``: the model already built on the meta device with those options (a table of several sizes
    builds it once); it is given one device's share of the heads, in place (every head at P = 1).
    """
    from .settings import default_max_batch_sessions
    from ..models.registry import PLANNED_MODELS, load_pipeline
    from ..runner.pool import DEFAULT_MEMORY_FRACTION, PoolBudgetError
    from ..runner.runner import ARRunner
    from ..runner.runtimes import shard_planned_pipeline
    from ..runner.types import ParkingPolicy, RuntimeOptions, UnsupportedConfiguration

    if settings.model not in PLANNED_MODELS:
        raise PlanError(
            f"model {settings.model!r} is not built on the meta device; the plan covers {list(PLANNED_MODELS)} "
            "(start the server and read /v1/stats for the others)"
        )
    if devices < 1:
        raise PlanError(f"--replicas must be >= 1, got {devices}")
    if pipeline is None:
        pipeline = load_pipeline(settings.model, "meta", **settings.model_options)
    world = len(settings.replica_devices())
    try:
        whole = shard_planned_pipeline(pipeline, world)  # every head; the pipeline keeps one device's share
    except UnsupportedConfiguration as exc:
        if not callable(getattr(pipeline, "shard_heads", None)):
            raise PlanError(str(exc)) from None
        heads = shard_planned_pipeline(pipeline, 1).num_kv_heads
        divisors = ", ".join(str(p) for p in range(2, heads + 1) if heads % p == 0)
        raise PlanError(f"{exc}; {settings.model}'s {heads} heads divide over {divisors} devices") from None
    card = pipeline.model_card()
    components = [
        Component(c["name"], planned_device(c["device"], c["device"]), c["weights"], int(c["bytes"]))
        for c in card.get("components", [])
    ]
    fraction = DEFAULT_MEMORY_FRACTION if settings.memory_fraction is None else settings.memory_fraction
    left = gpu_memory_bytes - CUDA_CONTEXT_BYTES - sum(c.bytes for c in components if c.on_gpu)
    budget = settings.kv_budget_bytes if settings.kv_budget_bytes is not None else int(max(left, 0) * fraction)
    spec = pipeline.kv_cache_spec()
    plan = FitPlan(
        model=settings.model, options=dict(settings.model_options), gpu_memory_bytes=gpu_memory_bytes,
        devices=devices, components=components, kv_budget_bytes=budget, memory_fraction=fraction,
        session_cap=spec.session_capacity, block_bytes=spec.block_bytes, resident_frames=spec.resident_frames,
        kv_window=spec.kept_window_text,
        kv_dtype=str(spec.dtype).removeprefix("torch."), branches=len(spec.kv_branches),
        model_owned_per_session=spec.model_owned_bytes_per_session, replica_devices=world,
        kv_heads=whole.num_kv_heads, device_kv_heads=spec.num_kv_heads,
        activation_bytes=activation_bytes(pipeline, whole, world),
        picture=f"{card.get('width')}x{card.get('height')}",
        device_kind="CPU" if world > 1 and all(d.startswith("cpu") for d in settings.replica_devices()) else "GPU",
        batch_rows=settings.max_batch_sessions or default_max_batch_sessions(GPU),
    )  # fmt: skip
    if "weights" in settings.model_options and settings.model_options["weights"] == "fp8":
        plan.notes.append("fp8 weights need a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell)")
    if left <= 0:
        plan.refusal = f"the weights on the GPU ({gib(gpu_memory_bytes - left)} with the context) leave nothing for KV"
        return _with_remedies(plan)
    options = RuntimeOptions(
        device="meta",
        kv_budget_bytes=max(budget, 1),
        max_batch_sessions=plan.batch_rows,
        rewind_seconds=settings.rewind_seconds,
        rewind_budget_bytes=settings.rewind_budget_bytes(),
        parking=ParkingPolicy(settings.park_budget_bytes, None, settings.park_spill_dir, settings.park_spill_budget_bytes),
    )
    try:
        runner = ARRunner.for_pipeline(pipeline, options)
    except PoolBudgetError as exc:
        plan.refusal = str(exc)
        return _with_remedies(plan)
    _read_runner(plan, runner)
    if plan.activation_bytes is not None and plan.activation_bytes * plan.batch_rows > left - budget:
        plan.notes.append(
            f"the estimated activations of {plan.batch_rows} batched session(s) ({gib(plan.activation_bytes * plan.batch_rows)}) "
            f"exceed what the KV budget leaves ({gib(left - budget)}): lower --memory-fraction or --max-batch-sessions"
        )
    return plan


def activation_bytes(pipeline: Any, whole: KVCacheSpec, world: int) -> int | None:
    """An estimate, from the shapes, of one batched session's working set in one block of a forward on each of
    ``world`` devices: the larger of the attention's and the FFN's live tensors (None where the DiT is not a Wan
    one). Not measured: the GPU check's ``fit`` phase measures the peak.

    Attention: the residual and its modulated copy (every token, whole on every device), this device's slice of
    the tokens projected to q, k and v, the all-to-all's buffers (every token, ``heads / P``; none at P = 1), the
    window's K and V read from the pool, q and k rotated, and the output. FFN: the residual, its input and the
    hidden layer before and after the activation; Ulysses runs it whole on every device, so it does not shrink
    with P.
    """
    import torch

    cfg = getattr(getattr(pipeline, "model", None), "cfg", None)
    dim, ffn = getattr(cfg, "dim", None), getattr(cfg, "ffn_dim", None)
    if not isinstance(dim, int) or not isinstance(ffn, int):
        return None
    dtype = getattr(pipeline, "dtype", whole.dtype)
    elem = torch.empty((), dtype=dtype if isinstance(dtype, torch.dtype) else whole.dtype).element_size()
    queries = whole.frames_per_chunk * whole.tokens_per_frame
    keys = (whole.resident_frames + whole.frames_per_chunk) * whole.tokens_per_frame  # what a chunk attends to
    local = dim // world  # this device's heads, times the head size
    exchanged = 0 if world == 1 else 2 * 3 * queries * local
    attention = (2 * queries * dim + 3 * -(-queries // world) * dim + exchanged + 2 * keys * local
                 + (queries + keys) * local + queries * local)  # fmt: skip
    feed_forward = 2 * queries * dim + 2 * queries * ffn
    return max(attention, feed_forward) * elem


def _read_runner(plan: FitPlan, runner: ARRunner) -> None:
    pool = runner.plan
    plan.session_capacity = pool.session_capacity
    plan.per_session_bytes = pool.per_session_bytes
    plan.fixed_bytes = pool.fixed_bytes
    plan.pool_bytes = pool.pool_bytes
    plan.rewind = runner.rewind.describe(runner.spec) if runner.rewind is not None else (runner.rewind_refusal or "off")
    plan.park_sessions = runner.parking.capacity


def _with_remedies(plan: FitPlan) -> FitPlan:
    offered = [f"{what} ({why})" if why else what for what, why in REMEDIES if not _already(plan, what)]
    plan.refusal = f"{plan.refusal}; try: " + "; ".join(offered)
    return plan


def _already(plan: FitPlan, remedy: str) -> bool:
    options = plan.options
    return (remedy.startswith('weights "int8"') and options.get("weights") in ("int8", "fp8", "w8a8")) or (
        remedy.startswith("text_encoder_device")
        and (plan.model not in TEXT_ENCODER_MODELS or "text_encoder_device" in options)
    )


class PlanDoesNotFit(ValueError):
    """``arstream serve``'s refusal before loading: the GPU cannot hold one session of the model as configured."""


def check_plan_fits(settings: Settings) -> FitPlan | None:
    """On a CUDA device, log the plan for the memory free there and refuse one that holds no session.

    None where nothing is planned: another device, a model the plan does not cover, or another runtime than
    ARStream's (whose pool arithmetic the plan is).
    """
    import torch

    from ..models.registry import PLANNED_MODELS

    device = torch.device(settings.replica_devices()[0])  # rank 0's: every device of a replica holds the same
    if device.type != "cuda" or settings.model not in PLANNED_MODELS or settings.runtime != "arstream":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    plan = fit_plan(settings, gpu_memory_bytes=free + CUDA_CONTEXT_BYTES)  # the context is already taken from free
    log.info("%s", plan.text())
    if plan.refusal is not None:
        raise PlanDoesNotFit(f"{settings.model} does not fit the {gib(free)} free on {device}: {plan.refusal}")
    return plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .settings import add_settings_arguments

    parser.add_argument("--gpu-memory", required=True, metavar="SIZE", help="memory of one GPU: 24GiB, 80GB, 141GB")
    # Not serve's --devices (one replica over several devices): here N GPUs each serve a replica of their own.
    parser.add_argument("--replicas", type=int, default=1, metavar="N",
                        help="replicas, each on one GPU or over serve's --devices [default: 1]")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON line after the text")
    add_settings_arguments(parser)  # serve's flags: --model, --model-options, the pool, rewind and parking


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from .settings import describe_settings_error, settings_from_args

    try:
        settings = settings_from_args(args)
        plan = fit_plan(settings, gpu_memory_bytes=parse_size(args.gpu_memory), devices=args.replicas)
    except ValidationError as exc:
        print(f"arstream plan: {describe_settings_error(exc)}", file=sys.stderr)
        return 2
    except (PlanError, ValueError) as exc:
        print(f"arstream plan: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # the model's own code needs its extra (wan, longlive), even on the meta device
        print(f"arstream plan: {settings.model} cannot be built here: {exc}", file=sys.stderr)
        return 2
    print(plan.text())
    if args.json:
        print(json.dumps(plan_document(plan)))
    return 0 if plan.refusal is None else 1


def plan_document(plan: FitPlan) -> dict[str, Any]:
    """The plan's figures as JSON (the docs' table and the tests read these)."""
    return {
        "model": plan.model,
        "options": plan.options,
        "gpu_memory_bytes": plan.gpu_memory_bytes,
        "devices": plan.devices,
        "replica_devices": plan.replica_devices,
        "gpus": plan.gpus,
        "kv_heads": plan.kv_heads,
        "device_kv_heads": plan.device_kv_heads,
        "block_bytes": plan.block_bytes,
        "resident_frames": plan.resident_frames,
        "kv_window": plan.kv_window,
        "activation_bytes": plan.activation_bytes,
        "batch_rows": plan.batch_rows,
        "components": [c.__dict__ for c in plan.components],
        "gpu_weights_bytes": plan.gpu_weights_bytes,
        "kv_budget_bytes": plan.kv_budget_bytes,
        "per_session_bytes": plan.per_session_bytes,
        "fixed_bytes": plan.fixed_bytes,
        "pool_bytes": plan.pool_bytes,
        "session_capacity": plan.session_capacity,
        "sessions": plan.sessions,
        "park_sessions": plan.park_sessions,
        "rewind": plan.rewind,
        "refusal": plan.refusal,
    }

"""Server settings: environment variables (``ARSTREAM_*``) overridden by ``arstream serve`` flags."""

from __future__ import annotations

import argparse
import json
import re
import socket
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from arstream.models.registry import DEFAULT_MODEL
from arstream.runner.threads import default_torch_threads

CPU_KV_BUDGET_BYTES = 256 * 1024 * 1024
# uvicorn's frame limit sits a little above ours so an oversized text message reaches the
# handler and gets a `message_too_large` error instead of a bare protocol close.
WS_FRAME_SLACK_BYTES = 4096


REPLICA_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def default_replica_id() -> str:
    """The host name's first label, made safe for a resume token prefix (``r0.``-style, no dots)."""
    label = socket.gethostname().split(".")[0]
    return re.sub(r"[^A-Za-z0-9_-]", "-", label)[:64] or "r0"


class Settings(BaseSettings):
    """Everything ``arstream serve`` can be told; see the README's Server section."""

    model_config = SettingsConfigDict(env_prefix="ARSTREAM_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port")
    model: str = DEFAULT_MODEL
    model_options: dict[str, Any] = Field(default_factory=dict)
    device: str = "cpu"
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads; default: one core fewer than the machine has (at least 1)"
    )
    kv_budget_bytes: int | None = Field(None, gt=0, description="default: 256 MiB on CPU, memory_fraction on CUDA")
    memory_fraction: float | None = Field(None, gt=0.0, le=1.0)
    max_pending_ticks: int = Field(4, ge=1, le=1024)
    max_batch_sessions: int | None = Field(
        None,
        ge=1,
        le=256,
        description="sessions whose chunks may share one forward; 1 disables batching; default: 1 on CPU, 4 elsewhere",
    )
    admission: Literal["kv", "realtime"] = Field(
        "kv",
        description="kv: admit while the KV pool has a session slot; realtime: also only while every admitted "
        "session still gets the model's fps at the measured chunk times (docs/benchmarks.md)",
    )
    encode_threads: int | None = Field(
        None, ge=1, le=256, description="frame encoder threads beside the model worker; default: one per CPU core"
    )
    idle_timeout_s: float = Field(60.0, gt=0)
    start_timeout_s: float = Field(10.0, gt=0)
    auth_token: str | None = None
    allowed_origins: str = Field("", description="comma list; '*' allows every origin")
    codec: Literal["jpeg", "raw"] = "jpeg"
    jpeg_quality: int = Field(80, ge=1, le=100)
    max_message_bytes: int = Field(65536, ge=256)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    shutdown_grace_s: float = Field(2.0, ge=0, description="how long shutdown waits for each session's last bytes")
    replica_id: str = Field(
        default_factory=default_replica_id,
        pattern=REPLICA_ID_PATTERN,
        description="this replica's name; resume tokens begin with it and a dot so a load balancer can route "
        "them (letters, digits, - and _); default: the host name's first label",
    )
    resume_grace_s: float = Field(
        30.0, ge=0, description="how long a dropped session keeps its KV for a resume; 0 disables resume"
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    def resolved_kv_budget_bytes(self) -> int | None:
        """The runner's byte budget: explicit, else 256 MiB on CPU, else None (memory fraction)."""
        if self.kv_budget_bytes is not None:
            return self.kv_budget_bytes
        if self.device.startswith("cuda"):
            return None
        return CPU_KV_BUDGET_BYTES

    def resolved_max_batch_sessions(self) -> int:
        """Explicit, else :func:`default_max_batch_sessions` for the device."""
        if self.max_batch_sessions is not None:
            return self.max_batch_sessions
        return default_max_batch_sessions(self.device)

    def resolved_torch_threads(self) -> int:
        """Explicit, else leave a core to the event loop and frame encoding."""
        if self.torch_threads is not None:
            return self.torch_threads
        return default_torch_threads()

    def origin_allow_list(self) -> list[str]:
        """Configured origins; empty means the same-host default (see :mod:`arstream.app.auth`)."""
        return [origin.strip().rstrip("/") for origin in self.allowed_origins.split(",") if origin.strip()]

    @property
    def ws_max_size(self) -> int:
        return self.max_message_bytes + WS_FRAME_SLACK_BYTES


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arstream serve",
        description="Serve an autoregressive world model over WebSocket (flags override ARSTREAM_* variables).",
    )
    add = parser.add_argument
    add("--host", help="bind address (default 127.0.0.1)")
    add("--port", type=int, help="TCP port (default 8000; 0 picks a free one)")
    add("--model", help=f"pipeline name (default {DEFAULT_MODEL}; fake-kv is the test fake)")
    add("--model-options", type=_json_object, help="JSON object passed to the pipeline loader as keyword arguments")
    add("--device", help="torch device (default cpu)")
    add("--torch-threads", type=int, help="torch intra-op threads (default: CPU cores - 1, at least 1)")
    add("--kv-budget-bytes", type=int, help="KV pool budget in bytes (default 256 MiB on CPU)")
    add("--memory-fraction", type=float, help="fraction of free CUDA memory for the KV pool")
    add("--max-pending-ticks", type=int, help="ticks a session may have queued or running (default 4)")
    add("--max-batch-sessions", type=int, help="sessions per batched forward (default 1 on CPU, 4 on other devices; 1 disables batching)")
    add("--idle-timeout-s", type=float, help="close a session after this long without a message (default 60)")
    add("--start-timeout-s", type=float, help="time allowed for the first message, `start` (default 10)")
    add("--auth-token", help="require this bearer token (header or ?token=)")
    add("--allowed-origins", help="comma list of allowed Origin values; '*' allows all")
    add("--codec", choices=["jpeg", "raw"], help="default frame codec when `start` names none (default jpeg)")
    add("--jpeg-quality", type=int, help="default JPEG quality 1..100 (default 80)")
    add("--max-message-bytes", type=int, help="largest client text message (default 65536)")
    add("--log-level", help="critical|error|warning|info|debug (default info)")
    return parser


def settings_from_argv(argv: list[str]) -> Settings:
    """Parse ``arstream serve`` flags; flags given win over the environment."""
    args = build_parser().parse_args(argv)
    overrides = {name: value for name, value in vars(args).items() if value is not None}
    return Settings(**overrides)


def default_max_batch_sessions(device: str) -> int:
    """1 on CPU, 4 on accelerators.

    A CPU forward is compute-bound: measured with tiny-world on one thread, four
    sessions batched gave 2-8 % more frames in total than round robin but nearly
    doubled action-to-frame latency (every session waits for the whole batch).
    Accelerators have idle width to fill, which is what batching is for.
    """
    return 1 if device.split(":")[0] == "cpu" else 4

"""Server settings: environment variables (``ARSTREAM_*``) overridden by ``arstream serve`` flags.

The settings come in groups, one class each (:class:`ServerSettings`, :class:`ModelSettings`, ...), that
:class:`Settings` joins into one flat model: ``settings.max_sessions`` and ``ARSTREAM_MAX_SESSIONS`` name a
setting whatever its group, and the groups show only where a reader looks for a setting (this file,
``arstream serve --help``, docs/server.md). A renamed or removed setting stays accepted for a while with a
one-line deprecation (:meth:`Settings.deprecation_notes`).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import resource
import socket
import sys
from collections.abc import Callable, Sequence
from types import UnionType
from typing import Any, ClassVar, Literal, Self, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, SettingsConfigDict

from .admission import AdmissionName
from .codecs import CODECS, CodecName
from . import webrtc_ports
from .start_image import base64_length
from .wire import FULL_CHROMA_MAX_PIXELS
from ..models.registry import DEFAULT_MODEL, check_model_name, check_model_options, check_runtime
from ..runner.types import RuntimeName
from ..runner.threads import default_torch_threads

CPU_KV_BUDGET_BYTES = 256 * 1024 * 1024
# uvicorn's frame limit sits a little above ours so an oversized text message reaches the
# handler and gets a `message_too_large` error instead of a bare protocol close.
WS_FRAME_SLACK_BYTES = 4096
# Descriptors kept for everything but client sockets: model files, pipes, logs, the listening socket.
RESERVED_FDS = 128


REPLICA_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def default_replica_id() -> str:
    """The host name's first label, made safe for a resume token prefix (``r0.``-style, no dots)."""
    label = socket.gethostname().split(".")[0]
    return re.sub(r"[^A-Za-z0-9_-]", "-", label)[:64] or "r0"


class SettingGroup(BaseModel):
    """Settings read together; ``arstream serve --help`` lists them under ``group_title``, with the docstring."""

    group_title: ClassVar[str]


class ServerSettings(SettingGroup):
    """Where the server listens, what it logs, how long it waits for last bytes at shutdown."""

    group_title = "server"

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="server log level")
    shutdown_grace_s: float = Field(2.0, ge=0, description="how long shutdown waits for each session's last bytes")

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class ModelSettings(SettingGroup):
    """The model served, what drives it, on which device, with how much memory for its KV."""

    group_title = "model"

    model: str = Field(
        DEFAULT_MODEL, description="pipeline name, or vllm-omni:NAME (docs/vllm-omni.md); fake-kv is the test fake"
    )
    model_options: dict[str, Any] = Field(
        default_factory=dict, description="JSON object passed to the pipeline loader as keyword arguments"
    )
    runtime: RuntimeName = Field(
        "arstream",
        description="what drives the model: arstream (its own runner) or vllm-omni (vLLM-Omni's AR-Diffusion runner, "
        "needs the vllm-omni extra; docs/vllm-omni.md)",
    )
    device: str = Field("cpu", description="torch device")
    devices: str | None = Field(
        None,
        description="one replica over several devices, comma-separated (cpu,cpu or cuda:0,cuda:1): rank 0 is this "
        "process on the first, each other device gets a process it starts; the model's attention heads and its KV "
        "are split between them (docs/deployment.md, 'A replica over several devices'); default: --device alone",
    )
    collective_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="with --devices: a rank silent for this long (no heartbeat, or a collective not done) is hung: "
        "it is killed, every session ends with the reason and the server exits 1",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads; default: one core fewer than the machine has (at least 1)"
    )
    kv_budget_bytes: int | None = Field(
        None, gt=0, description="KV pool budget in bytes; default: 256 MiB on CPU, memory_fraction on CUDA"
    )
    memory_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="fraction of free CUDA memory for the KV pool"
    )
    compile: bool = Field(
        False,
        description="torch.compile the model's DiT blocks at load, for the shapes the warm-up runs, before /readyz "
        "says ready (the log says 'compiling' until done; matrix-game-2, longlive; on the CPU it needs g++)",
    )

    @field_validator("devices")
    @classmethod
    def _several_devices(cls, value: str | None) -> str | None:
        if value is None:
            return None
        devices = [d.strip() for d in value.split(",")]
        if len(devices) < 2 or any(not d for d in devices):
            raise ValueError(f"--devices names two or more devices, comma-separated (cpu,cpu; cuda:0,cuda:1), got {value!r}")
        kinds = {d.split(":")[0] for d in devices}
        if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
            raise ValueError(f"--devices must all be cpu or all cuda:N, got {value!r}")
        return ",".join(devices)

    def replica_devices(self) -> tuple[str, ...]:
        """The devices one replica spans (``--devices``), rank 0 first; ``(device,)`` without it."""
        return (self.device,) if self.devices is None else tuple(self.devices.split(","))

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        return check_model_name(value)

    @field_validator("model_options")
    @classmethod
    def _options_fit_the_model(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # a vllm-omni: model's weights path is checked here, so a wrong one fails before the port is bound
        return check_model_options(info.data["model"], value) if "model" in info.data else value

    @field_validator("runtime")
    @classmethod
    def _runtime_runs_the_model(cls, value: str, info: ValidationInfo) -> str:
        if "model" in info.data:
            check_runtime(info.data["model"], value)
        return value


class SchedulingSettings(SettingGroup):
    """How ticks are served: credits, batching, admission, the threads beside the model worker."""

    group_title = "scheduling"

    max_pending_ticks: int = Field(4, ge=1, le=1024, description="ticks a session may have queued or running")
    max_batch_sessions: int | None = Field(
        None,
        ge=1,
        le=256,
        description="sessions whose chunks may share one forward; 1 disables batching; default: 1 on CPU, 4 elsewhere",
    )
    batch_wait_fraction: float = Field(
        0.25,
        ge=0,
        le=1,
        description="wait up to this fraction of the last round's time for its sessions' next ticks, so a round "
        "is not split in two, and from idle for other sessions' first ticks (batched sessions only; 0: never wait)",
    )
    decode_overlap: bool | None = Field(
        None,
        description="decode each round's chunks on a thread (a CUDA stream) of its own while the next round's forward "
        "runs, for models that split forward and decode (matrix-game-2, fake-kv); default: on for accelerators, off "
        "on CPU (docs/decode.md)",
    )
    admission: AdmissionName = Field(
        "kv",
        description="kv: admit while the KV pool has a session slot; realtime: also only while every admitted "
        "session still gets the model's fps at the measured chunk times (docs/server.md)",
    )
    encode_threads: int | None = Field(
        None, ge=1, le=256, description="frame encoder threads beside the model worker; default: one per CPU core"
    )
    encoder_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="steps of CPU niceness the encoder threads and the start image decode workers run below the model "
        "worker, "
        "so the worker gets a core first when cores are short",
    )
    keep_freed_memory: bool = Field(
        True, description="keep freed frame memory in the process (glibc) instead of faulting in fresh pages each round"
    )


class RewindSettings(SettingGroup):
    """How far back a session may rewind or be branched from (docs/rewind.md)."""

    group_title = "rewind"

    rewind_seconds: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="how far back a session may rewind or be branched from, in seconds of play: every chunk "
        "boundary of the last moments (up to 2 s), sparser further back, a point near this far back and none older "
        "than 1.2 times it, within --rewind-budget-mib; 0 turns rewind off (docs/rewind.md)",
    )
    rewind_budget_mib: float = Field(
        24.0,
        ge=0,
        description="memory each session's rewind points may take on top of the session (shared KV blocks and "
        "copies of the model's per-session state), counted in capacity; a model whose points cost more gets "
        "fewer, sparser ones, or a shorter horizon (docs/rewind.md)",
    )
    # Deprecated since the horizon is in seconds: the count of chunk boundaries kept. Still a field, so
    # it is parsed, bounded and reported like any other; Settings reads it as what it maps to.
    rewind_points: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="deprecated: the rewind horizon is --rewind-seconds; 0 reads as --rewind-seconds 0 (rewind "
        "off), another count is ignored",
    )


class ParkingSettings(SettingGroup):
    """Idle, detached and least recently used sessions parked in host memory, restored on their next tick
    (docs/deployment.md, Parking)."""

    group_title = "parking"

    park_budget_bytes: int = Field(
        0,
        ge=0,
        description="host memory for parked sessions: an idle (past park_after_s), detached or least recently used "
        "session moves there with its rewind points, its pool slot goes to another, and its next tick restores it "
        "(a slower chunk); the sessions a replica holds grow by this over a session's bytes; 0 turns parking off "
        "(docs/deployment.md, Parking)",
    )
    park_after_s: float | None = Field(
        None, ge=0, description="park a session idle this long (default: only when its slot is needed or it detached)"
    )
    park_spill_dir: str | None = Field(
        None, description="local directory for parked sessions past the park budget (one file each)"
    )
    park_spill_budget_bytes: int = Field(
        0, ge=0, description="disk bytes parked sessions may take in the spill directory (which it needs)"
    )


class CodecSettings(SettingGroup):
    """The frames' format when `start` names none."""

    group_title = "codec"

    codec: CodecName = Field("jpeg", description="frame codec when `start` names none")
    jpeg_quality: int = Field(80, ge=1, le=100, description="JPEG quality when `start` names none")
    small_frame_jpeg_quality: int = Field(
        95,
        ge=1,
        le=100,
        description="JPEG quality when `start` names none and the model's frames are at most 128x128 px "
        "(flat colours at that size show JPEG's noise; a 64x64 frame: 2.4 KB at 80, 4.5 KB at 95)",
    )
    webrtc: bool = Field(
        False,
        description="answer `webrtc_offer`: a session's frames on a WebRTC video track (needs the webrtc extra, "
        "aiortc); off, an offer is refused with webrtc_failed. Its peer reaches UDP ports on this host's addresses",
    )
    webrtc_max_peers: int = Field(
        16,
        ge=1,
        description="WebRTC peer connections this server holds at once (answering or connected); an offer past "
        "them gets webrtc_failed and its session plays on over the WebSocket",
    )
    webrtc_connect_timeout_s: float = Field(
        10.0,
        gt=0,
        description="an answered peer connection that has not connected within this many seconds (its ICE or DTLS "
        "never completed) is closed, its slot returned, and the session told `webrtc_state` `failed`",
    )
    webrtc_min_bitrate_kbps: int | None = Field(
        None,
        ge=1,
        description="the lowest bitrate each WebRTC track's encoder is let down to, whatever the browser's estimate "
        "(default: aiortc's, 500 kbps for H.264, 250 kbps for VP8)",
    )
    webrtc_max_bitrate_kbps: int | None = Field(
        None,
        ge=1,
        description="the highest bitrate each WebRTC track's encoder is let up to, whatever the browser's estimate "
        "(default: aiortc's, 3000 kbps for H.264, 1500 kbps for VP8); a track starts at aiortc's starting "
        "bitrate (1000 and 500 kbps) held within the bounds",
    )
    webrtc_udp_ports: str | None = Field(
        None,
        description="LOW-HIGH (e.g. 40000-40199): the UDP ports the server's ICE host candidates bind, one port per "
        "peer connection and address (default: any port the kernel gives); an offer when none is free gets "
        "webrtc_failed",
    )
    webrtc_advertised_address: str | None = Field(
        None,
        description="the IP address the server's ICE candidates carry (a replica behind 1:1 NAT, a published "
        "container port): its sockets then bind every local address of that family, one candidate each peer "
        "(default: one candidate per address of this host)",
    )

    webrtc_ice_servers: list[dict[str, Any]] = Field(
        default_factory=list,
        description="the ICE servers (STUN, TURN) clients' peer connections use, sent in `ready.webrtc.ice_servers`: "
        "a JSON list of RTCIceServer objects, e.g. [{\"urls\": \"turn:turn.example.net:3478?transport=udp\", "
        "\"username\": \"u\", \"credential\": \"p\"}]; a TURN entry without username gets time-limited "
        "credentials from --webrtc-turn-secret. The server's own candidates stay host candidates",
    )
    webrtc_turn_secret: str | None = Field(
        None,
        description="coturn's static-auth-secret (use-auth-secret): each `ready` gets TURN credentials of its own, "
        "good for --webrtc-turn-credential-ttl-s, for the TURN entries of --webrtc-ice-servers without a username "
        "(better given as ARSTREAM_WEBRTC_TURN_SECRET than as a flag)",
    )
    webrtc_turn_credential_ttl_s: float = Field(
        86400.0,
        gt=0,
        description="how long the TURN credentials of a `ready` are good for (a relayed peer connection needs them "
        "as long as it lasts: coturn checks them when the allocation is refreshed)",
    )

    @field_validator("webrtc_turn_secret")
    @classmethod
    def _empty_secret_is_none(cls, value: str | None) -> str | None:
        # compose passes an unset variable as "": no secret, not an empty one that anyone could sign with
        return value or None

    @field_validator("webrtc_ice_servers")
    @classmethod
    def _rtc_ice_servers(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for server in value:
            check_ice_server(server)
        return value

    @model_validator(mode="after")
    def _turn_credentials_known(self) -> Self:
        for server in self.webrtc_ice_servers:
            turn = any(url.startswith(("turn:", "turns:")) for url in ice_server_urls(server))
            if turn and "username" not in server and self.webrtc_turn_secret is None:
                raise ValueError("a TURN server in --webrtc-ice-servers needs a username and credential, or "
                                 "--webrtc-turn-secret to make them")
        return self

    @model_validator(mode="after")
    def _bitrate_bounds_in_order(self) -> Self:
        low, high = self.webrtc_min_bitrate_kbps, self.webrtc_max_bitrate_kbps
        if low is not None and high is not None and low > high:
            raise ValueError(f"--webrtc-min-bitrate-kbps ({low}) is above --webrtc-max-bitrate-kbps ({high})")
        return self

    @field_validator("webrtc_udp_ports")
    @classmethod
    def _port_range(cls, value: str | None) -> str | None:
        if value is not None:
            parse_port_range(value)
            _check_host_candidates_adapter()
        return value

    @field_validator("webrtc_advertised_address")
    @classmethod
    def _an_ip_address(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise ValueError("expected an IP address (IPv4 or IPv6), not a host name") from None
            _check_host_candidates_adapter()
        return value

    def webrtc_port_range(self) -> range | None:
        """The ports of ``--webrtc-udp-ports`` (HIGH included), or None: any port."""
        return None if self.webrtc_udp_ports is None else parse_port_range(self.webrtc_udp_ports)

    @field_validator("codec")
    @classmethod
    def _codec_can_encode(cls, value: str) -> str:
        # Refused before the port is bound, not at the first chunk: `--codec h264` on a machine without PyAV.
        reason = CODECS[value].unavailable_reason()
        if reason is not None:
            raise ValueError(reason)
        return value


def _check_host_candidates_adapter() -> None:
    # Refused at start-up, not at the first offer: an aioice whose gathering the adapter does not follow.
    reason = webrtc_ports.unavailable_reason()
    if reason is not None:
        raise ValueError(reason)


ICE_URL_SCHEMES = ("stun:", "stuns:", "turn:", "turns:")


def ice_server_urls(server: dict[str, Any]) -> list[str]:
    """An RTCIceServer's ``urls``, one or a list, as a list."""
    urls = server.get("urls")
    return [urls] if isinstance(urls, str) else list(urls or [])


def check_ice_server(server: Any) -> None:
    """An RTCIceServer as a browser takes it: ``urls`` (STUN or TURN URLs), and ``username`` and ``credential``
    together; raises ValueError."""
    if not isinstance(server, dict):
        raise ValueError("each ICE server is a JSON object")
    unknown = set(server) - {"urls", "username", "credential"}
    if unknown:
        raise ValueError(f"an ICE server has urls, username and credential, not {sorted(unknown)}")
    urls = server.get("urls")
    if not (isinstance(urls, str) or (isinstance(urls, list) and urls and all(isinstance(u, str) for u in urls))):
        raise ValueError("an ICE server's urls is a URL or a non-empty list of URLs")
    for url in ice_server_urls(server):
        if not url.startswith(ICE_URL_SCHEMES):
            raise ValueError(f"an ICE server URL starts with stun:, stuns:, turn: or turns:, not {url!r}")
    if ("username" in server) != ("credential" in server):
        raise ValueError("an ICE server's username and credential come together")
    if not all(isinstance(server.get(key, ""), str) for key in ("username", "credential")):
        raise ValueError("an ICE server's username and credential are strings")


def parse_port_range(text: str) -> range:
    """``LOW-HIGH`` (both included, 1 to 65535) as a range; raises ValueError."""
    match = re.fullmatch(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*", text)
    if match is None:
        raise ValueError("expected LOW-HIGH, e.g. 40000-40199")
    low, high = int(match[1]), int(match[2])
    if not 1 <= low <= high <= 65535:
        raise ValueError("expected 1 <= LOW <= HIGH <= 65535")
    return range(low, high + 1)


class AccessSettings(SettingGroup):
    """Who may connect: tokens, origins, host names, trusted proxies."""

    group_title = "access"

    auth_token: str | None = Field(None, description="require this bearer token (header or ?token=); default: none")
    allowed_origins: str = Field("", description="comma list of allowed Origin values; '*' allows every origin")
    allowed_hosts: str = Field(
        "", description="comma list of Host names served (*.example.com works); empty: any, or loopback names only "
        "when bound to loopback; '*': any"
    )
    forwarded_allow_ips: str = Field(
        "127.0.0.1", description="comma list of proxy addresses whose X-Forwarded-For is trusted; '*' trusts all"
    )
    refuse_before_upgrade: bool = Field(
        False, description="answer a missing or wrong token, or a refused origin, with HTTP 401/403 before the "
        "WebSocket upgrade instead of the `unauthorized` error (browsers then see only a failed connection)"
    )

    @field_validator("auth_token")
    @classmethod
    def _usable_auth_token(cls, value: str | None) -> str | None:
        if value is None:
            return None
        tokens = [token.strip() for token in value.split(",")]
        if not any(tokens):
            raise ValueError("the auth token is empty, which would admit an empty ?token=; unset it to run without one")
        if not all(tokens):
            raise ValueError("a comma list of auth tokens has an empty entry")
        return ",".join(tokens)

    @field_validator("allowed_origins")
    @classmethod
    def _normalised_origins(cls, value: str) -> str:
        return ",".join(normalise_origin(entry) for entry in value.split(",") if entry.strip())

    @field_validator("allowed_hosts")
    @classmethod
    def _normalised_hosts(cls, value: str) -> str:
        hosts = [entry.strip().lower() for entry in value.split(",") if entry.strip()]
        for host in hosts:
            if "/" in host or (":" in host and not host.startswith("[")):
                raise ValueError(f"allowed host {host!r} must be a bare host name, without scheme, port or path")
        return ",".join(hosts)

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _valid_proxy_addresses(cls, value: str) -> str:
        entries = [entry.strip() for entry in value.split(",") if entry.strip()]
        for entry in entries:
            if entry != "*":
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError:
                    raise ValueError(f"forwarded_allow_ips entry {entry!r} is not an IP address or network") from None
        return ",".join(entries)


class RecordingSettings(SettingGroup):
    """Recordings of what players saw, as fragmented MP4 on this replica's disk (off without --record-dir)."""

    group_title = "recording"

    record_dir: str | None = Field(
        None,
        description="directory for recordings (fragmented MP4, H.264; needs PyAV): a session that asks "
        "(start.record) is recorded, every session with --record-all; swept of earlier recordings at start",
    )
    record_all: bool = Field(False, description="record every session (needs --record-dir)")
    record_session_bytes: int = Field(
        256 * 2**20, ge=1, description="bytes one session's recordings may take; its later chunks are dropped"
    )
    record_total_bytes: int = Field(
        4 * 2**30, ge=1, description="bytes all recordings on this replica may take; chunks past it are dropped"
    )
    record_retention_s: float = Field(
        24 * 3600.0, ge=0, description="finished recordings older than this are deleted"
    )
    record_quality: int = Field(80, ge=1, le=100, description="the recordings' H.264 quality (as start.quality)")


class SessionSettings(SettingGroup):
    """How many sessions and viewers are served, and how long a session may wait."""

    group_title = "sessions"

    max_sessions: int | None = Field(
        None, ge=1, description="sessions served at once; default: as many as the KV pool holds (/v1/stats "
        "session_capacity)"
    )
    max_sessions_per_client: int | None = Field(
        4, ge=1, description="sessions one client address may hold (trusted proxies' own address is exempt)"
    )
    max_sessions_per_token: int | None = Field(None, ge=1, description="sessions one auth token may hold; default: no cap")
    start_timeout_s: float = Field(10.0, gt=0, description="time allowed for the first message, `start`")
    idle_timeout_s: float = Field(
        60.0, gt=0, description="close a session after this long without a tick or input (pings do not count)"
    )
    resume_grace_s: float = Field(
        30.0, ge=0, description="how long a dropped session keeps its KV for a resume; 0 disables resume"
    )
    max_viewers_per_session: int = Field(
        64, ge=0, description="viewers one session may have (watch links; they hold no KV, and count in the "
        "connection caps); 0: no watching"
    )
    viewer_stall_timeout_s: float = Field(
        10.0, gt=0, description="a viewer that takes nothing the server is sending it for this long is not reading: "
        "it gets `closed` (not_reading) and close 1008, and is dropped close_timeout_s later"
    )
    max_viewer_encodings: int = Field(
        2, ge=0, description="formats (codec, quality) one session's viewers may have encoded besides the "
        "controller's own frames; a viewer past it is served the nearest format already encoded"
    )


class MessageSettings(SettingGroup):
    """What one client may send, and have queued for it (bounds for serving strangers: docs/public.md)."""

    group_title = "messages"

    max_message_bytes: int = Field(65536, ge=256, description="largest client text message")
    max_control_items: int = Field(
        64, ge=1, description="JSON values one controls object may hold, containers included (checked before the schema)"
    )
    max_messages_per_s: float = Field(
        200.0, gt=0, description="messages a session may send per second on average; past it they are read more slowly"
    )
    message_burst: int = Field(400, ge=1, description="messages a session may send at once before the rate applies")
    max_frames_per_s: float = Field(
        100.0, gt=0, description="WebSocket frames that are not a whole message (fragments, pings, pongs) a connection "
        "may send per second on average; past it the connection is closed (1008)"
    )
    frame_burst: int = Field(
        200, ge=1, description="fragments, pings and pongs a connection may send at once before the rate applies"
    )
    frame_flood_ban_s: float = Field(
        10.0, ge=0, description="after a connection is closed over its frame budget, its client address may open no "
        "connection for this long (trusted proxies are exempt); 0: no ban"
    )
    max_send_buffer_bytes: int = Field(
        64 * 1024 * 1024,
        ge=65536,
        description="bytes queued for one client and not yet taken by it (replies, chunks, the socket's buffer); "
        "past it the client is not reading and is dropped",
    )


class StartImageSettings(SettingGroup):
    """A client's start image, checked before and while it is decoded (models that offer start images)."""

    group_title = "start images"

    max_start_image_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1,
        description="largest start image file a client may send in `start` (base64, so the start message may be "
        "a third larger than this on top of max_message_bytes; only when the model offers start images)",
    )
    max_start_image_pixels: int = Field(
        4096 * 4096,
        ge=1,
        description="most pixels (width x height, read from the file's header before decoding) of a client's "
        "start image",
    )
    max_start_image_jpeg_scans: int = Field(
        64,
        ge=1,
        description="most scans of a client's JPEG start image, counted before decoding by walking its markers as "
        "libjpeg reads them (libjpeg makes a pass over the whole picture per scan; a progressive JPEG has about 10)",
    )
    start_image_timeout_s: float = Field(
        5.0,
        gt=0,
        description="time a client's start image may take to decode, waiting for one of the 2 decode workers "
        "included; past it the decode's worker process is killed: over_capacity if its decode never started, else "
        "invalid_image",
    )


class ConnectionSettings(SettingGroup):
    """TCP and HTTP bounds, before any session exists (docs/public.md)."""

    group_title = "connections"

    max_connections: int | None = Field(
        None, ge=1, description="open TCP connections in all; default: 1000, fewer if the open-file limit is lower"
    )
    max_connections_per_client: int | None = Field(
        32, ge=1, description="open TCP connections per peer address (trusted proxies are exempt)"
    )
    connection_rate_per_client: float | None = Field(
        10.0, gt=0, description="new TCP connections per second one peer address may open on average (trusted "
        "proxies are exempt); past it they are closed at once, before any byte is read"
    )
    connection_burst_per_client: int = Field(
        30, ge=1, description="new TCP connections one peer address may open at once before its rate applies"
    )
    max_unstarted_connections: int = Field(
        64,
        ge=1,
        description="WebSocket connections waiting to start or resume a session, in all (keep it well under "
        "max_connections, so that waiting connections cannot take the slots health checks need); past it: HTTP 503",
    )
    max_unstarted_connections_per_client: int | None = Field(
        4,
        ge=1,
        description="WebSocket connections one client address may have waiting to start or resume a session "
        "(trusted proxies' own address is exempt); past it: HTTP 503",
    )
    max_header_bytes: int = Field(16384, ge=1024, description="largest HTTP request head (request line and headers)")
    request_head_timeout_s: float = Field(10.0, gt=0, description="time allowed to send a whole HTTP request head")
    close_timeout_s: float = Field(
        3.0, gt=0, description="time a WebSocket peer has to take its last messages and complete a close"
    )

    @field_validator("max_connections")
    @classmethod
    def _fits_open_file_limit(cls, value: int | None) -> int | None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if value is not None and hard != resource.RLIM_INFINITY and value + RESERVED_FDS > hard:
            raise ValueError(
                f"max_connections {value} does not fit the open-file limit: {hard} descriptors at most "
                f"(ulimit -Hn), {RESERVED_FDS} kept for the server; raise the limit or lower the cap"
            )
        return value


class ClusterSettings(SettingGroup):
    """Replicas behind a load balancer: names, peers, drains, resumes' routing (docs/deployment.md)."""

    group_title = "cluster"

    replica_id: str = Field(
        default_factory=default_replica_id,
        pattern=REPLICA_ID_PATTERN,
        description="this replica's name; resume tokens begin with it and a dot so a load balancer can route "
        "them (letters, digits, - and _); default: the host name's first label",
    )
    cluster_secret: str | None = Field(
        None,
        description="shared by a cluster's replicas: enables /v1/cluster/* (drain, session import), which "
        "require it as a bearer token; default: off",
    )
    cluster_peers: str = Field(
        "", description="comma list of peer replica URLs a drain (SIGTERM, or one that names none) moves sessions "
        "to; an http:// URL with a DNS name stands for every address the name has at drain time"
    )
    cluster_peers_file: str | None = Field(
        None, description="a file of peer replica URLs, one a line, read at drain time (added to --cluster-peers)"
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, description="how long a drain may take (SIGTERM or arstream drain); sessions not moved by "
        "then end as on shutdown"
    )
    max_parallel_imports: int = Field(
        2, ge=1, description="moved sessions this replica takes in at once (their snapshots streaming, their pool "
        "room held); one more gets 503 with Retry-After before a byte is read, and a draining replica tries again "
        "until its drain_timeout_s"
    )
    import_piece_timeout_s: float = Field(
        10.0, gt=0, description="each 4 MiB piece of a moved session's snapshot must all arrive within this many "
        "seconds of the piece before (a slow sender does not hold pool room); past it the import ends (408) and "
        "what it held goes back"
    )
    agent_port: int | None = Field(
        None, ge=0, le=65535, description="TCP port of the HAProxy agent check (readiness and free session slots, "
        "docs/deployment.md); 0 picks a free one; default: none"
    )


    @field_validator("cluster_secret")
    @classmethod
    def _usable_cluster_secret(cls, value: str | None) -> str | None:
        if value is not None and len(value) < 16:
            raise ValueError("the cluster secret must be at least 16 characters (it lets a peer hand this replica sessions)")
        return value


# The groups in the order --help and docs/server.md list them.
class Settings(
    ServerSettings,
    ModelSettings,
    SchedulingSettings,
    RewindSettings,
    ParkingSettings,
    CodecSettings,
    AccessSettings,
    SessionSettings,
    RecordingSettings,
    MessageSettings,
    StartImageSettings,
    ConnectionSettings,
    ClusterSettings,
    BaseSettings,  # last, so that its __init__ (which reads the environment) is the one that runs
):
    """Everything ``arstream serve`` can be told, in one flat model of the groups above; see docs/server.md."""

    model_config = SettingsConfigDict(env_prefix="ARSTREAM_", extra="forbid")

    _deprecation_notes: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _recording_needs_a_directory(self) -> Self:
        if self.record_all and self.record_dir is None:
            raise ValueError("--record-all records into --record-dir: give one")
        return self

    @model_validator(mode="after")
    def _deprecated_rewind_points(self) -> Self:
        if self.rewind_points is None:
            return self
        said = f"--rewind-points {self.rewind_points} (ARSTREAM_REWIND_POINTS) is deprecated"
        if self.rewind_points == 0 and "rewind_seconds" not in self.model_fields_set:
            self.rewind_seconds = 0.0
            self._deprecation_notes.append(f"{said}: read as --rewind-seconds 0 (rewind off)")
        else:
            self._deprecation_notes.append(
                f"{said} and ignored: the rewind horizon is --rewind-seconds {self.rewind_seconds:g} "
                "(seconds of play: every chunk boundary of the last 2 s, sparser further back)"
            )
        return self

    def deprecation_notes(self) -> list[str]:
        """One line for each deprecated setting given, saying what it was read as."""
        return list(self._deprecation_notes)

    def resolved_kv_budget_bytes(self) -> int | None:
        """The runner's byte budget: explicit, else 256 MiB on CPU, else None (memory fraction)."""
        if self.kv_budget_bytes is not None:
            return self.kv_budget_bytes
        if self.replica_devices()[0].startswith("cuda"):
            return None
        return CPU_KV_BUDGET_BYTES

    def rewind_budget_bytes(self) -> int:
        return int(self.rewind_budget_mib * 1024 * 1024)

    def resolved_max_batch_sessions(self) -> int:
        """Explicit, else :func:`default_max_batch_sessions` for the device."""
        if self.max_batch_sessions is not None:
            return self.max_batch_sessions
        return default_max_batch_sessions(self.replica_devices()[0])

    def resolved_decode_overlap(self) -> bool:
        """Explicit, else on for accelerators: on a CPU the forward and the decode share the same cores."""
        if self.decode_overlap is not None:
            return self.decode_overlap
        return self.replica_devices()[0].split(":")[0] != "cpu"

    def resolved_torch_threads(self) -> int:
        """Explicit, else leave a core to the event loop and frame encoding."""
        if self.torch_threads is not None:
            return self.torch_threads
        return default_torch_threads()

    def default_jpeg_quality(self, model_card: dict[str, Any]) -> int:
        """The JPEG quality of a session whose `start` names none: higher for a model's small frames."""
        width, height = model_card.get("width"), model_card.get("height")
        small = isinstance(width, int) and isinstance(height, int) and width * height <= FULL_CHROMA_MAX_PIXELS
        return self.small_frame_jpeg_quality if small else self.jpeg_quality

    def origin_allow_list(self) -> list[str]:
        """Configured origins; empty means the same-host default (see :mod:`arstream.app.auth`)."""
        return [origin.strip().rstrip("/") for origin in self.allowed_origins.split(",") if origin.strip()]

    @property
    def max_start_message_bytes(self) -> int:
        """The largest `start` when the model offers start images: any message plus a base64 start image."""
        return self.max_message_bytes + base64_length(self.max_start_image_bytes)

    @property
    def ws_max_size(self) -> int:
        """The WebSocket frame limit a connection opens with; it drops to :meth:`ws_message_limit` once
        the limit for `start` no longer applies (see arstream.app.guard.GuardedWebSocketProtocol)."""
        return self.ws_message_limit(self.max_start_message_bytes)

    @staticmethod
    def ws_message_limit(app_limit: int) -> int:
        return app_limit + WS_FRAME_SLACK_BYTES



SETTING_GROUPS: tuple[type[SettingGroup], ...] = tuple(
    base for base in Settings.__bases__ if isinstance(base, type) and issubclass(base, SettingGroup)
)

# What a JSON flag's value looks like typed in a shell (single quotes keep the JSON's double quotes).
_JSON_EXAMPLES: dict[type, str] = {
    dict: """'{"config": "tiny"}'""",
    list: """'[{"urls": ["turn:turn.example.net:3478"]}]'""",
}


def _json_value(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            example = _JSON_EXAMPLES[kind]
            raise argparse.ArgumentTypeError(f"expected JSON such as {example}, got {text!r}: {exc}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"expected a JSON {kind.__name__}, got {type(value).__name__}")
        return value

    parse.__name__ = f"JSON {kind.__name__}"  # argparse names the type in its error message
    return parse


def _flag_options(field: FieldInfo) -> dict[str, Any]:
    """argparse keywords for one field: bools as --x/--no-x, Literals with their choices, dicts/lists as JSON."""
    kind = field.annotation
    if get_origin(kind) in (Union, UnionType):  # ``X | None``: the flag takes an X
        kind = next(arg for arg in get_args(kind) if arg is not type(None))
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(kind) is Literal:
        # Choices shown, checked by the model, whose validators may normalise first (log level case).
        return {"metavar": "{" + ",".join(str(value) for value in get_args(kind)) + "}"}
    container = get_origin(kind) or kind
    if container in (dict, list):
        return {"type": _json_value(container), "metavar": "JSON"}
    if kind in (int, float):
        return {"type": kind, "metavar": "N" if kind is int else "NUM"}
    return {"metavar": "TEXT"}  # strings, and anything else pydantic parses from text


def _flag_help(field: FieldInfo) -> str:
    parts = [field.description or ""]
    bounds = [f"{sign} {getattr(rule, key)}" for rule in field.metadata
              for key, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if hasattr(rule, key)]
    if bounds:
        parts.append(f"({', '.join(bounds)})")
    default = field.get_default(call_default_factory=True)
    if default is not None and default is not PydanticUndefined:
        shown = json.dumps(default) if isinstance(default, (dict, list)) or default == "" else default
        parts.append(f"[default: {shown}]")
    return " ".join(part for part in parts if part).replace("%", "%%")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``arstream serve``'s description and options (one per setting)."""
    parser.description = (
        "Serve an autoregressive world model over WebSocket (PROTOCOL.md), with the demo page at /.\n"
        "Prints 'ARSTREAM_LISTENING URL' once the port is bound and the model is loaded.\n"
        "Each flag can also be set as ARSTREAM_<NAME> in the environment (e.g. ARSTREAM_PORT); flags win."
    )
    add_settings_arguments(parser)


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`Settings` field (``max_pending_ticks`` -> ``--max-pending-ticks``), in its group.

    Flags left out keep the environment's value, else the field's default, so
    a field added to a group is a flag, with its help, without more code.
    """
    for group in SETTING_GROUPS:
        arguments = parser.add_argument_group(f"{group.group_title} settings", " ".join((group.__doc__ or "").split()))
        for name, field in group.model_fields.items():
            flag = "--" + name.replace("_", "-")
            arguments.add_argument(
                flag, dest=name, default=argparse.SUPPRESS, help=_flag_help(field), **_flag_options(field)
            )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed flags over the environment; raises pydantic's ``ValidationError``.

    Each deprecation note goes to stderr once a process (serve checks its settings twice: before
    importing torch, and again when it runs).
    """
    given = {name: getattr(args, name) for name in Settings.model_fields if hasattr(args, name)}
    settings = Settings(**given)
    for note in settings.deprecation_notes():
        if note not in _NOTES_TOLD:
            _NOTES_TOLD.add(note)
            print(f"arstream serve: {note}", file=sys.stderr)
    return settings


_NOTES_TOLD: set[str] = set()


def settings_from_argv(argv: Sequence[str]) -> Settings:
    """Parse ``arstream serve`` flags; flags given win over the environment."""
    from ..cli import CommandParser

    parser = CommandParser(prog="arstream serve")
    add_settings_arguments(parser)
    return settings_from_args(parser.parse_args(argv))


def describe_settings_error(error: ValidationError) -> str:
    """One line naming each bad field as flag and variable, what is wrong, and the value given."""
    problems = []
    for item in error.errors():
        name = ".".join(str(part) for part in item["loc"])
        field = str(item["loc"][0]) if item["loc"] else ""
        where = flag_and_variable(field) if field in Settings.model_fields else name
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}, got {item['input']!r}")
    return "; ".join(problems)


def flag_and_variable(name: str) -> str:
    """``--max-sessions (ARSTREAM_MAX_SESSIONS)``: the two spellings of one setting."""
    return f"--{name.replace('_', '-')} (ARSTREAM_{name.upper()})"


DEFAULT_PORTS = {"http": 80, "https": 443}


def normalise_origin(entry: str) -> str:
    """An allowed origin as browsers send it: lower-case scheme and host, no default port, no path; or ``*``."""
    entry = entry.strip()
    if entry == "*":
        return entry
    parts = urlsplit(entry)
    if parts.scheme.lower() not in DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"allowed origin {entry!r} must look like https://host[:port] (http or https)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"allowed origin {entry!r} must be scheme://host[:port] only: browsers send no path")
    scheme = parts.scheme.lower()
    host = parts.hostname  # urlsplit lower-cases it
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"allowed origin {entry!r} has an invalid port") from None
    return f"{scheme}://{host}" if port in (None, DEFAULT_PORTS[scheme]) else f"{scheme}://{host}:{port}"


def default_max_batch_sessions(device: str) -> int:
    """1 on CPU, 4 on accelerators.

    A CPU forward is compute-bound: measured with tiny-world on one thread, four
    sessions batched gave 2-8 % more frames in total than round robin but nearly
    doubled action-to-frame latency (every session waits for the whole batch).
    Accelerators have idle width to fill, which is what batching is for.
    """
    return 1 if device.split(":")[0] == "cpu" else 4

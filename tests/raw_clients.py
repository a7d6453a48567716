"""Raw-socket clients for attack tests, and what a test reads from the server process (RSS, open files).

A real WebSocket library reads in the background and answers the server
politely; an attacker does neither. :class:`RawWebSocket` speaks just enough
RFC 6455 to upgrade and send frames, and never reads unless told to, with a
small receive buffer so the server's writes back up quickly.
"""

from __future__ import annotations

import base64
import io
import os
import re
import socket
import struct
from pathlib import Path

from PIL import Image

# Hang guard for blocking socket calls; it asserts nothing about speed.
SOCKET_GUARD_S = 30.0
SMALL_RECEIVE_BUFFER = 4096


def rss_bytes(pid: int) -> int:
    """The process's resident set size, from /proc/PID/status (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS line for process {pid}")


def child_processes(parent: int, command_part: str) -> dict[int, str]:
    """The processes whose parent is ``parent`` and whose command line holds ``command_part``: pid -> state
    (/proc/PID/stat: R running, S sleeping, Z exited and not reaped, ...)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone while listed
        if int(fields[1]) == parent and command_part in command:
            found[int(stat.parent.name)] = fields[0]
    return found


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def tcp_connect(
    port: int, *, receive_buffer: int | None = SMALL_RECEIVE_BUFFER, source_host: str | None = None
) -> socket.socket:
    """A blocking socket connected to the loopback server; ``source_host`` (e.g. 127.0.0.2) is another client."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if source_host is not None:
        sock.bind((source_host, 0))
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(SOCKET_GUARD_S)
    sock.connect(("127.0.0.1", port))
    return sock


def read_http_response(sock: socket.socket) -> tuple[str, bytes]:
    """An HTTP response head (up to its blank line, or what came before the server closed) and the bytes after it."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(4096)
        if not piece:
            break
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    return head.decode("latin-1"), rest


def read_http_head(sock: socket.socket) -> str:
    return read_http_response(sock)[0]


def closed_by_server(sock: socket.socket) -> bool:
    """Drain what the server sent until it closes the connection (True) or the guard expires (False)."""
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def close_code(payload: bytes) -> int | None:
    """The status code in a close frame's payload (None when it carries none)."""
    return struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None


class RawWebSocket:
    """A WebSocket client over a plain socket that reads nothing unless asked."""

    def __init__(
        self,
        port: int,
        path: str = "/v1/sessions",
        headers: dict[str, str] | None = None,
        *,
        source_host: str | None = None,
    ) -> None:
        self.sock = tcp_connect(port, source_host=source_host)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: 127.0.0.1:{port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{name}: {value}" for name, value in (headers or {}).items()),
        ]
        try:
            self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            self.response_head, self.leftover = read_http_response(self.sock)
        except OSError:
            self.sock.close()  # refused or dropped before it answered: raise, leaving no socket open
            raise
        self.status = int(self.response_head.split(" ", 2)[1]) if self.response_head else 0

    def _frame(self, opcode: int, payload: bytes) -> bytes:
        return self.frame(opcode, payload)

    @staticmethod
    def text_frame(text: str) -> bytes:
        """One masked text frame, to send (again and again) on any connection."""
        return RawWebSocket.frame(0x1, text.encode())

    @staticmethod
    def frame(opcode: int, payload: bytes) -> bytes:
        mask = os.urandom(4)
        length = len(payload)
        if length < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
        elif length < 65536:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        return header + mask + masked

    def send_text(self, text: str) -> None:
        self.sock.sendall(self._frame(0x1, text.encode()))

    def send_ping(self, payload: bytes = b"x" * 125) -> None:
        self.sock.sendall(self._frame(0x9, payload))

    def try_send(self, data: bytes) -> bool:
        """Send without blocking past the guard; False once the server stops taking bytes or drops us."""
        try:
            self.sock.sendall(data)
        except (TimeoutError, ConnectionResetError, BrokenPipeError):
            return False
        return True

    def read_frame(self) -> tuple[int, bytes]:
        """The next frame the server sent: its opcode and payload (server frames are not masked).

        Raises ConnectionError when the server closes the connection first.
        """

        def take(count: int) -> bytes:
            while len(self.leftover) < count:
                piece = self.sock.recv(65536)
                if not piece:
                    raise ConnectionError("the server closed the connection")
                self.leftover += piece
            data, self.leftover = self.leftover[:count], self.leftover[count:]
            return data

        first, second = take(2)
        length = second & 0x7F
        if length == 126:
            length = struct.unpack("!H", take(2))[0]
        elif length == 127:
            length = struct.unpack("!Q", take(8))[0]
        return first & 0x0F, take(length)

    def read_text(self) -> str:
        """The next text message (skipping control frames)."""
        while True:
            opcode, payload = self.read_frame()
            if opcode == 0x1:
                return payload.decode()
            if opcode == 0x8:
                raise ConnectionError(f"the server closed the WebSocket: {close_code(payload)}")

    def fragment_frames(self, count: int) -> bytes:
        """A text message's first 1-byte fragment and ``count`` 1-byte continuation fragments (never finished)."""
        first = bytes([0x01, 0x80 | 1]) + bytes(4) + b"x"
        return first + (bytes([0x00, 0x80 | 1]) + bytes(4) + b"x") * count

    def pong_frames(self, count: int) -> bytes:
        """``count`` empty pongs (unsolicited: the server ignores them, after parsing each)."""
        return (bytes([0x8A, 0x80]) + bytes(4)) * count

    def ping_frames(self, count: int, payload: bytes = b"x" * 125) -> bytes:
        return b"".join(self._frame(0x9, payload) for _ in range(count))

    def text_frames(self, texts: list[str]) -> bytes:
        return b"".join(self._frame(0x1, text.encode()) for text in texts)

    def close(self) -> None:
        self.sock.close()


def jpeg_scan_bomb(
    width: int, height: int, extra_scans: int, *, multi_picture: bool = False, junk_after_frame: bytes = b""
) -> bytes:
    """A progressive JPEG of a flat ``width`` x ``height`` picture with ``extra_scans`` more copies of its
    smallest scan (about 30 bytes each): libjpeg decodes each one with a pass over the whole picture.
    ``multi_picture``: an MPO (a second, small picture after it), which Pillow opens as "MPO", not "JPEG".
    ``junk_after_frame``: bytes that are no marker put after the frame header (libjpeg skips them, warns, and
    decodes on)."""
    buffer = io.BytesIO()
    picture = Image.new("RGB", (width, height), (90, 120, 200))
    if multi_picture:
        second = Image.new("RGB", (16, 16))
        picture.save(buffer, "MPO", save_all=True, append_images=[second], progressive=True, quality=90)
    else:
        picture.save(buffer, "JPEG", progressive=True, quality=90)
    data = buffer.getvalue()
    end = data.index(b"\xff\xd9")  # the first picture's end
    starts = [m.start() for m in re.finditer(rb"\xff\xda", data[:end])]
    scans = [data[a:b] for a, b in zip(starts, [*starts[1:], end])]
    smallest = min(scans[1:], key=len)  # a refinement scan: an end-of-band run over every block
    data = data[:end] + smallest * extra_scans + data[end:]
    frame = data.index(b"\xff\xc2")  # the progressive frame header
    after = frame + 2 + int.from_bytes(data[frame + 2 : frame + 4], "big")
    return data[:after] + junk_after_frame + data[after:]

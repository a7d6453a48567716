"""Where ``arstream serve`` listens: the checks made before anything heavy loads, and the URLs it announces.

Importing this module is cheap (no torch): ``arstream serve`` refuses bad
settings and an address it cannot bind in well under a second
(:func:`refusal_before_loading`, which the CLI runs before importing the
server), and names the host when the host is the problem.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys

from pydantic import ValidationError

from .settings import describe_settings_error, settings_from_args

ALL_INTERFACES = ("", "0.0.0.0", "::")


def display_host(host: str) -> str:
    """``host`` as a browser on this machine reaches it (all interfaces: loopback), brackets around IPv6."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def address_refusal(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound (checked with uvicorn's options before the model loads), or None."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except socket.gaierror as exc:
            return f"--host {host!r} is not an address or a name this machine can resolve ({exc.strerror})"
        except OSError as exc:
            where = f"{display_host(host)}:{port}"
            if exc.errno == errno.EADDRINUSE:
                return f"cannot listen on {where}: the port is in use; choose another with --port"
            if exc.errno == errno.EACCES:
                return f"cannot listen on {where}: permission denied (ports below 1024 need privileges); choose another with --port"
            return (
                f"cannot listen on {where} ({exc.strerror}): {host} is not an address of this machine; "
                "choose another with --host (127.0.0.1 for this machine only, 0.0.0.0 for the network)"
            )
    return None


def refusal_before_loading(args: argparse.Namespace) -> int | None:
    """Exit status 2 after one line on stderr when the settings or the address are refused; None when fine."""
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"arstream serve: {describe_settings_error(exc)}", file=sys.stderr)
        return 2
    refusal = address_refusal(settings.host, settings.port)
    if refusal is not None:
        print(f"arstream serve: {refusal}", file=sys.stderr)
        return 2
    return None


def lan_addresses() -> list[str]:
    """This machine's IPv4 addresses other devices on its networks may reach (not loopback), best first."""
    found: list[str] = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        # A UDP "connect" sends nothing; it asks the routing table which local address leads out.
        probe.connect(("10.255.255.255", 1))
        found.append(probe.getsockname()[0])
    except OSError:
        pass
    finally:
        probe.close()
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        found += [str(info[4][0]) for info in infos]
    except OSError:
        pass
    return [a for i, a in enumerate(found) if not a.startswith("127.") and a != "0.0.0.0" and a not in found[:i]]


def network_lines(host: str, port: int, *, token_required: bool = False) -> list[str]:
    """What to print when the server listens beyond this machine: the LAN URL(s), that it is reachable, and whether
    strangers on that network need a token."""
    if host not in ALL_INTERFACES:
        return []
    guard = (
        "Players need the access token (--auth-token): the page asks for it."
        if token_required
        else "Anyone who can reach this address can play: add --auth-token TOKEN to ask for one "
        "(docs/public.md for a server strangers reach)."
    )
    addresses = lan_addresses()
    if not addresses:
        return [
            f"ARStream listens on every interface, port {port}: open http://THIS-MACHINE'S-ADDRESS:{port}/ on another device",
            guard,
        ]
    urls = ", ".join(f"http://{address}:{port}/" for address in addresses)
    return [
        f"ARStream is reachable from the network: open {urls} on a phone or another computer on the same network "
        "(docs/demo.md, \"Play from a phone\")",
        guard,
    ]

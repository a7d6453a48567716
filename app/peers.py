"""The peers a drain moves sessions to: ``--cluster-peers`` and ``--cluster-peers-file``, resolved at drain time.

Each entry is a replica's base URL. An ``http://`` URL whose host is a DNS
name stands for every address that name has when the drain starts (a compose
service name, a Kubernetes headless Service), each on the URL's port; an
``https://`` URL stays as given (its certificate names the host, not an
address). The file, when set, holds one URL a line and is read at drain
time, so a launcher that learns its replicas' ports after starting them
(scripts/local-cluster.sh) can fill it in. This replica's own URLs are left
out: a drain never offers a session to itself.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from pathlib import Path
from urllib.parse import urlsplit

from .settings import Settings

log = logging.getLogger("arstream.migration")


def peer_entries(settings: Settings) -> list[str]:
    """The configured entries, in order: ``--cluster-peers`` first, then the file's lines (blank and # lines skipped)."""
    entries = [p.strip() for p in settings.cluster_peers.split(",") if p.strip()]
    if settings.cluster_peers_file:
        try:
            lines = Path(settings.cluster_peers_file).read_text().splitlines()
        except OSError as exc:
            log.warning("cannot read --cluster-peers-file %s: %s", settings.cluster_peers_file, exc)
            lines = []
        entries += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return entries


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _url(scheme: str, host: str, port: int | None, path: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}{'' if port is None else f':{port}'}{path.rstrip('/')}"


def expand(entry: str) -> list[str]:
    """One entry as the URLs it stands for now (a DNS name: one per address); [] when the name does not resolve."""
    parts = urlsplit(entry)
    host = parts.hostname
    if parts.scheme != "http" or host is None or _is_address(host):
        return [entry.rstrip("/")]
    port = parts.port or 80
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("drain peer %s does not resolve: %s", entry, exc)
        return []
    addresses = dict.fromkeys(str(info[4][0]) for info in found)  # in the resolver's order, once each
    return [_url("http", address, parts.port, parts.path) for address in addresses]


def own_urls(host: str, port: int) -> set[str]:
    """The URLs by which peers may name this replica: its bound address, loopback, and its host name's addresses."""
    hosts = {"127.0.0.1", "localhost", "::1"}
    if host not in ("", "0.0.0.0", "::"):
        hosts.add(host)
    try:
        hosts.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return {_url("http", h, port, "") for h in hosts}


async def configured_peers(settings: Settings, *, own: set[str]) -> list[str]:
    """The peer URLs to offer sessions to, in order, each once, this replica's own left out."""
    entries = peer_entries(settings)
    expanded = await asyncio.gather(*(asyncio.to_thread(expand, entry) for entry in entries))
    urls = dict.fromkeys(url for urls in expanded for url in urls)
    return [url for url in urls if url not in own]

"""What deploy/haproxy/render.py and deploy/envoy/render.py parse and report alike (standard library only).

Both are run as scripts (``python3 deploy/<balancer>/render.py``), so each puts this folder on ``sys.path``
and imports this module by its file name: no package to install on a balancer's host.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPLICA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # the server's replica_id rule
MAX_SLOTS = 64  # server slots one --statefulset/--compose option may declare


def slot_count(text: str, what: str) -> tuple[str, int]:
    """``WHAT=COUNT`` (a compose service's or a StatefulSet's name, and how many server slots it gets)."""
    name, eq, count = text.partition("=")
    if not eq or not REPLICA_NAME.match(name) or not count.isdigit() or not 0 < int(count) <= MAX_SLOTS:
        raise ValueError(f"expected {what}=COUNT with COUNT 1-{MAX_SLOTS}; got {text!r}")
    return name, int(count)


def add_statefulset_options(parser: argparse.ArgumentParser) -> None:
    """The options that say where a StatefulSet's pods are found."""
    parser.add_argument(
        "--headless-service", default="arstream-peers", help="the StatefulSet's headless Service (arstream-peers)"
    )
    parser.add_argument("--replica-port", type=int, default=8000, help="the pods' serving port (default 8000)")


def add_out_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="write here instead of standard output")


def write_rendered(render: Callable[[], str], out: Path | None) -> int:
    """Render and write to ``out`` (standard output when None); a ValueError is a usage error: exit status 2."""
    try:
        text = render()
    except ValueError as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
    return 0

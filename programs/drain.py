"""``arstream drain URL --to PEER``: move a replica's sessions to peers, then let it exit (app/migration.py).

``arstream drain --which SESSION URL [URL ...]``: which of these replicas holds that session (and how).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import httpx

from ..app.wire import DRAIN_PATH, HOLDER_PATH  # not the server's modules: no torch here
from ..cli import main_for

SECRET_ENV = "ARSTREAM_CLUSTER_SECRET"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Drain a replica: it stops admitting, moves each of its sessions (live, just started, detached, being\n"
        "resumed) to the first peer with room (the client follows with a new resume token), ends the rest\n"
        "as on shutdown, and exits. Prints the drain's report as one JSON line; exits 3 when any session\n"
        "was not moved. The replicas must have been started with the same cluster secret\n"
        f"(${SECRET_ENV} or --cluster-secret). With --which SESSION: print which of the URLs holds it."
    )
    parser.add_argument(
        "url", nargs="+", help="the replica's own base URL, e.g. http://10.0.0.5:8000 (not the balancer's); "
        "with --which, every replica to ask"
    )
    parser.add_argument(
        "--to", dest="peers", action="append", default=[], metavar="PEER",
        help="a peer replica's base URL; repeat for several (default: the replica's --cluster-peers)",
    )
    parser.add_argument(
        "--cluster-secret", default=None, metavar="TEXT", help=f"the cluster's secret [default: ${SECRET_ENV}]"
    )
    parser.add_argument("--no-exit", action="store_true", help="keep the replica running (not admitting) afterwards")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="NUM", help="seconds to wait for the report")
    parser.add_argument(
        "--which", metavar="SESSION", default=None,
        help="drain nothing: print the URL of the replica holding session SESSION (its `ready.session_id`)",
    )


def _refusal(response: httpx.Response) -> str:
    """A replica's refusal in words: its ``detail``, not the JSON around it.

    An answer that is not a replica's JSON (most often the balancer's 403 page: it never lets the cluster routes
    through) is said on one line, with the URL to give instead.
    """
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, str):
        return f"{response.status_code}: {detail}"
    text = " ".join(re.sub(r"<[^>]*>", " ", response.text).split())[:300]
    if response.headers.get("content-type", "").startswith("application/json"):
        return f"{response.status_code}: {text}"
    return (
        f"{response.status_code}: {text} (not a replica's answer: is this the balancer? It never lets drains "
        "through; give the replica's own URL, e.g. an ARSTREAM_REPLICA line of scripts/local-cluster.sh)"
    )


def which(urls: list[str], session_id: str, secret: str, timeout: float) -> int:
    """Print the replica that holds ``session_id``; 1 when none of ``urls`` does (or one could not be asked)."""
    failed = False
    for url in urls:
        try:
            response = httpx.get(
                f"{url.rstrip('/')}{HOLDER_PATH}/{session_id}",
                headers={"authorization": f"Bearer {secret}"},
                timeout=timeout,
            )
        except httpx.HTTPError as exc:
            print(f"arstream drain: {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed = True
            continue
        answer = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        if response.status_code == 200:
            print(f"{url} holds session {session_id} ({answer['held']}; replica {answer['replica']})", flush=True)
            return 0
        if not (response.status_code == 404 and "held" in answer):  # not "not here": a refusal
            print(f"arstream drain: {url}: {_refusal(response)}", file=sys.stderr)
            failed = True
    print(f"arstream drain: no replica {'answered that it holds' if failed else 'holds'} session {session_id}",
          file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    secret = args.cluster_secret or os.environ.get(SECRET_ENV)
    if not secret:
        print(
            f"arstream drain: no cluster secret: set {SECRET_ENV} (or give --cluster-secret) to the secret the "
            "replicas were started with",
            file=sys.stderr,
        )
        return 2
    if args.which is not None:
        return which(args.url, args.which, secret, args.timeout)
    if len(args.url) != 1:
        print("arstream drain: drain one replica at a time (several URLs only with --which)", file=sys.stderr)
        return 2
    url = args.url[0]
    body = {"peers": args.peers, "exit": not args.no_exit}
    try:
        response = httpx.post(
            url.rstrip("/") + DRAIN_PATH,
            json=body,
            headers={"authorization": f"Bearer {secret}"},
            timeout=args.timeout,
        )
    except httpx.HTTPError as exc:
        print(f"arstream drain: {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"arstream drain: {url} refused: {_refusal(response)}", file=sys.stderr)
        return 1
    report = response.json()
    print(f"moved {report['moved']} session(s), ended {report['ended']}", file=sys.stderr)
    for session in report["sessions"]:
        if not session["moved"]:
            print(f"  ended {session['session_id']} ({session['kind']}): {session['reason']}", file=sys.stderr)
    print(json.dumps(report), flush=True)
    return 0 if report["ended"] == 0 else 3


main = main_for("drain")

if __name__ == "__main__":
    sys.exit(main())

"""``arstream drain URL --to PEER``: move a replica's live sessions to peers, then let it exit (app/migration.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

from arstream.cli import main_for

SECRET_ENV = "ARSTREAM_CLUSTER_SECRET"
# The replica's route (app/migration.py); defined here so this command does not load the server (or torch).
DRAIN_PATH = "/v1/cluster/drain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Drain a replica: it stops admitting, moves each live session to the first peer with room\n"
        "(the client follows with a new resume token), ends the rest as on shutdown, and exits.\n"
        "Prints the drain's report as one JSON line."
    )
    parser.add_argument("url", help="the replica's own base URL, e.g. http://10.0.0.5:8000 (not the balancer's)")
    parser.add_argument(
        "--to", dest="peers", action="append", default=[], metavar="PEER",
        help="a peer replica's base URL; repeat for several (default: the replica's --cluster-peers)",
    )
    parser.add_argument(
        "--cluster-secret", default=None, metavar="TEXT", help=f"the cluster's secret [default: ${SECRET_ENV}]"
    )
    parser.add_argument("--no-exit", action="store_true", help="keep the replica running (not admitting) afterwards")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="NUM", help="seconds to wait for the report")


def run(args: argparse.Namespace) -> int:
    secret = args.cluster_secret or os.environ.get(SECRET_ENV)
    if not secret:
        print(f"arstream drain: give --cluster-secret or set {SECRET_ENV}", file=sys.stderr)
        return 2
    body = {"peers": args.peers, "exit": not args.no_exit}
    try:
        response = httpx.post(
            args.url.rstrip("/") + DRAIN_PATH,
            json=body,
            headers={"authorization": f"Bearer {secret}"},
            timeout=args.timeout,
        )
    except httpx.HTTPError as exc:
        print(f"arstream drain: {args.url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"arstream drain: {response.status_code} {response.text[:500]}", file=sys.stderr)
        return 1
    report = response.json()
    print(f"moved {report['moved']} session(s), ended {report['ended']}", file=sys.stderr)
    print(json.dumps(report), flush=True)
    return 0 if report["ended"] == 0 else 3


main = main_for("drain")

if __name__ == "__main__":
    sys.exit(main())

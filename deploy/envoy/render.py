#!/usr/bin/env python3
"""Render Envoy's configuration for a set of ARStream replicas (standard library only): Envoy as a second
balancer beside HAProxy (deploy/haproxy/), for clusters whose gateway is Envoy (docs/kubernetes.md).

    python3 deploy/envoy/render.py --statefulset arstream=8 --headless-service arstream-peers \\
        --bind 0.0.0.0:8080 --admin 127.0.0.1:9901 --out deploy/kubernetes/envoy/envoy.json
    python3 deploy/envoy/render.py --replica r0=127.0.0.1:8000 --replica r1=127.0.0.1:8001 --bind 127.0.0.1:8080

Routing, as HAProxy's (docs/deployment.md, "How HAProxy routes"):

- ``/v1/sessions?resume=NAME.…`` and ``?share=NAME.…``, ``/v1/realtime/video?resume=NAME.…`` (the vLLM-Omni
  dialect's resumes, a drain's ``session.moved`` among them): replica NAME's own cluster, whatever its health
  (no health check there): only the replica that holds a session can resume it or show it.
- ``/v1/sessions`` and ``/v1/realtime/video``: cluster ``sessions``, every replica, least requests, health-checked on ``/readyz`` (loaded,
  not draining, room for a session). Envoy has no agent check to learn each replica's free slots, so a full
  replica is taken out of this cluster by its health check; a draining one too. ``healthy_panic_threshold``
  0: with every replica unhealthy Envoy answers 503 rather than spread sessions over replicas that refuse
  them. ``no_traffic_interval`` short: Envoy checks a cluster that carries no traffic every minute by
  default, and a replica that has just started draining must stop getting sessions within seconds.
- everything else (the demo page, ``/v1/model``): cluster ``pages``, health-checked on ``/servingz``.
- ``/v1/cluster/`` (replica to replica): 403; ``/metrics``, ``/v1/stats``, ``/replicas/``: 404 (private).

Every route matches the path as the replica routes it: the replica decodes percent escapes (``/%6detrics`` is
its /metrics), so Envoy normalises the path first (RFC 3986: escaped unreserved characters decoded, dot
segments resolved), merges repeated slashes, and decodes ``%2F`` to ``/``, and forwards that path.

Replicas: ``--replica NAME=HOST:PORT`` (fixed addresses), or ``--statefulset NAME=COUNT`` for COUNT pods of a
Kubernetes StatefulSet, found by DNS: each pod by its stable name NAME-i.SERVICE (its own cluster), all of
them through the headless Service's name (``sessions``, ``pages``). Envoy's resolver applies the pod's
resolv.conf search domains, so the short names serve any namespace.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # deploy/: the parsing both balancers share
from render_cli import REPLICA_NAME, add_out_option, add_statefulset_options, slot_count, write_rendered  # noqa: E402
# A token is the replica's id, a dot, then the rest (app/resume.py); these query parameters carry one.
TOKEN_PARAMETERS = ("resume", "share")
SESSIONS_PATH = "/v1/sessions"
REALTIME_PATH = "/v1/realtime/video"  # the vLLM-Omni dialect: resumes only (it has no watch links)
HEALTH_INTERVAL = "1s"
# Timeouts as HAProxy's: connect 3 s; a WebSocket session may sit still for an hour.
CONNECT_TIMEOUT = "3s"
SESSION_IDLE_TIMEOUT = "3600s"
PRIVATE_PATHS = ("/metrics", "/v1/stats")
PRIVATE_PREFIXES = ("/replicas/",)
TYPES = "type.googleapis.com/envoy.extensions."  # the type URLs of Envoy's extensions' settings


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int


def parse_address(text: str) -> Endpoint:
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT; got {text!r}")
    return Endpoint(host, int(port))


def parse_named(text: str, what: str) -> tuple[str, str]:
    name, eq, rest = text.partition("=")
    if not eq or not REPLICA_NAME.match(name) or not rest:
        raise ValueError(f"expected NAME={what} with NAME of letters, digits, - or _; got {text!r}")
    return name, rest


def _cluster(name: str, endpoints: list[Endpoint], *, dns: bool, health_path: str | None) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STRICT_DNS" if dns else "STATIC",
        "connect_timeout": CONNECT_TIMEOUT,
        # The replica with the fewest open requests (sessions) of all, as HAProxy's leastconn: Envoy's default
        # compares two hosts picked at random, which can put two new sessions on one replica of two.
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.least_request",
                        "typed_config": {
                            "@type": TYPES + "load_balancing_policies.least_request.v3.LeastRequest",
                            "selection_method": "FULL_SCAN",
                        },
                    }
                }
            ]
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": e.host, "port_value": e.port}}}}
                        for e in endpoints
                    ]
                }
            ],
        },
    }
    if dns:
        # Envoy looks each name up again every 5 s (its default): a pod replaced or added appears within seconds.
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if health_path is not None:
        cluster["health_checks"] = [
            {
                "timeout": "1s",
                "interval": HEALTH_INTERVAL,
                "no_traffic_interval": HEALTH_INTERVAL,
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                # A Host the replica answers to even when it binds a loopback address (app/http_policy.py).
                "http_health_check": {"path": health_path, "host": "localhost"},
            }
        ]
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    return cluster


def _route(cluster: str) -> dict[str, Any]:
    # timeout 0: no limit on the upgraded stream as a whole; idle_timeout: a session may sit still an hour.
    return {"cluster": cluster, "timeout": "0s", "idle_timeout": SESSION_IDLE_TIMEOUT}


def _denied(match: dict[str, Any], status: int) -> dict[str, Any]:
    return {"match": match, "direct_response": {"status": status}}


def render(
    owners: dict[str, list[Endpoint]], shared: list[Endpoint], *, dns: bool, bind: Endpoint, admin: Endpoint
) -> dict[str, Any]:
    """Envoy's bootstrap: ``owners`` maps each replica to its own cluster's endpoints, ``shared`` is every replica."""
    if not owners:
        raise ValueError("at least one replica is needed")
    routes: list[dict[str, Any]] = [_denied({"prefix": "/v1/cluster/"}, 403)]
    routes += [_denied({"path": path}, 404) for path in PRIVATE_PATHS]
    routes += [_denied({"prefix": prefix}, 404) for prefix in PRIVATE_PREFIXES]
    owned = [(SESSIONS_PATH, parameter) for parameter in TOKEN_PARAMETERS] + [(REALTIME_PATH, "resume")]
    for name in owners:
        for path, parameter in owned:
            match = {"path": path, "query_parameters": [{"name": parameter, "string_match": {"prefix": f"{name}."}}]}
            routes.append({"match": match, "route": _route(name)})
    for path in (SESSIONS_PATH, REALTIME_PATH):
        routes.append({"match": {"path": path}, "route": {**_route("sessions"), **_retry_elsewhere()}})
    routes.append({"match": {"prefix": "/"}, "route": {"cluster": "pages"}})
    manager = {
        "@type": TYPES + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "arstream",
        "upgrade_configs": [{"upgrade_type": "websocket"}],
        # X-Forwarded-For: the client's address, so per-client caps count browsers (--forwarded-allow-ips).
        "use_remote_address": True,
        # The path as the replica reads it, before any route is matched (see the module's docstring).
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
        "stream_idle_timeout": SESSION_IDLE_TIMEOUT,
        "route_config": {
            "name": "arstream",
            "virtual_hosts": [{"name": "arstream", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": TYPES + "filters.http.router.v3.Router"},
            }
        ],
    }
    listener = {
        "name": "public",
        "address": {"socket_address": {"address": bind.host, "port_value": bind.port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }
    clusters = [_cluster("sessions", shared, dns=dns, health_path="/readyz")]
    clusters.append(_cluster("pages", shared, dns=dns, health_path="/servingz"))
    clusters += [_cluster(name, endpoints, dns=dns, health_path=None) for name, endpoints in owners.items()]
    return {
        "admin": {"address": {"socket_address": {"address": admin.host, "port_value": admin.port}}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


def _retry_elsewhere() -> dict[str, Any]:
    """A new session whose replica refuses the connection is tried on another (HAProxy's redispatch)."""
    return {
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset",
            "num_retries": 2,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {"@type": TYPES + "retry.host.previous_hosts.v3.PreviousHostsPredicate"},
                }
            ],
            "host_selection_retry_max_attempts": 3,
        }
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", action="append", default=[], metavar="NAME=HOST:PORT")
    parser.add_argument("--statefulset", metavar="NAME=COUNT", help="COUNT pods of a StatefulSet, found by DNS")
    add_statefulset_options(parser)
    parser.add_argument("--bind", default="0.0.0.0:8080", help="where clients connect (default 0.0.0.0:8080)")
    parser.add_argument("--admin", default="127.0.0.1:9901", help="Envoy's admin page, keep it private")
    add_out_option(parser)
    args = parser.parse_args(argv)

    def rendered() -> str:
        if bool(args.replica) == bool(args.statefulset):
            raise ValueError("give either --replica (one or more) or --statefulset")
        if args.statefulset:
            name, count = slot_count(args.statefulset, "NAME")
            pods = [f"{name}-{ordinal}" for ordinal in range(count)]  # a StatefulSet counts from 0
            owners = {pod: [Endpoint(f"{pod}.{args.headless_service}", args.replica_port)] for pod in pods}
            shared = [Endpoint(args.headless_service, args.replica_port)]
        else:
            named = [parse_named(text, "HOST:PORT") for text in args.replica]
            owners = {name: [parse_address(address)] for name, address in named}
            if len(owners) != len(named):
                raise ValueError("replica names must be unique")
            shared = [endpoint for endpoints in owners.values() for endpoint in endpoints]
        config = render(
            owners, shared, dns=bool(args.statefulset), bind=parse_address(args.bind), admin=parse_address(args.admin)
        )
        return json.dumps(config, indent=2) + "\n"

    return write_rendered(rendered, args.out)


if __name__ == "__main__":
    sys.exit(main())

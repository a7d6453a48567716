#!/usr/bin/env python3
"""Render deploy/haproxy/haproxy.cfg.template for a set of ARStream replicas (standard library only).

    python3 deploy/haproxy/render.py --bind :8080 --stats-bind :8404 --admin-bind :8405 \\
        --replica r0=replica-0:8000 --replica r1=replica-1:8000 --maxconn 6 > haproxy.cfg

Each ``--replica NAME=HOST:PORT[/MAXCONN][@AGENT_PORT]`` is one ``arstream serve`` (NAME is its
``--replica-id``); MAXCONN, the replica's session capacity until its agent check reports (``maxconn:`` in
app/balancer.py), defaults to ``--maxconn``; AGENT_PORT, its ``--agent-port``, to ``--agent-port``.
Template lines starting with ``@each `` repeat once per replica.

``--compose SERVICE=COUNT`` declares COUNT server slots for a scaled compose service: SERVICE-1 ..
SERVICE-COUNT at PROJECT-SERVICE-i:8000 (the container names, resolved by Docker's DNS while HAProxy
runs; a slot with no container stays in maintenance). deploy/replica-entrypoint.sh gives each container
the replica id SERVICE-i, so resumes find it.

``--statefulset NAME=COUNT`` declares COUNT server slots for a Kubernetes StatefulSet (deploy/kubernetes/):
NAME-0 .. NAME-(COUNT-1), the pod names and so the replicas' ids, each at its stable DNS name under the
headless Service (``--headless-service``), NAME-i.SERVICE.$POD_NAMESPACE.svc.CLUSTER_DOMAIN. HAProxy's
resolvers do not apply resolv.conf's search domains, so the name is whole; the namespace comes from the
balancer pod's environment when HAProxy starts (HAProxy expands "${VAR}" in quoted words), so one rendered
file serves any namespace. A slot whose pod does not exist (scaled down, or being replaced) stays in
maintenance until its name resolves. Why not ``server-template``: it numbers its slots in the order the DNS
answers come, so slot NAME-2 may hold pod NAME-0's address, and resumes route by the slot's name.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # deploy/: the parsing both balancers share
from render_cli import (  # noqa: E402
    REPLICA_NAME,
    add_out_option,
    add_statefulset_options,
    slot_count,
    write_rendered,
)

TEMPLATE = Path(__file__).resolve().parent / "haproxy.cfg.template"
EACH = "@each "
# The balancer pod's namespace (the downward API sets it in deploy/kubernetes/haproxy/balancer.yaml).
NAMESPACE_ENV = "POD_NAMESPACE"


@dataclass(frozen=True)
class Replica:
    name: str
    address: str
    maxconn: int
    agent_port: int


def parse_replica(text: str, default_maxconn: int, default_agent_port: int = 8001) -> Replica:
    name, eq, rest = text.partition("=")
    rest, at, agent = rest.partition("@")
    address, slash, maxconn = rest.partition("/")
    if not eq or not REPLICA_NAME.match(name) or ":" not in address:
        raise ValueError(
            f"expected NAME=HOST:PORT[/MAXCONN][@AGENT_PORT] with NAME of letters, digits, - or _; got {text!r}"
        )
    try:
        count = int(maxconn) if slash else default_maxconn
        agent_port = int(agent) if at else default_agent_port
    except ValueError:
        raise ValueError(f"MAXCONN and AGENT_PORT are numbers; got {text!r}") from None
    if count < 1:
        raise ValueError(f"maxconn must be at least 1, got {count} in {text!r}")
    if not 0 < agent_port < 65536:
        raise ValueError(f"the agent port must be 1-65535, got {agent_port} in {text!r}")
    return Replica(name, address, count, agent_port)


def compose_slots(text: str, project: str, default_maxconn: int, agent_port: int) -> list[Replica]:
    service, count = slot_count(text, "SERVICE")
    names = [f"{service}-{i}" for i in range(1, count + 1)]
    return [Replica(name, f"{project}-{name}:8000", default_maxconn, agent_port) for name in names]


def statefulset_slots(
    text: str, service: str, port: int, default_maxconn: int, agent_port: int, cluster_domain: str = "cluster.local"
) -> list[Replica]:
    name, count = slot_count(text, "NAME")
    if not REPLICA_NAME.match(service):
        raise ValueError(f"the headless Service's name is letters, digits, - or _; got {service!r}")
    pods = [f"{name}-{ordinal}" for ordinal in range(count)]  # a StatefulSet counts its pods from 0
    domain = f"{service}.${{{NAMESPACE_ENV}}}.svc.{cluster_domain}"
    return [Replica(pod, f'"{pod}.{domain}:{port}"', default_maxconn, agent_port) for pod in pods]


def render(
    replicas: list[Replica],
    *,
    bind: str,
    stats_bind: str,
    admin_bind: str = ":8405",
    check_interval: str = "2s",
    queue_timeout: str = "10s",
    per_source_connections: int = 16,
    per_source_connection_rate: int = 100,
    template: str | None = None,
) -> str:
    """The configuration text; raises KeyError when the template names a value that is not given."""
    if not replicas:
        raise ValueError("at least one replica is needed")
    if len({r.name for r in replicas}) != len(replicas):
        raise ValueError("replica names must be unique: " + ", ".join(r.name for r in replicas))
    values = {
        "bind": bind,
        "stats_bind": stats_bind,
        "admin_bind": admin_bind,
        "check_interval": check_interval,
        "queue_timeout": queue_timeout,
        "per_source_connections": per_source_connections,
        "per_source_connection_rate": per_source_connection_rate,
    }
    lines = []
    for line in (template if template is not None else TEMPLATE.read_text()).splitlines():
        if line.startswith(EACH):
            body = Template(line[len(EACH) :])
            lines += [
                body.substitute(values, name=r.name, address=r.address, maxconn=r.maxconn, agent_port=r.agent_port)
                for r in replicas
            ]
        else:
            lines.append(Template(line).substitute(values))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", action="append", default=[], metavar="NAME=HOST:PORT[/MAXCONN][@AGENT_PORT]")
    parser.add_argument("--compose", action="append", default=[], metavar="SERVICE=COUNT", help="server slots")
    parser.add_argument("--compose-project", default="arstream", help="compose project name (default arstream)")
    parser.add_argument("--statefulset", action="append", default=[], metavar="NAME=COUNT", help="server slots")
    add_statefulset_options(parser)
    parser.add_argument("--maxconn", type=int, default=4, help="sessions per replica when a replica names none")
    parser.add_argument("--agent-port", type=int, default=8001, help="replicas' --agent-port (default 8001)")
    parser.add_argument("--bind", default=":8080", help="where clients connect (default :8080)")
    parser.add_argument("--stats-bind", default=":8404", help="HAProxy /stats and /metrics (default :8404)")
    parser.add_argument(
        "--admin-bind", default=":8405", help="the operators' /stats with admin actions, behind a password (default :8405)"
    )
    parser.add_argument("--check-interval", default="2s", help="health and agent check interval (default 2s)")
    parser.add_argument(
        "--per-source-connections", type=int, default=16, help="connections one client address may hold (default 16)"
    )
    parser.add_argument(
        "--per-source-connection-rate",
        type=int,
        default=100,
        help="new connections one client address may open in any 10 s (default 100)",
    )
    parser.add_argument("--queue-timeout", default="10s", help="how long a new session waits for a slot (default 10s)")
    add_out_option(parser)
    args = parser.parse_args(argv)

    def rendered() -> str:
        replicas = [parse_replica(text, args.maxconn, args.agent_port) for text in args.replica]
        for text in args.compose:
            replicas += compose_slots(text, args.compose_project, args.maxconn, args.agent_port)
        for text in args.statefulset:
            replicas += statefulset_slots(text, args.headless_service, args.replica_port, args.maxconn, args.agent_port)
        return render(
            replicas,
            bind=args.bind,
            stats_bind=args.stats_bind,
            admin_bind=args.admin_bind,
            check_interval=args.check_interval,
            queue_timeout=args.queue_timeout,
            per_source_connections=args.per_source_connections,
            per_source_connection_rate=args.per_source_connection_rate,
        )

    return write_rendered(rendered, args.out)


if __name__ == "__main__":
    sys.exit(main())

"""A StatefulSet rolling update played for real on loopback: three replica processes named as the StatefulSet
names its pods, each on an address of its own, found by DNS, behind the real HAProxy, replaced one at a time
the way the kubelet and the StatefulSet controller do it, under streaming sessions.

What stands in for the cluster, and nothing else:

- cluster DNS: Debian's dnsmasq on a loopback address of this test's own, answering the headless Service's
  per-pod names (``arstream-N.arstream-peers.NAMESPACE.svc.cluster.local``) and its name for every pod; every
  process here sees it as a pod does, through its own /etc/resolv.conf (a private mount namespace, with the
  cluster's search domains), so the manifest's ``http://arstream-peers:8000`` peers resolve as in a pod;
- a pod: ``arstream serve`` with the manifest's environment (its ConfigMap, the pod name as the downward API
  gives it, the Secret), on the manifest's ports at an address of its own, serving fake-kv on the CPU;
- the kubelet: the manifest's preStop command run beside the pod with the pod's environment (its loopback
  URL pointed at the pod's address: these pods share one network), then SIGTERM,
  then a bounded wait of terminationGracePeriodSeconds; readiness is the manifest's readinessProbe;
- the StatefulSet controller: pods replaced highest ordinal first, each new pod (same name, a new address in
  DNS) Ready before the next is taken down.

HAProxy runs deploy/haproxy/render.py's StatefulSet mode (the manifest's own configuration, with loopback
binds and a faster check), finding each pod by its DNS name. Six sessions stream throughout; each one that
is moved follows `moved` through HAProxy. None is lost, every chunk index arrives once and in order, and
every frame equals an uninterrupted session's with the same seed and controls. Played twice: the manifest's
path (the preStop drain, then SIGTERM), and SIGTERM alone (the replica drains on it: a preStop hook that
failed loses nothing either).
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes_manifests import one, rendered, replica_container, replica_environment
from servers import REPO_ROOT, STARTUP_GUARD_S, STOP_GUARD_S, ProbeClient, fake_settings, running_server, session_client
from test_balancer import free_port
from test_cluster import wait_until
from test_kubernetes_autoscaling import answers

from arstream.app.server import DRAIN_REPORT_MARKER
from arstream.app.wire import decode_frame

RENDER = REPO_ROOT / "deploy" / "haproxy" / "render.py"
NAMESPACE = "arstream-test"
SECRET = "rollout-test-cluster-secret"
PODS = 3
SESSIONS = 6
SEED = 5
KEYS = [["d"], ["w"], ["w", "d"], [], ["a"], ["s"], ["d"], ["a", "s"]]
# A chunk takes 20 ms of model time: sessions stream all through each drain without flooding the 2 cores.
MODEL_OPTIONS = {"window_frames": 6, "session_capacity": 4, "compute_delay_s": 0.02}
# A name the test's DNS always answers: it is up once it does.
CANARY = "dns.cluster.local"
# Chunks each session streams after the last pod is replaced.
AFTER_ROLLOUT = 5


def digest(frames: list[bytes]) -> str:
    return hashlib.sha256(b"".join(frames)).hexdigest()


@dataclass
class Cluster:
    """The stand-ins: DNS on loopback, the pods' addresses, their processes, and HAProxy."""

    tmp: Path
    prefix: str  # 127.X.Y: this test's own loopback addresses
    objects: list[dict[str, Any]]
    resolv_conf: Path = field(init=False)
    hosts: Path = field(init=False)
    addresses: dict[str, str] = field(default_factory=dict)
    pods: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    next_host: int = 10

    def __post_init__(self) -> None:
        self.resolv_conf = self.tmp / "resolv.conf"
        domain = f"{NAMESPACE}.svc.cluster.local"
        self.resolv_conf.write_text(
            f"nameserver {self.dns}\nsearch {domain} svc.cluster.local cluster.local\noptions ndots:5\n"
        )
        self.hosts = self.tmp / "cluster-dns.hosts"
        self.hosts.write_text(f"{self.dns} {CANARY}\n")

    @property
    def dns(self) -> str:
        return f"{self.prefix}.1"

    @property
    def service(self) -> str:
        return str(one(self.objects, "StatefulSet")["spec"]["serviceName"])

    def in_pod(self, command: list[str]) -> list[str]:
        """COMMAND with the pod's view of DNS: its own /etc/resolv.conf, in a private mount namespace."""
        bind = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        return [shutil.which("unshare") or "unshare", "--mount", "sh", "-c", bind, str(self.resolv_conf), *command]

    def publish(self, dnsmasq: subprocess.Popen[bytes]) -> None:
        """The headless Service's records for the pods that exist now (dnsmasq rereads them on SIGHUP)."""
        domain = f"{self.service}.{NAMESPACE}.svc.cluster.local"
        lines = [f"{address} {pod}.{domain}\n{address} {domain}" for pod, address in self.addresses.items()]
        self.hosts.write_text("\n".join([f"{self.dns} {CANARY}", *lines]) + "\n")
        dnsmasq.send_signal(signal.SIGHUP)
        for pod, address in self.addresses.items():
            wait_until(partial(self.answers, f"{pod}.{domain}", address), f"DNS answers {pod}")

    def answers(self, name: str, address: str) -> bool:
        return self.resolves(name) == address

    def resolves(self, name: str) -> str | None:
        result = subprocess.run(self.in_pod(["getent", "ahostsv4", name]), capture_output=True, text=True, timeout=30)
        return result.stdout.split()[0] if result.returncode == 0 and result.stdout else None

    def pod_environment(self, pod: str) -> dict[str, str]:
        """The container's environment as the kubelet builds it, with this test's stand-ins: the pod's own
        address to bind (a pod has its own network), fake-kv on the CPU."""
        environment = {k: v for k, v in os.environ.items() if not k.startswith("ARSTREAM_")}
        environment.update(replica_environment(self.objects))
        environment.update(
            ARSTREAM_REPLICA_ID=pod,  # fieldRef metadata.name
            ARSTREAM_CLUSTER_SECRET=SECRET,  # the Secret arstream-cluster
            ARSTREAM_HOST=self.addresses[pod],
            ARSTREAM_FORWARDED_ALLOW_IPS=f"{self.prefix}.0/24",  # the pod network, where the balancer is
            ARSTREAM_MODEL="fake-kv",
            ARSTREAM_DEVICE="cpu",
            ARSTREAM_MODEL_OPTIONS=json.dumps(MODEL_OPTIONS),
            ARSTREAM_MAX_BATCH_SESSIONS="1",
            ARSTREAM_LOG_LEVEL="info",
            PYTHONUNBUFFERED="1",
            # The image's PATH has the project's console scripts (the preStop's `arstream`).
            PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        )
        return environment

    def url(self, pod: str, port_name: str = "http") -> str:
        ports = {p["name"]: p["containerPort"] for p in replica_container(self.objects)["ports"]}
        return f"http://{self.addresses[pod]}:{ports[port_name]}"

    def start_pod(self, pod: str, dnsmasq: subprocess.Popen[bytes]) -> None:
        """The StatefulSet controller creates POD: a new address, published in DNS, then the container."""
        self.addresses[pod] = f"{self.prefix}.{self.next_host}"
        self.next_host += 1
        self.publish(dnsmasq)
        command = self.in_pod([sys.executable, "-m", "arstream", "serve"])
        self.logs[pod] = self.tmp / f"{pod}-{self.next_host}.log"
        with self.logs[pod].open("wb") as log:
            self.pods[pod] = subprocess.Popen(
                command, env=self.pod_environment(pod), stdout=log, stderr=subprocess.STDOUT
            )

    def ready(self, pod: str) -> bool:
        """The manifest's readinessProbe, as the kubelet runs it."""
        probe = replica_container(self.objects)["readinessProbe"]["httpGet"]
        assert self.pods[pod].poll() is None, f"{pod} exited: {self.log_of(pod)}"
        try:
            return httpx.get(self.url(pod, probe["port"]) + probe["path"], timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def holds_sessions(self, pod: str) -> bool:
        return bool(httpx.get(self.url(pod) + "/v1/stats", timeout=10.0).json()["sessions"]["connected"])

    def log_of(self, pod: str) -> str:
        return "".join(path.read_text() for path in sorted(self.tmp.glob(f"{pod}-*.log")))[-4000:]

    def stop_all(self) -> None:
        for process in self.pods.values():
            process.kill()
            process.wait(STOP_GUARD_S)

    def terminate(self, pod: str, *, hook_runs: bool) -> dict[str, Any]:
        """The kubelet deletes POD: the preStop hook (unless ``hook_runs`` is False: a hook that failed, or a
        kubelet that skips it), then SIGTERM, then at most the grace period. The drain's report: the preStop's
        last line, or the pod's ``ARSTREAM_DRAIN_REPORT`` line when SIGTERM drained it."""
        spec = one(self.objects, "StatefulSet")["spec"]["template"]["spec"]
        grace = float(spec["terminationGracePeriodSeconds"])
        hook_output = ""
        if hook_runs:
            command = replica_container(self.objects)["lifecycle"]["preStop"]["exec"]["command"]
            # The hook runs inside the pod, whose loopback is its own; here the pods share one network, so the
            # pod's loopback is the address it binds.
            command = [word.replace("127.0.0.1", self.addresses[pod]) for word in command]
            hook = subprocess.run(
                self.in_pod(command), env=self.pod_environment(pod), capture_output=True, text=True, timeout=grace
            )
            assert hook.returncode == 0, f"preStop failed ({hook.returncode}): {hook.stderr}\n{self.log_of(pod)}"
            hook_output = hook.stdout
        process = self.pods.pop(pod)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_GUARD_S)
            raise AssertionError(f"{pod} outlived its grace period of {grace} s") from None
        del self.addresses[pod]
        if hook_runs:
            report: dict[str, Any] = json.loads(hook_output.strip().splitlines()[-1])
            return report
        lines = [line for line in self.logs[pod].read_text().splitlines() if line.startswith(DRAIN_REPORT_MARKER)]
        assert len(lines) == 1, f"{pod} did not drain on SIGTERM: {self.log_of(pod)}"
        report = json.loads(lines[0].removeprefix(DRAIN_REPORT_MARKER))
        return report


@contextmanager
def cluster_dns(cluster: Cluster) -> Iterator[subprocess.Popen[bytes]]:
    binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
    assert Path(binary).exists(), "dnsmasq is not installed (scripts/test.sh installs dnsmasq-base)"
    command = [
        binary,
        "--keep-in-foreground",
        "--no-resolv",
        "--no-hosts",
        "--bind-interfaces",
        "--port=53",
        f"--listen-address={cluster.dns}",
        f"--addn-hosts={cluster.hosts}",
        "--local=/cluster.local/",
        "--local-ttl=0",
        "--pid-file=",
        "--user=root",
        "--log-facility=-",
    ]
    with (cluster.tmp / "dnsmasq.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        # Answering (and so past installing its SIGHUP handler, which rereads the records) before any SIGHUP.
        wait_until(lambda: process.poll() is None and cluster.resolves(CANARY) == cluster.dns, "dnsmasq answers")
        yield process
    finally:
        process.terminate()
        process.wait(STOP_GUARD_S)


@dataclass
class Balancer:
    url: str
    stats: str

    def up(self, pod: str) -> bool:
        text = httpx.get(self.stats + "/stats;csv", timeout=10.0).text.lstrip("# ")
        rows = [r for r in csv.DictReader(io.StringIO(text)) if (r["pxname"], r["svname"]) == ("sessions", pod)]
        return bool(rows) and rows[0]["status"].startswith("UP")


@contextmanager
def haproxy(cluster: Cluster, slots: int) -> Iterator[Balancer]:
    port, stats_port = free_port(), free_port()
    ports = {p["name"]: p["containerPort"] for p in replica_container(cluster.objects)["ports"]}
    name = one(cluster.objects, "StatefulSet")["metadata"]["name"]
    render = [sys.executable, str(RENDER), "--statefulset", f"{name}={slots}", "--headless-service", cluster.service]
    render += ["--replica-port", str(ports["http"]), "--agent-port", str(ports["agent"]), "--maxconn", "4"]
    render += [
        "--bind",
        f"{cluster.dns}:{port}",
        "--stats-bind",
        f"{cluster.dns}:{stats_port}",
        "--admin-bind",
        f"{cluster.dns}:{free_port()}",
        "--check-interval",
        "200ms",
    ]
    config = cluster.tmp / "haproxy.cfg"
    config.write_text(subprocess.run(render, check=True, capture_output=True, text=True).stdout)
    with (cluster.tmp / "haproxy.log").open("wb") as log:
        process = subprocess.Popen(
            cluster.in_pod([shutil.which("haproxy") or "haproxy", "-db", "-f", str(config)]),
            env={**os.environ, "POD_NAMESPACE": NAMESPACE},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    balancer = Balancer(f"ws://{cluster.dns}:{port}/v1/sessions", f"http://{cluster.dns}:{stats_port}")
    try:
        wait_until(lambda: process.poll() is None and answers(balancer.stats + "/stats"), "HAProxy answers")
        yield balancer
    finally:
        process.terminate()
        process.wait(STOP_GUARD_S)


@dataclass
class Stream:
    """One session as its client saw it: each chunk's frames by chunk index, and the pods it was served by."""

    session_id: str = ""
    chunks: list[str] = field(default_factory=list)
    served_by: list[str] = field(default_factory=list)


async def stream(lb: Balancer, done: asyncio.Event) -> Stream:
    """A session that ticks without pause until ``done`` (and AFTER_ROLLOUT more chunks), following every
    `moved` through the balancer with its new token."""
    seen = Stream()
    resume: str | None = None
    tick_id = 0  # never reused: a tick dropped by a move does not come back
    extra = 0
    while True:
        url = lb.url if resume is None else f"{lb.url}?resume={resume}"
        start = {"codec": "raw", "seed": SEED} if resume is None else {"resume": resume, "codec": "raw"}
        async with session_client(url, start=start) as client:
            ready = client.ready
            assert ready is not None
            if resume is None:
                seen.session_id = ready["session_id"]
            else:
                assert ready["resumed"] is True and ready["session_id"] == seen.session_id, ready
                assert ready["resume"]["next_chunk_index"] == len(seen.chunks), ready
            seen.served_by.append(ready["resume"]["token"].split(".", 1)[0])
            while True:
                if done.is_set():
                    extra += 1
                    if extra > AFTER_ROLLOUT:
                        await client.send(type="close")
                        await client.closed_by_server()
                        return seen
                index = len(seen.chunks)
                await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[index % len(KEYS)]})
                tick_id += 1
                message = await client.recv_json()
                if message["type"] == "moved":
                    assert message["next_chunk_index"] == index, message
                    resume = message["resume"]
                    closed = await client.closed_by_server()
                    assert closed.messages[-1:] == [{"type": "closed", "reason": "moved"}], closed
                    break
                assert message["type"] == "chunk" and message["chunk_index"] == index, message
                assert message.get("restarted") is None, message
                frames = [await _binary(client) for _ in range(message["frames"])]
                seen.chunks.append(digest(frames))


async def _binary(client: ProbeClient) -> bytes:
    message = await client.recv()
    assert isinstance(message, bytes), message
    return decode_frame(message)[1].tobytes()


async def reference(chunks: int) -> list[str]:
    """An uninterrupted session with the same seed and controls, on a server of its own."""
    settings = fake_settings(model_options=MODEL_OPTIONS, max_batch_sessions=1)
    out = []
    with running_server(settings) as server:
        async with session_client(server.ws_url, start={"codec": "raw", "seed": SEED}) as client:
            for index in range(chunks):
                await client.send(type="tick", tick_id=index, controls={"keys": KEYS[index % len(KEYS)]})
                chunk = await client.recv_json()
                assert chunk["type"] == "chunk", chunk
                out.append(digest([await _binary(client) for _ in range(chunk["frames"])]))
    return out


def loopback_cluster(tmp_path: Path, overlay: str) -> Cluster:
    """The stand-ins for OVERLAY's cluster, on loopback addresses 127.X.Y.* of this test's own."""
    if os.geteuid() != 0:
        pytest.fail("these tests need root: a private mount namespace for each pod's resolv.conf")
    return Cluster(tmp_path, f"127.{random.randint(100, 250)}.{random.randint(1, 250)}", rendered(overlay))


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    return loopback_cluster(tmp_path, "gpu")


@pytest.mark.parametrize("hook_runs", [True, False], ids=["prestop-then-sigterm", "sigterm-alone"])
def test_a_rolling_update_in_statefulset_order_loses_no_session_and_every_frame_matches(
    cluster: Cluster, hook_runs: bool
) -> None:
    """The manifest's path (preStop drain, then SIGTERM), and SIGTERM alone (a preStop hook that failed)."""
    objects = cluster.objects
    replicas = one(objects, "StatefulSet")
    assert replicas["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    name = replicas["metadata"]["name"]
    pods = [f"{name}-{ordinal}" for ordinal in range(PODS)]
    update_order = list(reversed(pods))  # the StatefulSet controller: highest ordinal first
    slots = one(objects, "ScaledObject")["spec"]["maxReplicaCount"]
    reports: list[dict[str, Any]] = []
    with ExitStack() as stack:
        dnsmasq = stack.enter_context(cluster_dns(cluster))
        stack.callback(cluster.stop_all)
        for pod in pods:
            cluster.start_pod(pod, dnsmasq)
        for pod in pods:
            wait_until(partial(cluster.ready, pod), f"{pod} Ready", STARTUP_GUARD_S)
        lb = stack.enter_context(haproxy(cluster, slots))
        for pod in pods:
            wait_until(partial(lb.up, pod), f"HAProxy sees {pod} UP")

        async def rollout(done: asyncio.Event, streams: list[asyncio.Task[Stream]]) -> None:
            for pod in update_order:
                # Every session streaming, and some on the pod about to go.
                await asyncio.to_thread(wait_until, partial(cluster.holds_sessions, pod), f"sessions on {pod}")
                assert not any(task.done() for task in streams), [t.exception() for t in streams if t.done()]
                reports.append(await asyncio.to_thread(partial(cluster.terminate, pod, hook_runs=hook_runs)))
                cluster.start_pod(pod, dnsmasq)
                await asyncio.to_thread(wait_until, partial(cluster.ready, pod), f"new {pod} Ready", STARTUP_GUARD_S)
                await asyncio.to_thread(wait_until, partial(lb.up, pod), f"HAProxy sees the new {pod} UP")
            done.set()

        async def scenario() -> list[Stream]:
            done = asyncio.Event()
            streams = [asyncio.create_task(stream(lb, done)) for _ in range(SESSIONS)]
            await rollout(done, streams)
            return await asyncio.gather(*streams)

        results = asyncio.run(scenario())
        for pod in pods:  # every session closed: each new pod's KV pool is whole again
            stats = httpx.get(cluster.url(pod) + "/v1/stats", timeout=10.0).json()
            assert stats["sessions"]["connected"] == 0 and stats["kv"]["blocks_free"] == stats["kv"]["blocks_total"]
    assert [r["ended"] for r in reports] == [0] * PODS, reports
    moved = sum(int(r["moved"]) for r in reports)
    assert moved >= PODS and moved == sum(len(s.served_by) - 1 for s in results), (
        reports,
        [s.served_by for s in results],
    )
    assert all(set(s.served_by) <= set(pods) for s in results)
    want = asyncio.run(reference(max(len(s.chunks) for s in results)))
    for seen in results:
        assert seen.chunks == want[: len(seen.chunks)], (
            f"session {seen.session_id} (served by {seen.served_by}) differs"
        )

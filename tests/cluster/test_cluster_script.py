"""scripts/local-cluster.sh's own start-up (issue 33): the balancer's ports and a reused log folder.

Before: HAProxy's ports were chosen, released, and bound again only once every
replica was ready, so anything that bound or connected in between could take
one (about 1 start in 13 on a busy host); and a reused ARSTREAM_CLUSTER_DIR
gave the script the URL a replica printed in an earlier run.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servers import STARTUP_GUARD_S, wait_until
from test_cluster import Cluster, launch_cluster

# fake-kv's warm-up runs chunks through the model: this makes each replica's start-up last a while.
SLOW_START = ["--model", "fake-kv", "--model-options", json.dumps({"compute_delay_s": 1.5}), "--log-level", "info"]


def test_a_reused_log_folder_does_not_hand_out_an_earlier_runs_url(tmp_path: Path) -> None:
    """Old script: it read the first ARSTREAM_LISTENING line of r0.log, an earlier run's, and failed on it."""
    for name in ("r0", "r1"):
        (tmp_path / f"{name}.log").write_text("ARSTREAM_AGENT 127.0.0.1:1\nARSTREAM_LISTENING http://127.0.0.1:1\n")
    with launch_cluster(["--model", "fake-kv"], {"ARSTREAM_CLUSTER_DIR": str(tmp_path)}) as cluster:
        urls = [url for url, _pid in cluster.replicas.values()]
        assert len(urls) == 2 and "http://127.0.0.1:1" not in urls
        assert all(httpx.get(url + "/readyz", timeout=10.0).status_code == 200 for url in urls)
        assert httpx.get(cluster.lb + "/readyz", timeout=10.0).status_code == 200


@pytest.fixture
def starting(tmp_path: Path) -> Iterator[tuple[Path, list[Cluster]]]:
    """The script starting slow replicas in the background; the started cluster once it is up."""
    started: list[Cluster] = []
    done = threading.Event()
    stop = threading.Event()

    def run() -> None:
        try:
            with launch_cluster(SLOW_START, {"ARSTREAM_CLUSTER_DIR": str(tmp_path)}) as cluster:
                started.append(cluster)
                done.set()
                stop.wait(STARTUP_GUARD_S)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield tmp_path, started
        done.wait(STARTUP_GUARD_S)
    finally:
        stop.set()
        thread.join(STARTUP_GUARD_S)


def test_the_balancers_ports_are_held_while_the_replicas_start(starting: tuple[Path, list[Cluster]]) -> None:
    """Old script: the ports were free (anyone's) from the moment they were chosen until HAProxy bound them."""
    folder, started = starting
    ports_file = folder / "ports"
    wait_until(lambda: ports_file.exists() and ports_file.read_text().strip() != "", attempts=2400)
    before_haproxy = not (folder / "haproxy.cfg").exists()  # rendered only once every replica is ready
    ports = [int(word) for word in ports_file.read_text().split()]
    for port in ports:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))  # what another process's bind, or a connect's source port, would do
        assert taken.value.errno == errno.EADDRINUSE
    assert before_haproxy, "the replicas were ready before the check ran: nothing was shown (slow them more)"
    wait_until(lambda: bool(started), attempts=4800)
    lb_port = int(started[0].lb.rsplit(":", 1)[1])
    assert lb_port == ports[0] and httpx.get(started[0].lb + "/readyz", timeout=10.0).status_code == 200

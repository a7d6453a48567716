#!/usr/bin/env bash
# N ARStream replicas behind HAProxy on loopback, without Docker (docs/deployment.md).
#
#   scripts/local-cluster.sh N [serve options]
#
# Starts N `arstream serve` replicas (replica ids r0..rN-1) on free loopback ports and HAProxy
# (Debian's haproxy package) on a free port, routed like compose.yaml: new sessions to the
# replica with the fewest, at most the free slots its agent check reports; `?resume=rN.` to replica rN.
# Prints, on standard output:
#   ARSTREAM_REPLICA rN http://127.0.0.1:PORT PID      one per replica, once it is ready (again after a restart)
#   ARSTREAM_LB_STATS http://127.0.0.1:PORT/stats     HAProxy's statistics (/metrics: its exporter; private)
#   ARSTREAM_LB_PRIVATE http://127.0.0.1:PORT         the private port: /replicas/rN/PATH, /metrics, /stats
#   ARSTREAM_LB_ADMIN http://127.0.0.1:PORT/stats     /stats with its admin actions (DRAIN, MAINT): user operator,
#                                                     password ARSTREAM_LB_ADMIN_PASSWORD (unset: refused)
#   ARSTREAM_LB http://127.0.0.1:PORT                 once every replica is ready through the balancer
# and runs until SIGTERM or Ctrl-C, then stops everything it started. A replica that exits is started
# again on the same ports (ARSTREAM_RESTART=0: left dead). Logs: $ARSTREAM_CLUSTER_DIR
# (default: a new temporary directory). ARSTREAM_LB_PORT picks the balancer's port. ARSTREAM_GPUS=0,1,...
# gives replica i the GPU at position i (CUDA_VISIBLE_DEVICES; wraps around), for N GPUs on one host.
# Each replica reads its peers from $ARSTREAM_CLUSTER_DIR/peers (--cluster-peers-file, written once all are
# listening), so with ARSTREAM_CLUSTER_SECRET set a SIGTERM'd replica moves its sessions to the others.
set -euo pipefail

usage() { echo "usage: $0 N [arstream serve options]" >&2; exit 2; }
[ $# -ge 1 ] || usage
replicas=$1; shift
[[ $replicas =~ ^[1-9][0-9]*$ ]] || usage

root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${ARSTREAM_PYTHON:-}" ]; then python=$ARSTREAM_PYTHON
elif [ -x "$root/.venv/bin/python" ]; then python=$root/.venv/bin/python
else python=python3; fi
if [ -z "${ARSTREAM_CLUSTER_SECRET:-}" ]; then
    # Without a shared secret the cluster routes are off: say so now, not when a drain is refused.
    echo "$0: ARSTREAM_CLUSTER_SECRET is not set: these replicas cannot drain (SIGTERM ends their sessions and" \
         "arstream drain is refused). To drain, export the same secret (16+ characters) here and where you run" \
         "arstream drain, e.g. export ARSTREAM_CLUSTER_SECRET=\$(openssl rand -hex 16)" >&2
fi
haproxy_bin=${HAPROXY:-haproxy}
command -v "$haproxy_bin" >/dev/null || { echo "$0: haproxy not found (apt-get install haproxy)" >&2; exit 1; }
dir=${ARSTREAM_CLUSTER_DIR:-$(mktemp -d -t arstream-cluster.XXXXXX)}
mkdir -p "$dir"
: >"$dir/peers"  # filled once every replica listens (a reused folder's old list must not be read meanwhile)
# Hang guard for start-up only (loading a model can take a while); it asserts nothing about speed.
startup_guard_s=${ARSTREAM_STARTUP_GUARD_S:-600}

pids=()
holder_pid=""  # the process holding HAProxy's ports until it listens (hold_ports)
stop_all() {
    trap - TERM INT EXIT
    for pid in "${pids[@]}" $holder_pid; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}" $holder_pid; do wait "$pid" 2>/dev/null || true; done
}
trap 'stop_all; exit 0' TERM INT
trap 'stop_all' EXIT

# HAProxy's three ports are chosen before the replicas start (their allowed origins name the balancer's), and
# held until HAProxy listens: a port chosen, released and bound again later can be taken in between by any
# process's bind or outgoing connection (about 1 start in 13 on a busy host). The holder binds them with
# SO_REUSEPORT, as HAProxy binds its listeners on Linux, so HAProxy can bind them while they are held; no
# other socket can. It prints "LB_PORT STATS_PORT ADMIN_PORT" and holds them until it is stopped.
hold_ports() {  # WANTED_LB_PORT (0: any)
    # exec: the holder is this (background) process itself, so $! is its pid and TERM reaches it.
    exec "$python" - "$1" <<'PY'
import signal, socket, sys
held = []
for wanted in (int(sys.argv[1]), 0, 0):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(("127.0.0.1", wanted))
    except OSError as exc:
        sys.exit(f"local-cluster.sh: cannot take port {wanted} for the balancer: {exc}")
    held.append(sock)
print(*(sock.getsockname()[1] for sock in held), flush=True)
signal.pause()
PY
}

http_get() {  # URL -> body on stdout; fails on anything but 200
    "$python" - "$1" <<'PY'
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=5) as response:
    sys.stdout.write(response.read().decode())
PY
}

: >"$dir/ports"
hold_ports "${ARSTREAM_LB_PORT:-0}" >"$dir/ports" &
holder_pid=$!
until [ -s "$dir/ports" ]; do
    kill -0 "$holder_pid" 2>/dev/null || { wait "$holder_pid" || true; exit 1; }
    sleep 0.05
done
read -r lb_port stats_port admin_port <"$dir/ports"
lb="http://127.0.0.1:$lb_port"
# The demo page is served through the balancer: its origin must be allowed. Options given later win.
origins="$lb,http://localhost:$lb_port"

IFS=, read -r -a gpus <<<"${ARSTREAM_GPUS:-}"
serve_options=("$@")
start_replica() {  # INDEX HTTP_PORT AGENT_PORT: start replica rINDEX (port 0: a free one), its pid in pids[INDEX]
    local i=$1 gpu_env=()
    [ ${#gpus[@]} -eq 0 ] || gpu_env=("CUDA_VISIBLE_DEVICES=${gpus[$((i % ${#gpus[@]}))]}")
    env "${gpu_env[@]}" PYTHONUNBUFFERED=1 "$python" -m arstream serve --host 127.0.0.1 --port "$2" \
        --agent-port "$3" --replica-id "r$i" --allowed-origins "$origins" --cluster-peers-file "$dir/peers" \
        "${serve_options[@]}" >>"$dir/r$i.log" 2>&1 &
    pids[i]=$!
}
for ((i = 0; i < replicas; i++)); do
    : >"$dir/r$i.log"  # a reused log folder: the URLs below are read from this start's lines only
    start_replica "$i" 0 0
done

# Each replica prints ARSTREAM_AGENT HOST:PORT, then ARSTREAM_LISTENING URL once its model is loaded and warmed up.
urls=()
agents=()
for ((i = 0; i < replicas; i++)); do
    url=""
    for ((waited = 0; waited < startup_guard_s * 10; waited++)); do
        url=$(sed -n 's/^ARSTREAM_LISTENING \(http[^ ]*\).*/\1/p' "$dir/r$i.log" | head -n 1)
        [ -n "$url" ] && break
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            echo "$0: replica r$i exited during start-up; its log ($dir/r$i.log):" >&2
            cat "$dir/r$i.log" >&2
            exit 1
        fi
        sleep 0.1
    done
    [ -n "$url" ] || { echo "$0: replica r$i did not start within ${startup_guard_s} s ($dir/r$i.log)" >&2; exit 1; }
    urls+=("$url")
    agents+=("$(sed -n 's/^ARSTREAM_AGENT [^:]*:\([0-9]*\)$/\1/p' "$dir/r$i.log" | head -n 1)")
done

printf '%s\n' "${urls[@]}" >"$dir/peers"

# maxconn per replica until its agent check reports: its session capacity, as the replica itself reports it.
render_args=()
for ((i = 0; i < replicas; i++)); do
    capacity=$(http_get "${urls[$i]}/v1/stats" | "$python" -c 'import json, sys; print(json.load(sys.stdin)["kv"]["session_capacity"])')
    render_args+=(--replica "r$i=${urls[$i]#http://}/$capacity@${agents[$i]}")
done
"$python" "$root/deploy/haproxy/render.py" "${render_args[@]}" --bind "127.0.0.1:$lb_port" \
    --stats-bind "127.0.0.1:$stats_port" --admin-bind "127.0.0.1:$admin_port" --check-interval 500ms --out "$dir/haproxy.cfg"
"$haproxy_bin" -c -q -f "$dir/haproxy.cfg"
"$haproxy_bin" -db -f "$dir/haproxy.cfg" >"$dir/haproxy.log" 2>&1 &
pids+=($!)
haproxy_pid=$!

for ((i = 0; i < replicas; i++)); do
    echo "ARSTREAM_REPLICA r$i ${urls[$i]} ${pids[$i]}"
done
echo "ARSTREAM_LB_STATS http://127.0.0.1:$stats_port/stats"
echo "ARSTREAM_LB_PRIVATE http://127.0.0.1:$stats_port"
echo "ARSTREAM_LB_ADMIN http://127.0.0.1:$admin_port/stats"

# Ready through the balancer: each replica's /readyz answers 200 by way of HAProxy.
for ((i = 0; i < replicas; i++)); do
    for ((waited = 0; ; waited++)); do
        http_get "http://127.0.0.1:$stats_port/replicas/r$i/readyz" >/dev/null 2>&1 && break
        if ! kill -0 "$haproxy_pid" 2>/dev/null; then
            echo "$0: haproxy exited; its log ($dir/haproxy.log):" >&2
            cat "$dir/haproxy.log" >&2
            exit 1
        fi
        [ "$waited" -lt $((startup_guard_s * 10)) ] || { echo "$0: r$i never became ready through $lb" >&2; exit 1; }
        sleep 0.1
    done
done
# HAProxy listens on both ports now (the private one answered above, the public one is bound with it).
kill -TERM "$holder_pid" 2>/dev/null || true
wait "$holder_pid" 2>/dev/null || true
holder_pid=""
echo "ARSTREAM_LB $lb"
echo "arstream cluster: $replicas replica(s) behind $lb; logs in $dir; Ctrl-C stops everything" >&2

# Until SIGTERM or Ctrl-C. HAProxy routes around a replica that dies; it is started again on its ports.
while true; do
    sleep 1 &
    wait $! || true
    [ "${ARSTREAM_RESTART:-1}" != 0 ] || continue
    for ((i = 0; i < replicas; i++)); do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            wait "${pids[$i]}" 2>/dev/null || true
            echo "arstream cluster: replica r$i exited; starting it again" >&2
            port=${urls[$i]##*:}
            start_replica "$i" "$port" "${agents[$i]}"
            echo "ARSTREAM_REPLICA r$i ${urls[$i]} ${pids[$i]}"
        fi
    done
done

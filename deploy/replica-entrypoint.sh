#!/usr/bin/env bash
# The replica image's entry point: `arstream serve`, with what `docker compose up --scale replica=N` cannot
# give each container itself (docs/deployment.md):
#   - a replica id: ARSTREAM_REPLICA_ID if set, else the compose container name (arstream-replica-3 ->
#     replica-3, from the network's reverse DNS), the name HAProxy routes this replica's resumes by;
#   - a GPU of its own: with ARSTREAM_GPU_LOCKS set (a folder every replica shares) and no
#     CUDA_VISIBLE_DEVICES, the first GPU whose lock file no other running replica holds. The lock is held
#     for as long as the server runs and freed when it exits (the descriptor goes with exec).
set -euo pipefail

if [ -z "${ARSTREAM_REPLICA_ID:-}" ]; then
    name=$(python - <<'PY' || true
import socket
try:
    address = socket.gethostbyname(socket.gethostname())
    print(socket.gethostbyaddr(address)[0])
except OSError:
    pass
PY
)
    name=${name%%.*}  # arstream-replica-3.arstream_default -> arstream-replica-3
    project=${ARSTREAM_COMPOSE_PROJECT:-arstream}
    case "$name" in
        "$project"-*) export ARSTREAM_REPLICA_ID=${name#"$project"-} ;;
    esac
fi

if [ -n "${ARSTREAM_GPU_LOCKS:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
    gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
    for ((gpu = 0; gpu < gpus; gpu++)); do
        exec {lock}>"$ARSTREAM_GPU_LOCKS/gpu$gpu"
        if flock --nonblock "$lock"; then
            export CUDA_VISIBLE_DEVICES=$gpu
            break
        fi
        exec {lock}>&-
    done
    if [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
        echo "replica-entrypoint: all $gpus GPU(s) are taken by other replicas; scale down or add GPUs" >&2
        exit 1
    fi
    echo "replica-entrypoint: replica ${ARSTREAM_REPLICA_ID:-?} on GPU $CUDA_VISIBLE_DEVICES" >&2
fi

exec python -m arstream serve "$@"

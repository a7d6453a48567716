#!/usr/bin/env bash
# The replica image's entry point: `arstream serve`, with what `docker compose up --scale replica=N` cannot
# give each container itself (docs/deployment.md):
#   - a replica id: ARSTREAM_REPLICA_ID if set, else the compose container name (arstream-replica-3 ->
#     replica-3, from the network's reverse DNS), the name HAProxy routes this replica's resumes by;
#   - GPUs of its own: with ARSTREAM_GPU_LOCKS set (a folder every replica shares) and no
#     CUDA_VISIBLE_DEVICES, the first ARSTREAM_GPUS_PER_REPLICA (default 1) GPUs whose lock files no other
#     running replica holds. The locks are held for as long as the server runs and freed when it exits (the
#     descriptors go with exec). With several, the replica spans them: ARSTREAM_DEVICES=cuda:0,...,cuda:N-1
#     (as the process sees them), unless set.
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
    wanted=${ARSTREAM_GPUS_PER_REPLICA:-1}
    held=()
    for ((gpu = 0; gpu < gpus && ${#held[@]} < wanted; gpu++)); do
        exec {lock}>"$ARSTREAM_GPU_LOCKS/gpu$gpu"
        if flock --nonblock "$lock"; then
            held+=("$gpu")
        else
            exec {lock}>&-
        fi
    done
    if ((${#held[@]} < wanted)); then  # the locks taken so far go with this process
        echo "replica-entrypoint: $wanted GPU(s) a replica, and only ${#held[@]} of $gpus are free of other" \
            "replicas; scale down or add GPUs" >&2
        exit 1
    fi
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${held[*]}")
    export CUDA_VISIBLE_DEVICES
    if ((wanted > 1)) && [ -z "${ARSTREAM_DEVICES:-}" ]; then
        devices=()
        for ((rank = 0; rank < wanted; rank++)); do devices+=("cuda:$rank"); done
        ARSTREAM_DEVICES=$(IFS=,; echo "${devices[*]}")
        export ARSTREAM_DEVICES
    fi
    echo "replica-entrypoint: replica ${ARSTREAM_REPLICA_ID:-?} on GPU(s) $CUDA_VISIBLE_DEVICES" >&2
fi

exec python -m arstream serve "$@"

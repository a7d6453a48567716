# ARStream replica image: a CUDA PyTorch runtime, the project installed (with the shipped tiny-world
# weights), a non-root user, and a health check on /healthz. Model checkpoints: mount them at /models.
# Build: docker build -t arstream .   (docs/deployment.md)
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/arstream
COPY pyproject.toml README.md ./
COPY arstream ./arstream
COPY app ./app
COPY programs ./programs
COPY runner ./runner
COPY models ./models
COPY static ./static
# The base image's torch satisfies the torch==2.13.0 pin, so pip keeps its CUDA build. The extras a GPU
# replica needs: video (H.264 through PyAV), wan (diffusers, for matrix-game-2's VAE) and webrtc (aiortc: video
# on a WebRTC track when ARSTREAM_WEBRTC is on). DL3013 (pin versions)
# does not apply: this installs the project itself, whose pyproject.toml bounds its dependencies.
# hadolint ignore=DL3013
RUN python -m pip install --no-cache-dir ".[video,wan,webrtc]" \
    && groupadd --gid 10001 arstream \
    && useradd --create-home --uid 10001 --gid 10001 arstream \
    && mkdir -p /models /run/arstream-gpus \
    && chown arstream /models /run/arstream-gpus
COPY deploy/replica-entrypoint.sh /usr/local/bin/arstream-replica

USER 10001:10001
ENV ARSTREAM_HOST=0.0.0.0 \
    ARSTREAM_PORT=8000 \
    ARSTREAM_DEVICE=cuda
EXPOSE 8000
VOLUME ["/models"]
# Loading and warming a large model takes a while: the start period covers it. The port is the server's own
# (ARSTREAM_PORT, as `docker run -e ARSTREAM_PORT=...` or compose may set it), read when the check runs.
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('ARSTREAM_PORT') or '8000'; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=2)"]
# The replica id and GPU a scaled compose service cannot give each container (deploy/replica-entrypoint.sh).
ENTRYPOINT ["arstream-replica"]

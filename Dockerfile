# syntax=docker/dockerfile:1
# Images of trtllm-worker. Two targets:
#
#   gpu (the last stage, so the default): FROM NVIDIA's TensorRT-LLM release image, which
#       brings CUDA, TensorRT, Open MPI, PyTorch and tensorrt_llm itself; runs the trtllm
#       and trtllm-executor engines. Linux x86_64 or aarch64 with an NVIDIA GPU and driver.
#         docker build -t trtllm-worker:0.1.0 .
#         docker build --build-arg TRTLLM_VERSION=1.4.0rc1 .    (another release container)
#         docker build --build-arg TRTLLM_IMAGE=registry.example.com/trtllm:<tag> .
#   cpu: python:3.12-slim with the built-in echo engine only, for demos (docker-compose.yml)
#         docker build --target cpu -t trtllm-worker:0.1.0-cpu .
#
# Both run as the non-root user 1000, serve /healthz, /readyz and /metrics on port 8080, and
# start `trtllm-worker serve` under dumb-init, which passes SIGTERM on (the worker drains)
# and reaps the processes TensorRT-LLM spawns. Both hold the `gateway` extra too: the same
# image runs the OpenAI-compatible gateway with `trtllm-worker gateway` (no GPU; port 8000,
# WORKER_GATEWAY_PORT, with its own /healthz, /readyz and /metrics):
#         docker run -p 8000:8000 ... trtllm-worker:0.1.0-cpu gateway The gpu image contains NVIDIA software under
# NVIDIA's licence terms (see the base image).

# TensorRT-LLM's release image; its tags follow the tensorrt_llm version. The default is
# the newest stable release (trtllm_worker/engine/versions.py, STABLE); the worker supports
# 1.2.x, the 1.3 release candidates and 1.4 (docs/gpu.md, "TensorRT-LLM releases"), and
# the build fails on any other. Engines built with trtllm-build must be built with the
# same version as the image that serves them (trtllm-executor: 1.2.x only).
ARG TRTLLM_VERSION=1.2.1
ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_VERSION}
ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

# --- the worker as a wheel, and what it needs as hash-pinned requirements from uv.lock ---
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md uv.lock ./
COPY tools/uv-requirements.txt tools/image_requirements.py ./tools/
COPY trtllm_worker ./trtllm_worker
RUN pip install --no-cache-dir --require-hashes -r tools/uv-requirements.txt \
    && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && uv export --frozen --no-emit-project --extra uvloop --extra otel --extra image \
        --extra gateway --output-file /wheels/requirements.txt \
    && cp tools/image_requirements.py /wheels/

# --- cpu: the echo engine, no GPU, no model ------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
LABEL org.opencontainers.image.title="trtllm-worker (cpu, echo engine)" \
      org.opencontainers.image.description="TensorRT-LLM jobs from RabbitMQ, tokens to Redis streams; echo engine for demos" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 1000 worker \
    && useradd --uid 1000 --gid 1000 --home-dir /home/worker --create-home \
        --shell /usr/sbin/nologin worker
COPY --from=wheel /wheels /tmp/wheels
# everything from uv.lock, hash-checked: the worker's dependencies, uvloop (taken by
# WORKER_EVENT_LOOP=auto), the trace exporter (used only when OTEL_EXPORTER_OTLP_ENDPOINT is
# set), dumb-init and the gateway's server (Starlette, uvicorn); then the worker itself,
# whose dependencies are all there by now
RUN pip install --no-cache-dir --require-hashes -r /tmp/wheels/requirements.txt \
    && pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
USER 1000:1000
WORKDIR /home/worker
ENV HOME=/home/worker \
    WORKER_ENGINE=echo
# 8080: the worker's probes and metrics; 8000: the gateway (`trtllm-worker gateway`)
EXPOSE 8080 8000
ENTRYPOINT ["dumb-init", "--single-child", "--", "trtllm-worker"]
CMD ["serve"]

# --- gpu: TensorRT-LLM (the default target) -------------------------------------------
FROM ${TRTLLM_IMAGE} AS gpu
LABEL org.opencontainers.image.title="trtllm-worker" \
      org.opencontainers.image.description="TensorRT-LLM jobs from RabbitMQ, tokens to Redis streams" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# user 1000 with home /home/worker (Ubuntu-based images may already have a user 1000:
# it is kept, and only the home directory is added)
RUN if ! getent passwd 1000 > /dev/null; then \
        (getent group 1000 > /dev/null || groupadd --gid 1000 worker) \
        && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin worker; \
    fi \
    && mkdir -p /home/worker \
    && chown 1000:1000 /home/worker
COPY --from=wheel /wheels /tmp/wheels
# tensorrt_llm and its CUDA stack come with the image and must not change. Of uv.lock's
# requirements, those the image already holds are left out (image_requirements.py); the
# rest are installed hash-checked with every package of the image pinned as a constraint,
# so a lock pin that disagrees with the image fails the build instead of breaking
# TensorRT-LLM. The worker goes in last with --no-index: its dependencies must all be
# there, from the image or the lock. (The image's own Starlette and uvicorn, which
# trtllm-serve uses, serve the gateway too; the gateway extra's bounds must admit them.)
RUN python3 -m pip list --format=freeze > /tmp/image-packages.txt \
    && python3 /tmp/wheels/image_requirements.py /tmp/wheels/requirements.txt \
        /tmp/image-packages.txt > /tmp/worker-requirements.txt \
    && python3 -m pip install --no-cache-dir --require-hashes \
        --constraint /tmp/image-packages.txt -r /tmp/worker-requirements.txt \
    && wheel="$(find /tmp/wheels -name 'trtllm_worker-*.whl')" \
    && python3 -m pip install --no-cache-dir --no-index --constraint /tmp/image-packages.txt \
        "${wheel}[uvloop,otel,image,gateway]" \
    && python3 -m trtllm_worker.engine.versions \
    && rm -rf /tmp/wheels /tmp/image-packages.txt /tmp/worker-requirements.txt \
    && test -x /opt/nvidia/nvidia_entrypoint.sh
USER 1000:1000
WORKDIR /home/worker
ENV HOME=/home/worker \
    WORKER_ENGINE=trtllm
# 8080: the worker's probes and metrics; 8000: the gateway (`trtllm-worker gateway`)
EXPOSE 8080 8000
# NVIDIA's entrypoint first (driver checks, CUDA forward compatibility), which then execs
# dumb-init and the worker
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "dumb-init", "--single-child", "--", "trtllm-worker"]
CMD ["serve"]

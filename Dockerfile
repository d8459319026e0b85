# syntax=docker/dockerfile:1.7
# Two targets from one file:
#   worker (default): esd-worker + the GPU telemetry exporter, CUDA-enabled torch from PyPI
#   controller:       esd-sweep without torch (slim), for the controller Job / CronJob
# Build: docker build -t esd-sweep:0.1.0 .   |   docker build --target controller -t esd-sweep-controller:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY esd_worker ./esd_worker
COPY controller ./controller
COPY esd_sweep ./esd_sweep
# The wheel is built with constraints.txt's setuptools, without build isolation: the build
# tests/deploy/test_wheel.py makes from these same files.
RUN python -m pip install --no-cache-dir pip==26.3 \
    && python -m pip install --no-cache-dir -c constraints.txt setuptools \
    && python -m pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS controller
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
COPY --from=build /wheels /wheels
COPY --from=build /src/constraints.txt /wheels/constraints.txt
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir pip==26.3 \
    && /opt/venv/bin/pip install --no-cache-dir -c /wheels/constraints.txt \
        "$(ls /wheels/esd_sweep-*.whl)[s3,kube]" \
    && rm -rf /wheels \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin esd
COPY image/entrypoint.sh /usr/local/bin/entrypoint.sh
USER 1000
WORKDIR /home/esd
ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
CMD ["esd-sweep", "--help"]

FROM ${PYTHON_IMAGE} AS worker
# No NVIDIA_VISIBLE_DEVICES here: baked as "all", a pod that asks for no GPU would see every
# GPU of a node whose default runtime is nvidia. The device plugin sets it for the GPUs a
# pod was given, worker pods without GPUs set "void", the exporter DaemonSet its own.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/hf HF_HUB_DISABLE_TELEMETRY=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build /wheels /wheels
COPY --from=build /src/constraints.txt /wheels/constraints.txt
# torch==2.13.0 from PyPI is the CUDA build on linux/x86_64 (its CUDA libraries come as
# nvidia-* wheels, which torch pins itself); the driver comes from the node through the
# NVIDIA container runtime. Every other version is constraints.txt's.
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir pip==26.3 \
    && /opt/venv/bin/pip install --no-cache-dir -c /wheels/constraints.txt \
        "$(ls /wheels/esd_sweep-*.whl)[worker,s3]" \
    && rm -rf /wheels \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin esd \
    && mkdir -p /cache/hf && chown 1000:1000 /cache/hf
COPY image/entrypoint.sh /usr/local/bin/entrypoint.sh
USER 1000
WORKDIR /home/esd
ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
CMD ["esd-worker", "--help"]

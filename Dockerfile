# One image for every modelpool service; docker-compose.yml picks the command.
#
#   docker build -t modelpool:local .
#   docker run --rm modelpool:local modelpool --help
#
# The base is a build argument so the image builds where no registry is
# reachable, from a stand-in with the same Python (docs/deploy.md).

ARG PYTHON_IMAGE=python:3.11-slim

# Everything but modelpool's own code: rebuilt only when the dependencies change.
FROM ${PYTHON_IMAGE} AS dependencies
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # portable llama.cpp build: the image may run on a different CPU than it was built on
    CMAKE_ARGS="-DGGML_NATIVE=OFF"
# The slow step first, in its own layer: llama.cpp compiles once per version.
# A wheel already built for this Python in deploy/wheels/ is taken instead of
# compiling (`make install` builds a portable one; docs/deploy.md).
COPY deploy/wheels/ /wheels/
RUN pip install --upgrade pip wheel 'setuptools>=69' \
 && pip install --find-links /wheels llama-cpp-python==0.3.36
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]["dependencies"]))' \
      > /tmp/requirements.txt \
 && pip install --find-links /wheels -r /tmp/requirements.txt

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="modelpool" \
      org.opencontainers.image.description="modelpool's services: one image, the command picks the service"
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home --home-dir /home/modelpool modelpool
COPY --from=dependencies /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY . .
# Editable, so the migrations and the pool files are found beside the code in /app.
RUN pip install --no-deps --no-build-isolation -e . \
 && python3 -c 'import services.cli, services.gateway.app, services.autoscaler.main, lab.cli' \
 && install -d -o modelpool -g modelpool -m 0700 /credentials /db-credentials /db-admin-credentials
# Where compose's credential volumes are mounted (a new volume takes this owner and mode).
USER modelpool
EXPOSE 8000
# Every service writes whether it reaches Postgres and NATS to this file each second;
# `modelpool health` fails once it has not for 30 s, or the file went stale.
ENV MODELPOOL_HEALTH_FILE=/tmp/modelpool-health.json
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["modelpool", "health", "--down-after", "30"]
CMD ["modelpool", "--help"]

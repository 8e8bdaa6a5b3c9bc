#!/usr/bin/env sh
# The worker image's install steps (Dockerfile), runnable outside Docker too:
#   docker/install.sh VENV [EXTRAS]      e.g. docker/install.sh /opt/venv server
# A virtual environment at VENV with uv, then PyTorch alone first (TORCH_SPEC, default torch==2.13.0;
# TORCH_INDEX_URL: e.g. https://download.pytorch.org/whl/cu128 for CUDA, .../cpu for the CPU build),
# then the project's dependencies at the pins of requirements.lock (and those of EXTRAS, comma-
# separated), then the project itself. Run from the repository root. UV_FIND_LINKS and the other
# UV_* settings pass through (a directory of local wheels, a mirror).
set -eu
VENV=${1:?usage: docker/install.sh VENV [EXTRAS]}
EXTRAS=${2:-}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
UV_VERSION=${UV_VERSION:-0.13.9}
# The venv starts without pip (ensurepip: 5-7 s): uv comes from python3's own pip (`pip --python`,
# pip 22.3 or newer), else from a pip that ensurepip puts into the venv; uv puts pip in with the
# dependencies, at the version ensurepip would have (MLflow's logged models name it).
python3 -m venv --without-pip "$VENV"
PIP_SPEC=$(python3 -c "import ensurepip; print('pip==' + ensurepip.version())" 2>/dev/null || echo pip)
python3 -m pip --python "$VENV/bin/python" install --quiet --disable-pip-version-check "uv==$UV_VERSION" 2>/dev/null || {
  "$VENV/bin/python" -m ensurepip --default-pip >/dev/null && "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
}
UV="$VENV/bin/uv"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "$UV" pip install --quiet --python "$VENV/bin/python" --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
else
  "$UV" pip install --quiet --python "$VENV/bin/python" "$TORCH_SPEC"
fi
set -- -r pyproject.toml
for extra in $(echo "$EXTRAS" | tr ',' ' '); do set -- "$@" --extra "$extra"; done
"$UV" pip install --quiet --python "$VENV/bin/python" -c requirements.lock "$@" "$PIP_SPEC"
"$UV" pip install --quiet --python "$VENV/bin/python" --no-deps .

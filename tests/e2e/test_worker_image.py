"""The worker image (Dockerfile). No container engine runs on the machines this suite runs on, so
what can be checked without one is: the image's install steps (docker/install.sh, which the
Dockerfile runs) build a working environment in a clean virtualenv, at the lock's pins, and every
path the Dockerfile copies exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def _find_links() -> str:
    """The find-links pip is configured with (a directory of local wheels, e.g. the CPU torch), as the Makefile hands them to uv."""
    # the base interpreter's pip, as the Makefile asks it (`$(PYTHON) -m pip config get`)
    configured = subprocess.run([sys._base_executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True).stdout.split()
    return ",".join(sorted({*os.environ.get("PIP_FIND_LINKS", "").split(), *configured}))  # uv reads a comma-separated list


def test_the_images_install_steps_build_a_working_worker_environment(tmp_path):
    venv = tmp_path / "venv"
    env = os.environ | {"UV_FIND_LINKS": _find_links(), "TORCH_SPEC": "torch==2.13.0"}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["sh", "docker/install.sh", str(venv), "server"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    helped = subprocess.run([str(venv / "bin/qllm"), "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "run" in helped.stdout, helped.stdout + helped.stderr
    imported = subprocess.run([str(venv / "bin/python"), "-c", "import torch, psycopg, dvc_ssh, pipelines.grpo, flows.pipeline; print(torch.__version__)"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert imported.returncode == 0 and imported.stdout.startswith("2.13.0"), imported.stdout + imported.stderr
    # every installed package at the lock's pin (torch: TORCH_SPEC)
    pins = dict(line.split("==") for line in (REPO / "requirements.lock").read_text().splitlines() if "==" in line)
    frozen = subprocess.run([str(venv / "bin/uv"), "pip", "freeze", "--python", str(venv / "bin/python")], capture_output=True, text=True).stdout
    installed = dict(line.split("==") for line in frozen.splitlines() if "==" in line)
    off = {name: (version, pins[name]) for name, version in installed.items() if name in pins and pins[name] != version}
    assert not off, off
    assert {"mlflow", "dvc", "dvc-ssh", "prefect", "transformers", "psycopg"} <= set(installed)


def test_every_path_the_dockerfile_copies_exists():
    dockerfile = (REPO / "Dockerfile").read_text()
    copied = [source for line in dockerfile.splitlines() if line.startswith("COPY ") for source in line.split()[1:-1]]
    assert copied and all((REPO / source).exists() for source in copied), copied
    assert "sh docker/install.sh /opt/venv" in dockerfile  # the steps the first test runs
    for arg in ("TORCH_SPEC", "TORCH_INDEX_URL", "EXTRAS"):
        assert re.search(rf"^ARG {arg}\b", dockerfile, re.M) and f"${arg}" in dockerfile

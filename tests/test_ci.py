"""`.ci/run`, CI's entry point: what it hands `make test` and then `make test-slow` (the AVX2 cap, the
venv's interpreter), in that order, the second only once the first has passed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO

HANDED = ("PYTHON", "QLLM_CI_NATIVE", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def ci_calls(tmp_path: Path, failing: str = "", **env: str) -> tuple[int, list[dict[str, str]]]:
    """Run `.ci/run` with a stand-in `make` first on PATH that prints what each call was given (and
    exits 1 when given `failing`): `.ci/run`'s exit code and one record per call, in order."""
    (tmp_path / "bin").mkdir(parents=True)
    make = tmp_path / "bin/make"
    make.write_text('#!/bin/sh\nprintf "%s\\n" "args=$*" "cwd=$PWD"' + "".join(f' "{k}=${{{k}-unset}}"' for k in HANDED) + ' "--"\n'
                    + (f'[ "$*" = "{failing}" ] && exit 1\n' if failing else "") + "exit 0\n")  # fmt: skip
    make.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in HANDED}
    done = subprocess.run([str(REPO / ".ci/run")], env=base | {"PATH": f"{tmp_path / 'bin'}:{base['PATH']}"} | env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    calls = [dict(line.split("=", 1) for line in call.strip().splitlines()) for call in done.stdout.split("--\n") if call.strip()]
    return done.returncode, calls


def ci_run(tmp_path: Path, **env: str) -> dict[str, str]:
    """What `.ci/run`'s first make call (`make test`) was given; it must have passed."""
    code, calls = ci_calls(tmp_path, **env)
    assert code == 0, calls
    return calls[0]


def test_ci_runs_make_test_in_the_checkout_capped_to_avx2_unless_told_native(tmp_path):
    handed = ci_run(tmp_path)
    assert (handed["args"], Path(handed["cwd"])) == ("test", REPO)
    assert (handed["ONEDNN_MAX_CPU_ISA"], handed["ATEN_CPU_CAPABILITY"], handed["MKL_ENABLE_INSTRUCTIONS"]) == ("AVX2", "avx2", "AVX2")
    native = ci_run(tmp_path / "native", QLLM_CI_NATIVE="1")
    assert (native["ONEDNN_MAX_CPU_ISA"], native["ATEN_CPU_CAPABILITY"], native["MKL_ENABLE_INSTRUCTIONS"]) == ("unset",) * 3


def test_ci_runs_the_slow_set_after_the_default_suite_with_the_same_settings(tmp_path):
    """What left the default suite for speed (`-m slow`: the whole pipeline through SSH and S3, the
    deployment's resume, `dvc exp run`, the browser's screenshots, llama.cpp's checks) runs in CI
    after it, under the same cap and interpreter; a failing `make test` ends CI without it."""
    code, calls = ci_calls(tmp_path)
    assert code == 0 and [(call["args"], Path(call["cwd"])) for call in calls] == [("test", REPO), ("test-slow", REPO)]
    assert {k: calls[1][k] for k in HANDED} == {k: calls[0][k] for k in HANDED}
    code, calls = ci_calls(tmp_path / "failing", failing="test")
    assert code != 0 and [call["args"] for call in calls] == ["test"]
    code, calls = ci_calls(tmp_path / "slow-failing", failing="test-slow")
    assert code != 0 and [call["args"] for call in calls] == ["test", "test-slow"]


def test_ci_makes_the_venv_with_the_distributions_python_where_it_has_venv_and_pip(tmp_path):
    system = Path("/usr/bin/python3.11")
    usable = system.exists() and subprocess.run([system, "-c", "import ensurepip, pip, venv"], capture_output=True).returncode == 0
    assert ci_run(tmp_path)["PYTHON"] == (str(system) if usable else "unset")  # unset: make's default, python3
    assert ci_run(tmp_path / "given", PYTHON="python3.12")["PYTHON"] == "python3.12"  # one given is kept

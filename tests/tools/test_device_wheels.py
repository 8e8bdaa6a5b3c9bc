"""tools.device_wheels and tools/device_run.sh: what each part of the device check carries,
the 64 MiB a device command takes, and the script's refusals (no network: the resolution and the
downloads are replaced; `make device-rehearsal` runs them for real)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO
from tools import device_wheels as dw


@pytest.mark.parametrize(
    ("wheel", "fits"),
    [
        ("bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", True),  # any CPython 3, one platform
        ("pydantic_core-2.50.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
        (
            "cryptography-50.0.2-cp311-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
            True,
        ),  # the stable ABI since 3.11
        ("prefect-3.8.8-py3-none-any.whl", True),
        ("pydantic_core-2.50.4-cp311-cp311-manylinux2014_x86_64.whl", False),  # another Python
        ("pydantic_core-2.50.4-cp312-cp312-musllinux_1_2_x86_64.whl", False),  # another C library
        ("pydantic_core-2.50.4-cp312-cp312-manylinux2014_aarch64.whl", False),  # another processor
    ],
)
def test_a_wheel_fits_the_machine_by_its_tags(wheel, fits):
    assert dw.runs_there(wheel) is fits


def test_the_pipeline_part_takes_mlflows_client_and_leaves_out_what_the_run_does_not_use():
    roots = dw.roots("pipeline")
    assert {"mlflow-skinny", "sqlalchemy", "alembic", "prefect", "dvc", "pydantic"} <= set(roots)
    assert not {"mlflow", "bitsandbytes", "dvc-ssh", "torch"} & set(roots)
    assert dw.roots("core") == ["pydantic", "bitsandbytes"]


def test_the_closure_drops_the_machines_packages_and_the_left_out_ones_from_the_pipeline_only(monkeypatch):
    resolved = [
        "pydantic==2.14.3",
        "torch==2.13.0",
        "nvidia-cuda-cccl==13.3.5",
        "numpy==2.5.2",
        "apprise==1.13.1",
        "prefect==3.8.8",
    ]
    monkeypatch.setattr(dw, "resolve", lambda part: resolved)
    assert dw.closure("pipeline") == ["prefect==3.8.8", "pydantic==2.14.3"]
    assert dw.closure("core") == ["apprise==1.13.1", "prefect==3.8.8", "pydantic==2.14.3"]  # LEFT_OUT is the pipeline's


def _wheel(folder, name: str, mib: float):
    path = folder / f"{name}-1.0-py3-none-any.whl"
    path.write_bytes(os.urandom(int(mib * dw.MIB)))
    return path


def test_it_fails_when_a_command_would_carry_over_64_mib(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dw, "DEST", tmp_path)
    monkeypatch.setattr(dw, "tree_mib", lambda: 3.5)
    monkeypatch.setattr(dw, "fill", lambda part, dest: [_wheel(tmp_path, "big", 60.0)])
    assert dw.main(["--part", "pipeline"]) == 1
    assert "pipeline carries 63.5 MiB, over 64 MiB less a 1 MiB margin" in capsys.readouterr().err
    monkeypatch.setattr(dw, "fill", lambda part, dest: [_wheel(tmp_path, "small", 2.0)])
    assert dw.main(["--part", "pipeline"]) == 0
    assert (
        "pipeline: 1 wheels 2.0 MiB (largest: small 2.0) + working tree 3.5 = 5.5 MiB of the 64 MiB"
        in capsys.readouterr().out
    )


def test_the_working_tree_is_what_git_would_send(tmp_path, monkeypatch):
    for command in (["git", "init", "-q"], ["git", "config", "user.email", "t@t"], ["git", "config", "user.name", "t"]):
        subprocess.run(command, cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("/ignored/\n")
    (tmp_path / "tracked").write_bytes(b"x" * dw.MIB)
    subprocess.run(["git", "add", "tracked", ".gitignore"], cwd=tmp_path, check=True)
    (tmp_path / "untracked").write_bytes(b"y" * (dw.MIB // 2))  # untracked, not ignored: travels too
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big").write_bytes(b"z" * 4 * dw.MIB)
    monkeypatch.setattr(dw, "REPO", tmp_path)
    assert dw.tree_mib() == 1.5 + len("/ignored/\n") / dw.MIB  # whole bytes over 2**20: exact in float64


def _script(*args, env=None):
    return subprocess.run(["bash", str(REPO / "tools/device_run.sh"), *args], cwd=env.pop("CWD") if env else REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})  # fmt: skip


def test_the_device_script_refuses_an_unknown_part_and_a_part_without_wheels(tmp_path):
    done = _script("everything")
    assert done.returncode == 2 and "part must be core or pipeline, not 'everything'" in done.stderr
    done = _script("core", env={"CWD": str(tmp_path), "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and "no wheels in .device/core (make device-wheels" in done.stderr


def test_the_device_script_installs_the_parts_wheels_on_its_own_path(tmp_path):
    """A stand-in wheel: the script installs it into its folder and hands that to tools.gpu_check
    on PYTHONPATH (here a stand-in module that reports what it sees)."""
    project = tmp_path / "project"
    (project / ".device" / "core").mkdir(parents=True)
    (project / "tools").mkdir()
    (project / "tools" / "__init__.py").write_text("")
    (project / "tools" / "gpu_check.py").write_text(
        "import os, sys, carried\nprint('gpu_check', ' '.join(sys.argv[1:]), carried.WHERE.startswith(os.environ['PYTHONPATH']))\n"
    )
    with zipfile.ZipFile(project / ".device/core/carried-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("carried.py", "WHERE = __file__\n")
        whl.writestr("carried-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: carried\nVersion: 1.0\n")
        whl.writestr(
            "carried-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        whl.writestr("carried-1.0.dist-info/RECORD", "")
    out = tmp_path / "out"
    done = _script(
        "core",
        "--device",
        "cpu",
        "--tiny",
        env={"CWD": str(project), "OUT": str(out), "TMPDIR": str(tmp_path), "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_check core --out " + str(out) + " --device cpu --tiny True"
    assert (out / "core.log").read_text() == done.stdout
    assert (out / "core-device.txt").exists() and (tmp_path / "qllm-site-core" / "carried.py").exists()

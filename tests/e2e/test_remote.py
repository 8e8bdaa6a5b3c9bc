"""A second machine restores what the first one ran, sharing nothing with it but a DVC remote on a
real SSH server (OpenSSH's sshd, started here on 127.0.0.1 with generated keys).

The first clone runs the tiny pipeline with the remote as its default (`dvc remote add -d`): each
stage's outputs and the run-cache entries are pushed as the stage finishes. A second clone, in
another directory with its own HOME (its own known_hosts), DVC cache, MLflow store and no
`dvc.lock`, runs `qllm run`: every stage is restored from the remote (outputs checked out, the
run-cache and `dvc.lock` written), none trains, and the outputs have the first clone's md5s. A
third clone does the same with DVC's own `dvc repro --pull`.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.local_api import free_port
from tests.conftest import make_project, run

ALWAYS = {"base_model", "probe_device"}  # they read the world: they run on every machine


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """An OpenSSH server on 127.0.0.1 accepting one generated key for the current user."""
    server = shutil.which("sshd") or "/usr/sbin/sshd"
    assert Path(server).exists(), "OpenSSH's sshd is needed (Debian: apt-get install openssh-server; `make test` installs it as root)"
    home = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "user_key"):
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / name)], home)
    shutil.copy(home / "user_key.pub", home / "authorized_keys")
    (home / "authorized_keys").chmod(0o600)
    port = free_port()
    (home / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {home / 'host_key'}\nAuthorizedKeysFile {home / 'authorized_keys'}\n"
        f"PidFile {home / 'sshd.pid'}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nSubsystem sftp internal-sftp\n"
    )  # fmt: skip
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory
    log = open(home / "sshd.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen([server, "-D", "-e", "-f", str(home / "sshd_config")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not _keyscan(port):
        assert process.poll() is None and time.monotonic() < deadline, (home / "sshd.log").read_text()
        time.sleep(0.1)
    yield {"port": port, "user": getpass.getuser(), "key": home / "user_key", "known_host": f"[127.0.0.1]:{port} " + " ".join((home / "host_key.pub").read_text().split()[:2])}
    process.terminate()
    process.wait(timeout=10)
    log.close()


def _keyscan(port: int) -> str:
    return subprocess.run(["ssh-keyscan", "-p", str(port), "127.0.0.1"], capture_output=True, text=True).stdout.strip()


def _home(root: Path, server: dict) -> Path:
    """A HOME of its own for a clone (a machine): only the server's host key in known_hosts."""
    home = root.parent / f"{root.name}-home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh/known_hosts").write_text(server["known_host"] + "\n")
    return home


def _clone(source: Path, dest: Path, template_db: Path, server: dict) -> Path:
    run(["git", "clone", "-q", str(source), str(dest)], source.parent)
    shutil.copy2(template_db, dest / "mlflow.db")  # its own MLflow store
    run(["git", "config", "user.email", "tests@example.com"], dest)
    run(["git", "config", "user.name", "tests"], dest)
    run([sys.executable, "-m", "dvc", "remote", "modify", "--local", "team", "keyfile", str(server["key"])], dest)
    return dest


def _outs(root: Path) -> dict[str, dict[str, str]]:
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    return {name: {o["path"]: o["md5"] for o in entry.get("outs", [])} for name, entry in lock.items() if name not in ALWAYS}


def test_a_second_machine_restores_every_stage_from_an_ssh_remote(sshd, tmp_path, mlflow_template_db, prefect_server, monkeypatch):
    from flows.pipeline import pipeline
    from pipelines.core.run import repro

    remote = tmp_path / "remote"
    first = make_project(tmp_path / "first", mlflow_template_db)
    run([sys.executable, "-m", "dvc", "remote", "add", "-d", "team", f"ssh://{sshd['user']}@127.0.0.1:{sshd['port']}{remote}"], first)
    run([sys.executable, "-m", "dvc", "remote", "modify", "--local", "team", "keyfile", str(sshd["key"])], first)
    run(["git", "commit", "-qam", "the team's DVC remote"], first)

    monkeypatch.setenv("HOME", str(_home(first, sshd)))
    started = time.perf_counter()
    trained = pipeline(project_dir=str(first))
    first_seconds = time.perf_counter() - started
    repro.close(first)
    assert {s["name"] for s in trained["stages"] if s["status"] == "ran"} >= {"pretrain", "sft", "lora", "dpo", "grpo"}
    pushed = sum(f.stat().st_size for f in remote.rglob("*") if f.is_file())
    assert (remote / "runs").is_dir() and pushed > 0  # the outputs and the run-cache entries

    second = _clone(first, tmp_path / "second", mlflow_template_db, sshd)
    assert not (second / "dvc.lock").exists() and not (second / ".dvc/cache").exists()
    monkeypatch.setenv("HOME", str(_home(second, sshd)))
    started = time.perf_counter()
    restored = pipeline(project_dir=str(second))
    second_seconds = time.perf_counter() - started
    repro.close(second)
    status = {s["name"]: (s["status"], s["reason"]) for s in restored["stages"]}
    assert {name for name, (st, _) in status.items() if st == "ran"} == ALWAYS, status
    assert all(reason == "run-cache" for name, (_, reason) in status.items() if name not in ALWAYS), status
    assert _outs(second) == _outs(first)  # the same bytes, and dvc.lock written
    for name in ("pretrain", "sft", "grpo"):
        assert (second / f"data/models/{name}/model.safetensors").exists()
    print(f"\nfirst clone trains: {first_seconds:.1f} s; second clone restores: {second_seconds:.1f} s; remote holds {pushed / 1e6:.1f} MB")

    # DVC's own way on a third machine: `dvc repro --pull` restores each stage from the remote's run-cache
    third = _clone(first, tmp_path / "third", mlflow_template_db, sshd)
    env = os.environ | {"HOME": str(_home(third, sshd))}
    out = subprocess.run([sys.executable, "-m", "dvc", "repro", "--pull"], cwd=third, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("pretrain", "sft", "grpo", "evaluate"):
        assert f"Stage '{name}' is cached - skipping run, checking out outputs" in out.stdout, out.stdout
    assert _outs(third) == _outs(first)


def test_an_unreachable_remote_is_a_warning_and_the_stage_runs(tmp_path, mlflow_template_db, caplog):
    """A remote that cannot be reached (nothing listens on its port) never stops a run: the
    run-cache fetch and the push are warned about, the stage runs and is recorded locally."""
    import logging

    from pipelines.core.run import repro

    root = make_project(tmp_path / "project", mlflow_template_db)
    run([sys.executable, "-m", "dvc", "remote", "add", "-d", "--local", "team", f"ssh://nobody@127.0.0.1:{free_port()}/nowhere"], root)
    with caplog.at_level(logging.WARNING, logger="qllm"):
        try:
            outcome = repro.reproduce(root, "sample_data")
        finally:
            repro.close(root)
    assert (outcome.status, outcome.reason) == ("ran", "executed")
    assert "DVC remote 'team': could not fetch its run-cache" in caplog.text and "stages it holds will run here" in caplog.text
    assert "sample_data" in yaml.safe_load((root / "dvc.lock").read_text())["stages"]

"""A second machine restores what the first one ran, sharing nothing with it but a DVC remote: on a
real SSH server (OpenSSH's sshd, started here on 127.0.0.1 with generated keys), and on an S3 API
endpoint (moto's server, started here on 127.0.0.1; DVC's S3 remote through dvc-s3).

The first clone runs the tiny pipeline with the remote as its default (`dvc remote add -d`): each
stage's outputs and the run-cache entries are pushed as the stage finishes. A second clone, in
another directory with its own HOME (its own known_hosts), DVC cache, MLflow store and no
`dvc.lock`, runs `qllm run`: every stage is restored from the remote (outputs checked out, the
run-cache and `dvc.lock` written), none trains, and the outputs have the first clone's md5s. A
third clone does the same with DVC's own `dvc repro --pull`.

The default suite runs the toy DAG (tests/conftest.py) through each remote: what differs between
remotes is their settings and transport, which every stage uses the same way (the runner's push,
run-cache fetch and restore; DVC's checkout). The whole pipeline through SSH (about 50 s of a
suite's time, imitated), and through S3 up to `pretrain` (about 30 s of CPU, imitated) and whole
(about two minutes on a 2-core AVX2-only machine, where moto's server takes every object in a
request of its own), is the slow form (`-m slow`).
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

from qllm.services.local_api import free_port
from tests.conftest import git_identity, make_project, run
from tests.waiting import DEADLINE, exited, until

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
    until(lambda: _keyscan(port), f"sshd to answer on 127.0.0.1:{port}", process=process, log=home / "sshd.log", poll=0.1)
    yield {"port": port, "user": getpass.getuser(), "key": home / "user_key", "known_host": f"[127.0.0.1]:{port} " + " ".join((home / "host_key.pub").read_text().split()[:2])}
    process.terminate()
    exited(process, "sshd stopping on SIGTERM", log=home / "sshd.log")
    log.close()


def _keyscan(port: int) -> str:
    return subprocess.run(["ssh-keyscan", "-p", str(port), "127.0.0.1"], capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 with one bucket (moto accepts any credentials)."""
    import boto3

    port = free_port()
    home = tmp_path_factory.mktemp("s3")
    log = open(home / "moto.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")

    def bucket_made() -> bool:
        try:
            client.create_bucket(Bucket="qllm-dvc")
        except Exception:  # noqa: BLE001 - not listening yet
            return False
        return True

    until(bucket_made, f"moto's S3 server to make a bucket on {endpoint}", process=process, log=home / "moto.log", poll=0.2)
    yield {"endpoint": endpoint, "client": client}
    process.terminate()
    exited(process, "moto's S3 server stopping on SIGTERM", log=home / "moto.log")
    log.close()


@pytest.fixture
def shared_remote(request, tmp_path) -> dict:
    """The remote both clones share: its URL, the settings committed with it, each machine's own
    (`.dvc/config.local`), what goes in each machine's known_hosts, and how many bytes it holds."""
    if request.param["kind"] == "ssh":
        server = request.getfixturevalue("sshd")
        where = tmp_path / "remote"
        return {"url": f"ssh://{server['user']}@127.0.0.1:{server['port']}{where}", "committed": {}, "local": {"keyfile": str(server["key"])},
                "known_host": server["known_host"], "size": lambda: sum(f.stat().st_size for f in where.rglob("*") if f.is_file())}  # fmt: skip
    return _s3_remote(request.getfixturevalue("s3"), f"store-{tmp_path.name}")


def _s3_remote(server: dict, prefix: str) -> dict:
    """`shared_remote`'s record for a prefix of the S3 server's bucket."""

    def size() -> int:
        pages = server["client"].get_paginator("list_objects_v2").paginate(Bucket="qllm-dvc", Prefix=prefix)
        return sum(o["Size"] for page in pages for o in page.get("Contents", []))

    return {"url": f"s3://qllm-dvc/{prefix}", "committed": {"endpointurl": server["endpoint"]},
            "local": {"access_key_id": "testing", "secret_access_key": "testing"}, "known_host": "", "size": size}  # fmt: skip


def _home(root: Path, remote: dict) -> Path:
    """A HOME of its own for a clone (a machine): only the SSH server's host key in known_hosts."""
    home = root.parent / f"{root.name}-home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh/known_hosts").write_text(remote["known_host"] + "\n")
    return home


def _add_default_remote(root: Path, remote: dict) -> None:
    """`remote` as the project's default DVC remote `team`: its URL and settings in `.dvc/config`
    (committed), its credentials in `.dvc/config.local` (this machine's)."""
    run([sys.executable, "-m", "dvc", "remote", "add", "-d", "team", remote["url"]], root)
    for key, value in remote["committed"].items():
        run([sys.executable, "-m", "dvc", "remote", "modify", "team", key, value], root)
    _credentials(root, remote)


def _credentials(root: Path, remote: dict) -> None:
    for key, value in remote["local"].items():
        run([sys.executable, "-m", "dvc", "remote", "modify", "--local", "team", key, value], root)


def _clone(source: Path, dest: Path, template_db: Path | None, remote: dict) -> Path:
    run(["git", "clone", "-q", str(source), str(dest)], source.parent)
    if template_db is not None:
        shutil.copy2(template_db, dest / "mlflow.db")  # its own MLflow store
    git_identity(dest)
    _credentials(dest, remote)
    return dest


def _outs(root: Path) -> dict[str, dict[str, str]]:
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    return {name: {o["path"]: o["md5"] for o in entry.get("outs", [])} for name, entry in lock.items() if name not in ALWAYS}


REMOTES = [
    pytest.param({"kind": "ssh", "until": None}, id="ssh", marks=pytest.mark.slow),
    pytest.param({"kind": "s3", "until": "pretrain"}, id="s3-until-pretrain", marks=pytest.mark.slow),
    pytest.param({"kind": "s3", "until": None}, id="s3", marks=pytest.mark.slow),
]
"""The whole pipeline through SSH and through S3 (up to pretrain, and whole): `-m slow`. The default
suite checks both remotes' settings and transport on the toy DAG instead
(`test_a_second_machine_restores_the_toy_dag_from_the_shared_remote`): the runner pushes, fetches
the run-cache and restores the same way whatever the stage is."""


@pytest.mark.parametrize("shared_remote", REMOTES, indirect=True)
def test_a_second_machine_restores_every_stage_from_the_shared_remote(shared_remote, request, tmp_path, mlflow_template_db, prefect_server, monkeypatch):
    from flows.pipeline import pipeline
    from pipelines.core import dag
    from pipelines.core.run import repro

    remote, until = shared_remote, request.node.callspec.params["shared_remote"]["until"]
    first = make_project(tmp_path / "first", mlflow_template_db)
    _add_default_remote(first, remote)
    run(["git", "commit", "-qam", "the team's DVC remote"], first)

    monkeypatch.setenv("HOME", str(_home(first, remote)))
    started = time.perf_counter()
    trained = pipeline(project_dir=str(first), until=until)
    first_seconds = time.perf_counter() - started
    repro.close(first)
    stages = dag.order(first, until)
    assert [s["name"] for s in trained["stages"]] == stages
    assert "pretrain" in stages
    assert {s["name"] for s in trained["stages"] if s["status"] == "ran"} >= {"pretrain", "sft", "lora", "dpo", "grpo"} & set(stages)
    pushed = remote["size"]()
    assert pushed > 0  # the outputs and the run-cache entries

    second = _clone(first, tmp_path / "second", mlflow_template_db, remote)
    assert not (second / "dvc.lock").exists() and not (second / ".dvc/cache").exists()
    monkeypatch.setenv("HOME", str(_home(second, remote)))
    started = time.perf_counter()
    restored = pipeline(project_dir=str(second), until=until)
    second_seconds = time.perf_counter() - started
    repro.close(second)
    status = {s["name"]: (s["status"], s["reason"]) for s in restored["stages"]}
    assert list(status) == stages
    assert {name for name, (st, _) in status.items() if st == "ran"} == ALWAYS & set(stages), status
    assert all(reason == "run-cache" for name, (_, reason) in status.items() if name not in ALWAYS), status
    assert _outs(second) == _outs(first)  # the same bytes, and dvc.lock written
    for name in {"pretrain", "sft", "grpo"} & set(stages):
        assert (second / f"data/models/{name}/model.safetensors").exists()
    print(f"\nfirst clone trains: {first_seconds:.1f} s; second clone restores: {second_seconds:.1f} s; remote holds {pushed / 1e6:.1f} MB")

    # DVC's own way on a third machine: `dvc repro --pull` restores each stage from the remote's run-cache
    third = _clone(first, tmp_path / "third", mlflow_template_db, remote)
    env = os.environ | {"HOME": str(_home(third, remote))}
    out = subprocess.run([sys.executable, "-m", "dvc", "repro", "--pull", *([until] if until else [])], cwd=third, env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in {"pretrain", "sft", "grpo", "evaluate"} & set(stages):
        assert f"Stage '{name}' is cached - skipping run, checking out outputs" in out.stdout, out.stdout
    assert _outs(third) == _outs(first)


TOY_REMOTES = [pytest.param({"kind": "ssh"}, id="ssh"), pytest.param({"kind": "s3"}, id="s3")]


@pytest.mark.parametrize("shared_remote", TOY_REMOTES, indirect=True)
def test_a_second_machine_restores_the_toy_dag_from_the_shared_remote(shared_remote, toy, tmp_path, monkeypatch):
    """The pipeline's runner (`repro.reproduce`) on the toy DAG (tests/conftest.py) with an SSH or
    S3 default remote: the first clone's stages push their outputs and run-cache entries as they
    finish, a second clone restores both stages from the remote through the runner, and a third
    with DVC's own `dvc repro --pull`; no stage runs twice and every clone has the same outputs."""
    from pipelines.core.run import repro

    remote = shared_remote
    first = toy
    _add_default_remote(first, remote)
    git_identity(first)
    run(["git", "add", "-A"], first)
    run(["git", "commit", "-qm", "the toy, with the team's DVC remote"], first)
    monkeypatch.setenv("HOME", str(_home(first, remote)))

    def body(ws: Path, name: str, parent_run_id) -> None:
        if name == "a":
            (ws / "data/a").mkdir(parents=True, exist_ok=True)
            (ws / "data/a/out.txt").write_text("x" * 2)
        else:
            (ws / "data/b.txt").write_text((ws / "data/a/out.txt").read_text() + "b")
            (ws / "data/metrics").mkdir(parents=True, exist_ok=True)
            (ws / "data/metrics/b.json").write_text('{"m": 1}')

    ran = [repro.reproduce(first, name, execute=body) for name in ("a", "b")]
    assert [(o.status, o.reason) for o in ran] == [("ran", "executed")] * 2
    assert remote["size"]() > 0  # the outputs and the run-cache entries

    def must_not_run(ws: Path, name: str, parent_run_id) -> None:
        raise AssertionError(f"stage {name} ran on the second machine: it should have come from the remote")

    second = _clone(first, tmp_path / "second", None, remote)
    assert not (second / "dvc.lock").exists() and not (second / ".dvc/cache").exists()
    monkeypatch.setenv("HOME", str(_home(second, remote)))
    try:
        restored = [repro.reproduce(second, name, execute=must_not_run) for name in ("a", "b")]
    finally:
        repro.close(second)
    assert [(o.status, o.reason) for o in restored] == [("cached", "run-cache")] * 2
    assert _outs(second) == _outs(first) and (second / "data/b.txt").read_text() == "xxb"

    third = _clone(first, tmp_path / "third", None, remote)
    env = os.environ | {"HOME": str(_home(third, remote))}
    out = subprocess.run([sys.executable, "-m", "dvc", "repro", "--pull", "b"], cwd=third, env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("a", "b"):
        assert f"Stage '{name}' is cached - skipping run, checking out outputs" in out.stdout, out.stdout
    assert _outs(third) == _outs(first) and (third / "data/b.txt").read_text() == "xxb"


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

"""The pipeline against a team's MLflow server: `mlflow server` on a real PostgreSQL (started here
from the system's packages, on 127.0.0.1) with `--serve-artifacts`, so a worker needs no
object-store credentials: it speaks HTTP only.

The tiny pipeline runs twice with `MLFLOW_TRACKING_URI` set to the server: every stage's run, the
registered versions, their aliases and tags land in PostgreSQL and the artifacts in the server's
artifact store (none in the project); the registry gate reads the champion from the server;
`qllm lineage` and `qllm compare` answer from it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from qllm.services.local_api import free_port, wait_http
from tests.conftest import make_project
from tests.waiting import DEADLINE, exited


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL cluster of its own on 127.0.0.1 (a free port; `qllm.services.postgres`, as the team
    profile runs it), database `mlflow`, trust auth for the user `qllm`."""
    from qllm.services.postgres import Cluster

    home = Path(tempfile.mkdtemp(prefix="qllm-postgres-"))  # not under pytest's 0700 root-owned directory: the postgres user reads it
    if os.geteuid() == 0:
        shutil.chown(home, "postgres")
    cluster = Cluster(home / "data", free_port(), password=None)
    cluster.init()
    with open(home / "postgres.log", "wb") as log:
        process = subprocess.Popen(cluster.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        cluster.wait(process, DEADLINE, home / "postgres.log")
        cluster.create_database("mlflow")
        yield cluster.url("mlflow")
    finally:
        os.killpg(process.pid, signal.SIGINT)  # PostgreSQL's fast shutdown
        exited(process, "PostgreSQL's fast shutdown", log=home / "postgres.log")
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_server(postgres, tmp_path_factory):
    """`mlflow server` on that database, serving artifacts from its own directory."""
    home = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    log = open(home / "server.log", "wb")  # noqa: SIM115 - closed below
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    process = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres, "--serve-artifacts",
                                "--artifacts-destination", str(home / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
                                "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", process, "the MLflow server", DEADLINE, hint=f"; see {home / 'server.log'}")
    yield {"url": url, "artifacts": home / "artifacts"}
    os.killpg(process.pid, signal.SIGTERM)
    exited(process, "the MLflow server stopping on SIGTERM", log=home / "server.log")
    log.close()


def test_two_runs_register_through_the_server(mlflow_server, tmp_path, mlflow_template_db, prefect_server, monkeypatch, capsys):
    from mlflow import MlflowClient

    from flows.pipeline import pipeline
    from qllm.cli import main
    from tests.qllm.test_cli_tools import reset_mlflow_uris

    root = make_project(tmp_path / "project", mlflow_template_db)
    (root / "mlflow.db").unlink()  # the server is the only store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server["url"])
    try:
        first = pipeline(project_dir=str(root))
        monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server["url"])  # register sets MLflow's process-wide URI: back to the server
        second = pipeline(overrides=["evaluate.max_new_tokens=2"], project_dir=str(root))
    finally:
        reset_mlflow_uris()
    assert (first["model_version"], second["model_version"]) == ("1", "2")
    assert not (root / "mlflow.db").exists() and not (root / "mlartifacts").exists()  # nothing local

    client = MlflowClient(tracking_uri=mlflow_server["url"], registry_uri=mlflow_server["url"])
    versions = sorted(int(v.version) for v in client.search_model_versions("name='qllm'"))
    assert versions == [1, 2]
    champion = client.get_model_version_by_alias("qllm", "champion")
    second_version = client.get_model_version("qllm", "2")
    assert second_version.tags["gate.decision"] in ("champion", "challenger") and "gate.reason" in second_version.tags
    assert champion.version in ("1", "2")
    # the artifacts went through the server into its store: the registered model's files are there
    stored = [p for p in mlflow_server["artifacts"].rglob("*") if p.is_file()]
    assert any(p.name == "MLmodel" for p in stored) and any(p.suffix == ".safetensors" for p in stored)
    # the CLI answers from the server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server["url"])
    capsys.readouterr()
    assert main(["lineage", "models:/qllm@champion", "--project-dir", str(root)]) == 0
    trail = capsys.readouterr().out
    assert trail.startswith(f"models:/qllm/{champion.version}  @champion") and "sample_data  run" in trail and "(raw data)" in trail
    assert main(["compare", "--last", "2", "--json", "--project-dir", str(root)]) == 0
    compared = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in compared["runs"]] == [first["mlflow_run_id"], second["mlflow_run_id"]]
    assert compared["params"]["evaluate.max_new_tokens"] == ["4", "2"] and compared["metrics"]["register/version"] == [1.0, 2.0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_registrations_at_once_keep_every_version_and_the_best_champion(mlflow_server, seed):
    """Six registrations gate at the same moment against one champion (as six pipelines on six
    machines would, through the server): every version is kept, numbered once, and @champion ends
    on the best of those that passed, whichever wrote last; the one below the champion is
    challenger."""
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from mlflow import MlflowClient

    from pipelines import register
    from pipelines.core.params.release import RegisterParams

    client = MlflowClient(tracking_uri=mlflow_server["url"], registry_uri=mlflow_server["url"])
    name = f"race-{seed}"
    client.create_registered_model(name)
    run_id = client.create_run(client.create_experiment(f"race-{seed}")).info.run_id
    params = RegisterParams(model_name=name)

    def new_version(value: float) -> str:
        version = client.create_model_version(name, source=f"runs:/{run_id}/model", run_id=run_id).version
        client.set_model_version_tag(name, version, "metric.exact_match", repr(value))
        return str(version)

    first = new_version(0.5)
    register.promote(client, params, first, 0.5)
    values = [0.55, 0.9, 0.6, 0.7, 0.4, 0.85]
    random.Random(seed).shuffle(values)
    start = threading.Barrier(len(values))

    def registration(value: float) -> tuple[str, register.Decision]:
        version = new_version(value)
        start.wait()  # every gate reads the same champion
        return version, register.promote(client, params, version, value)

    with ThreadPoolExecutor(len(values)) as pool:
        results = list(pool.map(registration, values))
    numbers = sorted(int(v) for v, _ in results)
    assert numbers == list(range(2, 2 + len(values)))  # none lost, none twice
    assert sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'")) == [1, *numbers]
    by_value = {value: version for (version, _), value in zip(results, values, strict=True)}
    assert client.get_model_version_by_alias(name, "champion").version == by_value[0.9]
    decisions = {value: decision for (_, decision), value in zip(results, values, strict=True)}
    assert not decisions[0.4].promoted and all(decisions[v].promoted for v in values if v != 0.4)
    assert client.get_model_version_by_alias(name, "challenger").version == by_value[0.4]

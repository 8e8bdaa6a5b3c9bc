"""Deployments on a real Prefect server and process worker (`make serve`), run with `prefect deployment run`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows import serve
from tests.conftest import REPO, make_project

PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture(scope="module")
def served(tmp_path_factory, mlflow_template_db):
    """A tiny project with its services started by `flows.serve` (as `make serve` does); stopped
    afterwards, even when a test fails."""
    project = make_project(tmp_path_factory.mktemp("served") / "project", mlflow_template_db)
    shutil.copy(REPO / "prefect.yaml", project / "prefect.yaml")
    record = serve.start(project, prefect_port=0, mlflow_port=0)
    try:
        env = serve.service_env(project, record["prefect_api_url"])
        deployed = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], cwd=project, env=env, capture_output=True, text=True, timeout=180)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield project, record, env
    finally:
        stopped = serve.stop(project)
        assert len(stopped) == 3 and all(not serve._alive(s["pid"]) for s in record["services"].values())


def deployment_run(env: dict, project: Path, name: str, *params: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [PREFECT, "deployment", "run", name, "--watch", "--watch-timeout", str(int(timeout))]
    for param in params:
        command += ["--param", param]
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=timeout + 60)


def test_services_listen_on_localhost_only(served):
    _, record, _ = served
    urls = [s["url"] for s in record["services"].values() if "url" in s]
    assert len(urls) == 2 and all(url.startswith("http://127.0.0.1:") for url in urls)


def test_deployment_run_completes_and_registers(served):
    from mlflow import MlflowClient

    project, _, env = served
    result = deployment_run(env, project, "qllm-pipeline/default")
    assert result.returncode == 0 and "Completed" in result.stdout, result.stdout + result.stderr
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version_by_alias("qllm", "champion")
    assert version.tags["prefect.flow_run_id"]  # the worker's flow run, recorded on the version
    parents = client.search_runs([client.get_experiment_by_name("qllm").experiment_id], "tags.`qllm.kind` = 'pipeline'")
    assert len(parents) == 1 and parents[0].data.tags["qllm.prefect_flow_run_id"] == version.tags["prefect.flow_run_id"]
    assert json.loads((project / "data/register/registered.json").read_text())["version"] == "1"


def test_from_stage_deployment_reuses_upstream(served):
    project, _, env = served
    result = deployment_run(env, project, "qllm-pipeline/from-stage", "overrides=[\"dpo.beta=0.3\"]")
    assert result.returncode == 0 and "Completed" in result.stdout, result.stdout + result.stderr
    runs = sorted((project / ".qllm" / "runs").iterdir())
    metrics = [json.loads((ws / "data/metrics/dpo.json").read_text()) for ws in runs if (ws / "data/metrics/dpo.json").exists()]
    assert len(metrics) == 1 and metrics[0]["steps"] > 0  # dpo trained in the override's workspace


def test_from_stage_refuses_to_train_upstream(served):
    project, _, env = served
    # a new pretrain lr: nothing upstream of dpo is cached for it, so the run must fail, not train
    result = deployment_run(env, project, "qllm-pipeline/from-stage", "overrides=[\"pretrain.train.lr=0.0123\"]")
    assert result.returncode != 0 and "Failed" in result.stdout, result.stdout + result.stderr

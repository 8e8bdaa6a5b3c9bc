"""Deployments on a real Prefect server and process worker (`make serve`), run with `prefect deployment run`."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from qllm.services import serve
from tests.conftest import REPO, assert_stopped_by_itself, make_project
from tests.waiting import DEADLINE, until

PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture(scope="module")
def served(tmp_path_factory, mlflow_template_db):
    """A tiny project with its services started by `qllm.services.serve` (as `make serve` does); stopped
    afterwards, even when a test fails. Every wait (the servers answering, the deployments made, the
    services gone after SIGTERM) is for that state, bounded by `tests.waiting.DEADLINE`."""
    project = make_project(tmp_path_factory.mktemp("served") / "project", mlflow_template_db)
    shutil.copy(REPO / "prefect.yaml", project / "prefect.yaml")
    record = serve.start(project, prefect_port=0, mlflow_port=0, timeout=DEADLINE)
    try:
        env = serve.service_env(project, record["prefect_api_url"])
        deployed = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], cwd=project, env=env, capture_output=True, text=True, timeout=DEADLINE)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield project, record, env
    finally:
        stopped = serve.stop(project, timeout=DEADLINE)  # the worker's own shutdown on SIGTERM, however long a busy machine makes it
        assert len(stopped) == 3 and all(not serve._alive(s["pid"]) for s in record["services"].values())
        assert_stopped_by_itself(Path(record["services"]["prefect-worker"]["log"]))


def deployment_run(env: dict, project: Path, name: str, *params: str, timeout: float = DEADLINE) -> subprocess.CompletedProcess:
    """`prefect deployment run NAME --watch`: it returns when the flow run ends (`timeout` bounds a broken one)."""
    command = [PREFECT, "deployment", "run", name, "--watch", "--watch-timeout", str(int(timeout))]
    for param in params:
        command += ["--param", param]
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=timeout + 60)


def test_services_listen_on_localhost_only(served):
    _, record, _ = served
    urls = [s["url"] for s in record["services"].values() if "url" in s]
    assert len(urls) == 2 and all(url.startswith("http://127.0.0.1:") for url in urls)


def test_the_mlflow_ui_runs_no_job_consumers_and_one_worker(served):
    """`mlflow ui` on a database starts MLflow 3's job runner (a runner and five huey consumers, each a
    process importing MLflow) unless told not to; `make serve` tells it not to: the pipeline submits
    no MLflow jobs. `MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true` in its environment turns it on.
    `mlflow ui` also serves with four uvicorn worker processes unless told otherwise; `make serve`
    runs one: its uvicorn, with no worker processes of its own."""
    import psutil

    _, record, _ = served
    ui = psutil.Process(record["services"]["mlflow-ui"]["pid"])
    commands = [" ".join(child.cmdline()) for child in ui.children(recursive=True)]
    assert commands and not [c for c in commands if "huey" in c or "_job_runner" in c], commands
    uvicorn = [c for c in commands if " -m uvicorn " in c]
    assert len(uvicorn) == 1 and "--workers 1" in uvicorn[0], commands
    assert not [c for c in commands if "multiprocessing" in c], commands  # no spawned workers


def test_the_printed_mlflow_link_opens_the_projects_runs(served):
    from mlflow import MlflowClient

    project, record, _ = served
    ui = record["services"]["mlflow-ui"]["url"]
    link = serve.runs_link(project, ui)
    experiment = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_experiment_by_name("qllm")
    assert link == f"{ui}/#/experiments/{experiment.experiment_id}?workflowType=machine_learning"


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


@pytest.mark.slow  # the refusal itself: tests/e2e/test_pipeline_e2e.py (in-process); the deployment's from_stage: the test above
def test_from_stage_refuses_to_train_upstream(served):
    project, _, env = served
    # a new pretrain lr: nothing upstream of dpo is cached for it, so the run must fail, not train
    result = deployment_run(env, project, "qllm-pipeline/from-stage", "overrides=[\"pretrain.train.lr=0.0123\"]")
    assert result.returncode != 0 and "Failed" in result.stdout, result.stdout + result.stderr


@contextlib.contextmanager
def flow_run_states(env: dict, flow_run_id: str) -> Iterator[Callable[[], str]]:
    """A function giving the flow run's state now, through one client of the served API for every
    poll (a client made per poll cost about 10 s of CPU over the cancel test's wait)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        yield lambda: client.read_flow_run(UUID(flow_run_id)).state.type.value


RERUN = [pytest.param(False, id="cancel"), pytest.param(True, id="and-rerun", marks=pytest.mark.slow)]
"""The rerun that resumes is `-m slow` (a second flow-run process, about 15 s of CPU, imitated): the
resume from a stop's checkpoint is the same code under `qllm run` (tests/core/training/test_stop_signals.py)."""


@pytest.mark.parametrize("rerun", RERUN)
def test_cancelling_a_deployment_run_checkpoints_training_and_the_rerun_resumes(served, tmp_path, rerun):
    """`prefect flow-run cancel`: the worker signals the cancel intent, then SIGTERMs the flow-run
    process; Prefect's engine raises TerminationSignal in the flow, which stops pretrain after its
    step with a checkpoint before the run is marked Cancelled (the worker waits 30 s, then SIGKILLs).

    Training is held at step 20 (`tests/hold_training.py`) until the stop arrives, so the cancel
    always meets a running pretrain, on any machine: no race with how fast training is."""
    from mlflow import MlflowClient

    from tests import hold_training

    project, record, env = served
    worker_log = Path(record["services"]["prefect-worker"]["log"])
    seen = worker_log.stat().st_size
    held = tmp_path / "held"
    hold = hold_training.install(project)  # flow runs work in the project directory, which imports it
    extensions = f"pretrain.train.extensions=[mlflow_metrics, {{name: '{hold}', step: 20, marker: '{held}'}}]"
    params = ["until=pretrain", "overrides=" + json.dumps(["pretrain.train.max_steps=30", extensions])]
    started = subprocess.run([PREFECT, "deployment", "run", "qllm-pipeline/default", *[a for p in params for a in ("--param", p)]],
                             cwd=project, env=env, capture_output=True, text=True, timeout=DEADLINE)  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)

    def new_log() -> str:
        with open(worker_log, "rb") as log:
            log.seek(seen)
            return log.read().decode(errors="replace")

    with flow_run_states(env, flow_run_id) as state:
        until(held.exists, "the flow run's pretrain held after step 20", state=state, final=("COMPLETED", "FAILED", "CRASHED", "CANCELLED"),
              log=new_log, poll=0.2)  # fmt: skip
        assert int(held.read_text()) == 20
        cancelled = subprocess.run([PREFECT, "flow-run", "cancel", flow_run_id], cwd=project, env=env, capture_output=True, text=True, timeout=DEADLINE)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        until(lambda: state() == "CANCELLED", "the flow run cancelled", state=state, final=("COMPLETED", "FAILED", "CRASHED"), log=new_log, poll=0.5)
    stopped = re.search(r"pretrain: SIGTERM at step (\d+): checkpoint saved in (\S+);", new_log())
    assert stopped and int(stopped.group(1)) == 20, new_log()[-3000:]  # the step it was held after
    assert (Path(stopped.group(2)) / f"step-{int(stopped.group(1)):08d}" / "manifest.json").exists()
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("qllm").experiment_id
    (parent,) = client.search_runs([experiment], f"tags.`qllm.prefect_flow_run_id` = '{flow_run_id}'")
    (pretrain,) = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and tags.`qllm.stage` = 'pretrain'")
    assert (parent.info.status, pretrain.info.status) == ("KILLED", "KILLED")
    if not rerun:
        return

    seen = worker_log.stat().st_size
    rerun = deployment_run(env, project, "qllm-pipeline/default", *params)
    assert rerun.returncode == 0 and "Completed" in rerun.stdout, rerun.stdout + rerun.stderr
    assert f"pretrain: resumed from step {stopped.group(1)}" in new_log(), new_log()[-3000:]


def test_two_services_asking_for_any_port_never_get_the_same_one(monkeypatch):
    """Two back-to-back requests for a free port may be handed the same one (the first is not bound
    until its server starts): the MLflow UI's must differ from the Prefect server's."""
    handed = iter([41001, 41001, 41001, 41002])
    monkeypatch.setattr(serve, "free_port", lambda: next(handed))
    first = serve._port(0)
    assert (first, serve._port(0, taken=(first,))) == (41001, 41002)

"""A team's servers (`make serve PROFILE=team`) and two workers on one pool, each in its own checkout.

`flows.serve.start(profile="team")` starts, on 127.0.0.1: PostgreSQL (the system's packages) under
a Prefect server asking for an auth string and an MLflow tracking server with basic auth and
proxied artifacts, a worker in the first checkout and a DVC remote (a directory). A second worker
runs in a clone of the project (its own checkout, DVC cache and PREFECT_HOME: another machine,
sharing only the servers and the DVC remote). The sweep deployment `qllm-sweep/dpo-beta-workers`
then spreads its three DPO betas over both workers, and every stage outside dpo, export, evaluate and
register is computed once in all: the second checkout restores them from the remote.
"""

from __future__ import annotations

import base64
import json
import shutil
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flows import serve, sweep
from tests.conftest import REPO, make_project, run

PREFECT = str(Path(sys.executable).parent / "prefect")
SECOND = "worker-two"
PER_SET = {"dpo", "export", "evaluate", "register"}
MACHINE = {"base_model", "probe_device"}  # read the machine: they run in every checkout (milliseconds)


@pytest.fixture(scope="module")
def team(tmp_path_factory, mlflow_template_db):
    base = tmp_path_factory.mktemp("team")
    one = make_project(base / "one", mlflow_template_db)
    shutil.copy(REPO / "prefect.yaml", one / "prefect.yaml")
    run(["git", "add", "prefect.yaml"], one)
    run(["git", "commit", "-qm", "deployments"], one)
    two = base / "two"
    run(["git", "clone", "-q", str(one), str(two)], base)
    record = serve.start(one, prefect_port=0, mlflow_port=0, postgres_port=0, profile="team", worker_limit=2)  # each worker: the sweep (whichever takes it) and a set, or two sets
    worker = None
    try:
        client = serve.read_env_file(record["env_file"])
        env = serve.service_env(one, record["prefect_api_url"], client) | {"PREFECT_WORKER_QUERY_SECONDS": "2"}
        assert record["dvc_remote"].startswith("team -> ")  # the profile's remote: a directory a worker on this host reaches
        run([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "team", record["dvc_remote"].split(" ")[2]], two)
        log = open(base / "worker-two.log", "wb")  # noqa: SIM115 - closed below
        worker = subprocess.Popen(serve.worker_command(limit=2, name=SECOND), cwd=two, env=env | {"PREFECT_HOME": str(two / serve.STATE_DIR / "prefect")}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deployed = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], cwd=one, env=env, capture_output=True, text=True, timeout=180)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield {"one": one, "two": two, "record": record, "env": env, "client": client}
    finally:
        if worker is not None:
            serve.stop_processes({SECOND: {"pid": worker.pid}})  # SIGTERM, SIGKILL after 15 s
            worker.wait()
        stopped = serve.stop(one)
        assert len(stopped) == 4 and all(not serve._alive(s["pid"]) for s in record["services"].values())
        shutil.rmtree(record["services"]["postgres"]["data"], ignore_errors=True)


def _status(url: str, auth: str | None = None, body: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(local.rsplit(":", 1)[0])
    return found


def test_requests_without_credentials_are_refused_and_everything_listens_on_localhost(team):
    record, client = team["record"], team["client"]
    services = record["services"]
    prefect, mlflow = record["prefect_api_url"], services["mlflow-server"]["url"]
    search = f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=1"
    assert _status(f"{prefect}/flows/filter", body=b"{}") == 401
    assert _status(f"{prefect}/flows/filter", auth="qllm:wrong", body=b"{}") == 401
    assert _status(f"{prefect}/flows/filter", auth=client["PREFECT_API_AUTH_STRING"], body=b"{}") == 200
    assert _status(search) == 401
    assert _status(search, auth="qllm:wrong") == 401
    assert _status(search, auth=f"qllm:{client['MLFLOW_TRACKING_PASSWORD']}") == 200
    ports = [int(services[name]["url"].rsplit(":", 1)[1]) for name in ("prefect-server", "mlflow-server")] + [services["postgres"]["port"]]
    for port in ports:
        assert _listening(port) == {"0100007F"}, f"port {port} listens beyond 127.0.0.1"
    state = team["one"] / serve.STATE_DIR
    for private in (serve.TEAM_ENV, serve.SECRETS, "mlflow-auth.ini"):
        assert stat.S_IMODE((state / private).stat().st_mode) == 0o600, private
    passwords = json.loads((state / serve.SECRETS).read_text())
    logs = "".join(Path(s["log"]).read_text(errors="replace") for s in services.values())
    assert not any(secret in logs for secret in passwords.values())
    command_lines = []  # what `ps` shows every user of the host
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command_lines.append(cmdline.read_bytes().decode(errors="replace"))
        except OSError:  # a process that ended meanwhile
            continue
    assert not any(secret in line for line in command_lines for secret in passwords.values())


def test_a_sweep_spreads_over_two_workers_and_computes_shared_stages_once(team, monkeypatch):
    from mlflow import MlflowClient

    one, two, env, client = team["one"], team["two"], team["env"], team["client"]
    done = subprocess.run([PREFECT, "deployment", "run", "qllm-sweep/dpo-beta-workers", "--watch", "--watch-timeout", "900"],
                          cwd=one, env=env, capture_output=True, text=True, timeout=960)  # fmt: skip
    worker_logs = (team["record"]["services"]["prefect-worker"]["log"], Path(two).parent / "worker-two.log")
    assert done.returncode == 0, done.stdout + done.stderr + "".join(Path(p).read_text()[-4000:] for p in worker_logs)

    for key, value in client.items():
        if key.startswith("MLFLOW_TRACKING_"):  # the team's MLflow server, as a client of it
            monkeypatch.setenv(key, value)
    ran = sweep.stage_run_counts(one)
    versions = MlflowClient(tracking_uri=client["MLFLOW_TRACKING_URI"], registry_uri=client["MLFLOW_TRACKING_URI"]).search_model_versions("name='qllm'")
    # the sets: runs of qllm-pipeline/default on the pool's workers, one per beta, subflows of the sweep
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    async def set_runs():
        async with get_client() as prefect:
            return [r for r in await prefect.read_flow_runs() if r.parameters.get("overrides") and r.parent_task_run_id]

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: client["PREFECT_API_AUTH_STRING"]}):
        runs = asyncio.run(set_runs())
    assert sorted(tuple(r.parameters["overrides"]) for r in runs) == [("dpo.beta=0.05",), ("dpo.beta=0.2",), ("dpo.beta=0.5",)]
    assert all(r.state.is_completed() for r in runs)
    workers = {r.labels.get("prefect.worker.name") for r in runs}
    assert SECOND in workers and len(workers) == 2, f"the sets ran on {workers}: not spread over both workers"

    per_set = {stage: ran.get(stage, 0) for stage in PER_SET}
    assert per_set == dict.fromkeys(PER_SET, 3), ran
    shared = {stage: count for stage, count in ran.items() if stage not in PER_SET | MACHINE}
    assert shared and all(count == 1 for count in shared.values()), f"shared stages computed more than once: {ran}"
    assert {"pretrain", "sft", "lora"} <= set(shared)
    assert sorted(int(v.version) for v in versions) == [1, 2, 3]

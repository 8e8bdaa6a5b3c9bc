"""A team's servers (`make serve PROFILE=team`) and two workers on one pool, each in its own checkout.

`qllm.services.serve.start(profile="team")` starts, on 127.0.0.1: PostgreSQL (the system's packages) under
a Prefect server asking for an auth string and an MLflow tracking server with basic auth and
proxied artifacts, a worker in the first checkout and a DVC remote (a directory). A second worker
runs in a clone of the project (its own checkout, DVC cache and PREFECT_HOME: another machine,
sharing only the servers and the DVC remote), serving the pool's `default` queue only, so the
sweep's own run (queue `sweeps`) always lands on the first worker. The sweep deployment
`qllm-sweep/dpo-beta-workers` then spreads two DPO betas over both workers (one slot free on each),
and every stage outside dpo, export, evaluate and register is computed once in all: the second
checkout restores them from the remote.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flows import sweep
from qllm.services import serve
from tests.certificates import self_signed
from tests.conftest import REPO, assert_stopped_by_itself, make_project, run

PREFECT = str(Path(sys.executable).parent / "prefect")
SECOND = "worker-two"
PER_SET = {"dpo", "merge", "export", "evaluate", "register"}
MACHINE = {"base_model", "probe_device"}  # read the machine: they run in every checkout (milliseconds)
TEAM_NAME = "qllm-team.test"
"""A DNS name of the TLS certificate besides localhost: what a client on another machine would use."""


@pytest.fixture(scope="module")
def team(tmp_path_factory, mlflow_template_db):
    base = tmp_path_factory.mktemp("team")
    one = make_project(base / "one", mlflow_template_db)
    shutil.copy(REPO / "prefect.yaml", one / "prefect.yaml")
    run(["git", "add", "prefect.yaml"], one)
    run(["git", "commit", "-qm", "deployments"], one)
    two = base / "two"
    run(["git", "clone", "-q", str(one), str(two)], base)
    cert, key = self_signed(base / "tls", dns=("localhost", TEAM_NAME))
    # the first worker: the sweep's own run and a set; the second (queue `default`): the other set; every client speaks TLS to the fronts
    record = serve.start(one, prefect_port=0, mlflow_port=0, postgres_port=0, profile="team", worker_limit=2, tls=(str(cert), str(key)))
    worker = None
    try:
        client = serve.read_env_file(record["env_file"])
        env = serve.service_env(one, record["prefect_api_url"], client) | {"PREFECT_WORKER_QUERY_SECONDS": "2"}
        assert record["dvc_remote"].startswith("team -> ")  # the profile's remote: a directory a worker on this host reaches
        run([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "team", record["dvc_remote"].split(" ")[2]], two)
        # a service as `make serve` starts them (its own session, SIGINT at its default: qllm.services.serve._spawn)
        worker = serve._spawn(serve.worker_command(limit=1, name=SECOND, queues=["default"]), two, env | {"PREFECT_HOME": str(two / serve.STATE_DIR / "prefect")},
                              base / "worker-two.log")  # fmt: skip
        deployed = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], cwd=one, env=env, capture_output=True, text=True, timeout=180)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield {"one": one, "two": two, "record": record, "env": env, "client": client, "cert": cert}
    finally:
        if worker is not None:
            serve.stop_processes({SECOND: {"pid": worker.pid}})  # SIGTERM, SIGKILL after 15 s
            worker.wait()
        stopped = serve.stop(one)
        assert len(stopped) == 6 and all(not serve._alive(s["pid"]) for s in record["services"].values())
        for log in (record["services"]["prefect-worker"]["log"], base / "worker-two.log"):
            assert_stopped_by_itself(Path(log))
        shutil.rmtree(record["services"]["postgres"]["data"], ignore_errors=True)


TRUST: ssl.SSLContext | None = None
"""The test's self-signed certificate as the one trusted CA (set by the first test that needs it)."""


def _status(url: str, auth: str | None = None, body: bytes | None = None, method: str | None = None, host: str | None = None) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} | ({"Host": host} if host else {}), method=method)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30, context=TRUST) as response:
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


@pytest.fixture(autouse=True)
def _trust(team):
    global TRUST
    TRUST = ssl.create_default_context(cafile=str(team["cert"]))


def test_the_servers_speak_tls_only_and_clients_verify_the_certificate(team):
    """Behind `tls`, every URL a client gets is https, the servers themselves listen on other
    loopback ports, plain HTTP to a front gets no answer, and a client that does not trust the
    certificate is refused by its own TLS check."""
    record, client = team["record"], team["client"]
    services = record["services"]
    assert record["prefect_api_url"].startswith("https://127.0.0.1:") and client["MLFLOW_TRACKING_URI"].startswith("https://127.0.0.1:")
    assert client["PREFECT_API_SSL_CERT_FILE"] == client["MLFLOW_TRACKING_SERVER_CERT_PATH"] == str(team["cert"].resolve())
    mlflow_port = int(client["MLFLOW_TRACKING_URI"].rsplit(":", 1)[1])
    assert _status(f"{client['MLFLOW_TRACKING_URI']}/health") == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"{client['MLFLOW_TRACKING_URI']}/health", timeout=30, context=ssl.create_default_context())
    with socket.create_connection(("127.0.0.1", mlflow_port), timeout=30) as plain:
        plain.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b"HTTP/1.1 200" not in plain.recv(4096)  # the TLS front expected a handshake
    fronts = {services["prefect-tls"]["port"], services["mlflow-tls"]["port"]}
    assert fronts == {mlflow_port, int(record["prefect_api_url"].removesuffix("/api").rsplit(":", 1)[1])}



def test_a_client_may_call_the_servers_by_the_certificates_name(team):
    """A client on another machine calls the fronts by a name of the certificate (its TLS check
    accepts no other), so its requests carry that name as their Host header, port included:
    MLflow's server, which answers 403 to a Host it does not know (DNS-rebinding protection),
    answers them; a name outside the certificate is still refused. Each front started only after
    finding that its server asks for credentials (`qllm.services.tls_front --probe`)."""
    client = team["client"]
    url, port = client["MLFLOW_TRACKING_URI"], client["MLFLOW_TRACKING_URI"].rsplit(":", 1)[1]
    search = f"{url}/api/2.0/mlflow/experiments/search?max_results=1"
    auth = f"{client['MLFLOW_TRACKING_USERNAME']}:{client['MLFLOW_TRACKING_PASSWORD']}"
    assert _status(search, auth=auth, host=f"{TEAM_NAME}:{port}") == 200
    assert _status(search, auth=auth, host=TEAM_NAME) == 200
    assert _status(search, auth=auth, host=f"rebound.example:{port}") == 403
    prefect = client["PREFECT_API_URL"]
    prefect_host = f"{TEAM_NAME}:{prefect.removesuffix('/api').rsplit(':', 1)[1]}"
    assert _status(f"{prefect}/flows/filter", auth=client["PREFECT_API_AUTH_STRING"], body=b"{}", host=prefect_host) == 200
    for name, path in serve.TLS_PROBES.items():
        inner = team["record"]["services"][f"{name}-server"]["port"]
        assert _status(f"http://127.0.0.1:{inner}{path}") == 401, name  # what the front asked before it listened


def test_the_mlflow_server_runs_no_job_consumers(team):
    """MLflow 3 starts a job runner (huey consumers) beside a server on a database; the team's server
    runs without it: the pipeline submits no MLflow jobs, and each consumer is a process importing
    MLflow on the team's host."""
    import psutil

    server = psutil.Process(team["record"]["services"]["mlflow-server"]["pid"])
    commands = [" ".join(child.cmdline()) for child in server.children(recursive=True)]
    assert commands and not [c for c in commands if "huey" in c], commands


def test_the_mlflow_server_checks_a_password_once_and_a_change_takes_effect_at_once(team):
    """MLflow's basic auth hashes the password (scrypt) at every check, three checks a request. The
    team's server keeps a verified password for `serve.MLFLOW_AUTH_CACHE_SECONDS`, so 30 requests
    cost it less CPU than 15 checks made here (without it: 90). A password changed or a user
    deleted through MLflow's API is refused at the very next request all the same."""
    from werkzeug.security import check_password_hash, generate_password_hash

    from benchmarks.serving.mlflow_auth import server_cpu

    services, state = team["record"]["services"], team["one"] / serve.STATE_DIR
    passwords = json.loads((state / serve.SECRETS).read_text())
    assert f"auth_cache_ttl_seconds = {serve.MLFLOW_AUTH_CACHE_SECONDS}" in (state / "mlflow-auth.ini").read_text().splitlines()
    api, admin = f"{services['mlflow-server']['url']}/api/2.0/mlflow", f"{serve.USER}:{passwords['mlflow']}"
    search = f"{api}/experiments/search?max_results=1"

    hashed = generate_password_hash(passwords["mlflow_client"])  # the method MLflow's user store uses
    started = time.process_time()
    for _ in range(3):
        assert check_password_hash(hashed, passwords["mlflow_client"])
    one_check = (time.process_time() - started) / 3
    pid = services["mlflow-server"]["pid"]
    client = f"qllm-client:{passwords['mlflow_client']}"
    before = server_cpu(pid)
    for _ in range(30):
        assert _status(search, auth=client) == 200
    spent = server_cpu(pid) - before
    assert spent < 15 * one_check, f"30 requests took the server {spent:.2f} s of CPU; one password check takes {one_check:.3f} s here"

    old, new = "rotating-password-one-" + "x" * 16, "rotating-password-two-" + "y" * 16
    assert _status(f"{api}/users/create", auth=admin, body=json.dumps({"username": "rotating", "password": old}).encode()) == 200
    assert _status(search, auth=f"rotating:{old}") == 200  # verified, and now kept
    assert _status(f"{api}/users/update-password", auth=admin, body=json.dumps({"username": "rotating", "password": new}).encode(), method="PATCH") == 200
    assert _status(search, auth=f"rotating:{old}") == 401
    assert _status(search, auth=f"rotating:{new}") == 200
    assert _status(f"{api}/users/delete", auth=admin, body=json.dumps({"username": "rotating"}).encode(), method="DELETE") == 200
    assert _status(search, auth=f"rotating:{new}") == 401


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
    assert _status(search, auth=f"{client['MLFLOW_TRACKING_USERNAME']}:{client['MLFLOW_TRACKING_PASSWORD']}") == 200
    ports = [services[name]["port"] for name in ("prefect-tls", "mlflow-tls", "prefect-server", "mlflow-server", "postgres")]
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


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def test_clients_are_not_the_admin_and_each_server_reaches_only_its_own_database(team):
    """The team's clients hold an MLflow user that runs and registers but administers nothing;
    each server connects to PostgreSQL as a role owning only its own databases, and its
    environment holds its own database URL only."""
    import psycopg

    record, client = team["record"], team["client"]
    services, state = record["services"], team["one"] / serve.STATE_DIR
    passwords = json.loads((state / serve.SECRETS).read_text())
    assert client["MLFLOW_TRACKING_USERNAME"] == "qllm-client" and client["MLFLOW_TRACKING_PASSWORD"] == passwords["mlflow_client"]
    team_env = (state / serve.TEAM_ENV).read_text()
    assert all(passwords[name] not in team_env for name in ("mlflow", "postgres", "postgres_mlflow", "postgres_prefect"))

    api, auth = f"{services['mlflow-server']['url']}/api", f"qllm-client:{passwords['mlflow_client']}"
    admin = f"{serve.USER}:{passwords['mlflow']}"

    def call(path: str, body: dict, who: str = auth) -> int:
        return _status(f"{api}/{path}", auth=who, body=json.dumps(body).encode())

    user = {"username": "intruder", "password": "a-long-enough-password"}
    assert call("2.0/mlflow/users/create", user) == 403
    assert call("2.0/mlflow/users/update-admin", {"username": "qllm-client", "is_admin": True}) == 403
    grant = {"username": "qllm-client", "resource_type": "experiment", "resource_id": "0", "permission": "MANAGE"}
    assert call("3.0/mlflow/users/permissions/grant", grant) == 403
    def answer(path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(f"{api}/{path}", data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json", "Authorization": "Basic " + base64.b64encode(auth.encode()).decode()})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30, context=TRUST) as response:
            return json.loads(response.read())

    experiment = answer("2.0/mlflow/experiments/get-by-name?experiment_name=qllm")["experiment"]["experiment_id"]
    made = answer("2.0/mlflow/runs/create", {"experiment_id": experiment})["run"]["info"]  # EDIT: runs and logs
    assert call("2.0/mlflow/experiments/delete", {"experiment_id": experiment}) == 403
    assert call("2.0/mlflow/registered-models/delete", {"name": "qllm"}) == 403
    version = answer("2.0/mlflow/model-versions/create", {"name": "qllm", "source": f"{made['artifact_uri']}/model", "run_id": made["run_id"]})
    assert call("2.0/mlflow/registered-models/alias", {"name": "qllm", "alias": "probe", "version": version["model_version"]["version"]}) == 200
    removal = urllib.request.Request(f"{api}/2.0/mlflow/model-versions/delete", method="DELETE", data=json.dumps({"name": "qllm", "version": version["model_version"]["version"]}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Basic " + base64.b64encode(admin.encode()).decode()})  # fmt: skip
    with urllib.request.urlopen(removal, timeout=30, context=TRUST) as response:  # the admin may; the sweep then counts its own versions
        assert response.status == 200
    assert call("2.0/mlflow/users/create", user | {"password": "another-long-password"}, who=admin) == 200  # the admin still may

    port = services["postgres"]["port"]
    roles = {server: role for server, (role, _) in serve.DATABASE_ROLES.items()}
    with psycopg.connect(host="127.0.0.1", port=port, dbname="mlflow", user=roles["mlflow"], password=passwords["postgres_mlflow"]) as own:
        assert own.execute("SELECT count(*) FROM experiments").fetchone()[0] >= 1
        assert own.execute("SELECT rolsuper OR rolcreaterole OR rolcreatedb FROM pg_roles WHERE rolname = current_user").fetchone() == (False,)
    for server, database in (("mlflow", "prefect"), ("prefect", "mlflow"), ("prefect", "mlflow_auth")):
        with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
            psycopg.connect(host="127.0.0.1", port=port, dbname=database, user=roles[server], password=passwords[f"postgres_{server}"])

    prefect_env, mlflow_env = _environ(services["prefect-server"]["pid"]), _environ(services["mlflow-server"]["pid"])
    assert "/prefect" in prefect_env["PREFECT_API_DATABASE_CONNECTION_URL"] and roles["prefect"] in prefect_env["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert roles["mlflow"] in mlflow_env["MLFLOW_BACKEND_STORE_URI"]
    assert "MLFLOW_BACKEND_STORE_URI" not in prefect_env and "PREFECT_API_DATABASE_CONNECTION_URL" not in mlflow_env
    for environ in (prefect_env, mlflow_env):
        assert not any(passwords["postgres"] in value for value in environ.values())  # the superuser's password: nowhere
    assert passwords["postgres_mlflow"] not in "".join(prefect_env.values()) and passwords["postgres_prefect"] not in "".join(mlflow_env.values())


def test_a_servers_role_takes_over_the_tables_an_older_version_made_as_the_superuser(team):
    """Servers of an older version connected as the superuser, so their tables are its: `own`
    hands them (with their sequences and types) to the server's role, which then uses them."""
    import psycopg

    from qllm.services.postgres import Cluster

    state, services = team["one"] / serve.STATE_DIR, team["record"]["services"]
    passwords = json.loads((state / serve.SECRETS).read_text())
    cluster = Cluster(Path(services["postgres"]["data"]), services["postgres"]["port"], passwords["postgres"])
    cluster.create_database("legacy")
    with cluster._connect("legacy") as superuser:
        superuser.execute("CREATE TYPE mood AS ENUM ('ok', 'bad')")
        superuser.execute("CREATE TABLE runs (id serial PRIMARY KEY, mood mood)")
        superuser.execute("INSERT INTO runs (mood) VALUES ('ok')")
    cluster.own("qllm_legacy", "legacy-password", ("legacy",))
    with psycopg.connect(host="127.0.0.1", port=cluster.port, dbname="legacy", user="qllm_legacy", password="legacy-password", autocommit=True) as role:
        role.execute("INSERT INTO runs (mood) VALUES ('bad')")
        assert role.execute("SELECT id, mood FROM runs ORDER BY id").fetchall() == [(1, "ok"), (2, "bad")]
        role.execute("CREATE TABLE made_by_the_role (x int)")


def test_a_sweep_spreads_over_two_workers_and_computes_shared_stages_once(team, monkeypatch):
    from mlflow import MlflowClient

    one, two, env, client = team["one"], team["two"], team["env"], team["client"]
    betas = {"sweep": [["dpo.beta=0.05"], ["dpo.beta=0.5"]]}
    done = subprocess.run([PREFECT, "deployment", "run", "qllm-sweep/dpo-beta-workers", "--params", json.dumps(betas), "--watch", "--watch-timeout", "900"],
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
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_SSL_CERT_FILE, PREFECT_API_URL, temporary_settings

    async def flow_runs():
        async with get_client() as prefect:
            return await prefect.read_flow_runs()

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: client["PREFECT_API_AUTH_STRING"],
                             PREFECT_API_SSL_CERT_FILE: client["PREFECT_API_SSL_CERT_FILE"]}):  # fmt: skip
        every = asyncio.run(flow_runs())
    runs = [r for r in every if r.parameters.get("overrides") and r.parent_task_run_id]
    assert sorted(tuple(r.parameters["overrides"]) for r in runs) == [("dpo.beta=0.05",), ("dpo.beta=0.5",)]
    assert all(r.state.is_completed() for r in runs)
    workers = {r.labels.get("prefect.worker.name") for r in runs}
    assert SECOND in workers and len(workers) == 2, f"the sets ran on {workers}: not spread over both workers"
    (parent,) = [r for r in every if r.parameters.get("sweep")]
    assert parent.work_queue_name == "sweeps" and parent.labels.get("prefect.worker.name") not in (None, SECOND), parent.labels

    per_set = {stage: ran.get(stage, 0) for stage in PER_SET}
    assert per_set == dict.fromkeys(PER_SET, 2), ran
    shared = {stage: count for stage, count in ran.items() if stage not in PER_SET | MACHINE}
    assert shared and all(count == 1 for count in shared.values()), f"shared stages computed more than once: {ran}"
    assert {"pretrain", "sft", "lora"} <= set(shared)
    assert len(versions) == 2  # one per set (the least-privilege test's probe version was deleted)

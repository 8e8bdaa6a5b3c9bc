"""Local services for deployments: a Prefect server, a `process` work pool and worker, the MLflow UI.

    python -m flows.serve start     # what `make serve` runs; prints the URLs
    python -m flows.serve stop      # what `make stop` runs; stops exactly what `start` started
    python -m flows.serve status

Everything listens on 127.0.0.1. `start` records each process's PID, port and log file in
`.qllm/serve/services.json`; `stop` signals those PIDs only (their process groups: the worker's
flow-run subprocesses go too) and removes the record. Prefect's state lives in
`.qllm/serve/prefect` (PREFECT_HOME), so a served project does not touch the user's profile.

Then, from this directory:

    export PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect --no-prompt deploy --all
    prefect deployment run 'qllm-pipeline/default' --watch
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from flows.local_api import free_port, wait_http
from pipelines.core.errors import QllmError

STATE_DIR = ".qllm/serve"
RECORD = "services.json"
POOL = "qllm"
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000}


def _free(port: int) -> bool:
    with socket.socket() as probe:
        # as the servers bind (SO_REUSEADDR): a port a stopped server left in TIME_WAIT is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port(preferred: int, taken: tuple[int, ...] = ()) -> int:
    """`preferred` if it is free, else (or for 0) any free port not in `taken` (two back-to-back
    requests for a free port may be handed the same one: the first is not bound yet)."""
    if preferred and preferred not in taken and _free(preferred):
        return preferred
    port = free_port()
    while port in taken:  # the OS hands out another on the next request
        port = free_port()
    return port


def service_env(root: Path, prefect_url: str | None = None) -> dict[str, str]:
    """The environment the served processes (and `prefect deploy`/`deployment run`) use."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(root / STATE_DIR / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "DVC_NO_ANALYTICS": "1",
        "HF_HUB_OFFLINE": "1",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "qllm",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    if prefect_url:
        env["PREFECT_API_URL"] = prefect_url
    return env


def _spawn(command: list[str], root: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:  # the child keeps its own handle
        return subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start(root: Path, prefect_port: int = DEFAULT_PORTS["prefect"], mlflow_port: int = DEFAULT_PORTS["mlflow"], timeout: float | None = None) -> dict:
    """Start the services (refuses if a recorded set is still running); returns the record."""
    root = root.resolve()
    state = root / STATE_DIR
    if (state / RECORD).exists():
        running = {name: s["pid"] for name, s in read_record(root)["services"].items() if _alive(s["pid"])}
        if running:
            raise QllmError(f"services already running ({', '.join(f'{n} pid {p}' for n, p in running.items())}); run `make stop` first")
    prefect_port = _port(prefect_port)
    mlflow_port = _port(mlflow_port, taken=(prefect_port,))
    prefect_url = f"http://127.0.0.1:{prefect_port}/api"
    env = service_env(root, prefect_url)
    bin_dir = Path(sys.executable).parent
    services: dict[str, dict] = {}
    try:
        # The two servers boot side by side (each takes seconds); the worker needs the Prefect one first.
        log = state / "prefect-server.log"
        server = _spawn([str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)], root, env, log)
        services["prefect-server"] = {"pid": server.pid, "url": f"http://127.0.0.1:{prefect_port}", "log": str(log)}
        ui_log = state / "mlflow-ui.log"
        uri = f"sqlite:///{root / 'mlflow.db'}"
        ui = _spawn([str(bin_dir / "mlflow"), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(mlflow_port)], root, env, ui_log)
        services["mlflow-ui"] = {"pid": ui.pid, "url": f"http://127.0.0.1:{mlflow_port}", "log": str(ui_log)}
        wait_http(f"{prefect_url}/health", server, "the Prefect server", timeout, hint=f"; see {log}")
        created = subprocess.run([str(bin_dir / "prefect"), "work-pool", "create", POOL, "--type", "process", "--overwrite"],
                                 cwd=root, env=env, capture_output=True, text=True)  # fmt: skip
        if created.returncode != 0:
            raise QllmError(f"could not create work pool {POOL!r}: {created.stdout}{created.stderr}")
        log = state / "prefect-worker.log"
        worker = _spawn([str(bin_dir / "prefect"), "worker", "start", "--pool", POOL, "--type", "process"], root, env, log)
        services["prefect-worker"] = {"pid": worker.pid, "pool": POOL, "log": str(log)}
        wait_http(f"http://127.0.0.1:{mlflow_port}/health", ui, "the MLflow UI", timeout, hint=f"; see {ui_log}")
    except BaseException:
        _stop_all(services)  # nothing is left running, so no record: `make stop` must not kill reused PIDs
        raise
    state.mkdir(parents=True, exist_ok=True)
    (state / RECORD).write_text(json.dumps({"prefect_api_url": prefect_url, "services": services}, indent=2) + "\n")
    return read_record(root)


def read_record(root: Path) -> dict:
    path = root / STATE_DIR / RECORD
    if not path.exists():
        return {"services": {}}
    return json.loads(path.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (our own exited child not yet reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def _stop_all(services: dict[str, dict], timeout: float = 15.0) -> list[str]:
    stopped = []
    for name, service in reversed(list(services.items())):  # worker before server
        pid = service["pid"]
        if not _alive(pid):
            continue
        try:
            os.killpg(pid, signal.SIGTERM)  # started with a new session: its group is its pid
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0  # gone before this returns, even on a busy machine
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        stopped.append(f"{name} (pid {pid})")
    return stopped


def stop(root: Path) -> list[str]:
    """Stop the recorded services (only those PIDs) and forget them; returns what was stopped."""
    root = root.resolve()
    stopped = _stop_all(read_record(root)["services"])
    (root / STATE_DIR / RECORD).unlink(missing_ok=True)
    return stopped


def runs_link(root: Path, ui_url: str) -> str:
    """The served UI's link to the project experiment's runs (the experiment is made if new, so the
    link works before the first run)."""
    from pipelines.core.run import tracking

    root = root.resolve()
    return tracking.ui_runs_url(ui_url, tracking.experiment_id(root, uri=f"sqlite:///{root / 'mlflow.db'}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--project-dir", default=".", type=Path)
    parser.add_argument("--prefect-port", type=int, default=DEFAULT_PORTS["prefect"])
    parser.add_argument("--mlflow-port", type=int, default=DEFAULT_PORTS["mlflow"])
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            record = start(args.project_dir, args.prefect_port, args.mlflow_port)
            services = record["services"]
            print(f"Prefect UI/API  {services['prefect-server']['url']}   (export PREFECT_API_URL={record['prefect_api_url']})")
            print(f"Prefect worker  pool {POOL!r} (process), pid {services['prefect-worker']['pid']}")
            print(f"MLflow UI       {services['mlflow-ui']['url']}   (the runs: {runs_link(args.project_dir, services['mlflow-ui']['url'])})")
            print(f"logs and PIDs   {args.project_dir / STATE_DIR}; stop with `make stop`")
        elif args.action == "stop":
            stopped = stop(args.project_dir)
            print("stopped " + ", ".join(stopped) if stopped else "nothing was running")
        else:
            for name, service in read_record(args.project_dir.resolve())["services"].items():
                print(f"{name:<15} pid {service['pid']:<8} {'running' if _alive(service['pid']) else 'stopped'}  {service.get('url', '')}")
    except QllmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

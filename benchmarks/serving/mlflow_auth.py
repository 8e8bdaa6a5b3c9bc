"""What an authenticated request costs the team's MLflow server, with MLflow's credential cache off
(its default) and on (`qllm.services.serve.MLFLOW_AUTH_CACHE_SECONDS`).

    python -m benchmarks.serving.mlflow_auth [--requests 40] [--trials 2]

Each trial and arm starts the team profile's servers from nothing in a fresh tiny project
(`qllm.services.serve.start(profile="team")` on 127.0.0.1: PostgreSQL, the MLflow server with basic auth,
the Prefect server and a worker), with `auth_cache_ttl_seconds` 0 (off) or the project's value.
It then makes one request to warm up and `--requests` `experiments/get-by-name` calls as the team's
client (`qllm-client`), and reads the seconds they took and the MLflow server's CPU time (its
process and children, from /proc). The arms alternate, the first one alternating between trials.
Prints each trial, then the medians and on/off.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu
from qllm.services import serve


def server_cpu(pid: int) -> float:
    """User + system seconds of `pid` and its children."""
    import psutil

    server = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in (server, *server.children(recursive=True)))


def one_arm(work: Path, cache_seconds: int, requests: int) -> tuple[float, float]:
    """(seconds a request, server CPU seconds a request) with the cache set to `cache_seconds`."""
    from mlflow import MlflowClient

    from tests.conftest import make_project, migrated_mlflow_db

    (work / "store").mkdir(parents=True)
    project = make_project(work / "project", migrated_mlflow_db(work / "store" / "mlflow.db"))
    saved, serve.MLFLOW_AUTH_CACHE_SECONDS = serve.MLFLOW_AUTH_CACHE_SECONDS, cache_seconds
    record = None
    try:
        record = serve.start(project, prefect_port=0, mlflow_port=0, postgres_port=0, profile="team")
        client_env = serve.read_env_file(record["env_file"])
        credentials = {key: value for key, value in client_env.items() if key.startswith("MLFLOW_TRACKING_")}
        old = {key: os.environ.get(key) for key in credentials}
        os.environ.update(credentials)
        try:
            client = MlflowClient(tracking_uri=client_env["MLFLOW_TRACKING_URI"])
            client.get_experiment_by_name("qllm")  # a first request: connections made, the password seen once
            pid = record["services"]["mlflow-server"]["pid"]
            cpu, started = server_cpu(pid), time.perf_counter()
            for _ in range(requests):
                client.get_experiment_by_name("qllm")
            return (time.perf_counter() - started) / requests, (server_cpu(pid) - cpu) / requests
        finally:
            for key, value in old.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    finally:
        serve.MLFLOW_AUTH_CACHE_SECONDS = saved
        if record is not None:
            serve.stop(project)
            shutil.rmtree(record["services"]["postgres"]["data"], ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.mlflow_auth", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("requests", "trials"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    arms = {"off": 0, "on": serve.MLFLOW_AUTH_CACHE_SECONDS}
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    print(f"{cpu()}; {args.requests} requests an arm, {args.trials} trials")
    with tempfile.TemporaryDirectory(prefix="qllm-auth-bench-") as tmp:
        for trial in range(args.trials):
            order = list(arms) if trial % 2 == 0 else list(arms)[::-1]
            for name in order:
                wall, server = one_arm(Path(tmp) / f"{trial}-{name}", arms[name], args.requests)
                seen[name].append((wall, server))
                print(f"trial {trial + 1}, cache {name} ({arms[name]} s): {wall * 1000:.0f} ms a request, server CPU {server * 1000:.0f} ms a request", flush=True)
    medians = {name: (statistics.median(w for w, _ in runs), statistics.median(s for _, s in runs)) for name, runs in seen.items()}
    for name, (wall, server) in medians.items():
        print(f"median, cache {name}: {wall * 1000:.0f} ms a request, server CPU {server * 1000:.0f} ms")
    print(f"on/off: {medians['on'][0] / medians['off'][0]:.3f}x the time, {medians['on'][1] / medians['off'][1]:.3f}x the server CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

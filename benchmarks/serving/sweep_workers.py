"""A 3-value DPO sweep on one worker against two: wall time, and how many times each stage ran.

    python -m benchmarks.serving.sweep_workers [--params params/tiny.yaml] [--trials 2]

Each trial and arm starts from nothing: a fresh clone of this repository (the committed code),
the team profile's servers started in it (`qllm.services.serve.start(profile="team")`: PostgreSQL, the
MLflow server with auth, the Prefect server, a DVC remote directory) and its worker; the
two-worker arm adds a worker in a second clone (its own DVC cache and Prefect home, the same
servers and remote). Every worker takes two flow runs at once (`--limit 2`). The timed command is
`prefect deployment run 'qllm-sweep/dpo-beta-workers' --watch` (betas 0.05, 0.2, 0.5), from the
sweep's start to its last set's registration; the stage counts come from the MLflow server's
pipeline runs (`flows.sweep.stage_run_counts`). The arms alternate within a trial, which one
goes first alternating between trials. Prints each run, then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO
from flows import sweep
from qllm.services import serve

PREFECT = str(Path(sys.executable).parent / "prefect")


def sh(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True, text=True)


def clone(dest: Path) -> Path:
    sh(["git", "clone", "-q", str(REPO), str(dest)], REPO)
    sh([sys.executable, "-m", "dvc", "config", "--local", "core.analytics", "false"], dest)
    return dest


def arm(base: Path, workers: int, params: list[str]) -> dict:
    one = clone(base / "one")
    record = serve.start(one, prefect_port=0, mlflow_port=0, postgres_port=0, profile="team", worker_limit=2)
    extra = None
    try:
        client = serve.read_env_file(record["env_file"])
        env = serve.service_env(one, record["prefect_api_url"], client) | {"PREFECT_WORKER_QUERY_SECONDS": "2"}
        if workers == 2:
            two = clone(base / "two")
            sh([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "team", record["dvc_remote"].split(" ")[2]], two)
            with open(base / "worker-two.log", "wb") as log:
                extra = subprocess.Popen(serve.worker_command(limit=2, name="worker-two"), cwd=two, stdout=log, stderr=subprocess.STDOUT,
                                         env=env | {"PREFECT_HOME": str(two / serve.STATE_DIR / "prefect")}, start_new_session=True)  # fmt: skip
        sh([PREFECT, "--no-prompt", "deploy", "--all"], one, env)
        started = time.perf_counter()
        done = subprocess.run([PREFECT, "deployment", "run", "qllm-sweep/dpo-beta-workers", "--param", f"params_files={json.dumps(params)}",
                               "--watch", "--watch-timeout", "3600"], cwd=one, env=env, capture_output=True, text=True)  # fmt: skip
        seconds = time.perf_counter() - started
        if done.returncode:
            raise SystemExit(f"the sweep failed ({workers} worker(s)):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        os.environ.update({k: v for k, v in client.items() if k.startswith("MLFLOW_TRACKING_")})
        return {"workers": workers, "seconds": round(seconds, 1), "ran": dict(sorted(sweep.stage_run_counts(one).items()))}
    finally:
        if extra is not None:
            serve.stop_processes({"worker-two": {"pid": extra.pid}})
            extra.wait()
        serve.stop(one)
        shutil.rmtree(record["services"]["postgres"]["data"], ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", action="append", default=None, help="params files for every run (default: none, the shipped profile)")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--two-first", action="store_true", help="the two-worker arm first in even trials (then alternating)")
    args = parser.parse_args(argv)
    results: dict[int, list[dict]] = {1: [], 2: []}
    for trial in range(args.trials):
        for workers in (1, 2) if (trial + args.two_first) % 2 == 0 else (2, 1):
            with tempfile.TemporaryDirectory(prefix="qllm-sweep-bench-") as base:
                result = arm(Path(base), workers, args.params or [])
            results[workers].append(result)
            print(json.dumps({"trial": trial, **result}), flush=True)
    one, two = (statistics.median(r["seconds"] for r in results[w]) for w in (1, 2))
    print(f"median wall time: one worker {one:.1f} s, two workers {two:.1f} s, ratio {two / one:.3f} "
          f"(range {min(r['seconds'] for r in results[2]) / max(r['seconds'] for r in results[1]):.3f}-"
          f"{max(r['seconds'] for r in results[2]) / min(r['seconds'] for r in results[1]):.3f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

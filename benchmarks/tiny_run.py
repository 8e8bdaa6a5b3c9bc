"""A tiny `qllm run` from a fresh project, in two checkouts taken in turn: its wall time and its
pipeline's (the MLflow parent run's), and after/before.

    python -m benchmarks.tiny_run BEFORE AFTER [--trials 3]       # BEFORE, AFTER: checkouts, each with its .venv

Each checkout runs its own code with its own `.venv` (`make install` there; a `git worktree` of the
earlier commit is the usual BEFORE). Every trial makes a new project the way the test suite does
(tests/conftest.py `make_project`: params.yaml merged with params/tiny.yaml, git, DVC, an empty
MLflow store), by that checkout's code, then times `qllm run` in it; the checkouts alternate, so
that a machine slowing down weighs on both. One untimed run of each comes first: it writes the
bytecode of a fresh `.venv` (uv compiles none; with PYTHONDONTWRITEBYTECODE set nothing would, and
every run would compile its imports again: 20 s a run on an AVX2-only EPYC, all on one side).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.real_model import cpu

# Run by each checkout's own Python and code, so it uses only what older checkouts' tests/conftest.py has too
MAKE_PROJECT = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from mlflow import MlflowClient
from tests.conftest import make_project
dest = Path(sys.argv[2])
store = dest.parent / (dest.name + "-mlflow")
store.mkdir()
MlflowClient(f"sqlite:///{store / 'mlflow.db'}").search_experiments()  # an empty store, its tables made
make_project(dest, store / "mlflow.db")
"""
PIPELINE_SECONDS = re.compile(r"^mlflow run [0-9a-f]+ +\((\d+(?:\.\d+)?)s\)$", re.MULTILINE)


def pipeline_seconds(output: str) -> float:
    """The pipeline's seconds from `qllm run`'s last line (`mlflow run <id>  (21.7s)`)."""
    found = PIPELINE_SECONDS.findall(output)
    if not found:
        raise SystemExit(f"tiny_run: `qllm run` printed no `mlflow run <id> (<seconds>s)` line:\n{output[-2000:]}")
    return float(found[-1])


def venv(checkout: Path) -> Path:
    bin_dir = checkout / ".venv" / "bin"
    if not (bin_dir / "qllm").exists():
        raise SystemExit(f"tiny_run: {checkout} has no .venv with qllm (run `make install` there)")
    return bin_dir


def one_run(checkout: Path, work: Path, env: dict[str, str]) -> tuple[float, float]:
    bin_dir = venv(checkout)
    made = subprocess.run([str(bin_dir / "python"), "-c", MAKE_PROJECT, str(checkout), str(work)], capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"tiny_run: making the project with {checkout} failed:\n{made.stderr[-2000:]}")
    started = time.perf_counter()
    done = subprocess.run([str(bin_dir / "qllm"), "run"], cwd=work, env=env | {"PATH": f"{bin_dir}:{env.get('PATH', '')}"}, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"tiny_run: `qllm run` with {checkout} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return wall, pipeline_seconds(done.stdout + done.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="a checkout with its .venv: the baseline")
    parser.add_argument("after", type=Path, help="a checkout with its .venv")
    parser.add_argument("--trials", type=int, default=3, help="runs of each checkout (default 3)")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    for checkout in checkouts.values():
        venv(checkout)
    env = dict(os.environ) | {"DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                              "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    for variable in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PYTHONDONTWRITEBYTECODE"):
        env.pop(variable, None)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="tiny-run-") as tmp:
        for name, checkout in checkouts.items():  # untimed: bytecode written, caches warm
            one_run(checkout, Path(tmp) / f"{name}-warm-up", env)
        for trial in range(args.trials):
            for name, checkout in checkouts.items():
                wall, pipeline = one_run(checkout, Path(tmp) / f"{name}-{trial}", env)
                times[name].append((wall, pipeline))
                print(f"{name} {trial + 1}: qllm run {wall:.1f} s, its pipeline {pipeline:.1f} s", flush=True)
    print(f"\n{cpu()}; {args.trials} runs each, alternating\n")
    print("| | `qllm run`, wall (median) | its pipeline (median) |\n|---|---|---|")
    medians = {}
    for name, runs in times.items():
        medians[name] = (statistics.median(w for w, _ in runs), statistics.median(p for _, p in runs))
        walls, pipes = ", ".join(f"{w:.1f}" for w, _ in runs), ", ".join(f"{p:.1f}" for _, p in runs)
        print(f"| {name} | {walls} s ({medians[name][0]:.1f}) | {pipes} s ({medians[name][1]:.1f}) |")
    ratio_wall, ratio_pipe = (medians["after"][i] / medians["before"][i] for i in (0, 1))
    print(f"| after/before | **{ratio_wall:.2f}x** | **{ratio_pipe:.2f}x** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

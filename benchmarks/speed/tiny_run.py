"""A tiny `qllm run` from a fresh project, in two checkouts taken in turn: its wall time and its
pipeline's (the MLflow parent run's), and after/before.

    python -m benchmarks.speed.tiny_run BEFORE AFTER [--trials 3]       # BEFORE, AFTER: checkouts, each with its .venv
    python -m benchmarks.speed.tiny_run BEFORE AFTER --then "--set dpo.beta=0.2"   # and a second run in the project

Each checkout runs its own code with its own `.venv` (`make install` there; a `git worktree` of the
earlier commit is the usual BEFORE). Every trial makes a new project the way the test suite does
(tests/conftest.py `make_project`: params.yaml merged with params/tiny.yaml, git, DVC, an empty
MLflow store), by that checkout's code, then times `qllm run` in it; the checkouts alternate, so
that a machine slowing down weighs on both. One untimed run of each comes first: it writes the
bytecode of a fresh `.venv` (uv compiles none; with PYTHONDONTWRITEBYTECODE set nothing would, and
every run would compile its imports again: 20 s a run on an AVX2-only EPYC, all on one side).

`--then ARGS` times a second `qllm run ARGS` in each trial's project after the first: with an
override (`--set dpo.beta=0.2`), a run workspace whose stages upstream of the change are restored
from DVC's run-cache, which is mostly DVC's bookkeeping (collection, hashing, restore, dvc.lock).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu

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


def timed_run(bin_dir: Path, work: Path, env: dict[str, str], args: list[str], checkout: Path) -> tuple[float, float]:
    """`qllm run ARGS` in `work`: (its wall time, its pipeline's seconds)."""
    started = time.perf_counter()
    done = subprocess.run([str(bin_dir / "qllm"), "run", *args], cwd=work, env=env | {"PATH": f"{bin_dir}:{env.get('PATH', '')}"}, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"tiny_run: `{shlex.join(['qllm', 'run', *args])}` with {checkout} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return wall, pipeline_seconds(done.stdout + done.stderr)


def one_run(checkout: Path, work: Path, env: dict[str, str], then: list[str] | None = None) -> list[tuple[float, float]]:
    """A fresh project made by `checkout`'s code, `qllm run` in it, then `qllm run THEN` if given:
    (wall, pipeline seconds) of each."""
    bin_dir = venv(checkout)
    made = subprocess.run([str(bin_dir / "python"), "-c", MAKE_PROJECT, str(checkout), str(work)], capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"tiny_run: making the project with {checkout} failed:\n{made.stderr[-2000:]}")
    runs = [timed_run(bin_dir, work, env, [], checkout)]
    if then is not None:
        runs.append(timed_run(bin_dir, work, env, then, checkout))
    return runs


def table(times: dict[str, list[list[tuple[float, float]]]], then: list[str] | None) -> str:
    """The markdown table: per checkout, each run's wall and pipeline seconds with their medians,
    and after/before of the medians; with `then`, the second run's columns too."""
    runs = [("`qllm run`", 0)] + ([(f"`qllm run {shlex.join(then)}`", 1)] if then is not None else [])
    header = "| | " + " | ".join(f"{what}, wall (median) | its pipeline (median)" for what, _ in runs) + " |"
    lines = [header, "|---" * (1 + 2 * len(runs)) + "|"]
    medians = {}
    for name, trials in times.items():
        cells = []
        for _, i in runs:
            for j in (0, 1):
                values = [trial[i][j] for trial in trials]
                medians[name, i, j] = statistics.median(values)
                cells.append(f"{', '.join(f'{v:.1f}' for v in values)} s ({medians[name, i, j]:.1f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ratios = [f"**{medians['after', i, j] / medians['before', i, j]:.2f}x**" for _, i in runs for j in (0, 1)]
    lines.append("| after/before | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="a checkout with its .venv: the baseline")
    parser.add_argument("after", type=Path, help="a checkout with its .venv")
    parser.add_argument("--trials", type=int, default=3, help="runs of each checkout (default 3)")
    parser.add_argument("--then", metavar="ARGS", help="also time `qllm run ARGS` in the project after the first run (e.g. '--set dpo.beta=0.2')")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    then = shlex.split(args.then) if args.then is not None else None
    if then is not None and not then:
        parser.error("--then needs the arguments of the second `qllm run` (e.g. '--set dpo.beta=0.2')")
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    for checkout in checkouts.values():
        venv(checkout)
    env = dict(os.environ) | {"DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                              "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    for variable in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PYTHONDONTWRITEBYTECODE"):
        env.pop(variable, None)
    times: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="tiny-run-") as tmp:
        for name, checkout in checkouts.items():  # untimed: bytecode written, caches warm
            one_run(checkout, Path(tmp) / f"{name}-warm-up", env, then)
        for trial in range(args.trials):
            for name, checkout in checkouts.items():
                runs = one_run(checkout, Path(tmp) / f"{name}-{trial}", env, then)
                times[name].append(runs)
                commands = [["qllm", "run"], ["qllm", "run", *(then or [])]]
                seen = "; ".join(f"{shlex.join(command)} {wall:.1f} s, its pipeline {pipeline:.1f} s" for command, (wall, pipeline) in zip(commands, runs, strict=False))
                print(f"{name} {trial + 1}: {seen}", flush=True)
    print(f"\n{cpu()}; {args.trials} runs each, alternating\n")
    print(table(times, then))
    return 0


if __name__ == "__main__":
    sys.exit(main())

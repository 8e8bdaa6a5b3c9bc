"""Same inputs, same bytes: two clones of the project, run apart, agree on every DVC output.

Two copies of the tiny-profile project at different absolute paths, each run by `qllm run` in its
own process under a different PYTHONHASHSEED (so set iteration order differs between them), must
record the same md5 for every stage output in dvc.lock. Otherwise DVC sees changed inputs
downstream, and a run-cache shared through a remote is never reused on another machine. The
metrics files (`cache: false`) hold wall times and MLflow run ids and are exempt.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import yaml

from pipelines.core import dag
from tests.conftest import make_project


def qllm_run(project: Path, hash_seed: str) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PREFECT_API_URL": PREFECT_API_URL.value()}
    return subprocess.run([sys.executable, "-m", "flows.cli", "run"], cwd=project, capture_output=True, text=True, env=env)


def stage_outs(project: Path) -> dict[str, str]:
    """`{output path: md5}` from dvc.lock for every stage output except the metrics files."""
    specs = dag.stages(project)
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert set(lock) == set(specs), "every stage ran and is locked"
    return {out["path"]: out["md5"] for name, body in lock.items() for out in body["outs"] if out["path"] not in specs[name].metrics}


def differing_files(a: Path, b: Path) -> list[str]:
    """Files under output `a` whose bytes differ from (or are missing in) the same output `b`."""
    if a.is_file():
        return [] if filecmp.cmp(a, b, shallow=False) else [a.name]
    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} | {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    return sorted(str(n) for n in names if not ((a / n).is_file() and (b / n).is_file() and filecmp.cmp(a / n, b / n, shallow=False)))


def test_two_clones_write_identical_outputs(tmp_path, mlflow_template_db, prefect_server):
    projects = [make_project(tmp_path / "one", mlflow_template_db), make_project(tmp_path / "elsewhere" / "clone-two", mlflow_template_db)]
    for project, hash_seed in zip(projects, ("1", "2"), strict=True):
        result = qllm_run(project, hash_seed)
        assert result.returncode == 0, result.stdout + result.stderr
    first, second = (stage_outs(p) for p in projects)
    assert {"data/quantum_opt", "data/models/lora", "data/models/dpo", "data/evaluate", "data/register"} <= set(first)
    differing = {path: differing_files(projects[0] / path, projects[1] / path) for path in first if first[path] != second.get(path)}
    assert not differing, f"outputs whose bytes depend on the directory or the process: {differing}"

"""What every stage shares: its params section, its MLflow run, its input datasets, its metrics file.

A stage module is `run(...)` over paths and typed params plus a `main()` that calls
`stage.main(NAME, body)`, where `body(ctx) -> metrics` does the work. The same `main` runs under
`dvc repro` (`python -m pipelines.<name>`) and in-process under the Prefect flow.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines import config, dag, tracking, workspace
from pipelines.errors import QllmError
from pipelines.outputs import write_json

METRICS_DIR = "data/metrics"


@dataclass
class StageContext:
    """What a stage body gets: where it runs, its typed params, its tracker and logger."""

    name: str
    root: Path
    params: Any
    tracker: tracking.Tracker
    fingerprint: str = ""
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("qllm"))

    def path(self, relative: str) -> Path:
        return self.root / relative

    @property
    def spec(self) -> dag.Stage:
        return dag.stages(self.root)[self.name]

    @property
    def checkpoint_dir(self) -> Path:
        """Resumable checkpoints of this exact stage configuration (outside the stage outputs)."""
        return workspace.checkpoint_dir(self.root, self.name, self.fingerprint)


def dependency_digests(root: Path, spec: dag.Stage) -> dict[str, str]:
    """DVC md5 of every dependency that exists (code and data), keyed by its dvc.yaml path."""
    return {dep: dag.dvc_md5(root / dep) for dep in spec.deps if (root / dep).exists()}


def execute(name: str, body: Callable[[StageContext], dict[str, Any]], root: Path | str = ".", parent_run_id: str | None = None) -> dict[str, Any]:
    """Run one stage: validate params, open its MLflow run, call `body`, write its metrics JSON.

    The fingerprint (params section + DVC md5 of every dependency) names the checkpoint directory,
    so a rerun of the same stage resumes and a changed stage starts afresh.
    """
    root = Path(root).resolve()
    params = config.load_section(name, root)
    log = logging.getLogger(f"qllm.{name}")
    started = time.perf_counter()
    spec = dag.stages(root)[name]
    digests = dependency_digests(root, spec)
    fingerprint = config.digest({"stage": name, "params": config.to_plain(params), "deps": digests})
    with tracking.run(name, root, tags={"qllm.stage": name, "qllm.fingerprint": fingerprint}, parent_run_id=parent_run_id) as tracker:
        tracker.log_params({name: params})
        for dep, md5 in digests.items():
            if not dep.endswith(".py"):
                tracker.log_dataset(dep, context="input", digest=md5, name=dep)
        tracker.set_tags({f"qllm.dep.{dep}": md5 for dep, md5 in digests.items()})
        ctx = StageContext(name=name, root=root, params=params, tracker=tracker, fingerprint=fingerprint, log=log)
        metrics = body(ctx) or {}
        metrics = {**metrics, "seconds": round(time.perf_counter() - started, 3)}
        tracker.log_metrics({k: v for k, v in config.flatten(metrics).items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        metrics_file = f"{METRICS_DIR}/{name}.json"
        if metrics_file in ctx.spec.metrics:
            write_json(root / metrics_file, {**metrics, "mlflow_run_id": tracker.run_id})
            tracker.log_artifact(root / metrics_file)
    return metrics


def main(name: str, body: Callable[[StageContext], dict[str, Any]], argv: list[str] | None = None) -> int:
    """Command-line entry of a stage (`python -m pipelines.<name> [--root DIR]`)."""
    parser = argparse.ArgumentParser(prog=f"python -m pipelines.{name}", description=f"Run the {name} stage.")
    parser.add_argument("--root", default=".", help="project (or run workspace) directory; default: cwd")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        execute(name, body, args.root)
    except QllmError as exc:
        print(f"error: {name}: {exc}", file=sys.stderr)
        return 1
    return 0

"""What the stages that read the world share: `probe_device` (what this machine computes with) and
`base_model` (which model fine-tuning starts from).

DVC's idiom for state outside the repository is a stage with `always_changed: true` whose output
the stages that depend on it list as a dependency: it runs on every `dvc repro` and `qllm run`,
and while its output keeps its bytes nothing downstream is stale. Such a stage runs on every
no-change run, so it must cost milliseconds, not a training stage's machinery: this contract
imports no pydantic, MLflow or DVC of its own (`python -m pipelines.probe_device` under `dvc repro`
is a process start of about 60 ms), opens no MLflow run (what it finds is in the params and
metrics of every stage that uses it), and writes a metrics file with nothing that varies between
runs (no timings, no memory peaks), so `dvc.lock` keeps its bytes too.

    def body(ctx: world.Context) -> dict:      # the metrics; ctx.output() as in a stage
        ...
    world.main(NAME, body)                     # python -m pipelines.<name>; repro runs world.execute in-process

`dvc.yaml` marks these stages (`always_changed`); `repro` runs them with `execute`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.core import dag
from pipelines.core.errors import QllmError, stage_command
from pipelines.core.outputs import write_json

PARAMS_FILE = "params.yaml"


@dataclass(frozen=True)
class Context:
    """What a world-reading stage gets: its name, the project (or run workspace) directory, its
    params section as written (a mapping; the stage validates what it uses), and its logger."""

    name: str
    root: Path
    section: dict[str, Any]
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("qllm"))

    def output(self) -> Path:
        """The stage's one output in dvc.yaml (`outs`)."""
        (out,) = dag.stages(self.root)[self.name].outs
        return self.root / out


def section(root: Path, name: str) -> dict[str, Any]:
    """The `name` section of `<root>/params.yaml` as written (libyaml where built in)."""
    path = root / PARAMS_FILE
    try:
        data = dag.load_yaml(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise QllmError(f"{path}: cannot read the params ({exc})") from None
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


def execute(name: str, body: Callable[[Context], dict[str, Any]], root: Path | str = ".") -> dict[str, Any]:
    """Run the world-reading stage `name` in this process: `body`, then its metrics file."""
    root = Path(root).resolve()
    ctx = Context(name=name, root=root, section=section(root, name), log=logging.getLogger(f"qllm.{name}"))
    metrics = body(ctx) or {}
    metrics_file = dag.metrics_file(name)
    if metrics_file in dag.stages(root)[name].metrics:
        write_json(root / metrics_file, {**metrics, "mlflow_run_id": None})
    return metrics


def main(name: str, body: Callable[[Context], dict[str, Any]], argv: list[str] | None = None) -> int:
    """Command-line entry (`python -m pipelines.<name> [--root DIR]`, what dvc.yaml runs)."""
    return stage_command(name, lambda root: execute(name, body, root), argv)

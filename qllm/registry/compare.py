"""Compare MLflow runs side by side: the terminal twin of the MLflow UI's Compare view.

    qllm compare --last 2                       # the last two pipeline runs
    qllm compare 15d4cb98 da7230af --all        # runs by id (or unique prefix), every key
    qllm compare --last 3 --json

A pipeline run (tag `qllm.kind=pipeline`) is compared as the whole run: its effective params
(`params.yaml` artifact, flattened to `<stage>.<key>` like the stage runs log them), its own params
(overrides, params files, until) and metrics, and the metrics of every stage's run, named
`<stage>/<metric>`. For a stage restored from DVC's cache that is the earlier run that produced
its outputs (`lineage.stage_runs` over the run's `dvc.lock` artifact). A stage run is compared
with its own params and `<stage>/<metric>` metrics. By default only keys whose values differ are
shown.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pipelines.core import dag
from pipelines.core.errors import QllmError
from pipelines.core.outputs import flatten
from pipelines.core.run import tracking
from qllm.registry import lineage

RUN_ID = re.compile(r"^[0-9a-f]{32}$")
MIN_PREFIX = 6


def load_runs(root: Path | str = ".", run_ids: Sequence[str] = (), last: int | None = None) -> list[dict[str, Any]]:
    """The runs to compare, each as `{"run_id", "name", "kind", "start_time", "status", "params", "metrics"}`.

    Args:
        root: the project (holds `mlflow.db`).
        run_ids: run ids or unique prefixes (at least 6 characters), in the order to show them.
        last: instead of `run_ids`, the last `last` pipeline runs, oldest first.
    """
    if bool(run_ids) == (last is not None):
        raise QllmError("give run ids or --last N (not both)")
    client = lineage.open_client(root)
    runs = last_pipeline_runs(client, last) if last is not None else [find_run(client, run_id) for run_id in run_ids]
    if len(runs) < 2:
        raise QllmError(f"need at least two runs to compare (got {len(runs)})")
    return [view(client, run) for run in runs]


def last_pipeline_runs(client: Any, count: int) -> list[Any]:
    if count < 1:
        raise QllmError(f"--last must be at least 1 (got {count})")
    experiment = _experiment(client)
    runs = client.search_runs(
        [experiment.experiment_id],
        "tags.qllm.kind = 'pipeline'",
        order_by=["attributes.start_time DESC"],
        max_results=count,
    )
    if not runs:
        raise QllmError(
            f"no pipeline runs (tag qllm.kind=pipeline) in experiment {experiment.name!r}; run `qllm run` first"
        )
    return list(reversed(runs))


def _experiment(client: Any) -> Any:
    experiment = client.get_experiment_by_name(tracking.experiment_name())
    if experiment is None:
        raise QllmError(f"no MLflow experiment {tracking.experiment_name()!r}; run `qllm run` first")
    return experiment


def find_run(client: Any, run_id: str) -> Any:
    """The run with this id, or with this unique id prefix."""
    from mlflow.exceptions import MlflowException

    if RUN_ID.match(run_id):
        try:
            return client.get_run(run_id)
        except MlflowException:
            raise QllmError(f"unknown MLflow run id {run_id!r}") from None
    if len(run_id) < MIN_PREFIX or not re.fullmatch(r"[0-9a-f]+", run_id):
        raise QllmError(
            f"{run_id!r}: expected an MLflow run id (32 hex digits, or a unique prefix of at least {MIN_PREFIX})"
        )
    experiments = [e.experiment_id for e in client.search_experiments()]
    matches, token = [], None
    while True:
        page = client.search_runs(experiments, max_results=1000, page_token=token)
        matches += [r for r in page if r.info.run_id.startswith(run_id)]
        token = page.token
        if not token:
            break
    if not matches:
        raise QllmError(f"unknown MLflow run id {run_id!r} (no run id starts with it)")
    if len(matches) > 1:
        raise QllmError(f"run id prefix {run_id!r} is ambiguous: {', '.join(r.info.run_id for r in matches)}")
    return matches[0]


def view(client: Any, run: Any) -> dict[str, Any]:
    """What the comparison shows of one run (see the module docstring)."""
    tags = run.data.tags
    stage = tags.get("qllm.stage")
    params = dict(run.data.params)
    if tags.get("qllm.kind") == "pipeline":
        kind = "pipeline"
        metrics = dict(run.data.metrics)
        effective = _artifact_yaml(client, run.info.run_id, "params.yaml")
        if effective:
            params.update({k: str(v) for k, v in flatten(effective).items()})
        for name, run_id in _stage_runs(client, run).items():
            if run_id:
                metrics.update({f"{name}/{k}": v for k, v in client.get_run(run_id).data.metrics.items()})
    else:
        kind = f"stage {stage}" if stage else "run"
        metrics = {f"{stage}/{k}" if stage else k: v for k, v in run.data.metrics.items()}
    return {
        "run_id": run.info.run_id,
        "name": run.info.run_name,
        "kind": kind,
        "start_time": datetime.fromtimestamp(run.info.start_time / 1000).isoformat(timespec="seconds"),
        "status": run.info.status,
        "params": params,
        "metrics": metrics,
    }


def _artifact_yaml(client: Any, run_id: str, path: str) -> dict | None:
    text = lineage.artifact_text(client, run_id, path)
    return dag.load_yaml(text) if text is not None else None


def _stage_runs(client: Any, run: Any) -> dict[str, str | None]:
    """`{stage: run that produced its outputs}` for a pipeline run: from its `dvc.lock` artifact,
    else (a run that failed before logging it) the stage runs it started."""
    stages = lineage.artifact_lock(client, run.info.run_id)
    if stages:
        return lineage.stage_runs(client, stages, run.info.run_id)
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    return {child.data.tags.get("qllm.stage", child.info.run_name): child.info.run_id for child in children}


def table(runs: list[dict[str, Any]], all_keys: bool = False) -> dict[str, Any]:
    """`{"runs": [...], "params": {key: [value per run]}, "metrics": {...}}`, keys sorted; only
    keys whose values differ between the runs unless `all_keys` (a missing value is None)."""

    def rows(field: str) -> dict[str, list]:
        keys = sorted({k for run in runs for k in run[field]})
        values = {k: [run[field].get(k) for run in runs] for k in keys}
        return {k: v for k, v in values.items() if all_keys or _differ(v)}

    header = [{k: run[k] for k in ("run_id", "name", "kind", "start_time", "status")} for run in runs]
    return {"runs": header, "all": all_keys, "params": rows("params"), "metrics": rows("metrics")}


def _differ(values: list) -> bool:
    first = values[0]
    for value in values[1:]:
        if isinstance(first, float) and isinstance(value, float):
            if not (first == value or (math.isnan(first) and math.isnan(value))):
                return True
        elif value != first:
            return True
    return False


def render(compared: dict[str, Any], max_width: int = 28) -> str:
    """The comparison as a text table: one column per run, one row per key."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if value == "":
            return "''"
        text = f"{value:.6g}" if isinstance(value, float) else str(value)
        return text if len(text) <= max_width else text[: max_width - 1] + "…"

    runs = compared["runs"]
    rows: list[tuple[str, list[str]]] = [
        ("run", [r["run_id"][:8] for r in runs]),
        ("name", [cell(r["name"]) for r in runs]),
        ("kind", [cell(r["kind"]) for r in runs]),
        ("started", [r["start_time"].replace("T", " ") for r in runs]),
        ("status", [r["status"] for r in runs]),
    ]
    sections = []
    for field in ("params", "metrics"):
        body = [(key, [cell(v) for v in values]) for key, values in compared[field].items()]
        sections.append((field, body))
    key_width = max(len(key) for key, _ in rows + [row for _, body in sections for row in body])
    widths = [
        max(len(row[1][i]) for row in rows + [row for _, body in sections for row in body]) for i in range(len(runs))
    ]

    def line(key: str, cells: list[str]) -> str:
        return "  ".join([f"{key:<{key_width}}", *(f"{c:<{w}}" for c, w in zip(cells, widths, strict=True))]).rstrip()

    out = [line(key, cells) for key, cells in rows]
    for field, body in sections:
        if compared.get("all"):
            out += ["", f"{field} ({len(body)})"]
        else:
            out += ["", f"{field} ({len(body)} differ)" if body else f"{field}: none differ"]
        out += [line(key, cells) for key, cells in body]
    return "\n".join(out)

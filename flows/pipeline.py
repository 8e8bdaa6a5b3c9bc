"""The pipeline flow: every `dvc.yaml` stage as a Prefect task, in DAG order.

    qllm run [--set KEY=VALUE ...] [--params FILE ...] [--until STAGE]

The task graph is read from `dvc.yaml` (the one definition of the DAG); each task waits for the
stages it depends on, so independent branches run concurrently. Params (with overrides) are
validated before any stage starts. One MLflow parent run spans the flow run; every stage that runs
logs a child run under it.

SIGTERM (a `kill`, a Prefect cancellation, an orchestrator stopping the pod) reaches the flow the
way Prefect delivers it: while a flow runs, Prefect's engine owns SIGTERM and raises
`TerminationSignal` in the flow's thread. The flow hands it to its stages as a stop request
(`stop_stages_on_termination`): training stages finish their step, save a checkpoint and stop, no
new stage starts; then the signal goes on to Prefect, which marks the run Crashed (or Cancelled
for a cancellation) and ends the process as it intends.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run

from flows import preflight
from pipelines.core import config, dag, errors, params_file, workspace
from pipelines.core.run import repro, tracking
from tasks.stages import stage_task


@contextmanager
def stop_stages_on_termination(wait: Callable[[], object]) -> Iterator[None]:
    """Turn Prefect's `TerminationSignal` (its SIGTERM bridge) into the stop request the stages
    honour, and call `wait` (for the submitted stages) before it goes on to Prefect.

    Prefect's own answer to SIGTERM cancels task runs that have not started and then waits for
    the running ones (`ThreadPoolTaskRunner.cancel_all`), which only a stop request can shorten:
    a training stage in a worker thread sees no signal. A second SIGTERM (or SIGINT) while waiting
    interrupts the training threads at once; the newest checkpoints stay.
    """
    try:
        yield
    except TerminationSignal as exc:
        if errors.stop_requested() is not None:  # a second signal (the first was SIGINT, or a lost API)
            errors.interrupt_training()
            raise
        errors.ask_stop(signal_name(exc.signal), exc.signal)
        logging.getLogger("qllm").warning("waiting for the running stages to stop (a second signal interrupts them at once)")
        try:
            wait()
        except TerminationSignal:  # (a second SIGINT: the CLI's handler interrupts them itself)
            errors.interrupt_training()
            raise
        raise


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@flow(name="qllm-pipeline", log_prints=True, validate_parameters=True)
def pipeline(
    overrides: list[str] | None = None,
    params_files: list[str] | None = None,
    until: str | None = None,
    force: list[str] | None = None,
    project_dir: str = ".",
    from_stage: str | None = None,
) -> dict:
    """Run the pipeline up to `until` (default: every stage) and return its summary.

    Args:
        overrides: `section.key=value` params overrides (never written to params.yaml).
        params_files: YAML files merged over params.yaml, in order (e.g. params/tiny.yaml).
        until: last stage to run (with everything it depends on).
        force: stages to rerun even if DVC finds them up to date.
        project_dir: the project root (holds dvc.yaml, params.yaml, mlflow.db).
        from_stage: run this stage and everything downstream of it; the stages before it must
            come from DVC's caches (up to date or in the run-cache), else the run fails before
            training anything.
    """
    root = Path(project_dir).resolve()
    preflight.check_tracking(root)  # an unreachable MLflow server fails the run before any stage starts
    logger = get_run_logger()
    logging.getLogger("qllm").setLevel(logging.INFO)  # stage logs (shown via PREFECT_LOGGING_EXTRA_LOGGERS=qllm)
    _, data = params_file.load(root, params_files or [], overrides or [])
    ws = workspace.prepare(root, data)
    if ws != root:
        logger.info("overrides given: running in workspace %s (params.yaml untouched)", ws.relative_to(root))
    started = time.perf_counter()
    with workspace.locked(ws), tracking.run("pipeline", root, tags=_run_tags(ws, root)) as parent:
        parent.log_params({"overrides": " ".join(overrides or []), "params_files": " ".join(params_files or []), "until": until or ""})
        parent.log_artifact(ws / config.PARAMS_FILE)  # the effective params of this run
        futures = {}
        try:
            with stop_stages_on_termination(lambda: [future.wait() for future in futures.values()]):
                fresh = None if from_stage is None else {from_stage} | dag.downstream(ws, from_stage)
                for name in dag.order(ws, until):
                    waits = [futures[up] for up in dag.upstream(ws, name) if up in futures]
                    cached_only = fresh is not None and name not in fresh
                    futures[name] = stage_task(name).submit(str(ws), name, parent.run_id, name in (force or []), cached_only, wait_for=waits)
                states = {name: future.wait() or future.state for name, future in futures.items()}
        finally:
            repro.close(ws)
        stages = [_stage_summary(name, state) for name, state in states.items()]
        # Only what this run scheduled: a `--until` run must not report an earlier run's results.
        registered = _registered(ws) if "register" in futures else None
        summary = {
            "stages": stages,
            "mlflow_run_id": parent.run_id,
            "model_version": registered["version"] if registered else None,
            "workspace": str(ws),
            "seconds": round(time.perf_counter() - started, 3),
        }
        parent.set_tags({f"qllm.stage.{s['name']}": s["status"] for s in stages} | ({"qllm.model_version": registered["version"]} if registered else {}))
        if (ws / "dvc.lock").exists():
            parent.log_artifact(ws / "dvc.lock")  # hashes of every input and output after the run
        parent.log_metrics({f"stage_seconds/{s['name']}": s["seconds"] for s in stages if s["seconds"] is not None})
        if errors.stop_requested() is None:  # a stopped run publishes no results (and its Prefect API may be gone)
            _publish_artifacts(summary, evaluation_rows(ws) if "evaluate" in futures else [], registered)
        failed = [s for s in stages if s["status"] not in ("ran", "cached")]
        if failed:
            # Re-raise the first failure so the flow run (and the MLflow parent run) fail with it.
            states[failed[0]["name"]].result()
    return summary


def _run_tags(ws: Path, root: Path) -> dict[str, str]:
    tags = {"qllm.kind": "pipeline", "qllm.workspace": str(ws.relative_to(root)) if ws != root else "."}
    if flow_run.id:
        tags["qllm.prefect_flow_run_id"] = flow_run.id
    return tags


def _stage_summary(name: str, state) -> dict:
    if state.is_completed():
        outcome = state.result()
        return {"name": name, "status": outcome["status"], "reason": outcome["reason"], "seconds": outcome["seconds"], "outs": outcome["outs"]}
    return {"name": name, "status": "failed" if state.is_failed() else "not run", "reason": state.message or state.name, "seconds": None, "outs": {}}


def _registered(ws: Path) -> dict | None:
    """The register stage's record (`version`, `model_uri`, `alias`, `reason`), if it wrote one."""
    record = ws / "data" / "register" / "registered.json"
    return json.loads(record.read_text()) if record.exists() else None


def evaluation_rows(ws: Path) -> list[dict]:
    """The evaluate stage's comparison table (one row per model, in `evaluate.models` order)."""
    import pandas as pd

    path = ws / "data" / "evaluate" / "comparison.csv"
    if not path.exists():
        return []
    frame = pd.read_csv(path)
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def summary_markdown(summary: dict, rows: list[dict], registered: dict | None) -> str:
    """The run at a glance: stages (ran/cached, seconds), the evaluation, the registered version."""
    lines = ["# qllm pipeline run", "", f"MLflow parent run `{summary['mlflow_run_id']}`, {summary['seconds']:.1f} s", "",
             "| stage | status | seconds |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {s['name']} | {s['status']} | {_cell(s['seconds'], '.2f')} |" for s in summary["stages"]]
    if rows:
        columns = list(rows[0])
        lines += ["", "## Evaluation", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    if registered:
        lines += ["", f"## Registered: `{registered['model_uri']}` @{registered['alias']}", "", registered.get("reason", "")]
    return "\n".join(lines) + "\n"


def _cell(value, spec: str = ".4f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def _publish_artifacts(summary: dict, rows: list[dict], registered: dict | None) -> None:
    """Prefect artifacts of the run: the evaluation table and a markdown summary."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    if rows:
        create_table_artifact(key="qllm-evaluation", table=rows, description="Held-out evaluation of every model of the run")
    create_markdown_artifact(key="qllm-run-summary", markdown=summary_markdown(summary, rows, registered), description="qllm pipeline run")

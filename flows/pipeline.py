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
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run

from flows.stages import stage_task
from pipelines.core import dag, errors, workspace
from pipelines.core.outputs import flatten
from pipelines.core.params import files as params_file
from pipelines.core.params.base import PARAMS_FILE
from pipelines.core.run import preflight, repro, tracking


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


def _process_ends_with_the_run(flow, flow_run, state) -> None:
    """Prefect's hook on a flow run's final state: in a flow run's own process (a worker's
    `python -m prefect.engine`), which ends once the state is reported, the process's exit skips the
    collector's passes (`errors.exit_without_collecting`: 2.4 s of a process holding torch,
    transformers, PEFT and MLflow). A subflow (a sweep's set), or a flow called in a process that
    goes on (`qllm run`, a notebook, a test), leaves the collector alone."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "prefect.engine" and flow_run.parent_task_run_id is None:
        errors.exit_without_collecting()


FINAL_STATE_HOOKS = {name: [_process_ends_with_the_run] for name in ("on_completion", "on_failure", "on_cancellation", "on_crashed")}
"""Every final state of a flow run calls `_process_ends_with_the_run` (`@flow(**FINAL_STATE_HOOKS)`)."""


@flow(name="qllm-pipeline", log_prints=True, validate_parameters=True, **FINAL_STATE_HOOKS)
def pipeline(
    overrides: list[str] | None = None,
    params_files: list[str] | None = None,
    until: str | list[str] | None = None,
    force: list[str] | None = None,
    project_dir: str = ".",
    from_stage: str | None = None,
    parent_run_id: str | None = None,
) -> dict:
    """Run the pipeline up to `until` (default: every stage) and return its summary.

    Args:
        overrides: `section.key=value` params overrides (never written to params.yaml).
        params_files: YAML files merged over params.yaml, in order (e.g. params/tiny.yaml).
        until: last stage to run (with everything it depends on), or several (a sweep's shared
            stages in one run, independent ones at once).
        force: stages to rerun even if DVC finds them up to date.
        project_dir: the project root (holds dvc.yaml, params.yaml, mlflow.db).
        from_stage: run this stage and everything downstream of it; the stages before it must
            come from DVC's caches (up to date or in the run-cache), else the run fails before
            training anything.
        parent_run_id: the MLflow run this run's own run nests under (a sweep's).
    """
    root = Path(project_dir).resolve()
    preflight.check_tracking(root)  # an unreachable MLflow server fails the run before any stage starts
    logger = get_run_logger()
    logging.getLogger("qllm").setLevel(logging.INFO)  # stage logs (shown via PREFECT_LOGGING_EXTRA_LOGGERS=qllm)
    params, data = params_file.load(root, params_files or [], overrides or [])
    ws = workspace.prepare(root, data)
    if ws != root:
        logger.info("overrides given: running in workspace %s (params.yaml untouched)", ws.relative_to(root))
    started = time.perf_counter()
    name = run_name(root, overrides, params_files, until)
    with workspace.locked(ws), tracking.run(name, root, tags=_run_tags(ws, root), parent_run_id=parent_run_id) as parent:
        # the effective params, flattened (dpo.beta, lora.r, ...): MLflow's compare view shows the keys that differ
        parent.log_params({"overrides": " ".join(overrides or []), "params_files": " ".join(params_files or []), "until": _stages_text(until),
                           **flatten(params)})  # fmt: skip
        parent.log_artifact(ws / PARAMS_FILE)  # the effective params of this run
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
        rows = evaluation_rows(ws) if "evaluate" in futures else []
        parent.log_metrics(headline_metrics(rows, registered))
        # the Datasets column: the data this run trained on, by DVC md5
        parent.log_datasets([(path, digest, path) for path, digest in datasets(ws).items()], context="training")
        if errors.stop_requested() is None:  # a stopped run publishes no results (and its Prefect API may be gone)
            _publish_artifacts(summary, rows, registered)
        failed = [s for s in stages if s["status"] not in ("ran", "cached")]
        if failed:
            # Re-raise the first failure so the flow run (and the MLflow parent run) fail with it.
            states[failed[0]["name"]].result()
    return summary


NAME_LIMIT = 200
"""Characters of a run name kept (MLflow's limit is 250)."""
DATA_STAGES = ("sample_data", "ingest", "prepare_data", "tokenize")
"""Stages whose outputs are the run's data sets (the parent run's Datasets column)."""


def _stages_text(until: str | list[str] | None) -> str:
    return ", ".join([until] if isinstance(until, str) else until or [])


def run_name(root: Path, overrides: list[str] | None = None, params_files: list[str] | None = None, until: str | list[str] | None = None) -> str:
    """What a pipeline run is, for a list of runs: its profile (the params files, by stem) and
    overrides, or `default`; `until` when it stops early; and the project's short commit.

    `smollm2 + lora.adapter.r=16 @ 1a2b3c4`, `dpo.beta=0.5 @ 1a2b3c4`, `default (until sft) @ 1a2b3c4`."""
    what = " + ".join(part for part in (" + ".join(Path(f).stem for f in params_files or []), " ".join(overrides or [])) if part) or "default"
    if until:
        what += f" (until {_stages_text(until)})"
    commit = short_commit(root)
    name = f"{what} @ {commit}" if commit else what
    return name if len(name) <= NAME_LIMIT else name[: NAME_LIMIT - 1] + "…"


def short_commit(root: Path) -> str | None:
    """The checkout's commit, abbreviated as git does; None outside a git repository."""
    import subprocess

    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


HEADLINE_GROUPS = {"exact_match": "heldout/exact_match", "flexible_match": "heldout/flexible_match", "strict_match": "heldout/strict_match",
                   "preference_accuracy": "preference/accuracy", "rewards/accuracies": "preference/reward_accuracy",
                   "rewards/margins": "preference/reward_margin", "val_loss": "val/loss", "val_perplexity": "val/perplexity",
                   "general_loss": "general_text/loss", "general_perplexity": "general_text/perplexity",
                   **{cell: f"system_prompt/{cell}" for cell in ("facts_short", "facts_no_system_strict", "facts_no_system_short", "general_short",
                                                                 "general_system_form_kept", "general_system_short")}}  # system_prompt.CELLS, without its torch  # fmt: skip
"""evaluate's comparison columns -> the parent run's metric names (then `/<model>`): the held-out
answers first in MLflow's sorted lists (its compare view shows the first rows), other text scores
under `text/`."""


def headline_metrics(rows: list[dict], registered: dict | None) -> dict[str, float]:
    """The results on the parent run, under names that sort by metric, then model
    (`heldout/exact_match/dpo`, `val/loss/sft`, `text/bleu/lora`; `HEADLINE_GROUPS`), and the
    registered version's gate metric (`registered/<metric>`) and number."""
    metrics = {f"{HEADLINE_GROUPS.get(column, f'text/{column}')}/{row['model']}": float(value) for row in rows for column, value in row.items()
               if column != "model" and isinstance(value, (int, float)) and not isinstance(value, bool)}  # fmt: skip
    if registered and registered.get("value") is not None:
        metrics[f"registered/{registered['metric']}"] = float(registered["value"])
        metrics["registered/version"] = float(registered["version"])
    return metrics


def datasets(ws: Path) -> dict[str, str]:
    """The data stages' output directories and their DVC md5, from the run's dvc.lock."""
    lock = ws / "dvc.lock"
    if not lock.exists():
        return {}
    stages = (dag.load_yaml(lock.read_text(encoding="utf-8")) or {}).get("stages", {})
    return {out["path"]: out["md5"] for name in DATA_STAGES for out in stages.get(name, {}).get("outs", [])
            if out.get("md5", "").endswith(".dir")}  # fmt: skip


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

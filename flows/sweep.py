"""A sweep: the pipeline once per set of overrides, side by side, sharing every cached upstream stage.

    from flows.sweep import sweep
    sweep(sweep=[["dpo.beta=0.05"], ["dpo.beta=0.5"]], params_files=["params/tiny.yaml"])

or as the deployment `qllm-sweep/dpo-beta` (prefect.yaml). First the stages no override set
touches (those whose params sections no override names, and nothing they depend on changes) are
brought up to date once, in the project itself; then each override set runs as a `qllm-pipeline`
subflow in its own run workspace, `max_parallel` at a time. Each finds those shared stages in
DVC's run-cache and runs only what its overrides change (for a DPO beta sweep: `dpo`, `evaluate`,
`register`). Returns one summary per override set.

With `deployment` (e.g. `qllm-pipeline/default`), each override set is a run of that deployment
instead of a subflow in this process: the work pool's workers take them, each in its own checkout
(its own machine), so a sweep spreads over a team's workers. The shared stages still run once,
here, before the sets start; with a default DVC remote (`dvc remote add -d`) they are pushed to it
as they finish and every other worker restores them from it instead of computing them again
(`pipelines.core.run.repro`). Each set's summary then comes from the tracking server (the
pipeline run tagged with the flow run's id) and names the worker that ran it.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefect import flow, get_run_logger

from flows.pipeline import FINAL_STATE_HOOKS, pipeline, stop_stages_on_termination
from pipelines.core import dag, dvc_api
from pipelines.core.errors import QllmError
from pipelines.core.params import files as params_file
from pipelines.core.run import tracking

WORKER_LABEL = "prefect.worker.name"
"""The label a Prefect worker gives each flow run it takes."""


def _reads(params: tuple[str, ...], key: str) -> bool:
    """Whether a stage listing `params` in dvc.yaml (sections, or dotted keys of another section)
    reads the overridden `key`."""
    return any(key == p or key.startswith(p + ".") or p.startswith(key + ".") for p in params)


def shared_stages(root: Path, override_sets: list[list[str]]) -> list[str]:
    """Stages (in DAG order) no override set can change: reading none of the overridden keys (a
    stage's params in dvc.yaml: its section, and the keys of other sections it lists, such as
    ref_logprobs' `dpo.method`), and not downstream of one that does."""
    graph = dag.stages(root)
    keys = {key.split("=", 1)[0] for overrides in override_sets for key in overrides}
    changed = {name for name, spec in graph.items() if any(_reads(spec.params, key) for key in keys)}
    for name in list(changed):
        changed |= dag.downstream(root, name)
    return [name for name in dag.order(root) if name not in changed]


@flow(name="qllm-sweep", log_prints=True, validate_parameters=True, **FINAL_STATE_HOOKS)
def sweep(
    sweep: list[list[str]],
    overrides: list[str] | None = None,
    params_files: list[str] | None = None,
    max_parallel: int = 2,
    project_dir: str = ".",
    deployment: str | None = None,
) -> list[dict]:
    """Run the pipeline for every override set in `sweep` (each a list of `section.key=value`,
    applied after the common `overrides`).

    Args:
        sweep: the override sets, e.g. [["dpo.beta=0.05"], ["dpo.beta=0.5"]].
        overrides: applied to every set (and to the shared stages).
        params_files: YAML files merged over params.yaml for every run.
        max_parallel: pipeline subflows running at once.
        project_dir: the project root.
        deployment: run each set as a run of this deployment (`flow/deployment`, e.g.
            `qllm-pipeline/default`), taken by its work pool's workers, instead of in this process.
    """
    logger = get_run_logger()
    root = Path(project_dir).resolve()
    if not sweep:
        raise QllmError("sweep: give at least one override set")
    if max_parallel < 1:
        raise QllmError(f"sweep: max_parallel must be >= 1, got {max_parallel}")
    runs = [[*(overrides or []), *item] for item in sweep]
    for item in runs:  # every set is validated before any work starts
        params_file.load(root, params_files or [], item)
    shared = shared_stages(root, sweep)
    keys = swept_keys(sweep)
    tags = {"qllm.kind": "sweep", "qllm.swept": ", ".join(keys)}
    with tracking.run(sweep_name(root, sweep, overrides, params_files), root, tags=tags) as parent:  # the sets' runs nest under it
        parent.log_params({"swept": ", ".join(keys), "sets": " | ".join(" ".join(item) for item in sweep), "overrides": " ".join(overrides or []),
                           "params_files": " ".join(params_files or []), "deployment": deployment or ""})  # fmt: skip
        if shared:
            logger.info("shared stages, brought up to date once: %s", ", ".join(shared))
            feeds = {up for name in shared for up in dag.upstream(root, name)}
            sinks = [name for name in shared if name not in feeds]  # with their ancestors: every shared stage, in one run
            pipeline(overrides=overrides, params_files=params_files, until=sinks, project_dir=str(root), parent_run_id=parent.run_id)

        def one(item: list[str]) -> dict:
            if deployment:
                return on_workers(root, deployment, item, params_files, parent.run_id)
            return pipeline(overrides=item, params_files=params_files, project_dir=str(root), parent_run_id=parent.run_id)

        if deployment and shared and _default_remote(root) is None:
            logger.warning("sweep: the sets run on %s's workers but this project has no default DVC remote: a worker in another checkout "
                           "computes the shared stages again (`dvc remote add -d NAME URL`; docs/deployments.md)", deployment)  # fmt: skip

        with ThreadPoolExecutor(max_workers=max_parallel) as pool:  # each thread keeps this flow as parent
            futures = [pool.submit(contextvars.copy_context().run, one, item) for item in runs]
            with stop_stages_on_termination(lambda: concurrent.futures.wait(futures)):  # SIGTERM: the subflows' stages stop first
                summaries = [future.result() for future in futures]
    for item, summary in zip(sweep, summaries, strict=True):
        ran = [s["name"] for s in summary["stages"] if s["status"] == "ran"]
        where = f" on {summary['worker']}" if summary.get("worker") else ""
        logger.info("%s%s: ran %s; model version %s", " ".join(item), where, ", ".join(ran) or "nothing", summary["model_version"])
    return summaries


def _default_remote(root: Path) -> str | None:
    with dvc_api.open_repo(root) as repo:
        return dvc_api.default_remote(repo)


def swept_keys(sets: list[list[str]]) -> list[str]:
    """The keys the sets set, in first-seen order (`dpo.beta`)."""
    return list(dict.fromkeys(item.split("=", 1)[0].strip() for items in sets for item in items))


def sweep_name(root: Path, sets: list[list[str]], overrides: list[str] | None, params_files: list[str] | None) -> str:
    """The sweep's own run: which key it swept over which values, the common profile and
    overrides, the commit: `sweep dpo.beta=0.05|0.2|0.5 @ 1a2b3c4`."""
    from flows.pipeline import NAME_LIMIT, short_commit

    keys = swept_keys(sets)
    if len(keys) == 1:
        what = f"{keys[0]}=" + "|".join(item.split("=", 1)[1] for items in sets for item in items if "=" in item)
    else:
        what = " | ".join(" ".join(items) for items in sets)
    common = " + ".join(part for part in (" + ".join(Path(f).stem for f in params_files or []), " ".join(overrides or [])) if part)
    name = f"sweep {what}" + (f" on {common}" if common else "")
    commit = short_commit(root)
    name = f"{name} @ {commit}" if commit else name
    return name if len(name) <= NAME_LIMIT else name[: NAME_LIMIT - 1] + "…"


def on_workers(root: Path, deployment: str, overrides: list[str], params_files: list[str] | None, parent_run_id: str | None = None) -> dict:
    """One override set as a run of `deployment` (a subflow of the calling flow run), waited for;
    its summary from the tracking server: the stages' statuses (the pipeline run's `qllm.stage.*`
    tags), the MLflow run, the model version and the worker that ran it."""
    from prefect.deployments import run_deployment

    parameters = {"overrides": overrides, "params_files": params_files or []} | ({"parent_run_id": parent_run_id} if parent_run_id else {})
    run = run_deployment(deployment, parameters=parameters, timeout=None, poll_interval=2)
    worker = (run.labels or {}).get(WORKER_LABEL)
    what = f"sweep: {' '.join(overrides)}: flow run {run.name} ({run.id}) of {deployment}" + (f" on worker {worker}" if worker else "")
    if run.state is None or not run.state.is_completed():
        state = run.state.name if run.state else "no state"
        raise QllmError(f"{what} ended {state}: {run.state.message if run.state else ''}")
    client = tracking.client(root)
    found = client.search_runs([tracking.experiment_id(root)], filter_string=f"tags.`qllm.prefect_flow_run_id` = '{run.id}'", max_results=1)
    if not found:
        raise QllmError(f"{what} completed but no pipeline run in {tracking.tracking_uri(root)} carries its id: do the workers track to "
                        "the same MLflow server as this flow (MLFLOW_TRACKING_URI)?")  # fmt: skip
    tags = found[0].data.tags
    stages = [{"name": name, "status": tags[f"qllm.stage.{name}"]} for name in dag.order(root) if f"qllm.stage.{name}" in tags]
    return {"stages": stages, "mlflow_run_id": found[0].info.run_id, "model_version": tags.get("qllm.model_version"),
            "flow_run_id": str(run.id), "worker": worker}  # fmt: skip


def stage_run_counts(root: Path) -> dict[str, int]:
    """How many of the tracking store's pipeline runs ran each stage (not restored or cached):
    after a sweep, the shared stages should count 1 however many workers took part."""
    client = tracking.client(root)
    counts: dict[str, int] = {}
    for run in client.search_runs([tracking.experiment_id(root)], filter_string="tags.`qllm.kind` = 'pipeline'", max_results=10_000):
        for tag, status in run.data.tags.items():
            if tag.startswith("qllm.stage.") and status == "ran":
                counts[tag.removeprefix("qllm.stage.")] = counts.get(tag.removeprefix("qllm.stage."), 0) + 1
    return counts

"""A sweep: the pipeline once per set of overrides, side by side, sharing every cached upstream stage.

    from flows.sweep import sweep
    sweep(sweep=[["dpo.beta=0.05"], ["dpo.beta=0.5"]], params_files=["params/tiny.yaml"])

or as the deployment `qllm-sweep/dpo-beta` (prefect.yaml). First the stages no override set
touches (those whose params sections no override names, and nothing they depend on changes) are
brought up to date once, in the project itself; then each override set runs as a `qllm-pipeline`
subflow in its own run workspace, `max_parallel` at a time. Each finds those shared stages in
DVC's run-cache and runs only what its overrides change (for a DPO beta sweep: `dpo`, `evaluate`,
`register`). Returns one summary per override set.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefect import flow, get_run_logger

from flows.pipeline import pipeline, stop_stages_on_termination
from pipelines.core import dag, params_file
from pipelines.core.errors import QllmError


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


@flow(name="qllm-sweep", log_prints=True, validate_parameters=True)
def sweep(
    sweep: list[list[str]],
    overrides: list[str] | None = None,
    params_files: list[str] | None = None,
    max_parallel: int = 2,
    project_dir: str = ".",
) -> list[dict]:
    """Run the pipeline for every override set in `sweep` (each a list of `section.key=value`,
    applied after the common `overrides`).

    Args:
        sweep: the override sets, e.g. [["dpo.beta=0.05"], ["dpo.beta=0.5"]].
        overrides: applied to every set (and to the shared stages).
        params_files: YAML files merged over params.yaml for every run.
        max_parallel: pipeline subflows running at once.
        project_dir: the project root.
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
    if shared:
        logger.info("shared stages, brought up to date once: %s", ", ".join(shared))
        feeds = {up for name in shared for up in dag.upstream(root, name)}
        for sink in [name for name in shared if name not in feeds]:  # `until` takes one stage and its ancestors
            pipeline(overrides=overrides, params_files=params_files, until=sink, project_dir=str(root))

    def one(item: list[str]) -> dict:
        return pipeline(overrides=item, params_files=params_files, project_dir=str(root))

    with ThreadPoolExecutor(max_workers=max_parallel) as pool:  # each thread keeps this flow as parent
        futures = [pool.submit(contextvars.copy_context().run, one, item) for item in runs]
        with stop_stages_on_termination(lambda: concurrent.futures.wait(futures)):  # SIGTERM: the subflows' stages stop first
            summaries = [future.result() for future in futures]
    for item, summary in zip(sweep, summaries, strict=True):
        ran = [s["name"] for s in summary["stages"] if s["status"] == "ran"]
        logger.info("%s: ran %s; model version %s", " ".join(item), ", ".join(ran) or "nothing", summary["model_version"])
    return summaries

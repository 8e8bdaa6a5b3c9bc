"""One Prefect task per `dvc.yaml` stage: a thin wrapper over `pipelines.core.run.repro.reproduce`.

A stage DVC finds up to date (or restores from its run-cache) finishes in Prefect's `Cached`
state, so the Prefect UI and `dvc status` tell the same story. No retries: training is not an
idempotent I/O step, and a failed stage leaves nothing that looks finished to retry over.
"""

from __future__ import annotations

import functools
from pathlib import Path

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from pipelines.core.errors import QllmError, StopRequested, stop_requested
from pipelines.core.run import repro


def _refuse_to_run(root: Path, name: str, parent_run_id: str | None) -> None:
    raise QllmError(f"stage {name!r} is not up to date and has no DVC run-cache entry for these inputs; a run with "
                    "from_stage only reuses upstream outputs: run the pipeline up to it first (qllm run --until ...)")  # fmt: skip


def _reproduce(workspace: str, name: str, parent_run_id: str | None = None, force: bool = False, cached_only: bool = False):
    if (reason := stop_requested()) is not None:  # a stop signal (or a lost Prefect API) arrived: no new stage starts
        raise StopRequested(f"{name}: not started ({reason}); rerun to continue where the run stopped")
    if cached_only:  # upstream of from_stage: restore from DVC's caches or fail, never train
        outcome = repro.reproduce(Path(workspace), name, parent_run_id=parent_run_id, execute=_refuse_to_run)
    else:
        outcome = repro.reproduce(Path(workspace), name, parent_run_id=parent_run_id, force=force)
    if outcome.status == "cached":
        how = "up to date" if outcome.reason == "up-to-date" else "restored from the DVC run-cache"
        return Completed(name="Cached", message=f"{name}: {how}", data=outcome.as_dict())
    return outcome.as_dict()


@functools.cache
def stage_task(name: str) -> Task:
    """The Prefect task that brings stage `name` up to date (one per stage, named after it)."""
    return task(
        _reproduce,
        name=name,
        task_run_name=name,
        cache_policy=NO_CACHE,  # DVC decides what is stale; Prefect keeps no second cache
        retries=0,
        log_prints=True,
    )

"""Reproduce one `dvc.yaml` stage the way `dvc repro` does, but with the stage run in-process.

For a stage this follows DVC's own steps (`dvc/stage/__init__.py: Stage.run`, `dvc/stage/run.py`):

1. `stage.changed()`: compare code, data and params hashes with `dvc.lock` — unchanged means the
   workspace already holds the outputs: **cached** (up to date).
2. otherwise remove the stale outputs and try DVC's run-cache: an entry for the same
   (command, dependency hashes, params) restores the outputs from `.dvc/cache`: **cached** (restored).
3. otherwise run the stage (`pipelines.<stage>`) — **ran** — and save its outputs to the DVC
   cache, the run-cache and `dvc.lock`.

So "same inputs" means exactly what it means to DVC: `qllm run` and `dvc repro` always agree on
what is stale, and there is no second cache to drift. Running the stage in-process (instead of
`python -m pipelines.<stage>` in a subprocess) saves seconds of imports per stage; the command
string in `dvc.yaml` is still what DVC hashes and what `dvc repro` runs.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pipelines import dag

log = logging.getLogger("qllm.runner")

# One DVC Repo object per workspace, used by one thread at a time (DVC objects are not
# thread-safe); the stage itself runs outside this lock so parallel branches can overlap.
# DVC's internals (e.g. the run-cache) resolve paths against the current directory, as its CLI
# always runs from the repo root, so DVC steps run under chdir(root). Stage code only uses
# absolute paths, so this brief, serialised chdir cannot affect stages in other threads.
_repos: dict[Path, object] = {}
_repo_lock = threading.RLock()


@dataclass(frozen=True)
class StageOutcome:
    name: str
    status: str  # "ran" | "cached"
    reason: str  # "up-to-date" | "run-cache" | "executed"
    seconds: float
    outs: dict[str, str]  # output path -> DVC md5, as in dvc.lock

    def as_dict(self) -> dict:
        return asdict(self)


def _repo(root: Path):
    from dvc.repo import Repo

    with _repo_lock:
        if root not in _repos:
            logging.getLogger("dvc").setLevel(logging.WARNING)  # our own log says ran/cached
            _repos[root] = Repo(str(root))
        return _repos[root]


def close(root: Path | str) -> None:
    """Release the DVC repo object of a workspace (end of a pipeline run)."""
    with _repo_lock:
        repo = _repos.pop(Path(root).resolve(), None)
        if repo is not None:
            repo.close()


def run_in_process(root: Path, name: str, parent_run_id: str | None) -> None:
    """Execute `pipelines.<name>` in this process (what `python -m pipelines.<name>` runs)."""
    from pipelines import stage

    module = importlib.import_module(dag.stages(root)[name].module)
    stage.execute(module.NAME, module._body, root, parent_run_id=parent_run_id)


def reproduce(
    root: Path | str,
    name: str,
    *,
    parent_run_id: str | None = None,
    force: bool = False,
    execute: Callable[[Path, str, str | None], None] = run_in_process,
) -> StageOutcome:
    """Bring stage `name` of the workspace `root` up to date; see the module docstring."""
    from dvc.stage.cache import RunCacheNotFoundError

    root = Path(root).resolve()
    started = time.perf_counter()
    repo = _repo(root)
    with _repo_lock, contextlib.chdir(root), repo.lock:
        (stage,) = repo.stage.collect(f"{dag.DVC_FILE}:{name}")
        if not force and not stage.changed():
            return _outcome(stage, "cached", "up-to-date", started)
        stage.remove_outs(ignore_remove=False, force=False)
        restored = False
        if not force:
            try:
                repo.stage_cache.restore(stage)
                restored = True
            except RunCacheNotFoundError:
                pass
        if not restored:
            stage.save_deps()
    if not restored:
        log.info("%s: running", name)
        execute(root, name, parent_run_id)
    with _repo_lock, contextlib.chdir(root), repo.lock:
        stage.save()  # hashes outputs and records the run-cache entry
        stage.commit()  # moves outputs into the DVC cache (links them back)
        stage.dump(update_pipeline=False)  # dvc.lock
    return _outcome(stage, "cached" if restored else "ran", "run-cache" if restored else "executed", started)


def _outcome(stage, status: str, reason: str, started: float) -> StageOutcome:
    outs = {out.def_path: out.hash_info.value for out in stage.outs if out.hash_info}
    return StageOutcome(stage.name, status, reason, round(time.perf_counter() - started, 3), outs)

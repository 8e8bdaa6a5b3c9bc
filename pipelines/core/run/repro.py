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

Concurrent runs (run workspaces of one project share its DVC cache) never compute the same thing
twice at once: step 3 holds a lock named by DVC's run-cache key (command + dependency hashes +
params) in `.qllm/locks/`. A second run that reaches the same stage with the same inputs waits,
then finds the first one's run-cache entry and restores it (step 2 again) instead of running.
Reads and writes of the run-cache itself take a project-wide lock too (`_run_cache_lock`): DVC
makes them safe within one repo, not across workspaces that share a cache.
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

from pipelines.core import dag, dvc_api, workspace
from pipelines.core.data import world

log = logging.getLogger("qllm.runner")


# One DVC Repo object per workspace, used by one thread at a time (DVC objects are not
# thread-safe); the stage itself runs outside this lock so parallel branches can overlap.
# DVC's internals (e.g. the run-cache) resolve paths against the current directory, as its CLI
# always runs from the repo root, so DVC steps run under chdir(root). Stage code only uses
# absolute paths, so this brief, serialised chdir cannot affect stages in other threads.
_repos: dict[Path, object] = {}
_remotes: dict[object, str | None] = {}
"""Per Repo object: its default remote once the run-cache entries were fetched from it (None: it
could not be reached, so this run goes without it)."""
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
    with _repo_lock:
        if root not in _repos:
            _repos[root] = dvc_api.open_repo(root)
        return _repos[root]


def close(root: Path | str) -> None:
    """Release the DVC repo object of a workspace (end of a pipeline run)."""
    with _repo_lock:
        repo = _repos.pop(Path(root).resolve(), None)
        if repo is not None:
            _remotes.pop(repo, None)
            repo.close()


_imports_lock = threading.Lock()


def warm_imports() -> None:
    """Resolve the transformers and PEFT names the stages use, one thread at a time.

    transformers 5 resolves its top-level names lazily (`_LazyModule`), and two threads resolving
    them at once can fail with "cannot import name 'AutoModelForCausalLM' from 'transformers'"
    (PEFT, which imports transformers, likewise). Stages run side by side in Prefect worker
    threads, so each calls this before it starts; after the first call it costs a lock.
    """
    with _imports_lock:
        from peft import LoraConfig, PeftModel, get_peft_model  # noqa: F401
        from transformers import (  # noqa: F401
            AutoModelForCausalLM,
            AutoTokenizer,
            LlamaConfig,
            LlamaForCausalLM,
            PreTrainedTokenizerFast,
        )


def run_in_process(root: Path, name: str, parent_run_id: str | None) -> None:
    """Execute `pipelines.<name>` in this process (what `python -m pipelines.<name>` runs)."""
    from pipelines.core.run import stage

    spec = dag.stages(root)[name]
    module = importlib.import_module(spec.module)
    if spec.always_changed:  # it reads the world (probe_device, base_model): milliseconds, no MLflow run
        world.execute(module.NAME, module.body, root)
        return
    if getattr(module, "IMPORTS_TRANSFORMERS", True):  # the data stages never do: no 5 s of imports for `qllm run --until prepare_data`
        warm_imports()
    stage.execute(module.NAME, module.body, root, parent_run_id=parent_run_id)


def reproduce(
    root: Path | str,
    name: str,
    *,
    parent_run_id: str | None = None,
    force: bool = False,
    execute: Callable[[Path, str, str | None], None] = run_in_process,
) -> StageOutcome:
    """Bring stage `name` of the workspace `root` up to date; see the module docstring."""
    root = Path(root).resolve()
    started = time.perf_counter()
    repo = _repo(root)
    with _repo_lock, contextlib.chdir(root), repo.lock, dvc_api.dependencies_hashed_once():
        (stage,) = repo.stage.collect(f"{dag.DVC_FILE}:{name}")
        if not force and not stage.changed():
            return _outcome(stage, "cached", "up-to-date", started)
        reads_world = stage.always_changed
        if not reads_world:
            stage.remove_outs(ignore_remove=False, force=False)
            restored = not force and _restore(root, repo, stage)
            if not restored:
                stage.save_deps()
                key = _run_cache_key(stage)
    if reads_world:
        return _read_world(root, repo, stage, parent_run_id, started)
    if restored:
        _commit(root, repo, stage)
        return _outcome(stage, "cached", "run-cache", started)
    with _same_inputs_lock(root, name, key):
        if not force:  # another run may have produced these outputs while we waited
            with _repo_lock, contextlib.chdir(root), repo.lock, dvc_api.dependencies_hashed_once():
                # A fresh stage object: `stage` now has the new dependency hashes next to the old
                # outputs' hashes, which `restore` would take for a run-cache entry.
                (fresh,) = repo.stage.collect(f"{dag.DVC_FILE}:{name}")
                if _restore(root, repo, fresh):
                    stage, restored = fresh, True
        if not restored:
            log.info("%s: running", name)
            execute(root, name, parent_run_id)
        _commit(root, repo, stage, ran=not restored)
    return _outcome(stage, "cached" if restored else "ran", "run-cache" if restored else "executed", started)


def _read_world(root: Path, repo, stage, parent_run_id: str | None, started: float) -> StageOutcome:
    """Run a stage that reads the world (`always_changed`: probe_device, base_model; milliseconds,
    in this process) and record it in dvc.lock only if what it wrote, its code or its params differ
    from the entry there: DVC's `status` then says nothing but "always changed". On a no-change run
    that skips rewriting dvc.lock twice, most of what a no-change `qllm run` cost. Its outputs are
    written atomically over the old ones, so they are not removed first."""
    run_in_process(root, stage.name, parent_run_id)
    with _repo_lock, contextlib.chdir(root), repo.lock:
        recorded = stage.status() == {stage.addressing: ["always changed"]}
    if not recorded:
        _commit(root, repo, stage)
    return _outcome(stage, "ran", "executed", started)


def unchanged(root: Path | str, names: list[str]) -> list[StageOutcome] | None:
    """The outcomes of bringing `names` (in DAG order) up to date when none of them is stale, else
    None (`check`)."""
    outcomes, stale = check(root, names)
    return None if stale is not None else outcomes


def check(root: Path | str, names: list[str]) -> tuple[list[StageOutcome], str | None]:
    """(the outcomes of `names`, in DAG order, up to the first stale one; its name, or None).

    What `dvc repro` does on a no-change run, without the work when something is stale: a stage
    with `always_changed` (probe_device, base_model: each reads the world in milliseconds) runs, as
    it would in any run (`_read_world`); then every other stage is checked with `stage.changed()`
    (as `dvc status` does) up to the first stale one. `dvc.yaml`, `dvc.lock` and each params file
    are parsed once for all of it (again only if a world-reading stage rewrote dvc.lock). So a run
    that then starts the full flow has only repeated those milliseconds. (An `always_changed`
    stage downstream of another stage would have to wait for it: then that stage counts as the
    first stale one.)
    """
    root = Path(root).resolve()
    lock = root / "dvc.lock"
    if names and not lock.exists():  # nothing has run here yet (a fresh clone): every stage is stale
        return [], names[0]
    first = [name for name in names if dag.stages(root)[name].always_changed]
    if waiting := [name for name in first if dag.upstream(root, name)]:
        return [], waiting[0]

    def parsed() -> tuple[object, dict]:
        repo = _repo(root)
        with _repo_lock, contextlib.chdir(root), repo.lock:
            return repo, {stage.name: stage for stage in repo.index.stages}

    before = lock.stat().st_mtime_ns if lock.exists() else None
    repo, stages = parsed()
    done = {name: _read_world(root, repo, stages[name], None, time.perf_counter()) for name in first}
    if (lock.stat().st_mtime_ns if lock.exists() else None) != before:
        close(root)  # a new Repo object reads the dvc.lock those stages rewrote
        repo, stages = parsed()
    with _repo_lock, contextlib.chdir(root), repo.lock:
        started = time.perf_counter()
        for name in names:
            if name not in done:
                if stages[name].changed():
                    return [done[n] for n in names if n in done], name
                done[name] = _outcome(stages[name], "cached", "up-to-date", started)
    return [done[name] for name in names], None


def _run_cache_lock(root: Path) -> contextlib.AbstractContextManager:
    """Held while this process reads or writes DVC's run-cache, which the project's workspaces share.

    DVC writes a run-cache entry as a temporary file in the entry's directory, then renames it;
    a reader lists that directory and loads the newest file, and deletes one it cannot parse as
    corrupted. `repo.lock` is per workspace, so without this lock another workspace's reader can
    load the writer's half-written temporary, delete it, and either the writer's rename or the
    reader's delete fails (FileNotFoundError). Taken innermost (after `repo.lock`) and held only
    for the restore or the save.
    """

    return workspace.project_lock(root, "run-cache", "DVC's run-cache")


def _remote(repo) -> str | None:
    """The project's default DVC remote, its run-cache entries fetched once per Repo object (once
    per `qllm run`: `close` drops the object at the end), or None when there is none. A remote
    that cannot be reached is warned about and treated as none: the run computes what it needs."""
    if (remote := dvc_api.default_remote(repo)) is None:
        return None
    with _repo_lock:
        if repo not in _remotes:
            try:
                new = dvc_api.pull_run_cache(repo)
            except Exception as exc:  # noqa: BLE001 - any transport or DVC error: the run goes on without the remote
                log.warning("DVC remote %r: could not fetch its run-cache (%s: %s); stages it holds will run here", remote, type(exc).__name__, exc)
                _remotes[repo] = None
            else:
                log.info("DVC remote %r: %d run-cache entries fetched", remote, new)
                _remotes[repo] = remote
        return _remotes[repo]


def _restore(root: Path, repo, stage) -> bool:
    """Outputs restored from DVC's run-cache (an entry for the same command, deps and params); with
    a default remote, from its run-cache too, downloading the stage's outputs."""
    with _run_cache_lock(root):
        if (remote := _remote(repo)) is not None:
            try:
                return dvc_api.restore_from_run_cache(repo, stage, pull=True)
            except Exception as exc:  # noqa: BLE001 - a remote that fails mid-way: the local cache, else run
                log.warning("DVC remote %r: could not restore %s from it (%s: %s)", remote, stage.name, type(exc).__name__, exc)
        return dvc_api.restore_from_run_cache(repo, stage)


def _commit(root: Path, repo, stage, ran: bool = False) -> None:
    """The stage's outputs into the DVC cache, its run-cache entry and `dvc.lock`; a stage that `ran`
    here is pushed to the default remote too (one restored came from a cache that has it)."""
    with _repo_lock, contextlib.chdir(root), repo.lock, dvc_api.dependencies_hashed_once():  # hashed anew: the stage has run
        stage.save(run_cache=False)  # hashes the outputs
        stage.commit()  # moves outputs into the DVC cache (links them back)
        with _run_cache_lock(root):  # the run-cache entry, published once the objects it names are cached
            repo.stage_cache.save(stage)
        dvc_api.dump_lock(stage)  # dvc.lock
        remote = _remote(repo) if ran and stage.outs else None
    if remote is not None:
        with _repo_lock, contextlib.chdir(root):  # `push` takes the repo's lock itself
            _push(repo, stage, remote)


def _push(repo, stage, remote: str) -> None:
    """The stage's outputs and the run-cache entries to the default remote, so that another machine
    restores this stage instead of computing it. A failure is warned about, not fatal: the outputs
    are in the local cache, and `dvc push --run-cache` sends them later."""
    try:
        sent = dvc_api.push(repo, stage, f"{dag.DVC_FILE}:{stage.name}")
    except Exception as exc:  # noqa: BLE001
        log.warning("DVC remote %r: could not push %s (%s: %s); `dvc push --run-cache` retries", remote, stage.name, type(exc).__name__, exc)
        return
    log.info("DVC remote %r: %s pushed (%d files sent)", remote, stage.name, sent)


def _run_cache_key(stage) -> str | None:
    """DVC's run-cache key of the stage (None for a stage DVC would not cache a run of)."""
    return dvc_api.run_cache_key(stage)


def _same_inputs_lock(root: Path, name: str, key: str | None) -> contextlib.AbstractContextManager:
    """Held while a stage with these exact inputs runs, by any workspace of the project."""

    if key is None:
        return contextlib.nullcontext()
    return workspace.project_lock(root, key, f"stage {name} with the same inputs (it runs once, then this run restores its outputs)")


def _outcome(stage, status: str, reason: str, started: float) -> StageOutcome:
    outs = {out.def_path: out.hash_info.value for out in stage.outs if out.hash_info}
    return StageOutcome(stage.name, status, reason, round(time.perf_counter() - started, 3), outs)

"""Where a pipeline run executes: the project itself, or a run workspace for overrides.

`qllm run` with no overrides runs in the project: `data/` and `dvc.lock` are the ones `dvc repro`
sees. With `--set`/`--params` the effective params differ from `params.yaml`, which we never edit,
so the run executes in `.qllm/runs/<hash of the effective params>/`: a DVC workspace holding the
same `dvc.yaml` and sources (code, `data/sources`), the effective `params.yaml`, and the project's
DVC cache. DVC's run-cache is keyed on (command, dependency hashes, params), so every stage whose
inputs did not change is restored from the cache rather than recomputed — the mechanism behind
`dvc exp run --temp`. Different overrides get different workspaces, so concurrent runs and sweeps
never write the same files; the same overrides reuse theirs.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import yaml

from pipelines.core import dag, dvc_api
from pipelines.core.errors import QllmError
from pipelines.core.outputs import digest, write_json, write_private
from pipelines.core.params import files as params_file
from pipelines.core.params.base import PARAMS_FILE
from pipelines.core.paths import MARKER, project_root

log = logging.getLogger("qllm.workspace")

RUNS_DIR = ".qllm/runs"
CHECKPOINTS_DIR = ".qllm/checkpoints"
LOCKS_DIR = ".qllm/locks"


def checkpoint_dir(root: Path | str, stage: str, fingerprint: str) -> Path:
    """Checkpoints of one stage configuration, shared by the project and its run workspaces."""
    return project_root(root) / CHECKPOINTS_DIR / stage / fingerprint[:16]


def _sync_file(src: Path, dst: Path) -> None:
    if dst.exists() and dst.read_bytes() == src.read_bytes():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def _mirror_dir(src: Path, dst: Path) -> None:
    """Replace `dst` by hard links to the files of `src` (a copy where links are not possible)."""
    if dst.exists():
        shutil.rmtree(dst)

    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(src, dst, copy_function=link)


def _cache_dir(root: Path) -> Path:
    return dvc_api.cache_dir(root)


def prepare(root: Path | str, params_data: dict[str, Any]) -> Path:
    """The directory a run with these effective params executes in (created/synced as needed)."""
    root = Path(root).resolve()
    if not (root / ".dvc").is_dir():
        raise QllmError(f"{root}: not a DVC project (no .dvc/ directory); run from the project root or `dvc init`")
    if params_data == params_file.read_yaml(root / PARAMS_FILE):
        return root
    ws = root / RUNS_DIR / digest(params_data)[:12]
    # Syncing replaces the mirrored sources: never while another run with the same overrides
    # executes in this workspace (it holds the same lock for its whole run).
    with locked(ws):
        _sync(root, ws, params_data)
    return ws


def _sync(root: Path, ws: Path, params_data: dict[str, Any]) -> None:
    (ws / ".dvc").mkdir(parents=True, exist_ok=True)
    configs = dvc_api.workspace_config(root, _cache_dir(root))  # the project's remotes too: a run here pushes and restores as the project does
    for name in ("config", "config.local"):
        path = ws / ".dvc" / name
        if name not in configs:
            path.unlink(missing_ok=True)
        elif name == "config.local":  # the remotes' credentials: owner-only, as in the project (never through the umask)
            if not path.exists() or path.read_text() != configs[name] or path.stat().st_mode & 0o077:
                write_private(path, configs[name])
        elif not path.exists() or path.read_text() != configs[name]:
            path.write_text(configs[name])
    for name in (dag.DVC_FILE, ".dvcignore"):
        if (root / name).exists():
            _sync_file(root / name, ws / name)
    for source in dag.source_paths(root):
        src = root / source
        if not src.exists():
            raise QllmError(f"{src}: listed as a dependency in dvc.yaml but does not exist")
        _mirror_dir(src, ws / source) if src.is_dir() else _sync_file(src, ws / source)
    params_text = yaml.safe_dump(params_data, sort_keys=False, allow_unicode=True)
    if not (ws / PARAMS_FILE).exists() or (ws / PARAMS_FILE).read_text() != params_text:
        (ws / PARAMS_FILE).write_text(params_text)
    if not (ws / MARKER).exists():
        write_json(ws / MARKER, {"project_root": str(root)})


@contextmanager
def file_lock(path: Path | str, what: str, timeout: float = -1) -> Iterator[None]:
    """Hold an inter-process lock on `path` (created if needed); log once if another holder makes us wait."""
    from filelock import FileLock, Timeout

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another qllm process is using %s; waiting for it to finish", what)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise QllmError(f"{what}: still in use by another qllm process after {timeout:.0f}s") from None
    try:
        yield
    finally:
        lock.release()


def project_lock(root: Path | str, name: str, what: str) -> AbstractContextManager[None]:
    """`file_lock` on `.qllm/locks/<name>.lock` of the project `root` belongs to: one lock for
    the project and all its run workspaces."""
    return file_lock(project_root(root) / LOCKS_DIR / f"{name}.lock", what)


@contextmanager
def locked(ws: Path | str, timeout: float = -1) -> Iterator[None]:
    """Hold the workspace for one pipeline run; a second run with the same workspace waits."""
    with file_lock(Path(ws) / ".dvc" / "tmp" / "qllm-run.lock", f"workspace {ws}", timeout):
        yield


@contextmanager
def checkpoint_lock(directory: Path | str) -> Iterator[None]:
    """Hold a stage's checkpoint directory while it trains. Workspaces share checkpoint
    directories (same stage inputs, same directory), so two concurrent runs that train the same
    stage take turns: the second resumes from the first one's checkpoints instead of writing,
    rotating and pruning the same directory at the same time."""
    directory = Path(directory)
    with file_lock(directory.with_name(directory.name + ".lock"), f"checkpoints {directory}"):
        yield

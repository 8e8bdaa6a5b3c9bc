"""Everything the pipeline asks of DVC, in one place: the only module that imports `dvc`,
`dvc_data` or `dvc_objects` (tests/core/test_dag.py keeps it so).

    md5(path)                    the md5 DVC records for a file or a directory (`<md5>.dir`)
    open_repo(root)              a `dvc.repo.Repo` of the project (or run workspace) at `root`
    cache_dir(root)              where its cache keeps objects
    run_cache_key(stage)         DVC's run-cache key of a stage (None: DVC would not cache a run of it)
    restore_from_run_cache(...)  a stage's outputs from the run-cache, False when it has no entry
                                 (`pull`: the outputs, and the run-cache's entries, from the default remote)
    default_remote(repo)         the project's default DVC remote (`dvc remote add -d`), or None
    pull_run_cache(repo)         the default remote's run-cache entries into the local cache
    push(repo, stage, target)    a stage's outputs (`cache: false` ones too) and the run-cache entries to the default remote
    dump_lock(stage)             the stage's entry in dvc.lock, as `stage.dump(update_pipeline=False)` writes it

`pipelines/core/run/repro.py` reproduces stages with these and the `Stage` objects DVC's public
API hands out (`changed`, `save`, `commit`, `dump`). Two needs have no public API: the run-cache
key (`dvc.stage.cache._can_hash`, `_get_stage_hash`); and two of DVC's YAML helpers, to read
params files once per content (`dvc.dependency.param.load_path`) and dvc.lock without the
round-trip parser (`dvc.utils.serialize._common._modify_data`, `_yaml.parse_yaml`, `_yaml._dump`).
They are used only on the DVC versions tested (`TESTED`, the range `pyproject.toml` pins), and
tests/core/test_dvc_api.py checks that the installed DVC is one of them and still has those names
with the signatures used here.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

TESTED = (">=3.50", "<3.68")
"""The DVC versions whose private names this module uses (pyproject.toml pins the same range)."""


def md5(path: Path | str) -> str:
    """The md5 DVC records for a file or directory (`<md5>.dir` for directories).

    Computed here without importing dvc_data (a tenth of a second in every stage process, and
    absent where the stages run without DVC: `benchmarks.gpu_check core`). A file's is the md5 of
    its bytes (DVC 3's `hash: md5`); a directory's is DVC's tree hash: the md5 of the JSON list of
    its files' `{"md5", "relpath"}`, sorted by relative path (dvc_data's `Tree.as_bytes`), plus
    `.dir`. tests/core/test_dvc_api.py checks both against dvc_data's `build`."""
    path = Path(path)
    if not path.is_dir():
        return _file_md5(path)
    entries = [{"md5": _file_md5(Path(folder) / name), "relpath": (Path(folder) / name).relative_to(path).as_posix()}
               for folder, _, names in os.walk(path) for name in names]  # fmt: skip
    entries.sort(key=lambda entry: entry["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def _file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def open_repo(root: Path | str):
    """A `dvc.repo.Repo` at `root` (DVC's own log quieted to warnings: ours says ran or cached)."""
    from dvc.repo import Repo

    logging.getLogger("dvc").setLevel(logging.WARNING)
    _read_params_once_per_content()
    return Repo(str(root))


def cache_dir(root: Path | str) -> Path:
    """Where the DVC cache of the project at `root` keeps its objects."""
    with open_repo(root) as repo:
        return Path(repo.cache.local_cache_dir)


def workspace_config(root: Path | str, cache: Path) -> dict[str, str]:
    """The DVC config files (`config`, `config.local`: their text) of a run workspace of the
    project at `root`: no git, the project's cache (`cache`), and the project's remotes and default
    remote, each at the level it was set (credentials stay in `config.local`), with local paths
    made absolute (a relative one names a place from the project's `.dvc/`)."""
    from io import BytesIO

    from configobj import ConfigObj
    from dvc.config import Config

    project = Config(dvc_dir=str(Path(root) / ".dvc"), validate=False)
    files = {}
    for level, name in (("repo", "config"), ("local", "config.local")):
        conf = project.load_one(level)  # paths resolved to absolute ones
        out: dict[str, Any] = {"core": {"no_scm": "true"}, "cache": {"dir": str(cache)}} if level == "repo" else {}
        if conf["core"].get("remote"):
            out.setdefault("core", {})["remote"] = conf["core"]["remote"]
        if conf["remote"]:
            out |= {f'remote "{remote}"': dict(options) for remote, options in sorted(conf["remote"].items())}  # DVC's section names
        if out or level == "repo":
            text = BytesIO()
            ConfigObj(out).write(text)
            files[name] = text.getvalue().decode()
    return files


def run_cache_key(stage) -> str | None:
    """DVC's run-cache key of `stage` (None for a stage DVC would not cache a run of). Private
    names: see the module docstring."""
    from dvc.stage.cache import _can_hash, _get_stage_hash

    return _get_stage_hash(stage) if _can_hash(stage) else None


def restore_from_run_cache(repo, stage, pull: bool = False) -> bool:
    """Restore `stage`'s outputs from DVC's run-cache; False when it has no entry for them. With
    `pull`, outputs missing from the local cache are downloaded from the default remote (as
    `dvc repro --pull` does): an entry whose objects the remote lacks too counts as none."""
    from dvc.stage.cache import RunCacheNotFoundError

    try:
        repo.stage_cache.restore(stage, pull=pull)
    except RunCacheNotFoundError:
        return False
    return True


def default_remote(repo) -> str | None:
    """The name of the project's default DVC remote (`dvc remote add -d NAME URL`), or None."""
    return repo.config["core"].get("remote") or None


def pull_run_cache(repo) -> int:
    """Download the default remote's run-cache entries (small YAML files naming outputs by hash;
    the outputs themselves come when a stage is restored); how many were new here."""
    return len(repo.stage_cache.pull(None))


def push(repo, stage, target: str) -> int:
    """Upload `stage`'s outputs (`target`: its `dvc.yaml:stage` address) and the local run-cache
    entries to the default remote; how many files were sent (what the remote had is skipped).

    `dvc push --run-cache` sends the entries and the cached outputs, but not the outputs marked
    `cache: false` (the metrics files) that DVC commits to the cache for the run-cache alone, so
    another machine's restore finds the entry but not all of its outputs, and runs the stage: they
    are pushed here as well."""
    sent = repo.push(targets=[target], run_cache=True)
    uncached = {out.hash_info for out in stage.outs if not out.use_cache and out.hash_info}
    if uncached:
        result = repo.cloud.push(uncached)
        if result.failed:
            raise OSError(f"could not push {len(result.failed)} of the outputs marked cache: false")
        sent += len(result.transferred)
    return sent


_PARSED_PARAMS: dict[str, Any] = {}
_PARSED_PARAMS_LOCK = threading.Lock()
PARSED_PARAMS_KEPT = 16
"""Params files' texts whose parse is kept (the newest; a run reads one or two)."""


def _read_params_once_per_content() -> None:
    """DVC parses params.yaml anew for every stage that lists params and for every check of one
    (status, the run-cache key, `save`), 14 ms a parse of the tiny profile's 12 kB on an AVX2-only
    EPYC: a tenth of a tiny `qllm run`'s working samples under py-spy. From the first Repo opened
    on, a YAML params file is parsed once per text (by DVC's own parser: the same values), and
    each caller gets its own copy. Other files, and a DVC whose reader is not where this expects
    it, are read as before."""
    from dvc.dependency import param
    from dvc.utils.serialize import LOADERS, load_yaml
    from dvc.utils.serialize._yaml import parse_yaml

    original = getattr(param, "load_path", None)
    if original is None or getattr(original, "qllm_once_per_content", False):
        return

    def load_path(fs_path, fs, **kwargs):
        if kwargs or LOADERS.get(fs.suffix(fs_path).lower()) is not load_yaml:
            return original(fs_path, fs, **kwargs)
        with fs.open(fs_path, encoding="utf-8") as file:  # as DVC's load_yaml reads it
            text = file.read()
        with _PARSED_PARAMS_LOCK:
            parsed = _PARSED_PARAMS.get(text)
        if parsed is None:
            parsed = parse_yaml(text, fs_path)
            with _PARSED_PARAMS_LOCK:
                _PARSED_PARAMS[text] = parsed
                while len(_PARSED_PARAMS) > PARSED_PARAMS_KEPT:
                    del _PARSED_PARAMS[next(iter(_PARSED_PARAMS))]
        return copy.deepcopy(parsed)

    load_path.qllm_once_per_content = True
    param.load_path = load_path


def dump_lock(stage) -> None:
    """The stage's entry in dvc.lock: what `stage.dump(update_pipeline=False)` writes, byte for
    byte, but with dvc.lock read by the safe YAML parser. DVC reads it with the round-trip one,
    which keeps a file's comments and formatting for the next write: dvc.lock has none (DVC writes
    it whole), and that parse is 6x slower (0.32 s against 0.05 s for the tiny profile's 58 kB
    dvc.lock on an AVX2-only EPYC, once per stage of every run, under the repo's lock)."""
    from dvc.stage import serialize
    from dvc.utils.serialize._common import _modify_data
    from dvc.utils.serialize._yaml import _dump, parse_yaml

    repo, lockfile = stage.repo, stage.dvcfile._lockfile
    entry = serialize.to_lockfile(stage)
    with _modify_data(lockfile.path, parse_yaml, _dump, fs=repo.fs) as data:  # DVC's `modify_yaml`, another parser
        if not data:
            data.update({"schema": "2.0"})  # first, as DVC writes it
        data["stages"] = data.get("stages", {})
        modified = data["stages"].get(stage.name, {}) != entry[stage.name]
        data["stages"].update(entry)
    if modified:
        repo.scm_context.track_file(lockfile.relpath)

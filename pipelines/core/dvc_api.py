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
    dependencies_hashed_once()   within it (one thread, no stage running), each dependency is hashed once
    parse_dvc_file(text, path)   DVC's parse of dvc.yaml or dvc.lock (dvc.lock's stage blocks each parsed once)

`pipelines/core/run/repro.py` reproduces stages with these and the `Stage` objects DVC's public
API hands out (`changed`, `save`, `commit`, `dump`). Three needs have no public API: the run-cache
key (`dvc.stage.cache._can_hash`, `_get_stage_hash`); DVC's YAML readers and writer, to parse
params files, dvc.yaml and dvc.lock once per content (`dvc.dependency.param.load_path`,
`read_param_file`, `dvc.utils.strictyaml.load`) and to write dvc.lock without the round-trip parser
and a stage's entry rendered once (`dvc.utils.serialize._yaml.parse_yaml`, `_yaml._dump`); and a
dependency's hash computed once per step of a stage's bookkeeping (`dvc.output.Output._build`).
They are used only on the DVC versions tested (`TESTED`, the range `pyproject.toml` pins), and
tests/core/test_dvc_api.py checks that the installed DVC is one of them and still has those names
with the signatures used here.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TESTED = (">=3.50", "<3.68")
"""The DVC versions whose private names this module uses (pyproject.toml pins the same range)."""


def md5(path: Path | str) -> str:
    """The md5 DVC records for a file or directory (`<md5>.dir` for directories).

    Computed here without importing dvc_data (a tenth of a second in every stage process, and
    absent where the stages run without DVC: `tools.gpu_check core`). A file's is the md5 of
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
    _read_yaml_once_per_content()
    _hash_dependencies_once_when_held()
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


class _Kept:
    """The newest `size` results of a costly, pure function of a key, shared by threads (a result
    is computed outside the lock: two threads may compute the same one, and either is kept)."""

    def __init__(self, size: int):
        self.size = size
        self._items: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def get(self, key, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                return self._items[key]
        value = compute()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                del self._items[next(iter(self._items))]
        return value


_PARSED_PARAMS = _Kept(16)
"""Params files' parses by text (the newest; a run reads one or two)."""
_PARSED_DVC_FILES = _Kept(16)
"""dvc.yaml's and dvc.lock's parses by text: a run's dvc.yaml, and dvc.lock as it grows by one
stage at a time (`dump_lock` reads the text the stage's collection read)."""
_VALID_DVC_FILES = _Kept(16)
"""(text, schema) pairs that passed DVC's validation."""
_PARAM_VALUES = _Kept(256)
"""A params file's values for a dependency's keys, by (path, text, keys, flatten): a run's stages' keys."""


def _read_yaml_once_per_content() -> None:
    """DVC parses params.yaml anew for every stage that lists params and for every check of one
    (status, the run-cache key, `save`), and again into the context of dvc.yaml's interpolation at
    every collection of a stage, 14 ms a parse of the tiny profile's 12 kB on an AVX2-only EPYC: a
    tenth of a tiny `qllm run`'s working samples under py-spy (the interpolation's parses alone,
    still uncached, were 6% of the suite's in-process CPU in 2026-11-29's profile). It parses and validates
    dvc.yaml and dvc.lock anew for every stage it collects, 0.15 s a collection of one stage there
    (the 58 kB dvc.lock most of it): with the lock written once per stage, a fifth of the tiny
    pipeline's CPU in tests/e2e/test_pipeline_e2e.py under py-spy. From the first Repo opened on,
    each of those files is parsed (and validated) once per text, by DVC's own parser and schema
    (dvc.lock one stage's block at a time: `parse_dvc_file`), and each caller gets its own copy.
    A text that fails to parse or validate, other files, the round-trip parse, and a DVC whose
    readers are not where this expects them go DVC's own way."""
    from dvc.dependency import param
    from dvc.utils import serialize, strictyaml
    from dvc.utils.serialize import LOADERS, load_yaml
    from dvc.utils.serialize._yaml import YAMLFileCorruptedError, parse_yaml
    from voluptuous import MultipleInvalid

    # Params files are read through `load_path`: the name param.py imported (a stage's params
    # dependencies), and `dvc.utils.serialize.load_path` itself, which `Context.load_from` imports
    # at each call (params.yaml in the context dvc.yaml's interpolation reads, for every collection)
    original_params = getattr(serialize, "load_path", None)
    if original_params is not None and not getattr(original_params, "qllm_once_per_content", False):

        def load_path(fs_path, fs, **kwargs):
            if kwargs or LOADERS.get(fs.suffix(fs_path).lower()) is not load_yaml:
                return original_params(fs_path, fs, **kwargs)
            with fs.open(fs_path, encoding="utf-8") as file:  # as DVC's load_yaml reads it
                text = file.read()
            return copy.deepcopy(_PARSED_PARAMS.get(text, lambda: parse_yaml(text, fs_path)))

        load_path.qllm_once_per_content = True
        load_path.__wrapped__ = original_params  # inspect.signature shows DVC's (tests/core/test_dvc_api.py)
        serialize.load_path = load_path
    if getattr(param, "load_path", None) is original_params:
        param.load_path = serialize.load_path

    # A params dependency's values (`ParamsDependency.read_params`, at each status, hash and save of
    # it: ten times a stage) are the file's keys picked out with dpath, which walks the whole file
    # for each key: 3 ms a key for the tiny profile's params.yaml, on top of a copy of it all
    original_values = getattr(param, "read_param_file", None)
    if original_values is not None and not getattr(original_values, "qllm_once_per_content", False):

        def read_param_file(fs, path, key_paths=None, flatten=False, **load_kwargs):
            if load_kwargs:
                return original_values(fs, path, key_paths, flatten, **load_kwargs)
            try:
                with fs.open(path, encoding="utf-8") as file:
                    text = file.read()
            except (OSError, UnicodeDecodeError):  # DVC's reader raises its own error for it
                return original_values(fs, path, key_paths, flatten)
            key = (path, text, tuple(key_paths) if key_paths else None, flatten)
            return copy.deepcopy(_PARAM_VALUES.get(key, lambda: original_values(fs, path, key_paths, flatten)))

        read_param_file.qllm_once_per_content = True
        read_param_file.__wrapped__ = original_values
        param.read_param_file = read_param_file

    original_load = getattr(strictyaml, "load", None)
    if original_load is not None and not getattr(original_load, "qllm_once_per_content", False):

        def load(path, schema=None, fs=None, encoding="utf-8", round_trip=False):
            if round_trip or fs is None:
                return original_load(path, schema, fs, encoding, round_trip)
            try:
                with fs.open(path, encoding=encoding) as file:  # as DVC's strictyaml.load reads it
                    text = file.read()

                data = _PARSED_DVC_FILES.get(text, lambda: parse_dvc_file(text, path))

                def valid() -> bool:
                    schema(data)  # voluptuous: raises on an invalid file
                    return True

                if schema:  # DVC's schemas are class constants
                    _VALID_DVC_FILES.get((text, id(schema)), valid)
            except (OSError, UnicodeDecodeError, YAMLFileCorruptedError, MultipleInvalid):  # DVC's reader raises its own error for it
                return original_load(path, schema, fs, encoding, round_trip)
            return copy.deepcopy(data), text

        load.qllm_once_per_content = True
        load.__wrapped__ = original_load
        strictyaml.load = load


_held = threading.local()


@contextlib.contextmanager
def dependencies_hashed_once() -> Iterator[None]:
    """Within: each dependency object's hash is computed once in this thread (`Output._build`, which
    `get_hash` and `save` call), and the result is reused for the rest of the block.

    DVC hashes a stage's dependencies anew at every look: `restore` and `save` of the run-cache check
    each has a hash (`_can_hash`) then hash them again for the key (`_get_stage_hash`), `save_deps`
    and `Stage.save` once more, a file's hash a lookup in DVC's state database each time: eight
    times around a run-cache restore of a stage (tests/core/run/test_repro.py). Use it only where
    the dependencies cannot change: one stage's bookkeeping under its workspace's `repo.lock`, with
    no stage running in between (a stage may write what it reads; its outputs are never held: a
    restore writes them). Nested blocks share the outer one's hashes."""
    if getattr(_held, "builds", None) is not None:
        yield
        return
    _held.builds = {}
    try:
        yield
    finally:
        _held.builds = None


def _hash_dependencies_once_when_held() -> None:
    """Install the hold `dependencies_hashed_once` reads (once; outside one it changes nothing)."""
    from dvc.output import Output

    original = Output.__dict__.get("_build")
    if original is None or getattr(original, "qllm_held", False):
        return

    def _build(self, *args, **kwargs):
        builds = getattr(_held, "builds", None)
        if builds is None or not self.IS_DEPENDENCY or len(args) != 4 or not set(kwargs) <= {"ignore", "dry_run"}:
            return original(self, *args, **kwargs)
        # `get_hash` and `save` build with (odb, fs_path, fs, hash_name), the object's own ignore
        # rules, and dry_run (False unless given)
        odb, fs_path, _, hash_name = args
        key = (id(self), id(odb), fs_path, hash_name, bool(kwargs.get("dry_run", False)))
        if key not in builds:
            builds[key] = (self, original(self, *args, **kwargs))  # the object kept, so its id stays its own
        return builds[key][1]

    _build.qllm_held = True
    _build.__wrapped__ = original
    Output._build = _build


def dump_lock(stage) -> None:
    """The stage's entry in dvc.lock: what `stage.dump(update_pipeline=False)` writes, byte for
    byte, at a fraction of the cost.

    DVC reads dvc.lock with the round-trip parser (to keep comments: dvc.lock has none, DVC writes
    it whole) and dumps the whole file with the pure-Python round-trip emitter: 0.32 s and 0.20 s
    for the tiny profile's 58 kB dvc.lock on an AVX2-only EPYC, once per stage of every run, under
    the repo's lock. Here it is read with the safe parser (`_read_yaml_once_per_content` keeps the
    parse of a text it has seen), and written as DVC's dumper writes it stage by stage: a stage's
    block of the file is DVC's dump of that stage alone (the file is a header and the blocks in
    order; tests/core/run/test_repro.py checks the bytes against DVC's whole dump), so a block is
    rendered once per entry (`_lock_block`) and the others are reused. The file is replaced
    atomically (DVC truncates and rewrites it in place)."""
    from dvc.stage import serialize

    repo, lockfile = stage.repo, stage.dvcfile._lockfile
    entry = serialize.to_lockfile(stage)
    path = lockfile.path
    data = {}
    if repo.fs.exists(path):
        with repo.fs.open(path, encoding="utf-8") as file:
            text = file.read()
        data = copy.deepcopy(_PARSED_DVC_FILES.get(text, lambda: parse_dvc_file(text, path))) or {}
    if not data:
        data = {"schema": "2.0"}  # first, as DVC writes it
    data["stages"] = data.get("stages") or {}
    modified = data["stages"].get(stage.name, {}) != entry[stage.name]
    data["stages"].update(entry)
    tmp = Path(f"{path}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(_lock_text(data), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if modified:
        repo.scm_context.track_file(lockfile.relpath)


_LOCK_HEADER = "schema: '2.0'\nstages:\n"
_LOCK_BLOCK_START = re.compile(r"^  [^\s#]", re.MULTILINE)
_PARSED_LOCK_BLOCKS = _Kept(512)
"""dvc.lock's stage blocks' parses by the block's text: a few runs' worth of every stage's entries."""


def parse_dvc_file(text: str, path: str) -> Any:
    """DVC's parse of a dvc.yaml's or dvc.lock's `text` (`parse_yaml`), dvc.lock block by block.

    Every stage's commit rewrites dvc.lock with one block changed, and the next collection of a
    stage parsed all of it again: 50 ms for the tiny profile's 60 kB, for each of its 19 stages, and
    growing with the number of stages. dvc.lock as DVC writes it (`dump_lock` too) is the header,
    then one block per stage at two spaces' indent, each a mapping of its own, so its parse is the
    header's and the blocks' parses (each kept by its text) joined in order. Any other text (a file
    that is not a dvc.lock, an anchor or alias that could tie blocks together, a comment, a line
    outside the blocks, a stage named twice) is parsed whole, as DVC parses it."""
    from dvc.utils.serialize._yaml import parse_yaml

    if os.path.basename(path) != "dvc.lock" or not text.startswith(_LOCK_HEADER) or "&" in text or "*" in text:
        return parse_yaml(text, path)
    body = text[len(_LOCK_HEADER) :]
    starts = [match.start() for match in _LOCK_BLOCK_START.finditer(body)]
    if not starts or starts[0] != 0 or any(line and not line.startswith("  ") for line in body.splitlines()):
        return parse_yaml(text, path)
    stages: dict[str, Any] = {}
    for start, end in zip(starts, [*starts[1:], len(body)], strict=True):
        block = body[start:end]
        try:
            parsed = _PARSED_LOCK_BLOCKS.get(block, lambda block=block: parse_yaml("stages:\n" + block, path))
        except Exception:  # noqa: BLE001 - the whole file's parse raises DVC's error, with the file's line numbers
            return parse_yaml(text, path)
        entries = list(parsed["stages"].items()) if isinstance(parsed, dict) and list(parsed) == ["stages"] and isinstance(parsed["stages"], dict) else []
        if len(entries) != 1 or entries[0][0] in stages:
            return parse_yaml(text, path)
        stages[entries[0][0]] = entries[0][1]
    return {"schema": "2.0", "stages": stages}


_LOCK_BLOCKS = _Kept(256)
"""Rendered dvc.lock blocks by (name, entry): a few runs' worth of every stage's entries."""


def _lock_text(data: dict) -> str:
    """dvc.lock's text for `data` as DVC's dumper writes it: the header, then each stage's block
    (rendered once per entry). Anything but DVC's two top-level keys is dumped whole, DVC's way."""
    from dvc.utils.serialize._yaml import _dump

    def dumps(value: dict) -> str:
        stream = io.StringIO()
        _dump(value, stream)
        return stream.getvalue()

    if list(data) != ["schema", "stages"] or not data["stages"] or _shared(data):
        return dumps(data)
    return dumps({"schema": data["schema"]}) + "stages:\n" + "".join(_lock_block(name, entry, dumps) for name, entry in data["stages"].items())


def _shared(data) -> bool:
    """Whether a list or mapping is met twice in `data`: DVC's dumper writes it once with an
    anchor (`&id001`), numbered across the whole file, which a stage's block alone would not."""
    seen, todo = set(), [data]
    while todo:
        item = todo.pop()
        if isinstance(item, dict | list):
            if id(item) in seen:
                return True
            seen.add(id(item))
            todo.extend(item.values() if isinstance(item, dict) else item)
    return False


def _lock_block(name: str, entry: dict, dumps) -> str:
    """A stage's lines in dvc.lock (`stages:`'s `  name:` and what it holds): DVC's dump of the
    stage alone under `stages:`, kept per (name, entry) by its repr, so types and order count."""
    key = repr((name, entry))  # for YAML's plain values and containers, their types and order
    return _LOCK_BLOCKS.get(key, lambda: dumps({"stages": {name: entry}}).removeprefix("stages:\n"))

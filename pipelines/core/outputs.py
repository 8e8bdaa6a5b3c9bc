"""Atomic stage outputs: write into a temporary sibling, rename into place only when complete.

A stage killed half-way (even by SIGKILL) leaves at most a `.tmp-<name>-<pid>-*` sibling, never
a directory or file that looks finished. The temporary is a sibling, never inside a DVC output, so
DVC does not see it: `dvc status` reports the stage's output as missing (changed), and the next
write of the same output removes the leftover first, unless the process that made it is still
alive: two runs may write one shared file (the machine's `.qllm/device-probe.json`) at once.

The finished output gets the permissions a plain write would have given it under the process's
umask (0755 directories, 0644 files under the usual 022), not the owner-only ones of Python's
temporaries: on a team's shared checkout the others can read what a run wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clean_stale_temps(parent: Path, name: str) -> None:
    """Remove temporaries a killed run left next to `parent/name`: those of `name` (not of a
    longer name that starts with it) whose process is gone, or that carry no process id (older
    runs). A live process's temporary is another writer's work in progress, left alone."""
    if not parent.is_dir():
        return
    ours = re.compile(rf"{re.escape(TMP_PREFIX + name)}-(?:(\d+)-)?[^-]+")
    for candidate in parent.glob(f"{TMP_PREFIX}{name}-*"):
        match = ours.fullmatch(candidate.name)
        if match and not (match.group(1) and _alive(int(match.group(1)))):
            _remove(candidate)


def _umask() -> int:
    """The process's umask, read without changing it (Linux's /proc; elsewhere the usual 022):
    `os.umask` sets while it reads, which would race with the stages writing in other threads."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:  # no /proc (macOS, Windows): the usual umask
        return 0o022
    found = re.search(r"^Umask:\s+([0-7]+)$", status, flags=re.M)
    return int(found.group(1), 8) if found else 0o022


def _prefix(path: Path) -> str:
    return f"{TMP_PREFIX}{path.name}-{os.getpid()}-"


@contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces `path` when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path.parent, path.name)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(path), dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's is owner-only
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove(path)
    os.replace(tmp, path)


@contextmanager
def atomic_file(path: Path | str) -> Iterator[Path]:
    """Yield a temporary file path that replaces `path` when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path.parent, path.name)
    fd, name = tempfile.mkstemp(prefix=_prefix(path), dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's is owner-only
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_private(path: Path | str, text: str) -> None:
    """Write `text` (a secret: passwords, a remote's credentials) to `path` readable by its owner
    only, whatever the umask: into a new file created 0600 beside it, then renamed over `path`, so
    neither an existing file with wider permissions nor a half-written one ever holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=_prefix(path))  # created 0600, O_EXCL
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(name, 0o600)
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def write_json(path: Path | str, data: Any) -> None:
    """Atomically write pretty, key-sorted JSON (stable bytes for DVC)."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")


def sha256_file(path: Path | str) -> str:
    """SHA-256 of a file's bytes, read a megabyte at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: Path | str) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def record_batches(path: Path | str, batch_size: int, columns: list[str] | None = None) -> Iterator[Any]:
    """A Parquet file's rows as pyarrow `RecordBatch`es of at most `batch_size` rows (`columns`, or
    all), never the whole file: what the data stages stream their inputs with."""
    import pyarrow.parquet as pq

    # pre_buffer=False: with pyarrow's default (True) the reader keeps every column chunk it has
    # read until the file is closed, so memory would grow with the file instead of the batch.
    with pq.ParquetFile(path, pre_buffer=False) as source:
        yield from source.iter_batches(batch_size=batch_size, columns=columns)


# ------------------------------------------------- params as plain data: MLflow keys, names of runs


def to_plain(model: Any) -> dict[str, Any]:
    """A JSON-safe dict of a params model (a pydantic model: imported by none of this module, which
    the GPU machines without pydantic import)."""
    return model.model_dump(mode="json")


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested params to dotted keys (`pretrain.train.lr`) for MLflow."""
    if hasattr(data, "model_dump"):
        data = to_plain(data)
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(data, list) and data and all(isinstance(item, dict) for item in data):
        out = {}
        for index, item in enumerate(data):
            out.update(flatten(item, f"{prefix}{index}."))
        return out
    return {prefix.rstrip("."): data}


def digest(data: Any) -> str:
    """Stable SHA-256 of JSON-able data (used to name run workspaces and checkpoint dirs)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()

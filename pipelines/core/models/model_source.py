"""Where a base model comes from, for the `base_model` stage and everything that loads the base.

A record (what the stage writes to `data/base_model.json`) is `{"name": null}` when the pipeline
pretrains its own model, else the name as given, its `kind` (`hub`, `local` or `gguf`) and what
identifies its content: the commit a hub revision resolves to, the DVC md5 of a local
`save_pretrained` directory, or the md5 of a GGUF file (`pipelines.core.models.gguf_import`). When
`pretrain` trains nothing from a hub or directory base its output holds only a pointer (`POINTER`,
the same record) that `follow` resolves, so every stage that loads `data/models/pretrain` gets the
base; a GGUF base is converted there once instead (read by transformers' GGUF loader, dequantized).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pipelines.core.errors import QllmError
from pipelines.core.models import gguf_import
from pipelines.core.outputs import read_json
from pipelines.core.paths import project_root

RECORD = "data/base_model.json"
"""What the `base_model` stage writes (its `dvc.yaml` out)."""
POINTER = "base_model.json"
"""In `data/models/pretrain/` when `pretrain` trained nothing: the record of `OUT`."""
CHAT_TEMPLATE = "chat_template"
"""A record's key for the text of `base_model.chat_template_path`, which replaces the base's
template wherever its tokenizer is taken (`with_chat_template`)."""
# A hub repo id: `name` or `namespace/name`. Anything else (an absolute path, `./x`, `a/b/c`, ...)
# can only be a local directory, and so can a path under the project's `data/`.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
"""What `snapshot_download` fetches: config, weights, tokenizer and chat template files (no
duplicate `.bin`/`.onnx`/`.gguf` weights)."""


def local_model_dir(path: Path | str) -> Path | None:
    """The local directory `path` names, or None when it is a hub id to look up.

    A `Path`, an existing path and a string that cannot be a hub id (see `HUB_ID`) or lies under
    `data/` are local: when missing, a `QllmError` says so instead of the hub's "Repo id must be in
    the form ..." (the path taken for a repo id).
    """
    local = Path(path)
    if local.exists():
        if not local.is_dir():
            raise QllmError(f"{path}: not a directory (expected a save_pretrained model directory or a hub id)")
        return local
    text = str(path)
    if isinstance(path, Path) or not HUB_ID.fullmatch(text) or text.startswith("data/"):
        raise QllmError(f"{path}: no such model directory (expected a save_pretrained directory or a hub id)")
    return None


def model_location(name: str | Path, root: Path | str) -> Path | str:
    """Where a model named in params or an adapter's config is: an absolute path, a path relative
    to the project `root` (never to the current directory), or a hub id (returned as the string).

    A name that exists under `root`, or cannot be a hub id (see `HUB_ID`), or lies under `data/`
    is a local path under `root`; loading a missing one is then a clear "no such model directory"."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path
    local = Path(root) / path
    text = str(name)
    if isinstance(name, Path) or local.exists() or not HUB_ID.fullmatch(text) or text.startswith("data/"):
        return local
    return text


def hub_snapshot(name: str, revision: str | None) -> Path:
    """The local snapshot directory of a hub model at `revision` (downloaded when online, from the
    cache when `HF_HUB_OFFLINE=1`); its name is the commit."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, HFValidationError, OSError) as exc:
        at = f" at revision {revision!r}" if revision else ""
        raise QllmError(f"base_model.name={name!r}{at}: cannot fetch it from the Hugging Face hub or find it in the local cache ({exc})") from None


def location(record: dict[str, Any], root: Path) -> Path:
    """The local directory to load a recorded base from (the hub snapshot for a hub model, the
    file itself for a GGUF file)."""
    if record.get("kind") == "hub":
        return hub_snapshot(record["name"], record["revision"])
    if record.get("kind") == "gguf":
        return gguf_import.locate(record["name"], root)
    path = Path(record["name"])
    return path if path.is_absolute() else root / path


def follow(model_dir: Path | str) -> Path | str:
    """`model_dir` itself, or the base model its pointer names (`data/models/pretrain` when
    `pretrain` trained nothing). Relative names are relative to the project that holds it."""
    pointer = Path(model_dir) / POINTER
    if not pointer.is_file():
        return model_dir
    record = read_json(pointer)
    return location(record, project_root(Path(model_dir).resolve().parents[2]))


def with_chat_template(tokenizer, record: dict[str, Any] | None):
    """`tokenizer` with the chat template a base's record carries (`CHAT_TEMPLATE`), if any."""
    if record and record.get(CHAT_TEMPLATE) is not None:
        tokenizer.chat_template = record[CHAT_TEMPLATE]
    return tokenizer


def pointed(model_dir: Path | str) -> dict[str, Any] | None:
    """The record of the base a pointer directory names, else None (a real model directory)."""
    pointer = Path(model_dir) / POINTER
    return read_json(pointer) if pointer.is_file() else None


def display_name(record: dict[str, Any]) -> str:
    """`name@commit` for a hub model, the name as given for a local one."""
    return f"{record['name']}@{record['revision']}" if record.get("kind") == "hub" else record["name"]


def current(root: Path) -> dict[str, Any]:
    """The record the `base_model` stage wrote (`{"name": null}` when it has not run)."""
    path = root / RECORD
    return read_json(path) if path.exists() else {"name": None}

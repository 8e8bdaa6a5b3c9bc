"""Where a base model comes from, for the `base_model` stage and everything that loads the base.

A record (what the stage writes to `data/base_model.json`) is `{"name": null}` when the pipeline
pretrains its own model, else the name as given and what identifies its content: the commit a hub
revision resolves to, or the DVC md5 of a local `save_pretrained` directory. When `pretrain` trains
nothing its output holds only a pointer (`POINTER`, the same record) that `follow` resolves, so
every stage that loads `data/models/pretrain` gets the base.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import QllmError
from pipelines.core.outputs import read_json

if TYPE_CHECKING:  # the base_model stage reads the world on every run: no schema import unless a base is named
    from pipelines.core.config import BaseModelParams

RECORD = "data/base_model.json"
"""What the `base_model` stage writes (its `dvc.yaml` out)."""
POINTER = "base_model.json"
"""In `data/models/pretrain/` when `pretrain` trained nothing: the record of `OUT`."""
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
"""What `snapshot_download` fetches: config, weights, tokenizer and chat template files (no
duplicate `.bin`/`.onnx`/`.gguf` weights)."""


def _local(name: str, root: Path) -> Path | None:
    from pipelines.core.models import local_model_dir, model_location

    location = model_location(name, root)
    return local_model_dir(location) if isinstance(location, Path) else None  # a Path: missing -> a clear error


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


def resolve(params: BaseModelParams, root: Path) -> dict[str, Any]:
    """What `OUT` records: the name as given and what identifies its content."""
    if params.name is None:
        return {"name": None}
    from pipelines.core import dag, models  # torch and transformers: only for a base model
    local = _local(params.name, root)
    if local is not None:
        if params.revision is not None:
            raise QllmError(f"base_model.revision={params.revision!r}: a revision applies to hub models, but {params.name!r} is a local directory")
        models.load_tokenizer(local)  # a clear error now, not in the first training stage
        models.check_model_files(local)
        return {"name": params.name, "kind": "local", "md5": dag.dvc_md5(local)}
    snapshot = hub_snapshot(params.name, params.revision)
    return {"name": params.name, "kind": "hub", "revision": snapshot.name}


def location(record: dict[str, Any], root: Path) -> Path:
    """The local directory to load a recorded base from (the hub snapshot for a hub model)."""
    if record.get("kind") == "hub":
        return hub_snapshot(record["name"], record["revision"])
    path = Path(record["name"])
    return path if path.is_absolute() else root / path


def follow(model_dir: Path | str) -> Path | str:
    """`model_dir` itself, or the base model its pointer names (`data/models/pretrain` when
    `pretrain` trained nothing). Relative names are relative to the project that holds it."""
    pointer = Path(model_dir) / POINTER
    if not pointer.is_file():
        return model_dir
    from pipelines.core.workspace import project_root

    record = read_json(pointer)
    return location(record, project_root(Path(model_dir).resolve().parents[2]))


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

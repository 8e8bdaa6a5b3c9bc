"""Resolve the model the fine-tuning stages start from, so DVC sees when it changes.

    python -m pipelines.base_model   # what dvc.yaml runs (always: `always_changed: true`); writes data/base_model.json

With `base_model.name: null` (the default) the pipeline pretrains its own model and this stage
writes `{"name": null}`. With a name, the pipeline fine-tunes that model instead:

- a `save_pretrained` directory (relative to the project, or absolute) is recorded with the DVC md5
  of its content: edit a weight or the tokenizer and everything downstream reruns;
- a hub id is fetched (`huggingface_hub.snapshot_download`; offline, from the local cache) and
  recorded with the commit its `revision` resolves to: a new commit on the branch, or another
  revision, reruns everything downstream; the same commit keeps every stage cached.

`train_tokenizer` then saves the base model's tokenizer instead of training one, `tokenize`
encodes the text with it (for the validation perplexity `evaluate` reports), and `pretrain`
trains nothing: its output `data/models/pretrain/` holds only a pointer, `base_model.json`, that
`pipelines.models` follows when loading. sft, probe_lora and lora (`base_model:
data/models/pretrain`), and through them ref_logprobs, dpo, evaluate and register, all use the base.

Like `probe_device` this is DVC's idiom for state outside the repository: the stage runs on every
`dvc repro`/`qllm run` and, when its output keeps its bytes, nothing downstream is stale. The
output holds the name as given (no absolute path of this machine unless the name is one) and the
content hash or commit, nothing that varies between runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipelines import stage
from pipelines.config import BaseModelParams
from pipelines.errors import QllmError
from pipelines.outputs import read_json, write_json

NAME = "base_model"
OUT = "data/base_model.json"
POINTER = "base_model.json"
"""In `data/models/pretrain/` when `pretrain` trained nothing: the record of `OUT`."""
TRACKED = False
"""No MLflow run: it runs on every pipeline run; the base is in the training stages' lineage."""
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
"""What `snapshot_download` fetches: config, weights, tokenizer and chat template files (no
duplicate `.bin`/`.onnx`/`.gguf` weights)."""


def _local(name: str, root: Path) -> Path | None:
    from pipelines.models import local_model_dir

    path = Path(name)
    candidate = path if path.is_absolute() else root / path
    return local_model_dir(candidate) if candidate.exists() else local_model_dir(name)


def hub_snapshot(name: str, revision: str | None) -> Path:
    """The local snapshot directory of a hub model at `revision` (downloaded when online, from the
    cache when `HF_HUB_OFFLINE=1`); its name is the commit."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, HFValidationError, OSError) as exc:
        at = f" at revision {revision!r}" if revision else ""
        raise QllmError(f"base_model.name={name!r}{at}: cannot fetch it from the Hugging Face hub or find it in the local cache ({exc})") from None


def resolve(params: BaseModelParams, root: Path) -> dict[str, Any]:
    """What `OUT` records: the name as given and what identifies its content."""
    if params.name is None:
        return {"name": None}
    from pipelines import dag, models  # torch and transformers: only for a base model
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
    from pipelines.workspace import project_root

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
    path = root / OUT
    return read_json(path) if path.exists() else {"name": None}


def run(root: Path, out: Path, params: BaseModelParams) -> dict[str, Any]:
    from pipelines.workspace import project_root

    record = resolve(params, project_root(root))
    write_json(out, record)
    return record


def _body(ctx: stage.StageContext) -> dict:
    record = run(ctx.root, ctx.path(OUT), ctx.params)
    if record["name"] is None:
        ctx.log.info("base model: pretrained here (base_model.name is null)")
    else:
        ctx.log.info("base model: %s (%s)", record["name"], record.get("revision") or record.get("md5"))
    return {"fine_tuning": record["name"] is not None}


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, _body, argv, tracked=TRACKED)


if __name__ == "__main__":
    raise SystemExit(main())

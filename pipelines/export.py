"""The optional export stage: the model as GGUF files for llama.cpp and Ollama, and a Modelfile.

    python -m pipelines.export       # what dvc.yaml runs; writes data/export/
    qllm run --params params/export.yaml                 # the pipeline with this stage on
    llama-cli -m data/export/qllm-q8_0.gguf -cnv         # llama.cpp's chat, with the model's template
    ollama create qllm -f data/export/Modelfile && ollama run qllm

With `export.enabled: false` (the default) it writes only a README: no model is loaded, no cost.
Enabled, it loads the model of `export.model` (null: the one `register.model` registers; a LoRA
adapter is merged into its base first) and writes one GGUF file per entry of `export.types`
(`<register.model_name>-<type>.gguf`) with `pipelines.core.models.gguf_export`: the tokenizer
(tokens, merges, special tokens) and the chat template in the file's metadata, so llama.cpp,
llama-cpp-python and Ollama apply the same chat format as `qllm generate`. The K-quants come from
llama.cpp's own quantizer (llama-cpp-python) run on the f16 file. `Modelfile` (Ollama) names the
`export.modelfile_type` file, the template in Ollama's language, the stop tokens and greedy decoding.
`export.json` lists each file with its type, size and sha256. `register` (which runs after this
stage) attaches the files to the registry version when they are of the model it registers.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pipelines.core import paths
from pipelines.core.data import chat_template
from pipelines.core.errors import QllmError
from pipelines.core.models import gguf_export
from pipelines.core.models.models import load_for_inference, stop_token_ids
from pipelines.core.outputs import atomic_dir, write_json
from pipelines.core.run import stage

NAME = "export"
RECORD = "export.json"
MODELFILE = "Modelfile"

NO_IMAGE_MODEL = "the multimodal model is not exported to GGUF here (llama.cpp needs its vision tower as a separate mmproj file)"

DISABLED_README = """\
# Export stage disabled

`export.enabled` is false, so no GGUF file was written. To write the registered model as GGUF
(f16 and q8_0) with an Ollama Modelfile: `qllm run --params params/export.yaml`
(docs/export.md "GGUF for llama.cpp and Ollama").
"""

README = """\
# {name}: GGUF files of the {stage} model

Written by the export stage (`pipelines/export.py`) from `{source}`; the tokenizer and its chat
template are in each file's metadata. Files: {files}.

    llama-cli -m {first} -cnv                      # llama.cpp's chat (its template from the file)
    python -c "from llama_cpp import Llama; print(Llama('{first}').create_chat_completion([{{'role': 'user', 'content': 'Hi'}}]))"
{ollama}
"""


def file_name(model_name: str, kind: str) -> str:
    return f"{model_name}-{kind}.gguf"


def export(root: Path, model_dir: Path, out: Path, params, model_name: str, stage_name: str, log=None) -> dict[str, Any]:
    """Write the GGUF files (and Modelfile) of the model in `model_dir` into `out`, atomically; the record."""
    where = model_dir.relative_to(root).as_posix() if model_dir.is_relative_to(root) else model_dir.name
    model, tokenizer = load_for_inference(model_dir, root)
    shown = paths.named(out, root)
    return write_files(model, tokenizer, out, params, model_name, stage_name, where, log, shown)


def write_files(model, tokenizer, out: Path, params, model_name: str, stage_name: str, where: str, log=None, shown: str | None = None) -> dict[str, Any]:
    """The GGUF files of `params.types`, the Modelfile, README and `export.json` of `model` (adapters
    merged) in `out`, atomically; the record. `where` names the model in errors and the record,
    `shown` the output directory in the README's commands (default: its name)."""
    shown = shown or out.name
    numpy_types = [k for k in params.types if k in gguf_export.NUMPY_TYPES]
    llama_types = [k for k in params.types if k in gguf_export.LLAMA_CPP_TYPES]
    template = None
    if params.modelfile:  # before any file is written: a template Ollama cannot take stops the stage at once
        template = gguf_export.ollama_template(
            lambda messages: chat_template.apply_template(tokenizer, messages, tokenize=False, add_generation_prompt=True), where
        )
    files = []
    with atomic_dir(out) as tmp, tempfile.TemporaryDirectory() as scratch:
        for kind in numpy_types:
            files.append(gguf_export.write(model, tokenizer, tmp / file_name(model_name, kind), kind, model_name, where=where))
            if log:
                log.info("export: %s (%.1f MB)", files[-1]["file"], files[-1]["bytes"] / 1e6)
        if llama_types:
            source = tmp / file_name(model_name, "f16")
            if "f16" not in numpy_types:  # the quantizer's input, not kept
                source = Path(scratch) / file_name(model_name, "f16")
                gguf_export.write(model, tokenizer, source, "f16", model_name, where=where)
            for kind in llama_types:
                files.append(gguf_export.quantize_with_llama_cpp(source, tmp / file_name(model_name, kind), kind))
        files.sort(key=lambda f: params.types.index(f["type"]))
        stops = [tokenizer.convert_ids_to_tokens(i) for i in stop_token_ids(tokenizer)]
        record = {"stage": stage_name, "model_name": model_name, "source": where, "files": files,
                  "modelfile": MODELFILE if template is not None else None, "stop": stops}  # fmt: skip
        if template is not None:
            temperature = params.temperature if params.temperature is not None else gguf_export.generation_temperature(model)
            (tmp / MODELFILE).write_text(gguf_export.modelfile(file_name(model_name, params.modelfile_type), template, stops, params.system, temperature),
                                         encoding="utf-8")  # fmt: skip
        first = f"{shown}/{files[0]['file']}"
        ollama = f"\n    ollama create {model_name} -f {shown}/{MODELFILE} && ollama run {model_name}    # Ollama\n" if template else ""
        (tmp / "README.md").write_text(README.format(name=model_name, stage=stage_name, source=where, files=", ".join(f["file"] for f in files),
                                                     first=first, ollama=ollama), encoding="utf-8")  # fmt: skip
        write_json(tmp / RECORD, record)
    return record


def body(ctx: stage.StageContext) -> dict[str, Any]:
    params = ctx.params
    if not params.enabled:
        return stage.switched_off(ctx, DISABLED_README)
    stage_name = params.model or ctx.param("register.model")
    if stage_name == "multimodal":
        raise QllmError(f"export.model: {NO_IMAGE_MODEL}: set export.model to a language model's stage (pretrain, sft, lora, dpo, grpo)")
    record = export(ctx.root, ctx.input(f"models/{stage_name}"), ctx.output(), params, ctx.param("register.model_name"), stage_name, ctx.log)
    metrics: dict[str, Any] = {"enabled": True, "files": len(record["files"])}
    for entry in record["files"]:
        metrics[f"{entry['type']}_mb"] = round(entry["bytes"] / 1e6, 3)
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())

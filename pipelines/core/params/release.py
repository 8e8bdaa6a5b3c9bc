"""Params of what follows training: `evaluate`, `export` and `register`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.core.params.base import AppliesWhen, Section, only_with
from pipelines.core.params.rl import ToolsParams

ModelStage = Literal["pretrain", "sft", "lora", "dpo", "grpo"]


class BaseAnswersParams(Section):
    """The base model's greedy answers to the general prompts, the retention measure's reference
    (`pipelines/base_answers.py`; only with a base model, `base_model.name`)."""

    max_new_tokens: int = Field(128, ge=1)
    """Greedy decoding length of each answer, the base's here and every model's in `evaluate`: long
    enough for a short function, a list of five or a few sentences."""
    batch_size: int = Field(16, ge=1)
    """Prompts decoded (and scored) together."""


class EvaluateParams(Section):
    models: list[ModelStage] = Field(default_factory=lambda: ["pretrain", "sft", "lora", "dpo", "grpo"], min_length=1)
    """Models to evaluate on the same held-out sets (outputs of these stages)."""
    tools: ToolsParams = ToolsParams()
    """The tools a held-out question that offers them (its chat's `tools`) is answered with: a greedy
    episode (calls, results, answer), the answer scored as any other, each episode in
    predictions.jsonl and `tool_calls_correct` among the metrics. Empty: one-turn answers (a model
    that writes a call has answered with the call)."""
    max_new_tokens: int = Field(16, ge=1)
    """Greedy decoding length for exact-match answers."""
    batch_size: int = Field(32, ge=1)
    """Questions decoded together (left-padded)."""
    max_questions: int = Field(0, ge=0)
    """Evaluate at most this many held-out questions (0: all)."""
    validation: bool = False
    """Also answer the validation split's chat questions (the sample's validation people:
    `sample_data.validation_entity_fraction`) and report their metrics under `validation`: what
    settings are chosen on. The test split's held-out questions are only reported, never chosen on."""
    system_prompt_models: list[ModelStage] = Field(default_factory=list)
    """Models (of `models`) whose 2x2 is reported: the fact questions and the general prompts, each
    answered with and without the system prompt the questions carry (`pipelines.core.evaluation.system_prompt`):
    whether the system prompt is what switches the answer's form. Needs a base model (the general
    prompts' base answers). Costs two more greedy passes a model. Empty: none."""
    eval_batches: int = Field(0, ge=0)
    """Validation batches for loss/perplexity (0: the whole validation set)."""
    general_text_tokens: int = Field(0, ge=0)
    """What fine-tuning costs the model outside the task: `general_loss`/`general_perplexity` on the
    first this many tokens of real text the sample never shows (CPython's own documentation,
    `pydoc_data`, in rows of `tokenize.seq_len`; with `sample_data.corpus: real_text` that text is
    the training text, so it is not held out). 0: off."""
    workers: int = Field(1, ge=1)
    """Models evaluated at once (threads; each holds its model in memory). On a CPU the cores are
    already shared by one model's kernels; raise it on an accelerator with memory to spare."""
    bertscore_model: str | None = Field(None, min_length=1)
    """BERTScore of the answers against the references (`bertscore_f1`, `_precision`, `_recall`)
    with this local `save_pretrained` directory of a BERT-like encoder (bert, roberta, deberta, ...;
    relative to the project). Never downloaded. None: no BERTScore. The path is a param (changing
    it reruns evaluate); the encoder's files are not a dvc.yaml dependency."""
    bertscore_layer: Annotated[int | None, AppliesWhen("bertscore_model set", lambda s: s.bertscore_model is not None, shows=("bertscore_model",))] = Field(None, ge=0)
    """The encoder's hidden state that embeds the tokens (0: the embeddings, n: after layer n);
    None: the last. bert-score's defaults: 17 for roberta-large, 9 for bert-base-uncased."""

    @model_validator(mode="after")
    def _reported_models_are_evaluated(self) -> EvaluateParams:
        if missing := [m for m in self.system_prompt_models if m not in self.models]:
            raise ValueError(f"system_prompt_models: {', '.join(missing)} not in evaluate.models ({', '.join(self.models)}): only an evaluated model has a 2x2")
        return self


GgufType = Literal["f16", "q8_0", "bf16", "f32", "q4_k_m", "q4_k_s", "q5_k_m", "q6_k"]


class ExportParams(Section):
    """The optional GGUF export for llama.cpp and Ollama (`pipelines/export.py`, docs/export.md)."""

    enabled: bool = False
    """Write GGUF files. Off: the stage writes only a README (no cost)."""
    model: ModelStage | None = None
    """Which stage's model to export (adapters merged first); null: the one `register.model` registers
    (then register attaches the files to the registry version)."""
    types: list[GgufType] = Field(default_factory=lambda: ["f16", "q8_0"], min_length=1)
    """One GGUF file per type: f16, q8_0, bf16, f32 are written by the `gguf` package; the K-quants
    (q4_k_m, q4_k_s, q5_k_m, q6_k) by llama.cpp's quantizer from the f16 file, which needs llama-cpp-python."""
    modelfile: bool = True
    """Also write an Ollama Modelfile: the chat template in Ollama's template language, its stop tokens, greedy decoding."""
    modelfile_type: Annotated[GgufType, only_with("modelfile", True)] = "q8_0"
    """The file the Modelfile's FROM names (one of `types`)."""
    system: Annotated[str | None, only_with("modelfile", True)] = None
    """The Modelfile's default system prompt (SYSTEM); null: none (the sample chats' is "Answer with one word or number.")."""
    temperature: Annotated[float | None, only_with("modelfile", True)] = Field(None, ge=0)
    """The Modelfile's `PARAMETER temperature`; null: what the model's generation_config.json says
    (0 where it decodes greedily, as the pipeline's models do; else its temperature)."""

    @model_validator(mode="after")
    def _modelfile_type_written(self) -> ExportParams:
        if len(set(self.types)) != len(self.types):
            raise ValueError(f"types: each type once (got {self.types})")
        if self.modelfile and self.modelfile_type not in self.types:
            raise ValueError(f"modelfile_type {self.modelfile_type!r} is not among types {self.types}: the Modelfile's FROM names one of the files written")
        return self


class RegisterParams(Section):
    model: ModelStage | Literal["multimodal"] = "dpo"
    """Which stage's model to register (`multimodal`: the image-chat model, gated on its entry in
    evaluate.json, where `exact_match` is the held-out image questions')."""
    model_name: str = Field("qllm", min_length=1)
    """Registered model name in the MLflow model registry (no quotes, backslashes, `/` or control
    characters: MLflow's search filters and `models:/` URIs are built from it)."""
    alias: str = Field("champion", min_length=1)
    """Alias the new version gets when it passes the gate (at least the champion's metric + margin)."""
    challenger_alias: str = Field("challenger", min_length=1)
    """Alias the new version gets when it does not pass the gate (the champion keeps its alias)."""
    metric: str = Field("exact_match", min_length=1)
    """The gate's primary metric: a key of the model's entry in data/metrics/evaluate.json."""
    mode: Literal["max", "min"] = "max"
    """Whether a higher (`max`, e.g. exact_match) or lower (`min`, e.g. val_loss) metric is better."""
    margin: float = Field(0.0, ge=0)
    """How much better than the champion (in the metric's units) a new version must be."""

    @field_validator("model_name")
    @classmethod
    def _searchable(cls, name: str) -> str:
        if any(c in name for c in "'\"\\/") or any(ord(c) < 32 for c in name):
            raise ValueError(f"{name!r}: a registered model's name may not hold quotes, backslashes, '/' or control characters "
                             "(MLflow's search filters and models:/ URIs are built from it)")  # fmt: skip
        return name

    @model_validator(mode="after")
    def _distinct_aliases(self) -> RegisterParams:
        if self.alias == self.challenger_alias:
            raise ValueError(f"alias and challenger_alias must differ (both {self.alias!r})")
        return self

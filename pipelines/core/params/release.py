"""Params of what follows training: `merge`, `evaluate`, `export` and `register`.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.core.params.base import AppliesWhen, Section, only_with
from pipelines.core.params.rl import ToolsParams

ModelStage = Literal["pretrain", "sft", "lora", "dpo", "grpo", "merge"]


class BaseAnswersParams(Section):
    """The base model's greedy answers to the general prompts, the retention measure's reference
    (`pipelines/base_answers.py`; only with a base model, `base_model.name`)."""

    max_new_tokens: int = Field(128, ge=1)
    """Greedy decoding length of each answer, the base's here and every model's in `evaluate`: long
    enough for a short function, a list of five or a few sentences."""
    batch_size: int = Field(16, ge=1)
    """Prompts decoded (and scored) together."""


MergeModel = Literal["base", "pretrain", "sft", "lora", "dpo", "grpo"]
"""What a merge candidate can name: a stage's model, or `base` (the model `base_model.name` loads,
before continued pretraining)."""
DELTA_MODELS = ("sft", "lora", "dpo", "grpo")
"""The models with a delta (task vector) from the model they were trained from: τ_sft = θ_sft −
θ_pretrain, τ_lora = θ_lora − θ_pretrain (the adapter merged), τ_dpo = θ_dpo − θ_sft (θ_pretrain with
`dpo.start: base`), τ_grpo = θ_grpo − θ_sft."""
MAX_CANDIDATES = 6
"""Candidates `merge` tries at most: each is merged and scored on the validation split, and the more
tried, the more the choice fits the validation people rather than what they stand for."""


class MergeCandidate(Section):
    """One merge `merge` tries (`pipelines/core/models/merging.py` has the formulas): a method, the
    models it combines and the method's settings. Keys the method does not read stay at their
    defaults (anything else is refused)."""

    method: Literal["linear", "task_arithmetic", "ties", "dare", "dare_ties"] = "task_arithmetic"
    """`linear`: the weighted average of the models' weights, Σ wᵢθᵢ / Σ wᵢ (WiSE-FT with two models:
    θ = (1−α)·θ_pretrain + α·θ_sft for weights [1−α, α]); the others add the models' deltas to the
    pretrained model: `task_arithmetic` θ_pretrain + Σ wᵢτᵢ (Ilharco et al. 2023); `ties` trims each
    delta to its `density` largest magnitudes, elects each weight's sign by the summed mass and
    averages the deltas that agree (Yadav et al. 2023); `dare` drops each delta's entries with
    probability `drop_rate` and rescales the rest by 1/(1−drop_rate) before task arithmetic (Yu et
    al. 2024); `dare_ties` DARE's drops, then TIES's sign election, summing the deltas that agree
    (mergekit's `dare_ties`)."""
    models: list[MergeModel] = Field(default_factory=lambda: ["sft", "dpo"], min_length=1)
    """The models combined, each once: for `linear` at least two of base, pretrain, sft, lora, dpo,
    grpo (`base` needs `base_model.name`); for the others the models whose deltas are merged: sft,
    lora, dpo, grpo (see `DELTA_MODELS`)."""
    weights: list[float] = Field(default_factory=list)
    """One weight per model, in the order of `models` (`linear`: at least 0 and not all 0; the others:
    each delta's λᵢ, negative subtracts it). Empty: 1.0 each."""
    density: Annotated[float, only_with("method", "ties")] = Field(0.2, gt=0, le=1)
    """The share of each delta's entries TIES keeps, per tensor: the round(density·n) largest in
    magnitude (the paper keeps the top 20%)."""
    scale: Annotated[float, only_with("method", "ties")] = Field(1.0, gt=0)
    """TIES's λ: the merged delta (the mean of the deltas that agree in sign) is multiplied by it before
    it is added to θ_pretrain. Below 1 moves the result back towards the pretrained model."""
    drop_rate: Annotated[float, only_with("method", "dare", "dare_ties")] = Field(0.9, ge=0, lt=1)
    """DARE's p: each delta entry is dropped with this probability (seeded by `merge.seed`), the rest
    multiplied by 1/(1−p), so the delta is unchanged in expectation."""

    @model_validator(mode="after")
    def _models_fit_the_method(self) -> MergeCandidate:
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"models: each model once (got {self.models})")
        if self.weights and len(self.weights) != len(self.models):
            raise ValueError(f"weights: one per model ({len(self.models)} models {self.models}, {len(self.weights)} weights); or [] for 1.0 each")
        if not all(math.isfinite(w) for w in self.weights):
            raise ValueError(f"weights: finite numbers (got {self.weights})")
        if self.method == "linear":
            if len(self.models) < 2:
                raise ValueError(f"models: linear averages at least two models (got {self.models}); to move part of the way from "
                                 "pretrain to a model, list both: [pretrain, sft] with weights [0.5, 0.5]")  # fmt: skip
            if any(w < 0 for w in self.weights) or (self.weights and sum(self.weights) == 0):
                raise ValueError(f"weights: linear is a weighted average, each weight at least 0 and not all 0 (got {self.weights})")
        elif other := [m for m in self.models if m not in DELTA_MODELS]:
            raise ValueError(f"models: {', '.join(other)} has no delta to merge with {self.method}: its deltas are those of "
                             f"{', '.join(DELTA_MODELS)}, added to pretrain (base and pretrain can be averaged with method linear)")  # fmt: skip
        return self

    def weight_list(self) -> list[float]:
        """`weights`, or 1.0 per model where it is empty."""
        return list(self.weights) if self.weights else [1.0] * len(self.models)

    def label(self) -> str:
        """A short name for tables and the picture: `ties(sft, dpo; density 0.2)`."""
        weights = "" if not self.weights else " x " + ", ".join(f"{w:g}" for w in self.weights)
        setting = {"ties": f"; density {self.density:g}" + (f", scale {self.scale:g}" if self.scale != 1 else ""),
                   "dare": f"; drop {self.drop_rate:g}", "dare_ties": f"; drop {self.drop_rate:g}"}.get(self.method, "")  # fmt: skip
        return f"{self.method}({', '.join(self.models)}{weights}{setting})"


def _default_candidates() -> list[MergeCandidate]:
    return [MergeCandidate(method="linear", models=["pretrain", "sft"], weights=[0.5, 0.5]),
            MergeCandidate(method="dare", models=["sft", "dpo"])]  # fmt: skip


class MergeParams(Section):
    """Weight-space merging of the trained models (`pipelines/merge.py`, docs/fine-tuning.md
    "Merging"): each candidate merged, scored on the validation split, one chosen."""

    enabled: bool = True
    """Merge. Off: the stage writes only a README (no cost), and evaluate skips it."""
    candidates: list[MergeCandidate] = Field(default_factory=_default_candidates, min_length=1)
    """The merges to try, at most 6 (`MAX_CANDIDATES`). Each is scored on the validation split: the
    strict match of the validation questions' answers (facts and sums) and, with a base model, the
    retention log-loss on the validation third of the general prompts. The unmerged models they name
    are scored too, for the picture."""
    max_retention_loss: float = Field(0.15, ge=0)
    """The choice: of the candidates whose validation retention loss is at most this, the one with
    the best validation strict match (ties: the lower retention loss, then the first listed); if none
    is, the one with the lowest retention loss. Only with a base model (data/base_answers): without
    one there is no retention measure and the best strict match is chosen."""
    max_new_tokens: int = Field(16, ge=1)
    """Greedy decoding length of each validation answer (as `evaluate.max_new_tokens`; its own key, so
    that an evaluate-only change does not rerun the merge)."""
    batch_size: int = Field(32, ge=1)
    """Questions decoded (and general prompts scored) together."""
    seed: Annotated[int, AppliesWhen("a candidate of method dare or dare_ties", lambda s: any(c.method in ("dare", "dare_ties") for c in s.candidates))] = 0
    """DARE's drops: each tensor's mask is drawn from a generator seeded by this seed, the model's
    name and the tensor's name, so the same inputs give the same bytes, in any order."""

    @field_validator("candidates")
    @classmethod
    def _few_candidates(cls, candidates: list[MergeCandidate]) -> list[MergeCandidate]:
        if len(candidates) > MAX_CANDIDATES:
            raise ValueError(f"at most {MAX_CANDIDATES} candidates (got {len(candidates)}): each is scored on the validation split, "
                             "and the more are tried, the more the choice fits those few people rather than what they stand for")  # fmt: skip
        return candidates


class EvaluateParams(Section):
    models: list[ModelStage] = Field(default_factory=lambda: ["pretrain", "sft", "lora", "dpo", "grpo", "merge"], min_length=1)
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


class GateBound(Section):
    """A bound the registered model's metric must meet to be promoted (`register.require`)."""

    metric: str = Field(min_length=1)
    """A key of the model's entry in data/metrics/evaluate.json (`retention_loss`, `strict_match`, ...)."""
    at_least: float | None = None
    """The metric must be at least this (null: no lower bound)."""
    at_most: float | None = None
    """The metric must be at most this (null: no upper bound)."""

    @model_validator(mode="after")
    def _a_bound(self) -> GateBound:
        if self.at_least is None and self.at_most is None:
            raise ValueError(f"{self.metric}: give at_least, at_most or both (a requirement with no bound requires nothing)")
        if self.at_least is not None and self.at_most is not None and self.at_least > self.at_most:
            raise ValueError(f"{self.metric}: at_least {self.at_least} is above at_most {self.at_most}: no value meets both")
        return self

    def met_by(self, value: float) -> bool:
        return (self.at_least is None or value >= self.at_least) and (self.at_most is None or value <= self.at_most)

    def describe(self) -> str:
        """`retention_loss <= 0.15`, `strict_match >= 0.6`, `0.1 <= x <= 0.2`."""
        if self.at_least is not None and self.at_most is not None:
            return f"{self.at_least:g} <= {self.metric} <= {self.at_most:g}"
        return f"{self.metric} >= {self.at_least:g}" if self.at_least is not None else f"{self.metric} <= {self.at_most:g}"


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
    require: list[GateBound] = Field(default_factory=list)
    """Bounds every one of which the new version's metrics must also meet to be promoted, whatever the
    champion's (e.g. `{metric: retention_loss, at_most: 0.15}` beside the primary metric: facts and
    retention at once); one unmet makes it the challenger, the reason naming it. Empty: only `metric`."""

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

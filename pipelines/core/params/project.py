"""`Params`: the whole `params.yaml`, one section per stage (the same name as the stage module, the
`dvc.yaml` stage and the Prefect task), and the checks that span sections. Reading `params.yaml`,
profiles and `--set`s into it is `pipelines.core.params.files`.

The shipped `params.yaml` spells out every key, so DVC sees every value a stage depends on (a
test enforces it); the defaults here exist for users' own, shorter params files.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from pydantic import model_validator

from pipelines.core.params.base import Section
from pipelines.core.params.data import (
    IngestParams,
    PrepareDataParams,
    SampleDataParams,
    TokenizeParams,
    TrainTokenizerParams,
)
from pipelines.core.params.finetuning import (
    BaseModelParams,
    LoraParams,
    MultimodalParams,
    ProbeLoraParams,
    QuantumOptParams,
    SftParams,
)
from pipelines.core.params.preference import DpoParams, RefLogprobsParams
from pipelines.core.params.pretraining import PretrainParams
from pipelines.core.params.release import BaseAnswersParams, EvaluateParams, ExportParams, MergeParams, RegisterParams
from pipelines.core.params.rl import GrpoParams

# `register` (the stage) shadows the ABC `register` classmethod pydantic models inherit; instance
# attribute lookup returns the field, which is all we use, so the warning is noise.
warnings.filterwarnings("ignore", message='Field name "register" in "Params" shadows', category=UserWarning)


class ProbeDeviceParams(Section):
    """`probe_device` has no settings: it records the machine (see `pipelines/probe_device.py`)."""


class Params(Section):
    """The whole `params.yaml`: one section per stage."""

    sample_data: SampleDataParams = SampleDataParams()
    ingest: IngestParams
    prepare_data: PrepareDataParams = PrepareDataParams()
    train_tokenizer: TrainTokenizerParams = TrainTokenizerParams()
    tokenize: TokenizeParams = TokenizeParams()
    probe_device: ProbeDeviceParams = ProbeDeviceParams()
    base_model: BaseModelParams = BaseModelParams()
    pretrain: PretrainParams = PretrainParams()
    sft: SftParams = SftParams()
    probe_lora: ProbeLoraParams = ProbeLoraParams()
    quantum_opt: QuantumOptParams = QuantumOptParams()
    lora: LoraParams = LoraParams()
    ref_logprobs: RefLogprobsParams = RefLogprobsParams()
    dpo: DpoParams = DpoParams()
    grpo: GrpoParams = GrpoParams()
    merge: MergeParams = MergeParams()
    multimodal: MultimodalParams = MultimodalParams()
    export: ExportParams = ExportParams()
    base_answers: BaseAnswersParams = BaseAnswersParams()
    evaluate: EvaluateParams = EvaluateParams()
    register: RegisterParams = RegisterParams()

    @model_validator(mode="before")
    @classmethod
    def _renamed_sections(cls, data: Any) -> Any:
        if isinstance(data, dict) and "generate" in data:
            raise ValueError("generate: the stage that writes the sample data is called sample_data now "
                             "(`qllm generate` asks a model): rename the section to sample_data")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _curriculum_in_pretrain_only(self) -> Params:
        for name in ("sft", "probe_lora", "lora", "dpo"):
            if getattr(self, name).train.curriculum.strategy != "none":
                raise ValueError(
                    f"{name}.train.curriculum.strategy: the sequence-length curriculum is for pretrain (packed rows, which can be "
                    "cut anywhere); a cut chat or preference pair would lose its answer: set it to none"
                )
        return self

    @model_validator(mode="after")
    def _continue_needs_a_base(self) -> Params:
        pretrain = self.pretrain
        if not pretrain.continue_base:
            return self
        if self.base_model.name is None:
            raise ValueError("pretrain.continue_base is true but base_model.name is null: there is no base to continue; name one, or set "
                             "continue_base: false to pretrain a model here from scratch")  # fmt: skip
        for key, on in (("objective", pretrain.objective != "causal"), ("progressive.enabled", pretrain.progressive.enabled),
                        ("model.memory.enabled", pretrain.model.memory.enabled)):  # fmt: skip
            if on:
                raise ValueError(f"pretrain.{key}: continued pretraining trains the base as it is (causal, every layer, its own "
                                 f"architecture); set pretrain.continue_base: false or turn {key} off")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _mask_token_for_masked_diffusion(self) -> Params:
        if self.pretrain.objective == "masked_diffusion" and not self.train_tokenizer.mask_token and self.base_model.name is None:
            raise ValueError("pretrain.objective is masked_diffusion but train_tokenizer.mask_token is false: the objective needs the "
                             "tokenizer's <|mask|> token; set train_tokenizer.mask_token: true")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _grpo_needs_a_causal_model(self) -> Params:
        if self.grpo.enabled and self.pretrain.objective == "masked_diffusion" and self.base_model.name is None:
            raise ValueError("grpo.enabled: GRPO samples completions left to right and scores their tokens' log-probabilities, which a "
                             "masked-diffusion model (pretrain.objective: masked_diffusion) does not give; set grpo.enabled: false")  # fmt: skip
        if not self.grpo.enabled and self.register.model == "grpo":
            raise ValueError("register.model is grpo but grpo.enabled is false: there is no GRPO model to register")
        return self

    @model_validator(mode="after")
    def _merge_has_its_models(self) -> Params:
        merge = self.merge
        if not merge.enabled:
            for key, value in (("register.model", self.register.model), ("export.model", self.export.model)):
                if value == "merge":
                    raise ValueError(f"{key} is merge but merge.enabled is false: there is no merged model")
            return self
        pretrain_dir = LoraParams.model_fields["base_model"].default
        for index, candidate in enumerate(merge.candidates):
            key = f"merge.candidates.{index}.models"
            if "grpo" in candidate.models and not self.grpo.enabled:
                raise ValueError(f"{key}: grpo, but grpo.enabled is false: there is no GRPO model to merge (take grpo out of the "
                                 "candidate, or switch merging off: merge.enabled: false)")  # fmt: skip
            if "base" in candidate.models and self.base_model.name is None:
                raise ValueError(f"{key}: base is the model base_model.name loads, and base_model.name is null (the model "
                                 "pretrained here is pretrain)")  # fmt: skip
            if "lora" in candidate.models and candidate.method != "linear" and os.path.normpath(self.lora.base_model) != os.path.normpath(pretrain_dir):
                raise ValueError(f"{key}: lora's delta is taken from pretrain ({pretrain_dir}), but lora.base_model is "
                                 f"{self.lora.base_model}; average it with method linear instead")  # fmt: skip
        if self.base_model.name is None and merge.max_retention_loss != MergeParams.model_fields["max_retention_loss"].default:
            raise ValueError("merge.max_retention_loss: applies only with a base model (base_model.name), whose answers the retention "
                             "loss compares with; without one there is no retention measure and merge chooses on facts alone")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _sft_progressive_fits(self) -> Params:
        if self.sft.progressive.enabled:
            try:
                self.sft.progressive.check_fits(self.sft.train)
            except ValueError as exc:
                raise ValueError(f"sft.progressive: {exc}") from None
        return self

    @model_validator(mode="after")
    def _reference_quantized_like_the_policy(self) -> Params:
        policy = self.dpo.adapter.quantization
        if policy != self.ref_logprobs.quantization:
            raise ValueError(
                f"ref_logprobs.quantization is {self.ref_logprobs.quantization!r} but DPO starts from the SFT model quantized as "
                f"{policy!r} (dpo.adapter.quantization); the reference must be the model DPO starts from: set both to the same value"
            )
        return self

"""Params of preference optimisation: `ref_logprobs` and `dpo` (DPO, KTO, ORPO, SimPO and TRL's losses).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pipelines.core.params.base import AppliesWhen, Section, only_with
from pipelines.core.params.finetuning import FOUR_BIT, QUANTIZED, LoraAdapterParams, adapter_moved
from pipelines.core.params.training import PreferenceReplayParams, TrainParams


class RefLogprobsParams(Section):
    """Reference log-probabilities for DPO under the SFT model, computed once and cached.

    DPO starts from the same model; with `dpo.adapter: lora` the reference is therefore the LoRA
    base with its adapters disabled."""

    max_length: int = Field(0, ge=0)
    """Longest prompt + completion in tokens (0: the model's context length)."""
    max_prompt_length: int = Field(0, ge=0)
    """Longest prompt in tokens (0: no limit beyond `max_length`)."""
    on_invalid: Literal["drop", "error"] = "drop"
    """A pair with an empty or identical chosen/rejected, no user turn, or too long: drop it
    (counted per reason in the metrics) or stop with an error naming the example."""
    batch_size: int = Field(32, ge=1)
    """Pairs per forward pass."""
    quantization: Literal["none", "nf4", "fp4", "int8", "fp8"] = "none"
    """The SFT model quantized as `dpo.adapter.quantization` quantizes it (QLoRA DPO): the reference
    must be the model DPO starts from, so the two must be equal (checked)."""
    double_quant: Annotated[bool, only_with("quantization", *FOUR_BIT)] = True
    compute_dtype: Annotated[Literal["auto", "bf16", "fp16", "fp32"], only_with("quantization", *QUANTIZED)] = "auto"
    """As in `dpo.adapter`; `auto` here is fp32 (the reference pass scores in fp32)."""


PREFERENCE_METHODS = ("dpo", "kto", "orpo", "simpo")


DPO_LOSS_TYPES = Literal["sigmoid", "hinge", "ipo", "ipo_sum", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop"]


class DpoParams(Section):
    """Preference optimisation (DPO and its losses, KTO, ORPO, SimPO) from the cached reference.

    dpo and kto need the reference log-probabilities (`ref_logprobs`); orpo and simpo are
    reference-free, and `ref_logprobs` then only encodes the pairs (no model is loaded)."""

    method: Literal["dpo", "kto", "orpo", "simpo"] = "dpo"
    """dpo: paired, with a reference (`loss_type` picks the loss); kto: unpaired desirable/undesirable
    examples (paired data split in two), with a reference; orpo and simpo: paired, reference-free."""
    start: Literal["sft", "base"] = "sft"
    """The model the policy starts from, and dpo's and kto's reference: the SFT model, or the base
    (`data/models/pretrain`, or the model `base_model.name` names; ORPO's NLL term does the SFT)."""
    beta: float = Field(0.1, gt=0)
    """dpo/kto: strength of the implicit KL penalty (higher: stay closer to the reference); simpo:
    the reward scale (the paper uses 2-2.5); orpo: lambda, the odds-ratio term's weight."""
    loss_type: Annotated[DPO_LOSS_TYPES | None, only_with("method", "dpo", hint="kto, orpo and simpo have their own loss: set dpo.loss_type=null")] = None
    """method dpo's loss, TRL's names: sigmoid (DPO), hinge, ipo (TRL 1.16's, per-token), ipo_sum
    (IPO on summed log-ratios), robust, exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down,
    discopop (docs/preference.md); null: sigmoid. kto, orpo and simpo have their own loss: with them it
    must be null (as TRL's KTO, ORPO and CPO configs take none of these)."""
    label_smoothing: Annotated[float, AppliesWhen(
        "method dpo with loss_type sigmoid, robust or exo_pair, or method simpo",
        lambda s: s.method == "simpo" or (s.method == "dpo" and s.dpo_loss_type in ("sigmoid", "robust", "exo_pair")),
        shows=("method", "loss_type"), hint="kto's and orpo's losses have no label smoothing")] = Field(0.0, ge=0, lt=0.5)
    """The assumed share of flipped preference labels: dpo's sigmoid (conservative DPO), robust and
    exo_pair (needs > 0), and simpo; kto and orpo have none (it must be 0)."""
    discopop_tau: Annotated[float, only_with("loss_type", "discopop")] = Field(0.05, gt=0)
    """loss_type discopop: the temperature of its log-ratio modulation (TRL's default)."""
    simpo_gamma: Annotated[float, only_with("method", "simpo")] = Field(0.5, ge=0)
    """simpo: the target reward margin gamma (TRL's `simpo_gamma`)."""
    desirable_weight: Annotated[float, only_with("method", "kto")] = Field(1.0, gt=0)
    """kto: weight of the desirable examples' losses (TRL's guidance on imbalance is checked)."""
    undesirable_weight: Annotated[float, only_with("method", "kto")] = Field(1.0, gt=0)
    """kto: weight of the undesirable examples' losses."""
    sft_weight: Annotated[float, only_with("method", "dpo", "simpo", hint="orpo's loss already holds the NLL of the chosen answers with weight 1 "
                                                                       "(beta weighs the odds ratio); kto's has no NLL term (TRL's KTO has none)")] = Field(0.0, ge=0)
    """dpo and simpo: add this times the per-token NLL of the chosen answers to the loss (RPO; TRL's
    `rpo_alpha`, or CPO's `cpo_alpha` for simpo): keeps the policy generating what it is rewarded
    for, limiting drift. orpo's loss has the NLL itself (weight 1, its odds-ratio term weighted by
    `beta`) and kto none: with them it must be 0."""
    replay: PreferenceReplayParams = PreferenceReplayParams()
    """The base's own answers to the general prompts' train third (`base_answers`), an NLL term of
    weight `replay.weight` beside the preference loss, `replay.fraction` of the trained tokens: so
    that preference training keeps what the base could do. Needs a base model (`base_model.name`)."""
    adapter: LoraAdapterParams = LoraAdapterParams()
    """A LoRA adapter on the policy (`enabled: true`; the same block as `lora.adapter`), or all its
    weights trained (`enabled: false`)."""
    train: TrainParams = TrainParams()

    @model_validator(mode="before")
    @classmethod
    def _lora_moved(cls, data: Any) -> Any:
        return adapter_moved(data, "dpo")

    @model_validator(mode="after")
    def _no_loss_chunks(self) -> DpoParams:
        if self.train.loss_chunk_tokens:
            raise ValueError("train.loss_chunk_tokens: dpo does not chunk its loss (its loss is per-sequence log-probabilities, not a token cross-entropy); set it to 0")
        return self

    @model_validator(mode="after")
    def _exo_needs_smoothing(self) -> DpoParams:
        # what each setting applies to is declared on it (`AppliesWhen`); this is a value a loss needs
        if self.method == "dpo" and self.dpo_loss_type == "exo_pair" and not self.label_smoothing:
            raise ValueError("loss_type exo_pair needs label_smoothing > 0 (the EXO paper uses 1e-3)")
        return self

    @property
    def dpo_loss_type(self) -> str:
        """Method dpo's loss type (`loss_type`, null: sigmoid)."""
        return self.loss_type or "sigmoid"

    @property
    def needs_reference(self) -> bool:
        return self.method in ("dpo", "kto")

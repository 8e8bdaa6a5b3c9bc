"""Params of the fine-tuning stages: `sft`, `lora` (the adapter block `adapter`, shared with `dpo`
and `grpo`, and the rank allocation), `probe_lora`, `quantum_opt`, `multimodal`, and the base model
of fine-tuning mode (`base_model`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.core.params.base import WHEN_ENABLED, AppliesWhen, Section, only_with
from pipelines.core.params.pretraining import ProgressiveParams
from pipelines.core.params.training import ReplayParams, TrainParams

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven linear projections of a Llama-style block: the default LoRA targets and probe candidates."""


class FinetuneParams(Section):
    """Instruction tuning on chat records: the `sft` section, and the part of `lora` and `probe_lora`
    that is the same procedure (one code path, `pipelines/core/training/finetune.py`)."""

    base_model: str = "data/models/pretrain"
    """The model to start from. The default is the pipeline's base: the model `pretrain` trained,
    or, with `base_model.name` set, that model (`pretrain` then writes a pointer to it). Another
    directory or hub name here is not a DVC dependency (a warning says so): set `base_model.name`
    instead."""
    loss_on: Literal["assistant", "all"] = "assistant"
    """Train on assistant tokens only (completion-only loss) or on every token."""
    packing: bool = True
    """Pack several examples per row, with no attention across examples."""
    max_seq_len: int = Field(0, ge=0)
    """Row length in tokens (0: the base model's context length)."""
    overflow: Literal["truncate", "drop"] = "truncate"
    """What to do with an example longer than `max_seq_len` (counted in the metrics)."""
    train: TrainParams = TrainParams()


QUANTIZED = ("nf4", "fp4", "int8", "fp8")


FOUR_BIT = ("nf4", "fp4")


class QuantizationParams(Section):
    """A quantized, frozen base under full-precision adapters (QLoRA; `pipelines/core/models/quantize.py`)."""

    quantization: Literal["none", "nf4", "fp4", "int8", "fp8"] = "none"
    """`nf4`/`fp4`: 4-bit (bitsandbytes; CUDA, and x86 CPUs from bitsandbytes 0.48); `int8`:
    LLM.int8(); `fp8`: CUDA compute capability 8.9+ only; `none`: the base as it is."""
    double_quant: Annotated[bool, only_with("quantization", *FOUR_BIT)] = True
    """4-bit only: quantize the per-block scales too (QLoRA's double quantization)."""
    compute_dtype: Annotated[Literal["auto", "bf16", "fp16", "fp32"], only_with("quantization", *QUANTIZED)] = "auto"
    """dtype the 4-bit weights are dequantized to for each matmul; `auto`: the stage's
    `train.precision` as resolved on this machine."""


class LoraAdapterParams(Section):
    """A PEFT LoRA adapter: the `adapter` block of every stage that can train one (`lora`, `dpo`,
    `grpo`), the same keys in each. `enabled: false` trains all weights instead (`dpo`, `grpo`); the
    `lora` stage always trains an adapter. Its base may be quantized (QLoRA: `quantization`,
    `double_quant`, `compute_dtype`), which `base_quantization` hands on as a `QuantizationParams`."""

    quantization: Annotated[Literal["none", "nf4", "fp4", "int8", "fp8"], WHEN_ENABLED] = "none"
    """QLoRA: the frozen base quantized under the adapter. `nf4`/`fp4`: 4-bit (bitsandbytes; CUDA, and
    x86 CPUs from bitsandbytes 0.48); `int8`: LLM.int8(); `fp8`: CUDA compute capability 8.9+ only;
    `none`: the base as it is."""
    double_quant: Annotated[bool, only_with("quantization", *FOUR_BIT)] = True
    """4-bit only: quantize the per-block scales too (QLoRA's double quantization)."""
    compute_dtype: Annotated[Literal["auto", "bf16", "fp16", "fp32"], only_with("quantization", *QUANTIZED)] = "auto"
    """dtype the 4-bit weights are dequantized to for each matmul; `auto`: the stage's
    `train.precision` as resolved on this machine."""
    enabled: bool = False
    """Train a LoRA adapter on the frozen model (the settings below) instead of all its weights."""
    r: Annotated[int, WHEN_ENABLED] = Field(4, ge=1)
    """The adapter's rank: every targeted module's (unless `rank_pattern` says otherwise). Under the
    lora stage's in-training allocations (`lora.allocation: adalora | qubo_in_loop`) the rank budget:
    the parameters of rank `r` on every module, allocated unevenly (AdaLoRA's `target_r`); with
    `quantum_opt`, the ranks come from that stage and `r` is not read."""
    lora_alpha: Annotated[float, WHEN_ENABLED] = Field(8.0, gt=0)
    """Scaling numerator: updates are scaled by alpha/r (alpha/sqrt(r) with `use_rslora`), r the rank
    above; an allocation keeps that scale at every module's rank."""
    lora_dropout: Annotated[float, WHEN_ENABLED] = Field(0.05, ge=0, lt=1)
    target_modules: Annotated[list[str], WHEN_ENABLED] = Field(default_factory=lambda: list(ALL_PROJECTIONS), min_length=1)
    """Module names (suffixes) to adapt; an entry that matches no module is an error."""
    rank_pattern: Annotated[dict[str, int], WHEN_ENABLED] = Field(default_factory=dict)
    """Per-module ranks, `{module name or regex: rank}` (PEFT semantics)."""
    alpha_pattern: Annotated[dict[str, float], WHEN_ENABLED] = Field(default_factory=dict)
    """Per-module alphas, `{module name or regex: alpha}`."""
    bias: Annotated[Literal["none", "all", "lora_only"], WHEN_ENABLED] = "none"
    use_rslora: Annotated[bool, WHEN_ENABLED] = False
    """Rank-stabilised scaling alpha/sqrt(r), which keeps update size comparable across ranks."""
    use_dora: Annotated[bool, WHEN_ENABLED] = False
    """DoRA (Liu et al. 2024; PEFT `use_dora`): each adapted weight split into a magnitude vector,
    trained, and a direction that LoRA updates. Slower a step than plain LoRA (the weight norm is
    recomputed every forward); `lora.allocation: uniform` or `quantum_opt` only."""
    init_lora_weights: Annotated[str, WHEN_ENABLED] = Field("default", pattern=r"^(default|gaussian|pissa|pissa_niter_[1-9][0-9]*|olora)$")
    """How the adapters start (PEFT `init_lora_weights`): `default` (A random, B zero: the model
    starts unchanged), `gaussian`, `pissa` (the principal singular vectors of each weight, the
    rest left in the base; `pissa_niter_N`: by N iterations of randomized SVD, much faster on large
    weights), `olora` (QR). With pissa/olora the saved adapter is converted to a plain LoRA of
    rank 2r against the original base, so it loads on that base like any other; not with a
    quantized base. `lora.allocation: uniform` or `quantum_opt` only."""
    layers_to_transform: Annotated[list[int], WHEN_ENABLED] = Field(default_factory=list)
    """Decoder layers to adapt (PEFT `layers_to_transform`); negative indices count from the end
    (`[-1]`: the last layer only); empty: every layer. `lora.allocation: uniform` only."""
    trainable_tokens: Annotated[list[str], WHEN_ENABLED] = Field(default_factory=lambda: ["<|im_start|>", "<|im_end|>"])
    """Tokens whose embedding rows are trained too (PEFT `trainable_token_indices`): the chat
    markers a pretrained base has never seen, so the model can learn to end its turn."""
    merge: Annotated[bool, WHEN_ENABLED] = True
    """Also write the adapter merged into the base as a full model (`<out>/merged/`)."""

    @property
    def base_quantization(self) -> QuantizationParams:
        """How the frozen base under the adapter is quantized (QLoRA), as `finetune.run` and
        `quantize.from_params` take it."""
        return QuantizationParams(quantization=self.quantization, double_quant=self.double_quant, compute_dtype=self.compute_dtype)

    @model_validator(mode="before")
    @classmethod
    def _the_switch_is_enabled(cls, data: Any) -> Any:
        if isinstance(data, str):
            raise ValueError(f"the adapter is a block now, the same in lora, dpo and grpo: write `adapter: {{enabled: {json.dumps(data == 'lora')}}}` "
                             f"(enabled: true for a LoRA adapter, false for all weights) instead of `adapter: {data}`")  # fmt: skip
        return data


def adapter_moved(data: Any, section: str) -> Any:
    """Refuse the old `<section>.lora` block, with where its keys go now."""
    if isinstance(data, dict) and "lora" in data:
        raise ValueError(f"lora: the adapter's settings are in {section}.adapter now, the same block as lora.adapter, with "
                         f"`enabled: true` for a LoRA adapter (was `{section}.adapter: lora`): move {section}.lora's keys there")  # fmt: skip
    return data


class SftParams(FinetuneParams):
    """Full fine-tuning (`sft`): the shared fine-tuning procedure, plus growing the model."""

    replay: ReplayParams = ReplayParams()
    """The base's own answers mixed in (self-distillation replay), so that fine-tuning keeps what it could do."""

    progressive: ProgressiveParams = ProgressiveParams()
    """Grow the model beyond the base, stack by stack (LLaMA-Pro's block expansion with `growth:
    identity`): `stacks[0]` is the base model's layer count."""


class AdaptiveParams(Section):
    """Ranks allocated while training (`lora.allocation: adalora | qubo_in_loop`;
    `pipelines/core/quantum/rank_allocation.py`): SVD-form adapters on `adapter.target_modules`, starting at
    rank `init_r`, masked down to the budget of rank `adapter.r` on every module."""

    init_r: int = Field(12, ge=1)
    """Rank every module starts with (at least `adapter.r`, the budget it is masked down to)."""
    tinit: int = Field(10, ge=0)
    """Steps before the first re-allocation (all `init_r` components train)."""
    tfinal: int = Field(30, ge=0)
    """Last steps with the allocation fixed."""
    every: int = Field(10, ge=1)
    """Steps between re-allocations (AdaLoRA's `deltaT`; the QUBO is re-solved this often)."""
    beta1: float = Field(0.85, gt=0, lt=1)
    """Smoothing of the importance (sensitivity) of each rank component."""
    beta2: float = Field(0.85, gt=0, lt=1)
    """Smoothing of its uncertainty."""
    orth_reg_weight: float = Field(0.5, ge=0)
    """AdaLoRA's penalty keeping P and Q orthogonal."""
    lam: float = Field(0.02, ge=0)
    """qubo_in_loop: weight of the redundancy penalty (as `quantum_opt.lam`)."""
    ranks: list[int] = Field(default_factory=lambda: [2, 4, 6, 8, 10, 12], min_length=1)
    """qubo_in_loop: the ranks a module may get (0, no adapter, always can)."""
    solver: Literal["sa", "tabu", "milp", "exact"] = "sa"
    """qubo_in_loop: the QUBO solver of each re-allocation."""
    timeout: float = Field(5.0, gt=0)
    """qubo_in_loop: seconds a solve may take (`qubo.allocate_ranks`): milp and exact stop at it, tabu
    fits its reads into it; sa runs all `num_reads` and warns past it, so its allocation is the same
    on every machine."""
    num_reads: Annotated[int, only_with("solver", "sa", "tabu")] = Field(300, ge=0)
    """qubo_in_loop: samples per solve for sa/tabu (0: the library default, 1000 for sa). 300 found
    the allocation 1000 reads found in 23 of the 24 solves of the default run on two worlds (the
    other: a different allocation of equal objective) in a third of the time (benchmarks/results/adapters.md, issue 22)."""
    reference_timeout: float = Field(1.0, ge=0)
    """qubo_in_loop: seconds for the MILP reference the last solve's gaps are logged against: to
    its best allocation and to its proven bound on the optimum (0: no gaps). Only the last solve,
    whose allocation the adapter keeps: one reference per solve cost 12 s of the default lora
    stage (the 12 solves), on the pipeline's critical path."""

    @model_validator(mode="before")
    @classmethod
    def _budget_is_the_rank(cls, data: Any) -> Any:
        if isinstance(data, dict) and "budget_rank" in data:
            raise ValueError("budget_rank: the rank budget is lora.adapter.r now (the parameters of rank r on every module, allocated "
                             f"unevenly), so that r means the rank under every allocation: write lora.adapter.r: {data['budget_rank']}")  # fmt: skip
        return data


IN_TRAINING = ("adalora", "qubo_in_loop")
"""The lora stage's allocations made while training: SVD-form (AdaLoRA) adapters masked down to the budget."""


PLAIN_LORA_ONLY = ("bias", "use_rslora", "use_dora", "init_lora_weights", "quantization")
"""Adapter keys of plain LoRA (PEFT's `LoraConfig`), which the in-training allocations' SVD-form adapters do not have."""


LORA_STAGE_ADAPTER = {"enabled": True, "r": 8, "lora_alpha": 16.0}
"""The lora stage's own defaults of the adapter block (LitGPT's per-method defaults): always an adapter,
and the rank budget 8 of the in-training allocation at the update scale 16 / 8. An `adapter` mapping
given to the section changes these where it says."""


class LoraParams(FinetuneParams):
    """LoRA instruction tuning: the `sft` procedure (the fields above) with an `adapter`."""

    replay: ReplayParams = ReplayParams()
    """The base's own answers mixed in, as `sft.replay`."""

    adapter: Annotated[
        LoraAdapterParams,
        only_with("allocation", "uniform", "adalora", "qubo_in_loop", keys=("r", "target_modules")),
        only_with("allocation", "uniform", "quantum_opt", keys=PLAIN_LORA_ONLY),
        only_with("allocation", "uniform", keys=("rank_pattern", "alpha_pattern", "layers_to_transform")),
    ] = LoraAdapterParams(**LORA_STAGE_ADAPTER)
    """The adapter (the same block as `dpo.adapter` and `grpo.adapter`): its rank (the budget, under
    the in-training allocations), targets, a quantized base, merging. `quantum_opt` chooses the
    modules and their ranks itself, so `r` and `target_modules` are not read there; the in-training
    allocations train SVD-form adapters, which have no `bias`, rsLoRA, DoRA, PiSSA/OLoRA or
    quantized base, and allocate per module, so only `uniform` reads `rank_pattern`, `alpha_pattern`
    and `layers_to_transform`."""
    allocation: Literal["quantum_opt", "uniform", "adalora", "qubo_in_loop"] = "qubo_in_loop"
    """`qubo_in_loop` (the QUBO re-solved during training; the measured winner, tied with AdaLoRA)
    and `adalora` (PEFT's AdaLoRA): ranks allocated while training within the parameters of rank
    `adapter.r` on every module, as `adaptive` says; `quantum_opt`: target modules and per-module
    ranks from the `quantum_opt` stage (its `data/quantum_opt/allocation.json`); `uniform`: rank
    `adapter.r` on every `adapter.target_modules` entry. Every allocation scales a module's update
    by `adapter.lora_alpha` over the uniform rank of its budget (`adapter.r`, or quantum_opt's
    budget), whatever rank the module gets."""
    adaptive: Annotated[
        AdaptiveParams,
        only_with("allocation", *IN_TRAINING),
        only_with("allocation", "qubo_in_loop", keys=("lam", "ranks", "solver", "timeout", "num_reads", "reference_timeout")),
    ] = AdaptiveParams()
    """The in-training allocations' settings (`allocation: adalora | qubo_in_loop`; the QUBO's own
    ones, `qubo_in_loop` only)."""

    @model_validator(mode="before")
    @classmethod
    def _adapter_keys_moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = sorted(set(data) & set(LoraAdapterParams.model_fields))
            if moved:
                raise ValueError(f"{', '.join(moved)}: the adapter settings are under lora.adapter now (as under dpo.adapter): "
                                 f"write lora.adapter.{moved[0]}, not lora.{moved[0]}")  # fmt: skip
            if isinstance(data.get("adapter"), dict):
                if data["adapter"].get("enabled") is False:
                    raise ValueError("adapter.enabled: the lora stage trains an adapter (it must be true); to train all weights, use the sft stage")
                data = {**data, "adapter": {**LORA_STAGE_ADAPTER, **data["adapter"]}}
        return data

    @model_validator(mode="after")
    def _adapter_and_budget(self) -> LoraParams:
        if not self.adapter.enabled:  # an adapter given as a built block
            raise ValueError("adapter.enabled: the lora stage trains an adapter (it must be true); to train all weights, use the sft stage")
        if self.allocation in IN_TRAINING:
            adaptive = self.adaptive
            if adaptive.tinit + adaptive.tfinal >= self.train.max_steps:
                raise ValueError(f"adaptive.tinit ({adaptive.tinit}) + adaptive.tfinal ({adaptive.tfinal}) must leave steps of train.max_steps "
                                 f"({self.train.max_steps}) to re-allocate in")  # fmt: skip
            if self.adapter.r > adaptive.init_r:
                raise ValueError(f"adapter.r ({self.adapter.r}), the rank budget of the {self.allocation} allocation, must not exceed "
                                 f"adaptive.init_r ({adaptive.init_r}), the rank every module starts at: the budget is reached by masking")  # fmt: skip
            if self.allocation == "qubo_in_loop" and (max(adaptive.ranks) > adaptive.init_r or min(adaptive.ranks) < 1):
                raise ValueError(f"adaptive.ranks {adaptive.ranks} must lie in 1..adaptive.init_r ({adaptive.init_r})")
        return self


class ProbeLoraParams(FinetuneParams, QuantizationParams):
    """A short SFT run that records every candidate LoRA module's gradients (for `quantum_opt`)."""

    target_modules: list[str] = Field(
        default_factory=lambda: list(ALL_PROJECTIONS), min_length=1
    )
    """Candidate modules (name suffixes); every matching linear layer of every block is probed."""
    ranks: list[int] = Field(default_factory=lambda: [4, 8, 16], min_length=1)
    """Candidate ranks r for which the captured gradient energy v[m][r] is reported."""
    frozen_base: bool = False
    """Record the gradients at the base without training it (no optimizer: the weights plus two
    fp32 copies of the probed modules' weights, where training the probe takes a full fine-tuning's
    memory). A quantized base is always probed frozen. False: the probe trains as SFT would."""
    redundancy: Literal["detrended", "energy"] = "detrended"
    """How two modules' redundancy is measured over the probe's steps: `detrended`, the correlation of
    the step-to-step changes of their log gradient energies; `energy`, of the energies themselves
    (the first version: dominated by the common downward trend of all energies, mean 0.93)."""

    @field_validator("ranks")
    @classmethod
    def _positive_ranks(cls, ranks: list[int]) -> list[int]:
        if any(r < 1 for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be distinct positive integers, got {ranks}")
        return sorted(ranks)


class QuantumOptParams(Section):
    """LoRA rank allocation as a QUBO over the probe's scores (see pipelines/core/quantum/qubo.py)."""

    solver: Literal["exact", "sa", "tabu", "milp", "dwave", "qaoa", "greedy"] = "sa"
    """`sa`/`tabu` (dwave-samplers), `milp` (scipy, exact), `exact` (enumeration, small only),
    `dwave` (D-Wave Leap: extra `dwave` + DWAVE_API_TOKEN), `qaoa` (extra `qaoa`, <= max_qubits),
    `greedy` (the value-per-parameter heuristic, redundancy ignored: the classical baseline)."""
    fallback: Literal["sa"] | None = None
    """Solve with `sa` (logged) when the chosen backend is unavailable or too small."""
    lam: float = Field(0.1, ge=0)
    """Weight λ of the redundancy penalty between correlated modules. Values are shares of one
    gradient energy (Σ v <= 1) while the penalty sums over M·(M−1)/2 pairs. 0.1 had the lowest
    chat *validation* loss over {0, 0.02, 0.1} averaged over two worlds (benchmarks/results/adapters.md,
    issue 22); with the detrended redundancy it leaves part of the budget unspent (65,536 of
    94,208 parameters on the default world)."""
    budget_rank: Annotated[int, only_with("budget", 0)] = Field(8, ge=1)
    """Budget B = the trainable parameters of rank `budget_rank` on every candidate module. The lora
    stage scales every module's update by `lora.adapter.lora_alpha` over this rank (with `budget`:
    over the uniform rank of that many parameters), whatever rank the module gets."""
    budget: int = Field(0, ge=0)
    """An absolute parameter budget instead (0: use `budget_rank`)."""
    seed: int = 0
    timeout: float = Field(60.0, gt=0)
    """Seconds a solver may take (`qubo.allocate_ranks`): milp, exact, qaoa and Leap stop at it, tabu fits
    its reads into it; sa runs all `num_reads` and warns past it, so its allocation is the same on
    every machine."""
    reference_timeout: float = Field(15.0, ge=0)
    """Seconds for the MILP reference optimum the gap is measured against (0: skip it). With
    dense redundancy HiGHS rarely proves optimality; its best point at the limit is then used."""
    max_qubits: Annotated[int, only_with("solver", "qaoa")] = Field(16, ge=1)
    """QAOA refuses problems with more binary variables (statevector simulation is 2^n)."""
    num_reads: Annotated[int, only_with("solver", "sa", "tabu")] = Field(0, ge=0)
    """Samples drawn by sa/tabu (0: the library default)."""


class VisionParams(Section):
    """The vision tower of the multimodal model: a SigLIP vision transformer built from config."""

    image_size: int = Field(16, ge=1)
    """Side in pixels every image is resized to."""
    patch_size: int = Field(4, ge=1)
    """Side of a patch: an image becomes (image_size / patch_size)^2 tokens of the language model."""
    hidden_size: int = Field(64, ge=1)
    intermediate_size: int = Field(128, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _fits(self) -> VisionParams:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}")
        return self


class MultimodalParams(Section):
    """The optional LLaVA-style image-chat stage (`pipelines/multimodal.py`, docs/multimodal.md)."""

    enabled: bool = False
    """Train the multimodal model. Off: the stage writes only a README (no cost)."""
    base_model: str = "data/models/sft"
    """The language model: this pipeline's SFT model (or `data/models/pretrain`)."""
    vision: VisionParams = VisionParams()
    projector_act: str = "gelu"
    """Activation between the projector's two linear layers (LLaVA-1.5's MLP projector)."""
    vision_tower: Literal["trainable", "frozen"] = "trainable"
    """LLaVA freezes a pretrained tower; this one is built from config (nothing can be downloaded),
    so by default it learns with the projector."""
    alignment_steps: int = Field(400, ge=0)
    """Phase 1, feature alignment: the first steps train the projector (and the tower), the
    language model is frozen."""
    language_model: Literal["full", "frozen"] = "full"
    """Phase 2, instruction tuning: the language model trains too (`full`) or stays frozen."""
    instruction_lr: float = Field(1e-3, gt=0)
    """Peak learning rate of phase 2 (phase 1 uses `train.lr`), re-warmed over `train.warmup_steps`."""
    max_seq_len: int = Field(0, ge=0)
    """Longest chat in tokens, image tokens included (0: the language model's context); longer
    chats are dropped and counted, never cut (an image's tokens must stay whole)."""
    train: TrainParams = TrainParams()

    @model_validator(mode="after")
    def _no_loss_chunks(self) -> MultimodalParams:
        if self.train.loss_chunk_tokens:
            raise ValueError("train.loss_chunk_tokens: multimodal does not chunk its loss (its loss is the image chat's); set it to 0")
        return self


WITH_A_BASE = AppliesWhen("a base model named (`name`)", lambda s: s.name is not None, shows=("name",))


class BaseModelParams(Section):
    """Where the fine-tuning stages start from (docs/fine-tuning.md)."""

    name: str | None = None
    """None: the model `pretrain` trains here from scratch. Otherwise a hub id (`Qwen/Qwen2.5-0.5B`)
    or a `save_pretrained` directory (relative to the project): `train_tokenizer` then takes its
    tokenizer, `pretrain` trains nothing, and sft, probe_lora, lora, dpo, evaluate and register
    use it with its own tokenizer and chat template."""
    revision: Annotated[str | None, WITH_A_BASE] = None
    """Hub only: a branch, tag or commit; resolved to the commit it names (in data/base_model.json),
    so a new revision reruns everything downstream. None: the hub's default branch."""
    chat_template_path: Annotated[str | None, WITH_A_BASE] = None
    """A Jinja chat template file (relative to the project) that replaces the base's own in every
    stage, as TRL's `chat_template_path` does: for a base whose template cannot render tools
    (SmolLM2's: `templates/smollm2-tools.jinja`, its own rendering plus Qwen2.5's Hermes-style
    tools). Its text is recorded in data/base_model.json, so editing it reruns what follows.
    None: the base's own template."""

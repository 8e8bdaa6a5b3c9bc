"""Params of `pretrain`: the model to build (`ModelParams`, its memory extension), the objective
(causal or masked diffusion) and the growth and caching strategies.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.core.params.base import Section, only_with
from pipelines.core.params.training import ReplayParams, TrainParams


class MemoryParams(Section):
    """The memory extension: product-key memory layers (Lample et al. 2019; Berges et al. 2024,
    "Memory Layers at Scale") beside the MLP of chosen decoder layers (`pipelines/core/models/memory_model.py`)."""

    enabled: bool = False
    layers: list[int] = Field(default_factory=lambda: [1])
    """Decoder layers (0-based) that get a memory."""
    num_keys: int = Field(64, ge=2)
    """Sub-keys per half: the table has `num_keys**2` value rows."""
    heads: int = Field(2, ge=1)
    """Independent lookups per token (their reads are summed)."""
    key_dim: int = Field(32, ge=2)
    """Query/key size (even: two half-keys)."""
    topk: int = Field(8, ge=1)
    """Rows read per head and token."""

    @model_validator(mode="after")
    def _sizes(self) -> MemoryParams:
        if self.key_dim % 2:
            raise ValueError(f"key_dim must be even (two half-keys), got {self.key_dim}")
        if self.topk > self.num_keys:
            raise ValueError(f"topk ({self.topk}) must not exceed num_keys ({self.num_keys})")
        return self


class ModelParams(Section):
    """Llama architecture built from config (`LlamaConfig`); vocab size comes from the tokenizer."""

    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(512, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    """Grouped-query attention when smaller than `num_heads`."""
    rope_theta: float = Field(10_000.0, gt=0)
    tie_word_embeddings: bool = True
    memory: MemoryParams = MemoryParams()
    """The memory extension (`enabled: true`): the model is then a `QllmMemoryLlamaForCausalLM`."""

    @model_validator(mode="after")
    def _heads(self) -> ModelParams:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.memory.enabled and (bad := [i for i in self.memory.layers if not 0 <= i < self.num_layers]):
            raise ValueError(f"memory.layers {bad}: the model has layers 0..{self.num_layers - 1}")
        return self


class ActivationCacheParams(Section):
    """The time-step activation cache of frozen-trunk phases (`pipelines/core/training/progressive.py`)."""

    enabled: bool = False
    """Keep the frozen trunk's output per training sequence and skip the trunk's forward when the
    sequence comes again (the next epoch). Results are the same as without it."""
    memory_mb: float = Field(256, ge=0)
    """Activations kept in memory; least recently used ones beyond this spill to disk."""
    disk_mb: float = Field(0, ge=0)
    """Activations spilled to a temporary file (0: none, the least recently used are dropped)."""


class EndToEndParams(Section):
    """Training after the last stack was added."""

    scope: Literal["none", "stackwise", "rackwise"] = "rackwise"
    """`rackwise`: the whole model together; `stackwise`: each stack in turn (bottom first, the
    others frozen), the steps split evenly; `none`: no end-to-end phase."""
    steps: int | None = Field(None, ge=0)
    """Steps of the end-to-end phase; null: the rest of `train.max_steps`."""


class ProgressiveParams(Section):
    """Progressive stack-wise growth (stacking, Gong et al. 2019; G_stack, NeurIPS 2024; LLaMA-Pro's
    identity blocks, Wu et al. 2024): start with the first stack of layers, add one stack every
    `steps_per_stack` steps. `pipelines/core/training/progressive.py` has the schedule."""

    enabled: bool = False
    stacks: list[int] = Field(default_factory=lambda: [2, 2])
    """Layers per stack, bottom first; they add up to `model.num_layers`."""
    steps_per_stack: int = Field(200, ge=1)
    """Optimizer steps each stack trains before the next one is added."""
    growth: Literal["duplicate", "identity"] = "duplicate"
    """A new stack is a copy of the top stack (`duplicate`) or such a copy with its attention and
    MLP output projections zeroed (`identity`: the grown model computes what the smaller one did)."""
    trunk: Literal["frozen", "trainable"] = "frozen"
    """While a new stack trains: `frozen` trains only the new stack and the head (final norm, and the
    output projection when it is not tied to the embedding); `trainable` trains everything."""
    rewarm_steps: int | None = Field(None, ge=0)
    """Learning-rate re-warm after each growth (a linear ramp over the step-based schedule); null:
    `train.warmup_steps`."""
    end_to_end: EndToEndParams = EndToEndParams()
    save_stacks: bool = False
    """Also write each stack's layers on its own: `stacks/stack-NN.safetensors` in the output."""
    activation_cache: ActivationCacheParams = ActivationCacheParams()

    @field_validator("stacks")
    @classmethod
    def _positive(cls, stacks: list[int]) -> list[int]:
        if not stacks or any(n < 1 for n in stacks):
            raise ValueError(f"expected one or more stacks of at least one layer each, got {stacks}")
        return stacks

    def check_fits(self, train: TrainParams) -> None:
        """The phases fill `train.max_steps`, and the loop settings allow a model that changes shape."""
        growth_steps = len(self.stacks) * self.steps_per_stack
        rest = train.max_steps - growth_steps
        if rest < 0 or (self.end_to_end.steps is not None and self.end_to_end.steps != rest):
            wanted = growth_steps + (self.end_to_end.steps or 0)
            raise ValueError(f"train.max_steps is {train.max_steps} but progressive needs {wanted} ({len(self.stacks)} stacks x "
                             f"{self.steps_per_stack} steps_per_stack + end_to_end.steps {self.end_to_end.steps}): set "
                             "train.max_steps to that, or end_to_end.steps to null (the rest)")  # fmt: skip
        if self.end_to_end.scope == "none" and rest:
            raise ValueError(f"progressive.end_to_end.scope is none but {rest} steps remain after the last stack: set "
                             f"train.max_steps to {growth_steps} or choose a scope")  # fmt: skip
        if train.nproc > 1 or train.compile or train.early_stopping_patience:
            raise ValueError("progressive growth changes the model during training: it needs train.nproc 1, train.compile false "
                             "and train.early_stopping_patience 0 (a best checkpoint of a smaller model cannot be restored)")  # fmt: skip


class DiffusionParams(Section):
    """The masked-diffusion objective (MDLM, LLaDA; `pipelines/core/training/diffusion.py`)."""

    time_steps: Literal["continuous", "discrete"] = "continuous"
    """`continuous`: t ~ U(eps, 1) per sequence; `discrete`: one of `num_time_steps` steps, with the
    mask fractions of `time_step_mask_fractions`."""
    eps: Annotated[float, only_with("time_steps", "continuous")] = Field(1e-3, gt=0, lt=1)
    """Smallest continuous time step (the 1/t weight stays bounded)."""
    sampling: Literal["antithetic", "iid"] = "antithetic"
    """Time steps of a batch: evenly spread from one draw (less variance), or independent."""
    num_time_steps: Annotated[int, only_with("time_steps", "discrete")] = Field(10, ge=1)
    time_step_mask_fractions: Annotated[dict[int, float], only_with("time_steps", "discrete")] = Field(default_factory=lambda: {0: 0.15, 5: 0.5, 9: 0.9})
    """Mask fraction at the listed discrete steps, interpolated linearly between them."""
    val_samples: int = Field(4, ge=1)
    """Time steps per validation sequence for the NELBO estimate (Monte Carlo, fixed seed)."""
    val_seed: int = 0
    unmask_steps: int = Field(16, ge=1)
    """Generation: unmasking steps (each keeps the most confident predictions, LLaDA's low-confidence remasking)."""
    block_length: int | None = Field(None, ge=1)
    """Generation: fill the answer in blocks of this many tokens, left to right (null: one block)."""

    @field_validator("time_step_mask_fractions")
    @classmethod
    def _fractions(cls, table: dict[int, float]) -> dict[int, float]:
        if not table or any(not 0 < v <= 1 for v in table.values()) or any(k < 0 for k in table):
            raise ValueError(f"expected time steps >= 0 with mask fractions in (0, 1], got {table}")
        return table


class PretrainParams(Section):
    model: ModelParams = ModelParams()
    train: TrainParams = TrainParams()
    objective: Literal["causal", "masked_diffusion"] = "causal"
    """`causal`: next-token prediction; `masked_diffusion`: predict masked tokens with bidirectional
    attention (MDLM/LLaDA; the model is then a `QllmDiffusionLlamaForMaskedDiffusion`)."""
    diffusion: Annotated[DiffusionParams, only_with("objective", "masked_diffusion")] = DiffusionParams()
    """The masked-diffusion objective's settings (`objective: masked_diffusion` only)."""
    progressive: ProgressiveParams = ProgressiveParams()
    """Grow the model stack by stack (`enabled: true`); off: the whole model trains from step 0."""
    continue_base: bool = False
    """With `base_model.name` set: continue pretraining the base on the text sources (its own
    tokenizer, the packed rows of `tokenize`, the shared loop and `train:` here), so that what only
    the text holds reaches the base before sft (LLaMA-Factory's `stage: pt`, axolotl's completion
    data sets). False: the base is used as it is (`model:` is then not read either)."""
    replay: Annotated[ReplayParams, only_with("continue_base", True)] = ReplayParams()
    """With `continue_base`: the base's own answers to the general prompts' train third, rendered by
    its chat template as text and packed into rows beside the text's (`fraction` of the trained
    tokens), so that continued pretraining keeps the chat model it starts from."""

    @model_validator(mode="after")
    def _progressive_fits(self) -> PretrainParams:
        if self.objective == "masked_diffusion" and self.model.memory.enabled:
            raise ValueError("objective masked_diffusion and model.memory together are not supported yet: enable one of them")
        if self.objective == "masked_diffusion" and self.train.curriculum.strategy != "none":
            raise ValueError("objective masked_diffusion with train.curriculum is not supported: the curriculum is for the causal objective")
        grow = self.progressive
        if not grow.enabled:
            return self
        if sum(grow.stacks) != self.model.num_layers:
            raise ValueError(f"progressive.stacks {grow.stacks} add up to {sum(grow.stacks)} layers but model.num_layers is "
                             f"{self.model.num_layers}: make them agree")  # fmt: skip
        if self.model.memory.enabled:
            raise ValueError("progressive growth and model.memory together are not supported yet: enable one of them")
        grow.check_fits(self.train)
        return self

"""`TrainParams`, the training loop's settings every training stage shares (optimizer, schedule,
precision, checkpoints, loggers), and the sequence-length curriculum it can follow.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.core import extensions
from pipelines.core.errors import QllmError
from pipelines.core.params.base import Section, only_with

DEFAULT_EXTENSIONS = ("mlflow_metrics", "tensorboard", "system_metrics")
"""`train.extensions` when params do not set it: the loggers of every training stage."""


class CurriculumParams(Section):
    """Sequence-length warmup (Li et al., NeurIPS 2022; DeepSpeed's curriculum scheduler, Composer's
    `SeqLengthWarmup`): early steps train on the first `length(step)` tokens of every sequence.
    `pipelines/core/training/curriculum.py` has the schedule."""

    strategy: Literal["none", "length"] = "none"
    """`length`: warm the sequence length up from `start_length` to `end_length` over `steps`."""
    start_length: Annotated[int, only_with("strategy", "length")] = Field(64, ge=1)
    end_length: Annotated[int | None, only_with("strategy", "length")] = None
    """null: the data's full sequence length (`tokenize.seq_len` for pretrain)."""
    steps: Annotated[int, only_with("strategy", "length")] = Field(200, ge=1)
    """Optimizer steps of the warmup; from then on every step sees full-length sequences."""
    schedule: Annotated[Literal["linear", "root"], only_with("strategy", "length")] = "linear"
    """How the length grows: linearly in the step, or with its square root (DeepSpeed's
    `fixed_root`: faster at first)."""
    step_size: Annotated[int, only_with("strategy", "length")] = Field(8, ge=1)
    """Lengths are multiples of this (rounded down, never below `start_length`)."""

    @model_validator(mode="after")
    def _lengths(self) -> CurriculumParams:
        if self.end_length is not None and self.end_length < self.start_length:
            raise ValueError(f"end_length ({self.end_length}) must be at least start_length ({self.start_length})")
        return self


class TrainParams(Section):
    """The shared training loop's settings (every training stage has its own copy)."""

    seed: int = 0
    max_steps: int = Field(1000, ge=1)
    """Optimizer steps (each of `micro_batch_size * grad_accum_steps` sequences)."""
    micro_batch_size: int = Field(16, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate."""
    min_lr_ratio: Annotated[float, only_with("schedule", "cosine", "linear")] = Field(0.1, ge=0, le=1)
    """Final learning rate as a share of `lr` (cosine/linear schedules)."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    """Applied to matrices only; biases, norms and embeddings are not decayed."""
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    max_grad_norm: float = Field(1.0, ge=0)
    """Gradient clipping threshold; 0 disables clipping."""
    optimizer: Literal["adamw", "adamw_fused", "adamw_bnb_8bit", "paged_adamw_8bit"] = "adamw_fused"
    """`adamw`: `torch.optim.AdamW` (one kernel per parameter); `adamw_fused`: the same update in
    one fused kernel over all parameters (CPU and CUDA; what HF `Trainer` uses by default,
    `adamw_torch_fused`), 3-5x faster an optimizer step on the CPU; results differ from `adamw` by
    float rounding only. `adamw_bnb_8bit`: bitsandbytes' 8-bit AdamW, its two moments in 8 bits
    (2 bytes a parameter instead of 8: for full fine-tuning of a 1.5B model 3 GB instead of 12);
    `paged_adamw_8bit`: the same, its state paged to host memory when the GPU runs short (CUDA;
    on a CPU the plain 8-bit one). HF `Trainer`'s names for both."""
    attention: Literal["model", "sdpa", "eager"] = "model"
    """The attention kernel while training: `model` keeps the model's own (transformers' default is
    SDPA); `eager` is the plain matmul-and-softmax one. On a CPU in bf16, PyTorch's SDPA backward is
    slow at short lengths: `eager` trained the sample model's rows of 32-128 tokens in 0.65-0.74 of
    the time, but took 1.2x at 256 and 2x at 512 tokens, and in fp32 it gains nothing
    (benchmarks/results/peers.md). The saved model keeps its own kernel."""
    compile: bool = False
    """Compile the model's forward with `torch.compile` (TorchInductor; on a CPU it needs a C++
    compiler). The first steps pay the compilation (tens of seconds on a CPU) and every new
    sequence length may recompile; off by default because at the default sizes it does not pay
    back within a stage (benchmarks/results/peers.md). Results differ from eager by float rounding."""
    loss_chunk_tokens: int = Field(0, ge=0)
    """Apply the output head and the cross-entropy to at most this many trained tokens at a time,
    recomputing each chunk's logits in the backward pass, so the logits of a large vocabulary
    (Qwen2.5: 151,936 tokens, 0.6 MB per token in fp32) are never held for the whole batch
    (`pipelines.core.training.chunked_loss`); only positions with a label are scored. The loss is the same
    up to float rounding. 0: the model's own loss over every position (the default: at the
    sample's 872-token vocabulary chunking saves nothing). Causal LM losses only; not with FSDP."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Autocast dtype. `auto`: bf16 on CUDA devices and CPUs with bf16 matrix units (AMX,
    AVX512-BF16), fp16 on older CUDA devices, fp32 elsewhere (`pipelines.core.training.precision`); the resolved
    value is logged and written to the stage's metrics. fp16 (CUDA only) adds a grad scaler; bf16 on
    a CPU without bf16 units is emulated, many times slower than fp32 (a warning says by how much)."""
    eval_every: int = Field(100, ge=0)
    """Validate every N steps (0: only at the end)."""
    eval_batches: int = Field(20, ge=0)
    """Validation micro-batches per evaluation (0: the whole validation set)."""
    log_every: int = Field(10, ge=1)
    """Log training metrics to MLflow every N steps."""
    checkpoint_every: int = Field(200, ge=0)
    """Save a resumable checkpoint every N steps (0: never)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many recent checkpoints to keep (the best one is kept in addition)."""
    early_stopping_patience: int = Field(0, ge=0)
    """Stop after this many evaluations without a better validation loss (0: off)."""
    skip_nonfinite: int = Field(0, ge=0)
    """Batches with a NaN/inf loss or gradient norm to skip over the whole run (zeroed gradients, no
    optimizer or schedule step, a warning naming the step); one more stops training with an error
    naming the step. 0: the first one stops training. The count is reported as `skipped_nonfinite`."""
    gradient_checkpointing: bool = False
    """Recompute activations during backward instead of keeping them: much less memory for about a
    third more compute. Turn on when a step runs out of memory."""
    nproc: int = Field(1, ge=1)
    """Data-parallel processes on this machine: > 1 makes the stage run itself under
    `torchrun --nproc_per_node nproc` (DDP; gloo on CPU, nccl on CUDA). The global batch stays
    `micro_batch_size * grad_accum_steps`: each rank runs `grad_accum_steps / nproc` micro-batches
    per step, so `grad_accum_steps` must be divisible by `nproc`."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the `nproc` > 1 ranks share the model. `ddp`: every rank holds the whole model, gradients
    are averaged (all-reduce). `fsdp`: FSDP2 (`fully_shard` per decoder layer and at the root)
    shards parameters, gradients and AdamW state across the ranks, each layer gathered for its
    own forward/backward only: less accelerator memory per rank for more communication; the same
    loss curve as `ddp` and 1 process. Checkpoints and outputs hold the full (gathered) weights.
    Read whenever the stage runs on several processes: `nproc` > 1, or the stage started under
    `torchrun` by hand with `nproc` 1 (its world size is torchrun's, which params cannot know), so
    it is not refused with `nproc` 1; one process ignores it."""

    curriculum: CurriculumParams = CurriculumParams()
    """Sequence-length curriculum (`strategy: none | length`; pretrain only: its packed rows can be
    cut anywhere). The learning-rate schedule stays step-based; validation is at full length."""
    extensions: list[str | dict[str, Any]] = Field(default_factory=lambda: list(DEFAULT_EXTENSIONS))
    """Extensions of the training loop, run in this order (`pipelines.core.extensions`): a name, or
    `{name: ..., <setting>: ...}`. Built in: `mlflow_metrics` (the loop's metrics to the stage's MLflow
    run), `tensorboard` (event files under `tensorboard/<stage>/`; setting `log_dir`),
    `system_metrics` (MLflow system metrics: CPU, memory, GPU; settings `interval`, `max_interval`
    in seconds). Others as `package.module:Class`. The list replaces the default one: keep
    `mlflow_metrics` in it to log the loop's metrics to MLflow. `[]`: none."""

    @field_validator("extensions")
    @classmethod
    def _extensions(cls, entries: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:

        names = []
        for index, entry in enumerate(entries):
            try:
                name, settings = extensions.parse(entry, f"entry {index}")
                extensions.check_settings(extensions.resolve(name, f"entry {index}"), settings, f"entry {index} ({name})")
            except QllmError as exc:
                raise ValueError(str(exc)) from None
            names.append(name)
        if len(set(names)) != len(names):
            raise ValueError(f"an extension is listed twice: {names}")
        return entries

    @model_validator(mode="after")
    def _warmup(self) -> TrainParams:
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        if self.grad_accum_steps % self.nproc:
            raise ValueError(
                f"grad_accum_steps ({self.grad_accum_steps}) must be divisible by nproc ({self.nproc}): each process runs "
                f"grad_accum_steps / nproc micro-batches of micro_batch_size per step, so the global batch stays the same"
            )
        return self


class ReplayParams(Section):
    """Self-distillation replay (`pipelines.core.data.replay`): the base model's own answers to the
    train third of the general prompts (`base_answers`), mixed into the stage's training data so
    that it keeps what the base could do. Needs a base model (`base_model.name`)."""

    fraction: float = Field(0.0, ge=0, lt=1)
    """Share of the trained tokens (those the loss is computed on) that replay makes up, on average
    in every optimizer step. 0: no replay."""


class PreferenceReplayParams(ReplayParams):
    """Replay in preference optimisation (`dpo.replay`): the base's own answers as a separate
    NLL term beside the preference loss, `weight` times their per-token NLL, with `fraction` of
    the trained tokens (the pairs' answers and the replayed ones) in every step on average."""

    weight: float = Field(1.0, gt=0)
    """The replay NLL term's weight in the loss (the preference loss has weight 1)."""

    @model_validator(mode="after")
    def _weight_acts(self) -> PreferenceReplayParams:
        if not self.fraction and self.weight != 1.0:
            raise ValueError(f"weight={self.weight:g} does nothing with fraction 0 (no replay): set fraction > 0, or leave weight at 1")
        return self


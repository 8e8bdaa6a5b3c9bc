"""Sequence-length curriculum: a data order the shared loop is handed, never a copy of the loop.

    batches = curriculum.wrap(loop.Batches(...), cfg, full_length=seq_len)

With `train.curriculum.strategy: length` the first `steps` optimizer steps train on the first
`length(step)` tokens of every sequence (truncation, as DeepSpeed's curriculum scheduler does for
`seqlen`; Li et al., "The Stability-Efficiency Dilemma", NeurIPS 2022), growing from `start_length`
to `end_length` linearly or with the square root of the step (DeepSpeed's `fixed_linear` /
`fixed_root`), in multiples of `step_size`; after that every step sees full sequences. The
learning-rate schedule stays step-based (warmup and decay do not stretch with the shorter early
steps), validation always runs at full length, and the length is a function of the step alone,
so a resumed run continues mid-curriculum exactly. The loop calls `begin_step(step)` before it
draws a step's micro-batches and logs `metrics(step)`: `train/seq_len` and `train/tokens_seen`.
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.core.errors import QllmError
from pipelines.core.params.training import CurriculumParams, TrainParams


def length_at(step: int, curriculum: CurriculumParams, full_length: int) -> int:
    """Tokens per sequence at optimizer step `step` (0-based)."""
    end = curriculum.end_length or full_length
    if curriculum.strategy == "none" or step >= curriculum.steps:
        return end
    fraction = step / curriculum.steps
    if curriculum.schedule == "root":
        fraction = fraction**0.5
    length = int(curriculum.start_length + (end - curriculum.start_length) * fraction)
    length -= length % curriculum.step_size
    return max(curriculum.start_length, min(end, length))


class LengthCurriculum:
    """`Batches` whose token tensors (`[rows, full_length]`) are cut to the current length."""

    def __init__(self, batches: Any, cfg: TrainParams, full_length: int):
        self.batches, self.curriculum, self.full_length = batches, cfg.curriculum, full_length
        self.rows_per_step = cfg.micro_batch_size * cfg.grad_accum_steps
        self.length = length_at(0, self.curriculum, full_length)

    def __getattr__(self, name: str) -> Any:  # n, batch_size, shard, state_dict, load_state_dict, ...
        return getattr(self.batches, name)

    def __iter__(self) -> LengthCurriculum:
        return self

    def begin_step(self, step: int) -> None:
        self.length = length_at(step, self.curriculum, self.full_length)

    def __next__(self) -> Any:
        batch = next(self.batches)
        return {key: value[:, : self.length] if isinstance(value, torch.Tensor) and value.dim() == 2 else value for key, value in batch.items()}

    def tokens_seen(self, steps: int) -> int:
        """Tokens trained on over the first `steps` optimizer steps (all ranks together)."""
        if self.curriculum.strategy == "none":
            return steps * self.rows_per_step * self.full_length
        warm = min(steps, self.curriculum.steps)
        lengths = sum(length_at(step, self.curriculum, self.full_length) for step in range(warm))
        return self.rows_per_step * (lengths + (steps - warm) * length_at(steps, self.curriculum, self.full_length))

    def metrics(self, step: int) -> dict[str, float]:
        return {"train/seq_len": float(self.length), "train/tokens_seen": float(self.tokens_seen(step))}


def wrap(batches: Any, cfg: TrainParams, full_length: int, key: str = "pretrain.train.curriculum") -> Any:
    """`batches` under `cfg.curriculum` (unchanged with `strategy: none`)."""
    curriculum = cfg.curriculum
    if curriculum.strategy == "none":
        return batches
    end = curriculum.end_length or full_length
    if end > full_length:
        raise QllmError(f"{key}.end_length is {end} but the sequences have {full_length} tokens (tokenize.seq_len): lower it or set null")
    if curriculum.start_length > full_length:
        raise QllmError(f"{key}.start_length is {curriculum.start_length} but the sequences have {full_length} tokens (tokenize.seq_len)")
    return LengthCurriculum(batches, cfg, full_length)

"""The masked-diffusion objective: a loss function and a batch transform for the shared loop.

    loss_fn = diffusion.Objective(params.diffusion, mask_token_id)      # pretrain; sft: answer tokens only

Masked diffusion (MDLM, Sahoo et al., NeurIPS 2024; LLaDA, Nie et al. 2025): draw a time step
t in (0, 1] per sequence, replace each (maskable) token by the mask token with probability t, and
train the bidirectional model (`pipelines.core.models.diffusion_model`) to predict the masked tokens.
With the linear schedule (a token survives to time t with probability 1 - t) the negative ELBO is

    NELBO = E_t [ (1/t) * sum over masked positions of -log p(x_i | x_t) ],

an upper bound on the negative log-likelihood of the sequence. Per token, the loss of a batch is

    loss = sum_rows (1/t_row) * sum_{masked i in row} CE_i  /  (maskable tokens in the batch).

A worked example: two rows of 4 maskable tokens; row 1 at t = 0.5 masks 2 tokens with
cross-entropies 1.0 and 3.0, row 2 at t = 0.25 masks 1 token with cross-entropy 2.0:
loss = (4.0 / 0.5 + 2.0 / 0.25) / 8 = (8 + 8) / 8 = 2.0 nats per token. Each row's weighted sum is
an unbiased estimate of its tokens' total NLL bound: in expectation t * 4 tokens are masked, each
weighted 1/t.

Time steps are

- `continuous`: t = eps + (1 - eps) * u with u drawn for a batch of B rows as
  `(u0 + i / B) mod 1` (antithetic/stratified: one uniform u0, the rows spread evenly; MDLM's
  low-discrepancy sampler, less variance than independent draws) or independently (`iid`);
- `discrete`: `num_time_steps` steps k = 0..K-1 with mask fractions interpolated linearly between
  the steps `time_step_mask_fractions` lists (`{0: 0.15, 5: 0.5, 9: 0.9}`), k stratified over the
  batch the same way. With discrete steps a row's mask is a function of (row, k): seeded by a
  hash of the row's tokens and k, so a frozen trunk's activations repeat and the time-step
  activation cache (`pipelines.core.training.progressive`) can serve them.

Random draws use torch's global generator, which under `loop.train` holds the run's own stream
(`Objective.draws`; `pipelines.core.training.randomness`) that checkpoints save and restore: a
resumed run draws the same time steps and masks (exact resume). Validation (`nelbo_fn`) estimates the bound
with `val_samples` time steps per sequence from a generator seeded with `val_seed`, so every
evaluation sees the same masks; `exp(bound)` is the NELBO perplexity bound, comparable with a causal
model's perplexity on the same tokens (the causal model scores T-1 predictions per row, the bound T).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from pipelines.core.data.chat_template import MASK
from pipelines.core.errors import QllmError
from pipelines.core.params.pretraining import DiffusionParams


def fraction_table(params: DiffusionParams) -> list[float]:
    """Mask fraction of each discrete time step, interpolated between the listed steps (held beyond them)."""
    listed = sorted((int(k), float(v)) for k, v in params.time_step_mask_fractions.items())
    steps, values = [k for k, _ in listed], [v for _, v in listed]
    return [float(v) for v in np.interp(np.arange(params.num_time_steps), steps, values)]


def stratified(rows: int, generator: torch.Generator | None = None, antithetic: bool = True) -> torch.Tensor:
    """`rows` numbers in [0, 1): evenly spread from one uniform draw, or independent draws."""
    if not antithetic:
        return torch.rand(rows, generator=generator)
    return (torch.rand(1, generator=generator) + torch.arange(rows) / rows) % 1.0


def sample_time_steps(rows: int, params: DiffusionParams, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(t per row in (0, 1], discrete step per row or None)."""
    u = stratified(rows, generator, params.sampling == "antithetic")
    if params.time_steps == "continuous":
        return params.eps + (1 - params.eps) * u, None
    steps = (u * params.num_time_steps).long().clamp(max=params.num_time_steps - 1)
    return torch.tensor(fraction_table(params))[steps], steps


def mask_positions(input_ids: torch.Tensor, maskable: torch.Tensor, t: torch.Tensor, steps: torch.Tensor | None,
                   generator: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
    """Booleans: which maskable tokens are masked, each with probability t of its row. With discrete
    `steps`, row r's draws come from a generator seeded by its tokens and step (the same row at the
    same step is masked the same way)."""
    if steps is None:
        draws = torch.rand(input_ids.shape, generator=generator)
    else:
        draws = torch.empty(input_ids.shape)
        for row in range(input_ids.shape[0]):
            draws[row] = torch.rand(input_ids.shape[1], generator=row_generator(input_ids[row], int(steps[row])))
    return (draws.to(input_ids.device) < t.to(input_ids.device)[:, None]) & maskable


def weighted_loss(logits: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, t: torch.Tensor, maskable: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on masked positions, weighted by 1/t of the row, averaged over maskable tokens."""
    ce = torch.nn.functional.cross_entropy(logits[masked].float(), targets[masked], reduction="none")
    weights = (1.0 / t.to(logits.device))[:, None].expand_as(masked)[masked]
    return (ce * weights).sum() / maskable.sum().clamp(min=1)


class Objective:
    """The masked-diffusion loss function of the shared loop: `(model, batch) -> (loss, metrics)`.

    `batch["input_ids"]` holds the clean tokens; `labels` (-100: not trained, as in SFT: only
    answer tokens are masked and scored) and `attention_mask` (padding) are optional.
    """

    draws = True
    """Its time steps and masks are random: `loop.train` gives the run its own stream (`training.randomness`)."""

    def __init__(self, params: DiffusionParams, mask_token_id: int) -> None:
        self.params, self.mask_token_id = params, mask_token_id

    def maskable(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        maskable = torch.ones_like(ids, dtype=torch.bool)
        if "labels" in batch:
            maskable &= batch["labels"] != -100
        if "attention_mask" in batch and batch["attention_mask"].dim() == 2:
            maskable &= batch["attention_mask"].bool()
        return maskable

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], t: torch.Tensor, steps: torch.Tensor | None,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        ids = batch["input_ids"]
        maskable = self.maskable(batch)
        masked = mask_positions(ids, maskable, t, steps, generator)
        noisy = torch.where(masked, torch.full_like(ids, self.mask_token_id), ids)
        extra = {k: v for k, v in batch.items() if k in ("attention_mask", "position_ids")}
        logits = model(input_ids=noisy, **extra).logits
        return weighted_loss(logits, ids, masked, t, maskable), masked

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        t, steps = sample_time_steps(batch["input_ids"].shape[0], self.params)
        loss, masked = self.loss(model, batch, t, steps)
        return loss, {"train/mask_fraction": float(masked.sum()) / max(1, int(self.maskable(batch).sum()))}


def mask_token_id(tokenizer, where: str) -> int:
    """The tokenizer's mask token (`train_tokenizer` adds it for `pretrain.objective: masked_diffusion`)."""
    token = tokenizer.convert_tokens_to_ids(MASK)
    if token is None or token == tokenizer.unk_token_id:
        raise QllmError(f"{where}: the tokenizer has no {MASK} token; the masked-diffusion objective needs one "
                        "(train_tokenizer adds it when pretrain.objective is masked_diffusion)")  # fmt: skip
    return int(token)


def objective_of(model: torch.nn.Module) -> str:
    """`masked_diffusion` for a model trained with this objective (its config says so), else `causal`."""
    return getattr(getattr(model, "config", None), "objective", "causal")


ELBO_SAMPLES = 4
"""Masked draws per sequence when a masked-diffusion model scores an answer (`sequence_elbo`)."""


def row_generator(row: torch.Tensor, salt: int) -> torch.Generator:
    """A generator seeded by a row's tokens (and `salt`): the same row draws the same numbers in any model."""
    digest = hashlib.blake2b(row.cpu().numpy().tobytes() + salt.to_bytes(4, "little"), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def sequence_elbo(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion: torch.Tensor,
                  samples: int = ELBO_SAMPLES, eps: float = 1e-3) -> torch.Tensor:  # fmt: skip
    """A masked-diffusion model's stand-in for the summed log-probability of each row's completion
    tokens: the evidence lower bound, `-(1/K) sum_k (1/t_k) sum_{masked i} -log p(x_i | x_t_k)`, with
    only completion tokens masked (the prompt is always visible). The K time steps of a row are
    antithetic and its masks are seeded by the row's tokens, so a policy and its reference score a
    pair with the same draws and their difference has little variance (LLaDA 1.5's VRPO); gradients
    flow for training (DPO)."""
    rows, width = input_ids.shape
    generators = [row_generator(input_ids[r], 0) for r in range(rows)]
    start = torch.stack([torch.rand(1, generator=g) for g in generators])[:, 0]
    draws = torch.stack([torch.rand(samples, width, generator=g) for g in generators]).to(input_ids.device)  # [rows, K, width]
    mask_id = int(model.config.mask_token_id)
    total = torch.zeros(rows, device=input_ids.device)
    completion = completion.bool()
    for k in range(samples):
        t = (eps + (1 - eps) * ((start + k / samples) % 1.0)).to(input_ids.device)
        masked = (draws[:, k] < t[:, None]) & completion
        noisy = torch.where(masked, torch.full_like(input_ids, mask_id), input_ids)
        logits = model(input_ids=noisy, attention_mask=attention_mask).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[..., None])[..., 0]
        total = total + (logp * masked).sum(-1) / t
    return total / samples

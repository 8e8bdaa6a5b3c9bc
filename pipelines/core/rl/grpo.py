"""GRPO's arithmetic, as TRL 1.16's `GRPOTrainer` does it: group-normalised advantages and the
clipped surrogate loss with its variants (issue 39's stage builds on these).

    advantages, zero_std = group_advantages(rewards_per_func, weights, group_size)
    loss, metrics = policy_loss(logps, old_logps, ref_logps, advantages, mask, loss_type="dapo", ...)

**Advantages.** The reward functions' outputs (one column each; NaN where a function does not
score a completion) are weighted and summed per completion (a completion no function scored stays
NaN), then each group of `group_size` completions of one prompt is centred on its mean and, with
`scale="group"` (TRL's default), divided by its standard deviation (Bessel-corrected) + 1e-4;
`"batch"` divides by the whole batch's, `"none"` not at all (Dr. GRPO). An unscored completion's
advantage is 0. `zero_std` marks the completions of groups whose rewards are all equal: they teach
nothing, and their share is a metric users watch.

**Loss.** With per-token log-probabilities of the policy (`logps`), of the policy that generated
the completions (`old_logps`; equal to `logps` detached when each batch of generations is used once)
and of the reference (`ref_logps`, only for `beta` > 0): the ratio `r = exp(logps - old_logps)`, the
clipped surrogate `-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)` per token, plus `beta` times
the k3 KL estimate `exp(ref - logps) - (ref - logps) - 1`. Averaged by `loss_type`:

- `grpo`: per completion over its tokens, then over completions (length bias towards short wrong answers);
- `dr_grpo`: summed over all tokens, divided by completions x `max_completion_length` (Dr. GRPO);
- `dapo` (TRL's default): summed over all tokens, divided by the number of completion tokens in
  the batch (`num_items`: across gradient-accumulation micro-batches, as DAPO's token-level loss);
- `bnpo`: summed over the micro-batch's tokens, divided by its token count.

Metrics (TRL's names): `kl` (when `beta` > 0), `clip_ratio/low_mean`, `clip_ratio/high_mean`,
`clip_ratio/region_mean` (token shares clipped below, above, either), each a masked mean.
`tests/core/rl/test_grpo.py` checks both against TRL's own code on random inputs.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALES = ("group", "batch", "none")


def _nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (NaN for fewer than two values), as TRL's `nanstd`."""
    mean = torch.nanmean(values, dim=dim, keepdim=True) if dim is not None else torch.nanmean(values)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=keepdim) if dim is not None else torch.nanmean((values - mean) ** 2)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=keepdim) if dim is not None else (~torch.isnan(values)).sum()
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=variance.dtype))
    return torch.sqrt(variance * correction)


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, group_size: int, scale: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of `rewards_per_func` ([completions, functions], groups of `group_size` in a
    row) and which completions sit in a group (or batch) of equal rewards; see the module docstring."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    if rewards_per_func.shape[0] % group_size:
        raise ValueError(f"{rewards_per_func.shape[0]} completions do not make groups of {group_size}")
    unscored = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscored] = float("nan")
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = _nanstd(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return ((values * mask).sum() / mask.sum().clamp(min=1.0)).item()


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    max_completion_length: int | None = None,
    num_items: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's loss over per-token tensors `[completions, tokens]` and its metrics; see the module
    docstring. `old_logps` None: the policy's own, detached (one pass over each generation).
    `num_items` (dapo): the completion tokens the loss is normalised by (default: `mask.sum()`)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(LOSS_TYPES)}")
    if beta and ref_logps is None:
        raise ValueError("beta > 0 needs the reference's per-token log-probabilities")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type 'dr_grpo' divides by max_completion_length: pass it")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old_logps = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    metrics: dict[str, float] = {}
    if beta:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    else:  # dapo
        loss = (per_token * mask).sum() / max(float(num_items if num_items is not None else mask.sum().item()), 1.0)
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
    metrics |= {"clip_ratio/low_mean": _masked_mean(low, mask), "clip_ratio/high_mean": _masked_mean(high, mask),
                "clip_ratio/region_mean": _masked_mean(torch.maximum(low, high), mask)}  # fmt: skip
    return loss, metrics

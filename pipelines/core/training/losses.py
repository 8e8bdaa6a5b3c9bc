"""Preference losses (DPO and relatives) on per-example sequence log-probabilities.

    losses, chosen_rewards, rejected_rewards = preference_loss(pc, pr, rc, rr, beta=0.1)

With `logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)`:

- `sigmoid` (DPO; Rafailov et al. 2023), with label smoothing eps (conservative DPO):
  `-(1 - eps) * logsigmoid(beta * logits) - eps * logsigmoid(-beta * logits)`
- `ipo` (Azar et al. 2023): `(logits - 1 / (2 * beta)) ** 2`
- `hinge` (SLiC): `relu(1 - beta * logits)`

The implicit rewards are `beta * (policy - ref)` for chosen and rejected, detached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _sigmoid(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)


def _ipo(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return (logits - 1 / (2 * beta)) ** 2


def _hinge(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return torch.relu(1 - beta * logits)


LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {"sigmoid": _sigmoid, "ipo": _ipo, "hinge": _hinge}


def preference_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-example losses and (detached) chosen/rejected rewards; see the module docstring."""
    if loss_type not in LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(LOSSES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    logits = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    losses = LOSSES[loss_type](logits, beta, label_smoothing)
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


def reward_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
) -> dict[str, float]:
    """Batch means under the names TRL users know, plus `kl/chosen` (policy - ref on chosen)."""
    return {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "logps/chosen": policy_chosen_logps.detach().mean().item(),
        "logps/rejected": policy_rejected_logps.detach().mean().item(),
        "kl/chosen": (policy_chosen_logps - ref_chosen_logps).detach().mean().item(),
    }

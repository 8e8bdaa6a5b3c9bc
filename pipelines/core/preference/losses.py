"""Preference losses on per-example sequence log-probabilities, as TRL 1.16 writes them.

    losses, chosen_rewards, rejected_rewards = preference_loss(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid")
    losses, chosen_rewards, rejected_rewards, extra = reference_free_loss("simpo", pc_avg, pr_avg, beta=2.0, gamma=0.5)
    loss, metrics = kto_loss(logps, labels, ref_logps, kl_logps, ref_kl_logps, beta=0.1)

**With a reference** (TRL's `DPOTrainer` loss types). With `c = policy_chosen - ref_chosen`,
`r = policy_rejected - ref_rejected` (summed completion log-probabilities) and `d = c - r`:

| loss_type | per-pair loss |
|---|---|
| `sigmoid` (DPO) | `-(1-e) logsig(b d) - e logsig(-b d)`: with label smoothing `e > 0`, conservative DPO (cDPO; TRL's CPO `sigmoid`; TRL 1.16's DPO `sigmoid` is the `e = 0` case) |
| `hinge` (SLiC) | `relu(1 - b d)` |
| `ipo` | `((c/n_c - r/n_r) - 1/(2b))^2`: TRL 1.16's, on per-token averages (`n`: completion tokens) |
| `ipo_sum` | `(d - 1/(2b))^2`: Eq. 17 of Azar et al. on the summed log-ratios (TRL before 1.0) |
| `robust` | `(-(1-e) logsig(b d) + e logsig(-b d)) / (1 - 2e)` |
| `exo_pair` | `q logq - q log(1-e) + q' logq' - q' log e`, `q = sig(b d)`, `q' = sig(-b d)` (needs `e > 0`) |
| `nca_pair` | `-logsig(b c) - logsig(-b c)/2 - logsig(-b r)/2` |
| `bco_pair` | `-logsig(b c) - logsig(-b r)` |
| `sppo_hard` | `(c - 1/(2b))^2 + (r + 1/(2b))^2` |
| `apo_zero` | `1 - sig(b c) + sig(b r)` |
| `apo_down` | `sig(b c) + 1 - sig(b d)` |
| `discopop` | `-logsig(b d) (1 - m) + exp(-b d) m`, `m = sig(b d / tau)` |

The implicit rewards are `b c` and `b r`, detached.

**Without a reference** (log-probabilities averaged over the completion's tokens, `pc`, `pr`):
`simpo` (Meng et al. 2024; TRL's `CPOTrainer(loss_type="simpo")`): `-(1-e) logsig(b (pc - pr) - gamma)
- e logsig(-(b (pc - pr) - gamma))`; `orpo` (Hong et al. 2024; TRL's `ORPOTrainer`): minus
`b logsig(log_odds)` with `log_odds = (pc - pr) - (log(1 - exp pc) - log(1 - exp pr))`, added to
the chosen answers' NLL by the caller. Rewards: `b pc` and `b pr`.

**KTO** (Ethayarajh et al. 2024; TRL's `KTOTrainer`) on unpaired examples: desirable ones lose
`1 - sig(b (c - z))`, undesirable ones `1 - sig(b (z - r))`, weighted, averaged over the batch;
`z` is the batch's KL estimate `mean(policy - ref)` over mismatched prompt/completion pairs,
detached and clamped at 0.

`tests/core/preference/test_losses.py` checks every one against TRL's own trainer code on random
inputs (to 1e-6), metrics included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Ratios:
    """Policy minus reference log-probabilities of a batch of pairs, and their completion lengths."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor | None = None
    rejected_tokens: torch.Tensor | None = None

    @property
    def delta(self) -> torch.Tensor:
        return self.chosen - self.rejected


def _sigmoid(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(beta * x.delta) - eps * F.logsigmoid(-beta * x.delta)


def _hinge(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    return torch.relu(1 - beta * x.delta)


def _ipo(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    if x.chosen_tokens is None or x.rejected_tokens is None:
        raise ValueError("loss_type 'ipo' averages over the completion tokens: pass chosen_tokens and rejected_tokens")
    average = x.chosen / x.chosen_tokens.clamp(min=1.0) - x.rejected / x.rejected_tokens.clamp(min=1.0)
    return (average - 1 / (2 * beta)) ** 2


def _ipo_sum(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    return (x.delta - 1 / (2 * beta)) ** 2


def _robust(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    return (-(1 - eps) * F.logsigmoid(beta * x.delta) + eps * F.logsigmoid(-beta * x.delta)) / (1 - 2 * eps)


def _exo_pair(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    z = beta * x.delta
    return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))


def _nca_pair(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    chosen, rejected = beta * x.chosen, beta * x.rejected
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def _bco_pair(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    return -F.logsigmoid(beta * x.chosen) - F.logsigmoid(-beta * x.rejected)


def _sppo_hard(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    return (x.chosen - 0.5 / beta) ** 2 + (x.rejected + 0.5 / beta) ** 2


def _apo_zero(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    return 1 - torch.sigmoid(beta * x.chosen) + torch.sigmoid(beta * x.rejected)


def _apo_down(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    return torch.sigmoid(beta * x.chosen) + 1 - torch.sigmoid(beta * x.delta)


def _discopop(x: Ratios, beta: float, eps: float, tau: float) -> torch.Tensor:
    logits = beta * x.delta
    modulation = torch.sigmoid(logits / tau)
    return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation


LOSSES: dict[str, Callable[[Ratios, float, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid, "hinge": _hinge, "ipo": _ipo, "ipo_sum": _ipo_sum, "robust": _robust, "exo_pair": _exo_pair,
    "nca_pair": _nca_pair, "bco_pair": _bco_pair, "sppo_hard": _sppo_hard, "apo_zero": _apo_zero, "apo_down": _apo_down,
    "discopop": _discopop,
}  # fmt: skip
SMOOTHED = ("sigmoid", "robust", "exo_pair")
"""The loss types that read `label_smoothing` (exo_pair needs it > 0)."""
REFERENCE_FREE = ("simpo", "orpo")


def _check(beta: float, label_smoothing: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")


def preference_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
    discopop_tau: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and (detached) chosen/rejected rewards; see the module docstring."""
    if loss_type not in LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(LOSSES)}")
    _check(beta, label_smoothing)
    if loss_type == "exo_pair" and label_smoothing == 0:
        raise ValueError("loss_type 'exo_pair' needs label_smoothing > 0 (the EXO paper uses 1e-3)")
    ratios = Ratios(policy_chosen_logps - ref_chosen_logps, policy_rejected_logps - ref_rejected_logps, chosen_tokens, rejected_tokens)
    losses = LOSSES[loss_type](ratios, beta, label_smoothing, discopop_tau)
    return losses, beta * ratios.chosen.detach(), beta * ratios.rejected.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (Maechler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def reference_free_loss(
    method: str, policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor, *, beta: float, gamma: float = 0.5, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """SimPO's or ORPO's per-pair losses (ORPO's without its NLL term), rewards and extra metrics,
    from completion log-probabilities averaged per token."""
    _check(beta, label_smoothing)
    chosen, rejected = policy_chosen_logps.float(), policy_rejected_logps.float()
    extra: dict[str, float] = {}
    if method == "simpo":
        logits = (chosen - rejected) - gamma / beta
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif method == "orpo":
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        losses = -beta * ratio  # TRL adds `-beta * ratio.mean()` to the NLL
        extra = {"log_odds_ratio": ratio.detach().mean().item(), "log_odds_chosen": log_odds.detach().mean().item()}
    else:
        raise ValueError(f"unknown reference-free method {method!r}; expected one of {', '.join(REFERENCE_FREE)}")
    return losses, beta * chosen.detach(), beta * rejected.detach(), extra


def reward_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
) -> dict[str, float]:
    """Batch means under the names TRL users know, plus `kl/chosen` (policy - ref on chosen) when
    there is a reference."""
    metrics = {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "logps/chosen": policy_chosen_logps.detach().mean().item(),
        "logps/rejected": policy_rejected_logps.detach().mean().item(),
    }
    if ref_chosen_logps is not None:
        metrics["kl/chosen"] = (policy_chosen_logps - ref_chosen_logps).detach().mean().item()
    return metrics


def kto_loss(
    logps: torch.Tensor,
    desirable: torch.Tensor,
    ref_logps: torch.Tensor,
    kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KTO's batch loss and TRL's metrics (`kl`, `rewards/chosen`, `rewards/rejected`,
    `rewards/margins`, `logps/chosen`, `logps/rejected`; a side the batch lacks is left out).

    `logps`/`ref_logps`: the completions' summed log-probabilities under the policy and the
    reference; `desirable`: bool labels; `kl_logps`/`ref_kl_logps`: the same for each example's
    mismatched completion (the policy's without gradients)."""
    _check(beta, 0.0)
    kl = (kl_logps.detach() - ref_kl_logps).mean().clamp(min=0)
    desirable = desirable.bool()
    chosen_ratios = logps[desirable] - ref_logps[desirable]
    rejected_ratios = logps[~desirable] - ref_logps[~desirable]
    chosen_losses = 1 - torch.sigmoid(beta * (chosen_ratios - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_ratios))
    loss = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses)).nanmean()
    metrics = {"kl": kl.item()}
    if len(chosen_ratios):
        metrics["rewards/chosen"] = (beta * chosen_ratios.detach()).nansum().item() / len(chosen_ratios)
        metrics["logps/chosen"] = logps[desirable].detach().nansum().item() / len(chosen_ratios)
    if len(rejected_ratios):
        metrics["rewards/rejected"] = (beta * rejected_ratios.detach()).nansum().item() / len(rejected_ratios)
        metrics["logps/rejected"] = logps[~desirable].detach().nansum().item() / len(rejected_ratios)
    if len(chosen_ratios) and len(rejected_ratios):
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return loss, metrics


def kto_weight_advice(desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's warning on imbalanced KTO data (Eq. 8 of the KTO paper: `desirable_weight * n_D /
    (undesirable_weight * n_U)` in [1, 4/3]), or None when the weights are in range."""
    desirable, undesirable = max(desirable, 1), max(undesirable, 1)
    if desirable == undesirable:
        return None
    low_d, high_d = round(undesirable * undesirable_weight / desirable, 2), round(undesirable * undesirable_weight / desirable * 1.33, 2)
    low_u, high_u = round(desirable * desirable_weight / undesirable / 1.33, 2), round(desirable * desirable_weight / undesirable, 2)
    if low_d <= desirable_weight <= high_d or low_u <= undesirable_weight <= high_u:
        return None
    return (f"{desirable} desirable and {undesirable} undesirable examples: with these weights the two sides are out of "
            f"balance (KTO paper, Eq. 8); set EITHER desirable_weight in [{low_d}, {high_d}] OR undesirable_weight in "
            f"[{low_u}, {high_u}] (not both)")  # fmt: skip

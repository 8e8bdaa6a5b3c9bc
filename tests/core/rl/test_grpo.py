"""GRPO's loss and advantages against TRL 1.16, on hidden random inputs.

The loss: TRL's `GRPOTrainer._compute_loss`, called unbound on a stand-in `self` whose
`_get_per_token_logps_and_entropies` returns the random per-token log-probabilities: loss, gradient
and TRL's clip-ratio and KL metrics must equal ours up to rounding (tests/numerics.py). The advantages: TRL writes them inline
in its generation step, so they are checked by the numbers of its formula computed with TRL's own
`nanstd`, and by hand on small groups.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict

import numpy as np
import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

from pipelines.core.rl import grpo
from tests import numerics


class _Accelerator:
    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    @staticmethod
    def gather_for_metrics(x):
        return x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _stub(loss_type: str, beta: float, eps_low: float, eps_high: float, max_len: int, logps: torch.Tensor):
    stub = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1), loss_type=loss_type,
        epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_len, accelerator=_Accelerator(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )  # fmt: skip
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.ones_like(logps), None)
    return stub


ROUNDINGS = 7 + 8 + 24
"""Ours and TRL's loss, gradient and metrics each go through at most: a completion's sum over its
7 tokens, the sum over 8 completions, and the per-token formula (the ratio's exp, the clipping, the
KL's exp and the products and normalisations: 24)."""

CASES = [("grpo", 0.0, 0.2, 0.2), ("dr_grpo", 0.04, 0.2, 0.2), ("dapo", 0.0, 0.2, 0.28), ("bnpo", 0.04, 0.2, 0.2), ("dapo", 0.1, 0.1, 0.3)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("loss_type", "beta", "eps_low", "eps_high"), CASES)
def test_policy_loss_equals_trls(loss_type, beta, eps_low, eps_high, seed):
    rng = np.random.default_rng(seed)
    rows, width, max_len = 8, 7, 9
    mask = torch.zeros(rows, width)
    for i in range(rows):
        mask[i, : int(rng.integers(1, width + 1))] = 1
    logps = -torch.from_numpy(rng.exponential(1.0, (rows, width))).float()
    old = logps + torch.from_numpy(rng.normal(0, 0.3, (rows, width))).float()  # ratios off 1: some clipped
    ref = logps + torch.from_numpy(rng.normal(0, 0.2, (rows, width))).float()
    advantages = torch.from_numpy(rng.normal(0, 1, rows)).float()
    logps.requires_grad_()
    inputs = {"prompt_ids": torch.zeros(rows, 3, dtype=torch.long), "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
              "completion_ids": torch.zeros(rows, width, dtype=torch.long), "completion_mask": mask.long(), "advantages": advantages,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}  # fmt: skip
    stub = _stub(loss_type, beta, eps_low, eps_high, max_len, logps)
    trl_loss = GRPOTrainer._compute_loss(stub, None, inputs)
    trl_metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}

    ours, metrics = grpo.policy_loss(logps, old, ref if beta else None, advantages, mask, loss_type=loss_type, beta=beta, epsilon_low=eps_low,
                                     epsilon_high=eps_high, max_completion_length=max_len, num_items=float(mask.sum()))  # fmt: skip
    # one token's term: the ratio times the advantage, and beta times the KL's
    kl = ((ref - logps).exp() - (ref - logps) - 1).detach()
    term = float(advantages.abs().max() * (logps - old).exp().max()) + beta * float(kl.max())
    numerics.assert_close_as(ours, trl_loss, n=ROUNDINGS, magnitude=term, what="loss")
    (trl_grad,) = torch.autograd.grad(trl_loss, logps)
    (our_grad,) = torch.autograd.grad(ours, logps)
    numerics.assert_close_as(our_grad, trl_grad, n=ROUNDINGS, magnitude=term, what="gradient")  # a token's share of the term, at most all of it
    for name, value in metrics.items():  # the clip ratios are fractions of tokens (size 1), the KL a mean of kl
        assert value == numerics.approx(trl_metrics[name], n=ROUNDINGS, magnitude=float(kl.max()) if name == "kl" else 1.0), name
    assert ("kl" in metrics) == bool(beta) and 0 < metrics["clip_ratio/region_mean"] < 1


def test_one_pass_over_each_generation_has_ratio_one_and_no_clipping():
    logps = -torch.rand(4, 5).requires_grad_()
    loss, metrics = grpo.policy_loss(logps, None, None, torch.tensor([1.0, -1.0, 0.5, 0.0]), torch.ones(4, 5), loss_type="grpo")
    assert metrics["clip_ratio/region_mean"] == 0
    # d/dlogp of -r A at r = 1 is -A, averaged per completion over its 5 tokens, then over 4
    (grad,) = torch.autograd.grad(loss, logps)  # a mean over 5 tokens, then over 4 completions, against one division: 4 roundings
    numerics.assert_close_as(grad, (-torch.tensor([1.0, -1.0, 0.5, 0.0]) / 20).unsqueeze(1).expand(4, 5), n=4, magnitude=1 / 20)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_follow_trls_formula(scale, seed):
    rng = np.random.default_rng(10 + seed)
    group, groups, functions = 4, 3, 2
    rewards = torch.from_numpy(rng.integers(0, 3, (group * groups, functions))).float()
    rewards[5, 1] = float("nan")  # one function did not score one completion
    rewards[7] = float("nan")  # no function scored another: its advantage is 0
    weights = torch.tensor([1.0, 0.5])
    ours, zero_std = grpo.group_advantages(rewards, weights, group, scale)
    # TRL's sum_then_normalize, with TRL's nanstd
    summed = (rewards * weights).nansum(1)
    summed[torch.isnan(rewards).all(1)] = float("nan")
    mean = torch.nanmean(summed.view(-1, group), 1).repeat_interleave(group)
    std = nanstd(summed).expand_as(summed) if scale == "batch" else nanstd(summed.view(-1, group), dim=1).repeat_interleave(group)
    expected = summed - mean if scale == "none" else (summed - mean) / (std + 1e-4)
    # the same formula in another order: the weighted sum over 2 functions, the mean and the standard
    # deviation over a group of 4 (or a batch of 12: its sums, square root and division) (tests/numerics.py)
    numerics.assert_close_as(ours, torch.nan_to_num(expected, nan=0.0), n=2 + 2 * 12 + 6)
    # rewards are multiples of 0.5: a group of equal ones has a standard deviation of exactly 0, others of at least 0.2
    assert ours[7] == 0 and torch.equal(zero_std, std == 0)


def test_advantages_by_hand():
    """One group [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3) = 0.57735; advantages +-0.5/0.57745.
    A group of equal rewards [2, 2, 2, 2]: advantages 0, marked zero-std."""
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0], [2.0], [2.0], [2.0], [2.0]])
    advantages, zero_std = grpo.group_advantages(rewards, torch.tensor([1.0]), 4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    # fp32 against float64: the mean and the standard deviation over 4 (sums, square root, division) and the division
    numerics.assert_close_as(advantages, torch.tensor([a, -a, -a, a, 0, 0, 0, 0], dtype=torch.float64), n=2 * 4 + 6)
    assert zero_std.tolist() == [False] * 4 + [True] * 4
    with pytest.raises(ValueError, match="7 completions do not make groups of 4"):
        grpo.group_advantages(rewards[:7], torch.tensor([1.0]), 4)

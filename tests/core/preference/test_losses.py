"""Preference losses checked by hand on three examples (arithmetic in the docstrings)."""

from __future__ import annotations

import math

import pytest
import torch

from pipelines.core.preference.losses import preference_loss, reward_metrics
from tests import numerics

# policy chosen/rejected and reference chosen/rejected log-probs of three pairs
PC = torch.tensor([-1.0, -2.0, -3.0])
PR = torch.tensor([-2.0, -2.0, -1.0])
RC = torch.tensor([-1.5, -2.0, -2.0])
RR = torch.tensor([-1.5, -2.0, -2.0])
# logits = (pc - pr) - (rc - rr) = [1 - 0, 0 - 0, -2 - 0] = [1, 0, -2]
LOGITS = [1.0, 0.0, -2.0]


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_sigmoid_is_dpo():
    """beta = 0.5: loss = -logsigmoid(0.5 * [1, 0, -2]) = [0.4741, 0.6931, 1.3133]."""
    losses, chosen, rejected = preference_loss(PC, PR, RC, RR, beta=0.5)
    expected = [-logsigmoid(0.5 * z) for z in LOGITS]
    # fp32 against float64: the differences and the product (exact here), then logsigmoid's exp,
    # log1p and sum (2 + 2 + 1 roundings, tests/numerics.py) and the sign: 8 in all, generously
    assert losses.tolist() == numerics.approx(expected, n=8)
    assert losses.tolist() == numerics.approx([0.474077, 0.693147, 1.313262], n=8, decimals=6)
    # rewards: 0.5 * (pc - rc) = [0.25, 0, -0.5]; 0.5 * (pr - rr) = [-0.25, 0, 0.5]: binary fractions, exact in fp32
    assert chosen.tolist() == [0.25, 0.0, -0.5] and rejected.tolist() == [-0.25, 0.0, 0.5]
    assert not chosen.requires_grad


def test_label_smoothing_gives_conservative_dpo():
    """eps = 0.2: -(0.8) logsigmoid(0.5 z) - 0.2 logsigmoid(-0.5 z); at z = 1: 0.8*0.4741 + 0.2*0.9741 = 0.5741."""
    losses, _, _ = preference_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.2)
    expected = [-0.8 * logsigmoid(0.5 * z) - 0.2 * logsigmoid(-0.5 * z) for z in LOGITS]
    # two terms of 8 roundings each (the weights 0.8 and 0.2 rounded to fp32 among them) and their sum
    assert losses.tolist() == numerics.approx(expected, n=17)
    assert losses[0].item() == numerics.approx(0.574077, n=17, decimals=6)


def test_ipo_sum_is_eq_17_on_summed_log_ratios():
    """beta = 0.5: (z - 1/(2*0.5))^2 = (z - 1)^2 = [0, 1, 9]."""
    losses, _, _ = preference_loss(PC, PR, RC, RR, beta=0.5, loss_type="ipo_sum")
    assert losses.tolist() == [0.0, 1.0, 9.0]  # small integers: exact in fp32


def test_ipo_averages_over_completion_tokens():
    """beta = 0.5, chosen tokens [2, 1, 4], rejected [1, 1, 2]: c = pc - rc = [0.5, 0, -1], r = pr - rr =
    [-0.5, 0, 1]; c/n_c - r/n_r = [0.25 + 0.5, 0, -0.25 - 0.5] = [0.75, 0, -0.75]; minus 1: squared
    [0.0625, 1, 3.0625]."""
    losses, _, _ = preference_loss(PC, PR, RC, RR, beta=0.5, loss_type="ipo", chosen_tokens=torch.tensor([2.0, 1.0, 4.0]),
                                   rejected_tokens=torch.tensor([1.0, 1.0, 2.0]))  # fmt: skip
    assert losses.tolist() == [0.0625, 1.0, 3.0625]  # binary fractions throughout: exact in fp32
    with pytest.raises(ValueError, match="pass chosen_tokens and rejected_tokens"):
        preference_loss(PC, PR, RC, RR, beta=0.5, loss_type="ipo")


def test_hinge():
    """beta = 0.5: relu(1 - 0.5 z) = relu([0.5, 1, 2]) = [0.5, 1, 2]; beta = 2: relu([-1, 1, 5]) = [0, 1, 5]."""
    # binary fractions throughout: exact in fp32
    assert preference_loss(PC, PR, RC, RR, beta=0.5, loss_type="hinge")[0].tolist() == [0.5, 1.0, 2.0]
    assert preference_loss(PC, PR, RC, RR, beta=2.0, loss_type="hinge")[0].tolist() == [0.0, 1.0, 5.0]


def test_gradient_raises_chosen_and_lowers_rejected():
    pc, pr = PC.clone().requires_grad_(), PR.clone().requires_grad_()
    losses, _, _ = preference_loss(pc, pr, RC, RR, beta=0.5)
    losses.sum().backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()  # descending the loss raises chosen, lowers rejected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 0.1, "loss_type": "kto"}, "unknown loss_type 'kto'; expected one of sigmoid, hinge, ipo, ipo_sum, robust"),
        ({"beta": 0.1, "loss_type": "exo_pair"}, r"loss_type 'exo_pair' needs label_smoothing > 0"),
        ({"beta": 0.0}, "beta must be > 0, got 0.0"),
        ({"beta": -1.0}, "beta must be > 0"),
        ({"beta": 0.1, "label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\), got 0.5"),
        ({"beta": 0.1, "label_smoothing": -0.1}, "label_smoothing must be in"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        preference_loss(PC, PR, RC, RR, **kwargs)


def test_reward_metrics_use_trl_names():
    _, chosen, rejected = preference_loss(PC, PR, RC, RR, beta=0.5)
    metrics = reward_metrics(chosen, rejected, PC, PR, RC)
    # accuracies: chosen > rejected for pair 1 only (0.25 > -0.25; 0 = 0; -0.5 < 0.5) -> 1/3
    # means of 3 binary fractions: the sums are exact, the division by 3 rounds once in fp32
    assert metrics["rewards/accuracies"] == numerics.approx(1 / 3, n=3)
    assert metrics["rewards/margins"] == numerics.approx((0.5 + 0 - 1.0) / 3, n=3)
    assert metrics["kl/chosen"] == numerics.approx((0.5 + 0 - 1.0) / 3, n=3)  # mean(pc - rc)
    assert metrics["logps/chosen"] == -2.0 and metrics["logps/rejected"] == numerics.approx(-5 / 3, n=3)  # -6 / 3: exact

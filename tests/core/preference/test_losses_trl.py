"""Every preference loss against TRL 1.16's own trainer code, on hidden random inputs, up to rounding.

TRL writes its losses inside trainer methods (`DPOTrainer._compute_loss`, `KTOTrainer._compute_loss`,
`CPOTrainer.cpo_loss`, `ORPOTrainer.odds_ratio_loss`/`get_batch_loss_metrics`), so the tests call
those methods unbound on a stand-in `self` that holds only the attributes they read, with a stand-in
model whose per-token log-probabilities are drawn at random (zero outside the completion, as TRL's
fused head returns them for label -100). Loss, rewards and TRL's logged metrics must equal ours.
"""

from __future__ import annotations

import os
import types
from collections import defaultdict

import numpy as np
import pytest
import torch

from pipelines.core.preference import losses
from tests import numerics

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # CPO and ORPO live in trl.experimental in 1.16
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

SEEDS = (0, 1, 2)
ROUNDINGS = 11 + 8 + 24 + 8
"""Ours and TRL's computations of a loss, gradient or metric each go through at most: a row's sum of
its 11 per-token log-probabilities, a mean over up to 8 rows (KTO's KL term), the loss formula (at
most four elementwise functions and 16 other operations: 24) and the mean over up to 8 rows
(tests/numerics.py)."""


def _assert_same(ours, theirs, floor: float, what: str = "") -> None:
    """Ours and TRL's computation of one value agree within `ROUNDINGS` of rounding, measured on the
    value's own size or on `floor`, the size of what it is computed from, whichever is larger."""
    magnitude = max(float(torch.as_tensor(theirs).abs().max()), floor)
    numerics.assert_close_as(ours, theirs, n=ROUNDINGS, magnitude=magnitude, what=what)


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x

    @staticmethod
    def gather(x):
        return x


class _Model(torch.nn.Module):
    """Returns the log-probabilities registered for an `input_ids` tensor (TRL's fused-head outputs)."""

    def __init__(self):
        super().__init__()
        self.outputs: dict[int, torch.Tensor] = {}

    def register(self, input_ids: torch.Tensor, log_probs: torch.Tensor) -> None:
        self.outputs[input_ids.data_ptr()] = log_probs

    def forward(self, input_ids, **_):
        log_probs = self.outputs[input_ids.data_ptr()]
        width = log_probs.shape[1]
        return types.SimpleNamespace(log_probs=log_probs, entropy=torch.ones_like(log_probs), mean_logits=torch.zeros_like(log_probs),
                                     is_top1=torch.zeros(log_probs.shape[0], width, dtype=torch.bool))  # fmt: skip


def _sequences(rng: np.random.Generator, rows: int, width: int = 12):
    """Random rows: a prompt of 2-5 tokens, then 1-6 completion tokens, right-padded; per-token
    log-probabilities (shifted, as the model predicts t + 1) zero outside the completion."""
    input_ids = torch.from_numpy(rng.integers(5, 50, size=(rows, width)))
    attention = torch.zeros(rows, width, dtype=torch.long)
    completion = torch.zeros(rows, width, dtype=torch.long)
    for i in range(rows):
        start, length = int(rng.integers(2, 6)), int(rng.integers(1, 7))
        attention[i, : start + length] = 1
        completion[i, start : start + length] = 1
    token_logps = -torch.from_numpy(rng.exponential(1.5, size=(rows, width - 1))).float() * completion[:, 1:]
    return input_ids, attention, completion, token_logps


def _dpo_stub(loss_type: str, beta: float, eps: float, tau: float, model: _Model):
    return types.SimpleNamespace(
        model=model, accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=eps,
        args=types.SimpleNamespace(discopop_tau=tau), use_weighting=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, ref_model=None,
    )  # fmt: skip


DPO_CASES = [
    ("sigmoid", 0.1, 0.0), ("hinge", 0.5, 0.0), ("ipo", 0.3, 0.0), ("robust", 0.2, 0.1), ("exo_pair", 0.1, 1e-3),
    ("nca_pair", 0.2, 0.0), ("bco_pair", 0.2, 0.0), ("sppo_hard", 0.5, 0.0), ("apo_zero", 0.1, 0.0), ("apo_down", 0.1, 0.0),
    ("discopop", 0.1, 0.0),
]  # fmt: skip


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("loss_type", "beta", "eps"), DPO_CASES)
def test_dpo_losses_equal_trls(loss_type, beta, eps, seed):
    rng = np.random.default_rng(seed)
    pairs = 6
    input_ids, attention, completion, token_logps = _sequences(rng, 2 * pairs)
    token_logps.requires_grad_()
    ref = -torch.from_numpy(rng.exponential(4.0, size=2 * pairs)).float()
    model = _Model()
    model.register(input_ids, token_logps)
    stub = _dpo_stub(loss_type, beta, eps, 0.05, model)
    inputs = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion,
              "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}  # fmt: skip
    trl_loss = DPOTrainer._compute_loss(stub, model, inputs, False)
    trl_metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}

    summed = token_logps.sum(1)
    tokens = completion.sum(1).float()
    ours, chosen_rewards, rejected_rewards = losses.preference_loss(
        summed[:pairs], summed[pairs:], ref[:pairs], ref[pairs:], beta=beta, loss_type=loss_type, label_smoothing=eps,
        chosen_tokens=tokens[:pairs], rejected_tokens=tokens[pairs:],
    )  # fmt: skip
    inputs = float(summed.abs().max() + ref.abs().max())  # the log-ratios' size
    _assert_same(ours.mean(), trl_loss, beta * inputs, "loss")
    # the gradients as well: the same function of the per-token log-probabilities
    (trl_grad,) = torch.autograd.grad(trl_loss, token_logps)
    (our_grad,) = torch.autograd.grad(ours.mean(), token_logps)
    _assert_same(our_grad, trl_grad, beta / pairs, "gradient")
    metrics = losses.reward_metrics(chosen_rewards, rejected_rewards, summed[:pairs], summed[pairs:], ref[:pairs])
    assert metrics["rewards/accuracies"] == trl_metrics["rewards/accuracies"]  # counts of the same comparisons over 6 pairs
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        _assert_same(metrics[name], trl_metrics[name], inputs if name.startswith("logps") else beta * inputs, name)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.1), (0.3, 0.25), (0.5, 0.0)])
def test_conservative_dpo_equals_trls_cpo_sigmoid_on_the_log_ratios(beta, eps, seed):
    """`sigmoid` with label smoothing e > 0 is conservative DPO (cDPO, Mitchell 2023):
    -(1-e) logsig(b d) - e logsig(-b d). TRL 1.16's `DPOTrainer` sigmoid ignores `label_smoothing`
    (its docs give it to robust and exo_pair only); TRL's CPO `sigmoid` is the same formula on a
    reference-free margin, so it is checked on the log-ratios c and r (d = c - r), by TRL's code."""
    rng = np.random.default_rng(300 + seed)
    policy = -torch.from_numpy(rng.exponential(6.0, size=12)).float().requires_grad_()
    ref = -torch.from_numpy(rng.exponential(6.0, size=12)).float()
    c, r = policy[:6] - ref[:6], policy[6:] - ref[6:]
    stub = types.SimpleNamespace(alpha=0.0, loss_type="sigmoid", beta=beta, label_smoothing=eps, simpo_gamma=0.5, accelerator=_Accelerator())
    trl_losses, _, _ = CPOTrainer.cpo_loss(stub, c, r)
    ours, _, _ = losses.preference_loss(policy[:6], policy[6:], ref[:6], ref[6:], beta=beta, loss_type="sigmoid", label_smoothing=eps)
    _assert_same(ours, trl_losses, beta * float(policy.abs().max() + ref.abs().max()), "losses")
    (trl_grad,) = torch.autograd.grad(trl_losses.mean(), policy)
    (our_grad,) = torch.autograd.grad(ours.mean(), policy)
    _assert_same(our_grad, trl_grad, beta / 6, "gradient")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_ipo_sum_is_trls_ipo_on_one_token_answers_and_its_formula(beta, seed):
    """The project's default loss, `ipo_sum`: IPO (Azar et al. 2023) on the summed log-ratios,
    (h - 1/(2 beta))^2 with h = (pi_c - ref_c) - (pi_r - ref_r). TRL has no such loss type; its `ipo`
    divides each log-ratio by the answer's token count, so on answers of one token the two agree,
    and TRL's code then checks ours (the formula is checked on longer answers too)."""
    rng = np.random.default_rng(200 + seed)
    pairs, width = 6, 8
    input_ids = torch.from_numpy(rng.integers(5, 50, size=(2 * pairs, width)))
    attention = torch.zeros(2 * pairs, width, dtype=torch.long)
    completion = torch.zeros(2 * pairs, width, dtype=torch.long)
    for i in range(2 * pairs):  # a prompt of 2-5 tokens, then one answer token
        start = int(rng.integers(2, 6))
        attention[i, : start + 1] = 1
        completion[i, start] = 1
    token_logps = (-torch.from_numpy(rng.exponential(1.5, size=(2 * pairs, width - 1))).float() * completion[:, 1:]).requires_grad_()
    ref = -torch.from_numpy(rng.exponential(2.0, size=2 * pairs)).float()
    model = _Model()
    model.register(input_ids, token_logps)
    stub = _dpo_stub("ipo", beta, 0.0, 0.05, model)
    inputs = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion,
              "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}  # fmt: skip
    trl_loss = DPOTrainer._compute_loss(stub, model, inputs, False)
    summed = token_logps.sum(1)
    ours, _, _ = losses.preference_loss(summed[:pairs], summed[pairs:], ref[:pairs], ref[pairs:], beta=beta, loss_type="ipo_sum")
    _assert_same(ours.mean(), trl_loss, float(summed.abs().max() + ref.abs().max()), "loss")
    # longer answers: the formula written out
    pc, pr, rc, rr = (-torch.from_numpy(rng.exponential(6.0, size=pairs)).float() for _ in range(4))
    expected = (((pc - rc) - (pr - rr)) - 1 / (2 * beta)) ** 2
    got, _, _ = losses.preference_loss(pc, pr, rc, rr, beta=beta, loss_type="ipo_sum")
    _assert_same(got, expected, float((pc.abs() + rc.abs() + pr.abs() + rr.abs()).max() ** 2), "formula")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("beta", "desirable_weight", "undesirable_weight", "labels"), [
    (0.1, 1.0, 1.0, [1, 0, 1, 0, 1, 1, 0]), (0.5, 1.33, 1.0, [1, 1, 1, 0, 0, 1, 1]), (0.2, 1.0, 0.7, [0, 0, 0, 0, 0, 0, 0]),
    (0.2, 1.0, 1.0, [1, 1, 1, 1, 1, 1, 1]),
])  # fmt: skip
def test_kto_equals_trls(beta, desirable_weight, undesirable_weight, labels, seed):
    rng = np.random.default_rng(100 + seed)
    rows = len(labels)
    input_ids, attention, completion, token_logps = _sequences(rng, rows)
    kl_ids, kl_attention, kl_completion, kl_token_logps = _sequences(rng, rows)
    token_logps.requires_grad_()
    model = _Model()
    model.register(input_ids, token_logps)
    model.register(kl_ids, kl_token_logps)
    ref = -torch.from_numpy(rng.exponential(4.0, size=rows)).float()
    ref_kl = -torch.from_numpy(rng.exponential(4.0, size=rows)).float()
    label = torch.tensor(labels, dtype=torch.bool)
    stub = types.SimpleNamespace(
        model=model, accelerator=_Accelerator(), aux_loss_enabled=False, precompute_ref_logps=True, calculate_KL=True, loss_type="kto",
        beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight, ref_model=None,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    stub._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, stub)
    inputs = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion, "KL_input_ids": kl_ids,
              "KL_attention_mask": kl_attention, "KL_completion_mask": kl_completion, "label": label, "ref_logps": ref, "ref_KL_logps": ref_kl}  # fmt: skip
    trl_loss = KTOTrainer._compute_loss(stub, model, inputs, False)
    trl_metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}

    ours, metrics = losses.kto_loss(token_logps.sum(1), label, ref, kl_token_logps.sum(1), ref_kl, beta=beta,
                                    desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)  # fmt: skip
    inputs = float(token_logps.sum(1).abs().max() + ref.abs().max() + kl_token_logps.sum(1).abs().max() + ref_kl.abs().max())
    weight = max(desirable_weight, undesirable_weight)
    _assert_same(ours, trl_loss, weight * beta * inputs, "loss")
    (trl_grad,) = torch.autograd.grad(trl_loss, token_logps)
    (our_grad,) = torch.autograd.grad(ours, token_logps)
    _assert_same(our_grad, trl_grad, weight * beta / rows, "gradient")
    logged = {k for k in trl_metrics if k.startswith(("rewards/", "logps/")) or k == "kl"}
    assert logged == set(metrics)
    for name in logged:
        _assert_same(metrics[name], trl_metrics[name], inputs if name.startswith("logps") or name == "kl" else beta * inputs, name)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("beta", "gamma", "eps", "cpo_alpha"), [(2.0, 0.5, 0.0, 0.0), (2.5, 1.4, 0.0, 0.0), (2.0, 0.5, 0.1, 1.0)])
def test_simpo_equals_trls_cpo(beta, gamma, eps, cpo_alpha, seed):
    rng = np.random.default_rng(200 + seed)
    chosen = -torch.from_numpy(rng.exponential(1.5, size=8)).float().requires_grad_()
    rejected = -torch.from_numpy(rng.exponential(1.5, size=8)).float()
    nll = torch.tensor(float(rng.exponential(1.0)))
    stub = types.SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=eps, accelerator=_Accelerator(),
                                 cpo_alpha=cpo_alpha, aux_loss_enabled=False)  # fmt: skip
    stub.cpo_loss = types.MethodType(CPOTrainer.cpo_loss, stub)
    stub.concatenated_forward = lambda model, batch: (chosen, rejected, torch.zeros(8, 2, 3), torch.zeros(8, 2, 3), nll)
    trl_loss, trl_metrics = CPOTrainer.get_batch_loss_metrics(stub, None, {})

    ours, chosen_rewards, rejected_rewards, extra = losses.reference_free_loss("simpo", chosen, rejected, beta=beta, gamma=gamma, label_smoothing=eps)
    total = ours.mean() + cpo_alpha * nll
    inputs = float(chosen.abs().max() + rejected.abs().max()) + gamma / beta  # the margin's size
    _assert_same(total, trl_loss, beta * inputs + cpo_alpha * float(nll), "loss")
    (trl_grad,) = torch.autograd.grad(trl_loss, chosen)
    (our_grad,) = torch.autograd.grad(total, chosen)
    _assert_same(our_grad, trl_grad, beta / 8, "gradient")
    metrics = losses.reward_metrics(chosen_rewards, rejected_rewards, chosen, rejected, None) | extra
    assert metrics["rewards/accuracies"] == trl_metrics["rewards/accuracies"]  # counts of the same comparisons over 8 pairs
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        _assert_same(metrics[name], trl_metrics[name], inputs if name.startswith("logps") else beta * inputs, name)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 0.25])
def test_orpo_equals_trls(beta, seed):
    rng = np.random.default_rng(300 + seed)
    # per-token averages, some near 0 (probabilities near 1, where log(1 - exp) needs care)
    chosen = -torch.from_numpy(np.concatenate([rng.exponential(1.0, size=6), [1e-4, 0.5]])).float().requires_grad_()
    rejected = -torch.from_numpy(np.concatenate([rng.exponential(1.0, size=6), [0.3, 1e-3]])).float()
    nll = torch.tensor(float(rng.exponential(1.0)))
    stub = types.SimpleNamespace(beta=beta, accelerator=_Accelerator(), aux_loss_enabled=False)
    stub.odds_ratio_loss = types.MethodType(ORPOTrainer.odds_ratio_loss, stub)
    stub.concatenated_forward = lambda model, batch: (chosen, rejected, torch.zeros(8, 2, 3), torch.zeros(8, 2, 3), nll)
    trl_loss, trl_metrics = ORPOTrainer.get_batch_loss_metrics(stub, None, {})

    ours, chosen_rewards, rejected_rewards, extra = losses.reference_free_loss("orpo", chosen, rejected, beta=beta)
    total = nll + ours.mean()
    log_odds = float(extra["log_odds_chosen"])
    inputs = float(chosen.abs().max() + rejected.abs().max()) + abs(log_odds)  # log(1 - exp) near 0: the log-odds' size
    _assert_same(total, trl_loss, float(nll) + beta * inputs, "loss")
    (trl_grad,) = torch.autograd.grad(trl_loss, chosen)
    (our_grad,) = torch.autograd.grad(total, chosen)
    _assert_same(our_grad, trl_grad, beta / 8, "gradient")
    metrics = losses.reward_metrics(chosen_rewards, rejected_rewards, chosen, rejected, None) | extra
    assert metrics["rewards/accuracies"] == trl_metrics["rewards/accuracies"]  # counts of the same comparisons over 8 pairs
    names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "log_odds_ratio", "log_odds_chosen")
    for name in names:
        _assert_same(metrics[name], trl_metrics[name], beta * inputs if name.startswith("rewards") else inputs, name)


def test_kto_weight_advice_matches_trls_ranges():
    """TRL's example numbers: 100 desirable, 300 undesirable at weights 1, 1 -> desirable_weight in
    [3.0, 3.99] or undesirable_weight in [0.25, 0.33]; in range -> no advice."""
    advice = losses.kto_weight_advice(100, 300, 1.0, 1.0)
    assert advice is not None and "desirable_weight in [3.0, 3.99]" in advice and "undesirable_weight in [0.25, 0.33]" in advice
    assert losses.kto_weight_advice(100, 300, 3.5, 1.0) is None
    assert losses.kto_weight_advice(100, 300, 1.0, 0.3) is None
    assert losses.kto_weight_advice(200, 200, 1.0, 1.0) is None

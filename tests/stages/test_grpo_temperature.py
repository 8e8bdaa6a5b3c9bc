"""GRPO at a temperature other than 1, through the stage: the policy's, the generating policy's and
the reference's log-probabilities are all of the distribution sampled from, logits / T (TRL's
convention for all three: `add_fused_lm_head(temperature=...)` on the policy and on the reference
model, the old log-probabilities from the same policy), and the loss is the clipped surrogate plus
beta x k3 computed from them, here by hand, independently of `pipelines.core.training`."""

from __future__ import annotations

import pytest
import torch

from pipelines import grpo
from pipelines.core.models.models import load_causal_lm
from tests.stages.grpo_logps import plain_logps, rounding_bound
from tests.stages.test_grpo import TRAIN, Recorder, params, user_rewards, workspace  # noqa: F401 - fixtures

TEMPERATURE, BETA, EPSILON = 0.6, 0.1, 0.2


def padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])


def test_policy_old_and_reference_log_probabilities_and_the_loss_are_at_the_temperature(workspace, user_rewards, monkeypatch):  # noqa: F811 - fixtures
    calls: list[dict] = []
    stage_loss = grpo.grpo_loss

    def recording(p):
        loss_fn = stage_loss(p)

        def recorded(model, batch):
            expected = plain_logps(model, batch, TEMPERATURE)  # the policy as the loss sees it, before it computes
            loss, metrics = loss_fn(model, batch)
            calls.append({"batch": batch, "policy": expected, "loss": float(loss.detach()), "metrics": metrics, "bound": rounding_bound(model, batch, TEMPERATURE)})
            return loss, metrics

        return recorded

    monkeypatch.setattr(grpo, "grpo_loss", recording)
    # num_iterations 2: step 2 reuses step 1's completions, so its ratio to the generating policy is no longer 1
    p = params(user_rewards, beta=BETA, temperature=TEMPERATURE, num_iterations=2, epsilon=EPSILON,
               train=TRAIN.model_copy(update={"max_steps": 2, "lr": 0.05}))  # fmt: skip
    grpo.run(workspace, workspace / "data/models/sft", workspace / "data/prepared/chat", workspace / "data/models/grpo", p, Recorder())
    start = load_causal_lm(workspace / "data/models/sft").eval()
    first, second = calls
    assert all(torch.equal(first["batch"][k], second["batch"][k]) for k in ("completion_ids", "old_logps", "ref_logps"))  # one generation, used twice
    batch = first["batch"]
    width = batch["completion_ids"].shape[1]
    mask = batch["completion_mask"].float()
    old = padded(first["policy"], width)  # the policy that sampled: the first step's, before any update
    reference = padded(plain_logps(start, batch, TEMPERATURE), width)
    for name, want in (("old_logps", old), ("ref_logps", reference)):
        assert (batch[name] * mask - want).abs().max().item() <= first["bound"], name
    assert (padded(second["policy"], width) - old).abs().max().item() > 100 * first["bound"]  # the policy moved in between

    for call in calls:
        logps = padded(call["policy"], width)
        advantages = batch["advantages"].unsqueeze(1)
        ratio = torch.exp(logps - old)
        surrogate = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - EPSILON, 1 + EPSILON) * advantages)
        kl = torch.exp(reference - logps) - (reference - logps) - 1
        loss = ((surrogate + BETA * kl) * mask).sum() / float(batch["num_items"])  # dapo: over the generation's completion tokens
        # each token's term moves by at most (|A| r + beta |e^(ref - lp) - 1|) x 2 delta when each log-probability is delta off
        slope = (advantages.abs() * ratio + BETA * (torch.exp(reference - logps) - 1).abs()) * mask
        bound = 2 * call["bound"] * float(slope.sum()) / float(batch["num_items"])
        assert call["loss"] == pytest.approx(float(loss), abs=bound)
        assert call["metrics"]["kl"] == pytest.approx(float((kl * mask).sum() / mask.sum()), abs=2 * call["bound"] * float((slope / BETA).max()))

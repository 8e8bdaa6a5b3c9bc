"""GRPO's KL reference is the model the run starts from, for every way a LoRA adapter starts
(PiSSA and OLoRA move part of each weight into the adapter, so the base alone is not the start
model) and for full training: the reference's log-probabilities equal the start model's, computed
here by a plain forward of each sequence alone, and the KL logged at the first step is zero."""

from __future__ import annotations

import pytest
import torch

from pipelines import grpo
from pipelines.core.models.models import load_causal_lm
from pipelines.core.rl import rollouts
from tests.stages.grpo_logps import plain_logps, rounding_bound
from tests.stages.test_grpo import TRAIN, Recorder, params, user_rewards, workspace  # noqa: F401 - fixtures

INITS = ["default", "gaussian", "pissa", "pissa_niter_2", "olora"]
TEMPERATURE = 0.7
RANK = 4  # the adapter's default rank: its product B A is in every adapted layer's chain

@pytest.mark.parametrize(("adapter", "init"), [("none", None), *(("lora", init) for init in INITS)])
def test_the_reference_is_the_start_model_and_the_first_kl_is_zero(workspace, user_rewards, monkeypatch, adapter, init):  # noqa: F811 - fixtures
    seen: list[tuple[dict, torch.Tensor]] = []
    computed = rollouts.RolloutBatches._reference_logps

    def recorded(self, batch):
        logps = computed(self, batch)
        seen.append((batch, logps))
        return logps

    monkeypatch.setattr(rollouts.RolloutBatches, "_reference_logps", recorded)
    # lora_dropout 0: with PiSSA the adapter holds the weights' principal part at step 0, and dropping
    # parts of its input would make the training-mode policy differ from the start model by itself
    lora = {"adapter": {"enabled": True, "init_lora_weights": init, "lora_dropout": 0.0, "merge": False}} if adapter == "lora" else {}
    p = params(user_rewards, beta=0.1, **lora, temperature=TEMPERATURE,
               train=TRAIN.model_copy(update={"max_steps": 2, "extensions": ["mlflow_metrics"]}))  # fmt: skip
    tracker = Recorder()
    grpo.run(workspace, workspace / "data/models/sft", workspace / "data/prepared/chat", workspace / "data/models/grpo", p, tracker)
    start = load_causal_lm(workspace / "data/models/sft").eval()
    assert len(seen) == 2  # one micro-batch per step, each generation's reference computed once
    for batch, ref in seen:
        bound = rounding_bound(start, batch, TEMPERATURE, rank=RANK if adapter == "lora" else 0)
        for row, want in enumerate(plain_logps(start, batch, TEMPERATURE)):
            got = ref[row, : len(want)]
            assert (got - want).abs().max().item() <= bound, (row, (got - want).abs().max().item(), bound)
    kl = [m["kl"] for _, m in tracker.metrics if "kl" in m]
    # step 1: the policy is the start model; k3 = exp(d) - d - 1 <= d^2 (|d| <= 1) for the policy's and the
    # reference's log-probabilities d apart, both computed from the same weights in fp32
    first_bound = rounding_bound(start, seen[0][0], TEMPERATURE, rank=RANK if adapter == "lora" else 0)
    assert kl[0] <= first_bound**2, (kl[0], first_bound**2)

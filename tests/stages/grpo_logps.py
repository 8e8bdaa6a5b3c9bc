"""Log-probabilities of GRPO's completions computed apart from the stage, and how far two fp32
computations of them may be apart (tests/stages/test_grpo_reference.py, test_grpo_temperature.py)."""

from __future__ import annotations

import torch

from tests import numerics


def plain_logps(model, batch: dict, temperature: float) -> list[torch.Tensor]:
    """Each completion's per-token log-probabilities under `model` at `temperature`, by one forward
    of its own prompt and completion, unpadded (no cache, no batch), scored by TRL's own
    `selective_log_softmax` (logits / temperature, TRL's convention for the policy, the generating
    policy and the reference): independent of the stage's path."""
    from trl.trainer.utils import selective_log_softmax

    group = int(batch["group_size"])
    out = []
    with torch.no_grad():
        for row in range(batch["completion_ids"].shape[0]):
            prompt = batch["prompt_ids"][row // group][batch["prompt_mask"][row // group].bool()]
            n = int(batch["completion_mask"][row].sum())
            completion = batch["completion_ids"][row, :n]
            logits = model(input_ids=torch.cat([prompt, completion]).unsqueeze(0)).logits[0].float()
            out.append(selective_log_softmax(logits[len(prompt) - 1 : -1], completion, temperature=temperature))
    return out


def rounding_bound(model, batch: dict, temperature: float, rank: int = 0) -> float:
    """How far two fp32 computations of the same completion log-probabilities may be apart by
    rounding alone: a log-probability `z_t / T - logsumexp(z / T)` moves by at most 2 max|dz| / T,
    and a logit `z` goes through the decoder's chain (`numerics.model_roundings` over the prompt and
    completion), measured against the logits' largest magnitude. `rank`: an adapter that rebuilds
    each of a layer's 7 weights as `W + B A` (PiSSA, OLoRA) adds a rank-`rank` product and a sum."""
    config = model.config
    width = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    roundings = numerics.model_roundings(config, width) + (config.num_hidden_layers * 7 * (rank + 1) if rank else 0)
    with torch.no_grad():
        largest = max(1.0, float(model(input_ids=batch["prompt_ids"][:1]).logits.abs().max()))
    return 2 * numerics.tolerance(roundings, torch.float32, largest) / temperature

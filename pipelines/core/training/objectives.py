"""Which objective trains and validates a model: the causal chat loss, or masked diffusion.

A masked-diffusion model (`pipelines.core.models.diffusion_model`) says so in its config; the stages
that fine-tune or evaluate any model ask here for the loss (`chat_objective`) and the validation
(`nelbo_fn`) that fit it, so the shared loop and the stages stay the same for both objectives.
"""

from __future__ import annotations

import math

import torch

from pipelines.core.data import chat_examples
from pipelines.core.params.pretraining import DiffusionParams
from pipelines.core.training import diffusion, loop


def chat_objective(model: torch.nn.Module):
    """The fine-tuning loss for `model`: the completion-only chat loss of a causal LM, or, for a
    masked-diffusion model, that objective on the answer tokens only (the prompt is never masked,
    as in LLaDA's SFT; continuous antithetic time steps). Packed rows stay apart (the model's
    bidirectional mask follows their position ids). LLaDA also pads each answer with EOS targets
    so the model learns to end it; with this pipeline's short answers those targets outnumbered
    the answers and the model answered with EOS alone (exact match 0 on both worlds), so the answer
    ends at its `<|im_end|>`, where generation cuts it."""
    if diffusion.objective_of(model) != "masked_diffusion":
        return chat_examples.chat_loss
    return diffusion.Objective(DiffusionParams(), int(model.config.mask_token_id))


def nelbo_fn(objective: diffusion.Objective, batches: list[dict[str, torch.Tensor]], precision: str):
    """Validation: the NELBO bound per token (`val/loss`, nats) and `val/perplexity` = exp(bound),
    averaged over `val_samples` time steps per sequence drawn from a generator seeded by `val_seed`
    (the same masks at every evaluation); `loop.mean_loss` does the rest."""
    params = objective.params
    repeated = [batch for batch in batches for _ in range(params.val_samples)]

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        generator = torch.Generator().manual_seed(params.val_seed)

        def draw(m: torch.nn.Module, batch: dict[str, torch.Tensor]):
            t, steps = diffusion.sample_time_steps(batch["input_ids"].shape[0], params, generator)
            return objective.loss(m, batch, t, steps, generator)

        bound = loop.mean_loss(model, draw, repeated, next(model.parameters()).device, precision)
        return {"val/loss": bound, "val/nelbo": bound, "val/perplexity": math.exp(min(bound, 50.0))}

    return evaluate

"""GRPO's rollouts (issue 39, third part): a group of sampled completions per prompt, and their
per-token log-probabilities.

    rollouts = sample(model, tokenizer, prompts, group_size=8, max_completion_length=32, temperature=1.0)
    logps = token_logps(model, rollouts)        # [prompts x group, completion tokens], masked by rollouts.completion_mask

`sample` renders each chat prompt with the chat template (as `evaluate` does), left-pads the batch
and calls `model.generate` once with `num_return_sequences=group_size`, sampling at `temperature`
(and `top_p`) with the KV cache, stopping at the template's end of turn. The completions of one
prompt are consecutive rows (what `grpo.group_advantages` expects). A completion's mask covers
its tokens up to and including its first stop token, as TRL's; one with no stop token within
`max_completion_length` is `truncated` (its share is a metric; TRL's `mask_truncated_completions`
would drop it from the loss). Sampling draws from torch's global generator, which the training
loop's checkpoints save and restore: a run resumed after a kill samples what it would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelines.core.data.chat_template import render_prompt
from pipelines.core.models.models import stop_token_ids


@dataclass(frozen=True)
class Rollouts:
    """Sampled completions: `group_size` consecutive rows per prompt."""

    prompt_ids: torch.Tensor  # [prompts, prompt width], left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # [prompts x group, completion width], right-padded
    completion_mask: torch.Tensor  # up to and including the first stop token
    truncated: torch.Tensor  # bool [prompts x group]: no stop token within max_completion_length
    texts: list[str]  # the completions decoded, special tokens dropped
    group_size: int

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)


@torch.no_grad()
def sample(model, tokenizer, prompts: list[list[dict]], *, group_size: int, max_completion_length: int, temperature: float = 1.0, top_p: float = 1.0) -> Rollouts:
    """`group_size` completions of each chat prompt, sampled with the KV cache; see the module docstring."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample a group, got {temperature}")
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    encoded = tokenizer([render_prompt(tokenizer, p) for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False)
    encoded = {k: v.to(model.device) for k, v in encoded.items()}
    stop = stop_token_ids(tokenizer)
    output = model.generate(**encoded, do_sample=True, temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_completion_length,
                            num_return_sequences=group_size, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model.train(was_training)
    completion_ids = output[:, encoded["input_ids"].shape[1] :]
    is_stop = torch.isin(completion_ids, torch.tensor(stop, device=completion_ids.device))
    width = completion_ids.shape[1]
    first_stop = torch.where(is_stop.any(-1), is_stop.int().argmax(-1), torch.full_like(is_stop[:, 0], width, dtype=torch.long))
    positions = torch.arange(width, device=completion_ids.device).unsqueeze(0)
    completion_mask = (positions <= first_stop.unsqueeze(1)).long()
    texts = [tokenizer.decode(ids[: int(n)], skip_special_tokens=True).strip() for ids, n in zip(completion_ids, completion_mask.sum(-1), strict=True)]
    return Rollouts(encoded["input_ids"], encoded["attention_mask"], completion_ids, completion_mask, ~is_stop.any(-1), texts, group_size)


def token_logps(model, rollouts: Rollouts) -> torch.Tensor:
    """Per-token log-probabilities of the completions under `model` ([rows, completion width]; 0
    outside the mask), the prompt repeated for each of its group's rows; only the completion's
    positions get vocabulary logits."""
    group = rollouts.group_size
    prompt_ids = rollouts.prompt_ids.repeat_interleave(group, dim=0)
    prompt_mask = rollouts.prompt_mask.repeat_interleave(group, dim=0)
    input_ids = torch.cat([prompt_ids, rollouts.completion_ids], dim=1)
    attention = torch.cat([prompt_mask, rollouts.completion_mask], dim=1)
    width = rollouts.completion_ids.shape[1]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False, logits_to_keep=width + 1).logits[:, :-1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, rollouts.completion_ids.unsqueeze(-1)).squeeze(-1)
    return logps * rollouts.completion_mask

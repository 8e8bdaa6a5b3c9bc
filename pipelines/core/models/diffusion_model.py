"""A masked-diffusion language model: a Llama with bidirectional attention and generation by
iterative unmasking, as a model class of its own.

Trained with the masked-diffusion objective (MDLM, Sahoo et al. 2024; LLaDA, Nie et al. 2025;
`pipelines.core.training.diffusion`), the model predicts masked tokens from the whole sequence, so every
position attends to every other (non-padding) one. Its config (`model_type:
qllm_diffusion_llama`, `objective: masked_diffusion`, `mask_token_id`) says so, and:

- `forward` builds the bidirectional attention mask itself (a 2-D padding mask, or none, is
  turned into a full `[batch, 1, query, key]` mask), so the model cannot be run causally by mistake;
- `generate` answers by iterative unmasking (LLaDA's sampler with low-confidence remasking, greedy):
  the prompt is followed by `max_new_tokens` mask tokens; each of `unmask_steps` steps predicts
  every masked position and keeps the most confident predictions, the rest stay masked; with
  `block_length` < `max_new_tokens` the answer is filled block by block, left to right (LLaDA's
  semi-autoregressive mode). Everything after the first stop token becomes padding, so callers of
  `model.generate(...)` (evaluation, `qllm generate`) need no change;
- inside the pipeline the classes are registered with the Auto classes on import; elsewhere the
  saved directory carries this file: `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`.

This file therefore imports only torch and transformers.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


class QllmDiffusionConfig(LlamaConfig):
    """`LlamaConfig` plus what a masked-diffusion model needs: its mask token and sampler settings."""

    model_type = "qllm_diffusion_llama"

    def __init__(self, objective: str = "masked_diffusion", mask_token_id: int | None = None, unmask_steps: int = 16,
                 block_length: int | None = None, **kwargs) -> None:  # fmt: skip
        self.objective = objective
        self.mask_token_id = mask_token_id
        self.unmask_steps = unmask_steps
        self.block_length = block_length
        super().__init__(**kwargs)


def bidirectional_mask(attention_mask: torch.Tensor | None, batch: int, length: int, device: torch.device,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`[batch, 1, length, length]` booleans: query i may attend to key j whenever j is not padding
    and, in packed rows (`position_ids` restarting at 0 for each example), lies in the same example."""
    keys = torch.ones(batch, length, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.to(torch.bool)
    mask = keys[:, None, None, :].expand(batch, 1, length, length)
    if position_ids is not None:
        segment = (position_ids == 0).cumsum(-1).expand(batch, length)
        mask = mask & (segment[:, :, None] == segment[:, None, :])[:, None]
    return mask


class QllmDiffusionLlamaForMaskedDiffusion(LlamaForCausalLM):
    """A Llama decoder run bidirectionally; `logits[:, i]` predicts the token *at* position i (no shift)."""

    config_class = QllmDiffusionConfig

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if labels is not None:
            raise ValueError("a masked-diffusion model predicts the token at each position, not the next one: compute its loss "
                             "on the masked positions (pipelines.core.training.diffusion), not with labels")  # fmt: skip
        if attention_mask is None or attention_mask.dim() == 2:
            reference = input_ids if input_ids is not None else kwargs["inputs_embeds"]
            attention_mask = bidirectional_mask(attention_mask, reference.shape[0], reference.shape[1], reference.device,
                                                kwargs.get("position_ids"))  # fmt: skip
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 32,
                 unmask_steps: int | None = None, block_length: int | None = None, eos_token_id=None, pad_token_id: int | None = None,
                 do_sample: bool = False, temperature: float = 1.0, **ignored) -> torch.Tensor:  # fmt: skip
        """The prompt (left-padded rows) followed by `max_new_tokens` unmasked tokens, cut after the
        first of `eos_token_id` (an id or a list). Greedy by default (the same inputs give the same
        answer); `do_sample` with `temperature` > 0 picks each step's tokens with Gumbel noise on the
        logits (LLaDA's sampling; seed with `torch.manual_seed`)."""
        config = self.config
        mask_id = config.mask_token_id
        if mask_id is None:
            raise ValueError("config.mask_token_id is not set: this model cannot generate by unmasking")
        steps = max(1, unmask_steps or config.unmask_steps)
        block = min(max_new_tokens, block_length or config.block_length or max_new_tokens)
        rows, prompt = input_ids.shape
        device = input_ids.device
        x = torch.cat([input_ids, torch.full((rows, max_new_tokens), mask_id, dtype=input_ids.dtype, device=device)], dim=1)
        keep = torch.ones_like(x, dtype=torch.long)
        if attention_mask is not None:
            keep[:, :prompt] = attention_mask.long()
        positions = (keep.cumsum(-1) - 1).clamp(min=0)  # left padding: the first real token is at position 0
        blocks = -(-max_new_tokens // block)
        per_block = max(1, steps // blocks)
        for b in range(blocks):
            start, end = prompt + b * block, prompt + min((b + 1) * block, max_new_tokens)
            counts = [(end - start) // per_block + (1 if s < (end - start) % per_block else 0) for s in range(per_block)]
            for count in counts:
                if count == 0:
                    continue
                logits = self(input_ids=x, attention_mask=keep, position_ids=positions).logits.float()
                logits[..., mask_id] = float("-inf")  # never predict the mask itself
                if do_sample and temperature > 0:
                    gumbel = -torch.log(-torch.log(torch.rand_like(logits).clamp(1e-20, 1.0)))
                    guess = (logits / temperature + gumbel).argmax(-1)
                else:
                    guess = logits.argmax(-1)
                confidence = torch.softmax(logits, -1).gather(-1, guess[..., None])[..., 0]
                masked = x == mask_id
                masked[:, :start] = False
                masked[:, end:] = False
                confidence = torch.where(masked, confidence, torch.tensor(float("-inf"), device=device))
                chosen = confidence.topk(count, dim=-1).indices  # the most confident stay; the others are remasked
                x.scatter_(1, chosen, guess.gather(1, chosen))
        if eos_token_id is not None:
            stops = torch.tensor(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id], device=device)
            new = x[:, prompt:]
            after = torch.isin(new, stops).long().cumsum(-1) - torch.isin(new, stops).long() > 0  # past the first stop token
            new[after] = pad_token_id if pad_token_id is not None else stops[0]
        return x


AutoConfig.register(QllmDiffusionConfig.model_type, QllmDiffusionConfig, exist_ok=True)
AutoModelForCausalLM.register(QllmDiffusionConfig, QllmDiffusionLlamaForMaskedDiffusion, exist_ok=True)
QllmDiffusionConfig.register_for_auto_class()
QllmDiffusionLlamaForMaskedDiffusion.register_for_auto_class("AutoModelForCausalLM")

"""Greedy answers to chat prompts, batched: what `evaluate`, the retention measure's reference
(`base_answers`) and the benchmarks decode with. Light on purpose (the chat template and the
model's stop tokens only), so that the base's reference answers rerun only when the base, the
prompts or this decoding change, never when training code does."""

from __future__ import annotations

import torch

from pipelines.core.data.chat_template import left_padding, render_prompt
from pipelines.core.models.models import stop_token_ids


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy answers to chat prompts, batched with left padding (the tokenizer's side as it was
    after), cut at `<|im_end|>`/EOS."""
    texts = [render_prompt(tokenizer, p) for p in prompts]  # with the chat's tools, if any
    # Similar lengths together: less padding per batch. Answers are put back in input order.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    answers: list[str] = [""] * len(texts)
    stop = stop_token_ids(tokenizer)  # renders the template: once, not per batch
    model.eval()
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        with left_padding(tokenizer):
            encoded = tokenizer([texts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        encoded = {k: v.to(model.device) for k, v in encoded.items()}
        output = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=tokenizer.pad_token_id,
        )
        new_tokens = output[:, encoded["input_ids"].shape[1] :]
        for index, text in zip(chunk, tokenizer.batch_decode(new_tokens, skip_special_tokens=True), strict=True):
            answers[index] = text.strip()
    return answers

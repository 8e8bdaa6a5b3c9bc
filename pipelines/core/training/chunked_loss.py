"""Cross-entropy of a causal LM without ever holding the logits of the whole batch.

    loss_fn = chunked_loss.causal(1024)      # the shared loop's loss_fn, with train.loss_chunk_tokens: 1024
    loss, _ = loss_fn(model, batch)          # batch: input_ids, labels (-100: not trained), position_ids or attention_mask

A model of Qwen2.5's 151,936-token vocabulary turns 4 rows of 1,024 tokens into 2.5 GB of fp32
logits, and its loss keeps several tensors of that size for the backward pass (the shifted copy,
the log-softmax): more than the 0.5B model's 4-bit weights several times over. Here the model runs
with its output head swapped for an identity, so its forward returns the final hidden states;
only the positions that are trained (label != -100: for completion-only SFT, the answers) go
through the head, `chunk` tokens at a time, each chunk's logits recomputed in the backward pass
(activation checkpointing) instead of kept. The value is the model's own loss (the mean over
trained tokens, as transformers' `ForCausalLMLoss` computes it) up to float rounding; the peak
holds one chunk's logits. The forward goes through the wrapper the loop hands over (DDP, PEFT),
so their hooks run as usual.

Models that transform the logits after the head (`final_logit_softcapping`, `logit_scale`,
`logits_scaling`) would then transform the hidden states instead: they are a clear error.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipelines.core.errors import QllmError

IGNORE = -100
AFTER_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of models that change the logits after the output head."""


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside the loop's wrappers (DDP, torch.compile, PEFT)."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif hasattr(model, "get_base_model"):  # PEFT
            model = model.get_base_model()
        else:
            return model


def check(model: torch.nn.Module, setting: str = "train.loss_chunk_tokens") -> None:
    """A clear error when `model` cannot have its loss chunked this way."""
    base = causal_lm(model)
    head = getattr(base, "lm_head", None)
    if not isinstance(head, torch.nn.Module):
        raise QllmError(f"{setting}: {type(base).__name__} has no `lm_head` output layer to chunk; set it to 0")
    config = getattr(base, "config", None)
    for key in AFTER_HEAD:
        value = getattr(config, key, None)
        if value not in (None, 0, 0.0, 1, 1.0):
            raise QllmError(f"{setting}: {type(base).__name__} applies {key}={value} to its logits after the head, which chunking "
                            "would skip; set it to 0")  # fmt: skip


@contextmanager
def _head_off(base: torch.nn.Module):
    head = base.lm_head
    base.lm_head = torch.nn.Identity()
    try:
        yield head
    finally:
        base.lm_head = head


def _chunk_sum(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def causal(chunk: int):
    """The shared loop's `loss_fn`: mean next-token cross-entropy over the trained tokens, the
    head applied `chunk` trained tokens at a time."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        base = causal_lm(model)
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
        labels = batch.get("labels", batch["input_ids"])
        with _head_off(base) as head:
            hidden = model(**inputs, use_cache=False).logits  # the final hidden states: the head is an identity
        targets = labels[:, 1:]
        keep = targets != IGNORE
        hidden, targets = hidden[:, :-1][keep], targets[keep]
        total = hidden[:0].sum().float()  # 0, in the graph even if no token is trained
        for start in range(0, targets.numel(), chunk):
            piece = (head, hidden[start:start + chunk], targets[start:start + chunk])
            total = total + (checkpoint(_chunk_sum, *piece, use_reentrant=False) if torch.is_grad_enabled() else _chunk_sum(*piece))
        return total / max(1, targets.numel()), {}

    loss_fn.chunk = chunk
    return loss_fn


def chunkable(model: torch.nn.Module) -> bool:
    """Whether `model`'s head can be applied a chunk at a time (see `check`)."""
    try:
        check(model)
    except QllmError:
        return False
    return True


@torch.no_grad()
def summed_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per row, the summed log-probability of the tokens where `mask` is 1 (each predicted from the
    one before), the head applied to `chunk` of those tokens at a time: what `log_softmax(logits)`
    gathered at the targets gives, without a batch's whole logits (inference only)."""
    base = causal_lm(model)
    with _head_off(base) as head:
        hidden = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    keep = mask[:, 1:].bool()
    rows = torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(1).expand_as(keep)[keep]
    hidden, targets = hidden[:, :-1][keep], input_ids[:, 1:][keep]
    summed = torch.zeros(input_ids.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, targets.numel(), chunk):
        logps = torch.log_softmax(head(hidden[start : start + chunk]).float(), dim=-1)
        summed.index_add_(0, rows[start : start + chunk], logps.gather(-1, targets[start : start + chunk].unsqueeze(-1)).squeeze(-1))
    return summed


def for_loop(loss_fn, model: torch.nn.Module, cfg, desc: str):
    """`loss_fn` with its head chunked as `cfg.loss_chunk_tokens` asks (0: `loss_fn` itself).
    Only the causal LM losses can be: `desc` names the stage in the errors."""
    if not cfg.loss_chunk_tokens:
        return loss_fn
    setting = f"{desc}.train.loss_chunk_tokens"
    if not getattr(loss_fn, "causal_lm_loss", False):  # the mark of the model's own cross-entropy (chat_loss, causal_lm_loss)
        raise QllmError(f"{setting}: the masked-diffusion objective scores its own masked tokens; set it to 0")
    if cfg.strategy == "fsdp":
        raise QllmError(f"{setting}: chunking applies the output head after the sharded forward, which FSDP does not allow; "
                        f"use --set {desc}.train.strategy=ddp or set it to 0")  # fmt: skip
    check(model, setting)
    return causal(cfg.loss_chunk_tokens)

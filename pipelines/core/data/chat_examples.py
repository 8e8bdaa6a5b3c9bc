"""Chat records -> training examples: template rendering, loss masks, length limits, packing.

Every example is rendered with the tokenizer's chat template; `{% generation %}` marks give the
assistant-token mask, so the loss covers only what the assistant says (its closing `<|im_end|>`
included) unless `loss_on: all`.

Packing puts several examples into one row of `max_seq_len` tokens *without attention across
examples*: each example's position ids restart at 0 and no attention mask is passed, from which
transformers builds a block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`).
That requires the forward pass to run without a KV cache (`use_cache=False`), as `chat_loss`
does. The first label of every example is ignored, so no position is trained to predict the next
example's first token. Without packing, rows are right-padded per batch with an attention mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pipelines.core.data.chat_template import render_with_assistant_mask

IGNORE = -100


@dataclass
class Example:
    input_ids: np.ndarray  # int64 [n]
    labels: np.ndarray  # int64 [n], IGNORE where no loss


@dataclass
class EncodeStats:
    examples: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_target: int = 0
    target_tokens: int = 0
    tokens: int = 0
    lengths: list[int] = field(default_factory=list)

    def as_metrics(self, prefix: str) -> dict[str, float]:
        lengths = np.asarray(self.lengths or [0])
        return {
            f"{prefix}examples": self.examples,
            f"{prefix}truncated": self.truncated,
            f"{prefix}dropped_too_long": self.dropped_too_long,
            f"{prefix}dropped_no_target": self.dropped_no_target,
            f"{prefix}target_tokens": self.target_tokens,
            f"{prefix}tokens": self.tokens,
            f"{prefix}max_length": int(lengths.max()),
            f"{prefix}mean_length": round(float(lengths.mean()), 2),
        }


def encode(tokenizer, conversations: list[list[dict]], max_len: int, loss_on: str = "assistant", overflow: str = "truncate") -> tuple[list[Example], EncodeStats]:
    """Render, mask and length-limit conversations.

    `overflow`: `truncate` keeps the first `max_len` tokens (an example left with no trained
    token is dropped); `drop` discards examples longer than `max_len`. Both are counted.
    """
    stats = EncodeStats()
    examples = []
    # Length limits are applied below (and counted); the tokenizer's own limit would only warn.
    tokenizer.model_max_length = max(tokenizer.model_max_length, 1 << 30)
    for messages in conversations:
        rendered = render_with_assistant_mask(tokenizer, messages)
        ids = np.asarray(rendered["input_ids"], dtype=np.int64)
        mask = np.asarray(rendered["assistant_masks"], dtype=bool) if loss_on == "assistant" else np.ones(len(ids), dtype=bool)
        if len(ids) > max_len:
            if overflow == "drop":
                stats.dropped_too_long += 1
                continue
            ids, mask = ids[:max_len], mask[:max_len]
            stats.truncated += 1
        mask[0] = False  # never a target: in a packed row it would be predicted from the previous example
        if not mask.any():
            stats.dropped_no_target += 1
            continue
        examples.append(Example(ids, np.where(mask, ids, IGNORE)))
        stats.examples += 1
        stats.target_tokens += int(mask.sum())
        stats.tokens += len(ids)
        stats.lengths.append(len(ids))
    return examples, stats


@dataclass
class Row:
    """One training row: one example, or several packed ones with per-example position ids."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray


def pack(examples: list[Example], max_len: int) -> list[Row]:
    """First-fit decreasing bin packing into rows of at most `max_len` tokens (deterministic)."""
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    bins: list[list[int]] = []
    space: list[int] = []
    for index in order:
        length = len(examples[index].input_ids)
        for b, free in enumerate(space):
            if length <= free:
                bins[b].append(index)
                space[b] -= length
                break
        else:
            bins.append([index])
            space.append(max_len - length)
    rows = []
    for members in bins:
        parts = [examples[i] for i in members]
        rows.append(
            Row(
                np.concatenate([p.input_ids for p in parts]),
                np.concatenate([p.labels for p in parts]),
                np.concatenate([np.arange(len(p.input_ids)) for p in parts]),
            )
        )
    return rows


def unpacked(examples: list[Example]) -> list[Row]:
    return [Row(e.input_ids, e.labels, np.arange(len(e.input_ids))) for e in examples]


def collate(rows: list[Row], pad_id: int, packed: bool) -> Callable[[np.ndarray], dict[str, torch.Tensor]]:
    """A collate function over row indices: right-padded tensors.

    Packed batches carry `position_ids` and no attention mask (block-diagonal from positions;
    padding forms its own segment after the last example). Unpacked batches carry a 2D mask.
    """

    def batch(indices: np.ndarray) -> dict[str, torch.Tensor]:
        chosen = [rows[i] for i in np.sort(indices)]
        width = max(len(r.input_ids) for r in chosen)
        input_ids = np.full((len(chosen), width), pad_id, dtype=np.int64)
        labels = np.full((len(chosen), width), IGNORE, dtype=np.int64)
        position_ids = np.zeros((len(chosen), width), dtype=np.int64)
        attention = np.zeros((len(chosen), width), dtype=np.int64)
        for i, row in enumerate(chosen):
            n = len(row.input_ids)
            input_ids[i, :n], labels[i, :n], attention[i, :n] = row.input_ids, row.labels, 1
            position_ids[i, :n] = row.position_ids
            position_ids[i, n:] = np.arange(width - n)  # padding: a separate segment of its own
        out = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "num_tokens": int(attention.sum()),
        }
        if packed:
            out["position_ids"] = torch.from_numpy(position_ids)
        else:
            out["attention_mask"] = torch.from_numpy(attention)
        return out

    return batch


def chat_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean cross-entropy over the target tokens of the batch (no KV cache: see module docstring)."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "position_ids", "attention_mask")}
    output = model(**inputs, use_cache=False)
    return output.loss, {}


chat_loss.causal_lm_loss = True  # the model's own cross-entropy: `chunked_loss.for_loop` may chunk its head

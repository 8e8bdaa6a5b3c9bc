"""The base model's own answers as training data: self-distillation replay (issue 80).

A `base_answers` output holds the base's greedy answers to the general prompts, split into train,
validation and test thirds (`pipelines.core.evaluation.retention`). Replay mixes the *train* third
back into a fine-tuning stage's data, as chats of one user turn (no system message) and the base's
answer, so that what the model learns from the user's data comes with what it could do before.
The validation and test thirds are never replayed: they measure what was kept.

    rows, meta = replay.read(Path("data/base_answers"))
    chats = replay.conversations(rows)          # the train third: [user turn, the base's answer]

`finetune.replay_examples` turns them into chat examples (sft, lora); `text_rows` into packed
text rows (continued pretraining). `fraction` is the share of the trained tokens (the tokens the loss is computed on) that replay
makes up: enough replay examples, cycling through the train third in its order, to give at least
`fraction / (1 - fraction)` times the task's trained tokens. Mixed into the rows before packing,
every optimizer step holds that share on average.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from pipelines.core.data.chat_template import render_chat
from pipelines.core.errors import QllmError

ANSWERS = "answers.jsonl"
META = "meta.json"
"""The files of a `base_answers` output: the base's answer per prompt, and its NLL per split."""


def read(directory: Path) -> tuple[list[dict], dict] | None:
    """`(answers, meta)` of a `base_answers` output, or None where it holds none (no base model)."""
    if not (directory / ANSWERS).exists():
        return None
    rows = [json.loads(line) for line in (directory / ANSWERS).read_text(encoding="utf-8").splitlines()]
    return rows, json.loads((directory / META).read_text(encoding="utf-8"))


def messages_of(prompts: list[dict]) -> list[list[dict]]:
    """The chat of each general prompt: one user turn, no system message."""
    return [[{"role": "user", "content": p["prompt"]}] for p in prompts]


def conversations(rows: list[dict], split: str = "train") -> list[list[dict]]:
    """The base's answers to the prompts of `split` as chats: the user turn, the base's answer."""
    return [m + [{"role": "assistant", "content": row["answer"]}] for row, m in zip(rows, messages_of(rows), strict=True) if row["split"] == split]


def text_rows(tokenizer, directory: Path, fraction: float, task_tokens: int, seq_len: int, dtype: np.dtype,
              key: str = "pretrain.replay.fraction") -> tuple[np.ndarray, dict[str, float]]:  # fmt: skip
    """Continued pretraining's replay: the train third's chats rendered by the chat template as text
    (each followed by EOS, as `tokenize` separates documents), the stream cycled and cut into rows of
    `seq_len`: as many rows as give at least `fraction / (1 - fraction)` times the task's
    `task_tokens`. Every token of a pretraining row is trained on."""
    reference = read(directory)
    if reference is None:
        raise QllmError(f"{key}={fraction}: replay mixes in the base model's own answers, and {directory} holds none "
                        "(no base model: base_model.name is null); set it to 0, or continue pretraining a base model")  # fmt: skip
    stream: list[int] = []
    for chat in conversations(reference[0]):
        stream += tokenizer(render_chat(tokenizer, chat), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rows_needed = math.ceil(fraction / (1.0 - fraction) * task_tokens / seq_len)
    repeats = math.ceil(rows_needed * seq_len / len(stream))
    cycled = np.asarray(stream * repeats, dtype=dtype)
    rows = cycled[: rows_needed * seq_len].reshape(rows_needed, seq_len)
    share = rows.size / (rows.size + task_tokens) if rows.size + task_tokens else 0.0
    return rows, {"replay_rows": rows_needed, "replay_tokens": int(rows.size), "replay_share": round(share, 4)}

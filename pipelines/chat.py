"""Chat format shared by the tokenizer, SFT, DPO and evaluation: ChatML special tokens and template.

A turn renders as `<|im_start|>{role}: {content}<|im_end|>`. The content follows a space, as
words do in running text, so a byte-level BPE tokenizer gives it the same tokens as in the
pretraining corpus (`ĠPelora`, not a line-initial `Pelora`). With ChatML's newline after the role
the model must learn a second spelling of every answer, and the tiny models here then memorise the
training answers instead of reusing what pretraining stored: held-out facts dropped to chance.

The template marks assistant turns with `{% generation %}` so
`tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)` gives the completion-only
loss mask directly (the closing `<|im_end|>` is trained, so the model learns to stop).
"""

from __future__ import annotations

import json
import threading
from typing import Any

_TEMPLATE_LOCK = threading.Lock()


def render_with_assistant_mask(tokenizer, messages: list[dict]) -> dict:
    """`input_ids` and `assistant_masks` of a conversation rendered with the chat template.

    transformers caches each compiled template and shares it between threads, and the tracker
    behind `{% generation %}` belongs to the template: two threads rendering at once fail with
    "AssistantTracker should not be reused before closed" (in the flow `sft` and `probe_lora`
    tokenize side by side). Rendering is cheap next to training, so one lock serialises it.
    """
    with _TEMPLATE_LOCK:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, PAD]
ROLES = ("system", "user", "assistant")

# HF renders templates with trim_blocks: the newline after a block tag is dropped, hence {{ '\n' }}.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant:{% generation %} {{ message['content'] }}<|im_end|>{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}: {{ message['content'] }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}"
)


def rendered_turn(role: str, content: str) -> str:
    """A turn as the tokenizer sees it between special tokens (used to train the tokenizer)."""
    return f"{role}: {content}"


def parse_messages(value: str | list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages from the JSON string stored in Parquet (or an already-parsed list)."""
    return json.loads(value) if isinstance(value, str) else list(value)


def split_last_answer(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], str]:
    """(prompt messages, reference answer) for a conversation ending with an assistant turn."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("conversation does not end with an assistant turn")
    return messages[:-1], messages[-1]["content"]


def normalize_answer(text: str) -> str:
    """Exact-match normalisation: first line, trimmed, case-folded, without trailing punctuation."""
    first = text.strip().split("\n", 1)[0] if text.strip() else ""
    return first.strip().rstrip(".!?,;:").strip().casefold()

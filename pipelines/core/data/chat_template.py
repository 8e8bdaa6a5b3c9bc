"""Chat format shared by the tokenizer, SFT, DPO and evaluation: ChatML special tokens and template.

A turn renders as `<|im_start|>{role}: {content}<|im_end|>`. The content follows a space, as
words do in running text, so a byte-level BPE tokenizer gives it the same tokens as in the
pretraining corpus (`ĠPelora`, not a line-initial `Pelora`). With ChatML's newline after the role
the model must learn a second spelling of every answer, and the tiny models here then memorise the
training answers instead of reusing what pretraining stored: held-out facts dropped to chance.

The template marks assistant turns with `{% generation %}` so
`tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)` gives the completion-only
loss mask directly (the closing `<|im_end|>` is trained, so the model learns to stop).

Base models bring their own templates, and those of Qwen2.5, Llama 3, Mistral, Gemma and Phi-3
have no `{% generation %}` markers. For them the assistant spans are found as axolotl and
LLaMA-Factory do, by rendering the conversation turn by turn: the text an assistant turn adds is
`render(turns[:i+1])` minus `render(turns[:i], add_generation_prompt=True)`, trailing whitespace
after its end-of-turn token left out. That needs every partial rendering to be a prefix of the
whole conversation; a template that rewrites earlier turns (e.g. drops past reasoning) is a
`ChatTemplateError` naming the turn. Tokens are marked from the full rendering's character
offsets with transformers' own rule for the markers (a token overlapping a span is trained), so a
template with markers and the same template without them train exactly the same tokens.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from pipelines.core.errors import QllmError

TEMPLATE_LOCK = threading.RLock()
"""Held by every rendering of a chat template in this project (`apply_template`, the masked
renders below). transformers compiles each template once per process and shares the compiled one
between threads, together with the tracker behind `{% generation %}`: while one thread renders with
`return_assistant_tokens_mask=True`, any other thread's rendering of the same template, masked or
not, runs the same `{% generation %}` blocks, and the spans it renders were added to the first
thread's mask (ref_logprobs beside grpo in one `qllm run`: "prompt tokens differ between chosen
and rejected"; two masked renders at once: "AssistantTracker should not be reused before closed").
Reentrant: the masked renders render turn by turn under it. Rendering is cheap next to training."""
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(QllmError):
    """The tokenizer's chat template cannot give completion-only masks for a conversation."""


def chat_template_of(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: transformers uses "default"
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise ChatTemplateError(f"{name}: no chat template (tokenizer_config.json has no `chat_template`); chats cannot be rendered")
    return template


def has_generation_marks(tokenizer) -> bool:
    """Does the chat template mark assistant text with `{% generation %}`?"""
    return bool(GENERATION_MARK.search(chat_template_of(tokenizer)))


TOOLS_KEY = "tools"
"""A tool chat carries its tool schemas on its first message under this key (`layouts._chat`):
one stored value a chat, and chats without tools keep their bytes. `tools_of` takes them off."""
DATE_STRING = "26 Jul 2024"
"""Llama 3.1+ templates print today's date (`strftime_now`) unless given `date_string`: the date
their own fallback uses keeps the rendering, hence the token ids and DVC's md5s, the same every day."""


def tools_of(messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """(the messages as a template takes them, the chat's tool schemas or None)."""
    if not messages or TOOLS_KEY not in messages[0]:
        return messages, None
    first = {k: v for k, v in messages[0].items() if k != TOOLS_KEY}
    return [first, *messages[1:]], messages[0][TOOLS_KEY]


def uses_tools(messages: list[dict]) -> bool:
    return bool(messages) and (TOOLS_KEY in messages[0] or any(m.get("role") == "tool" or "tool_calls" in m for m in messages))


@functools.lru_cache(maxsize=16)
def _unread_tool_names(template: str) -> list[str]:
    """Which of `tools`, `tool_calls` a chat template never reads (once per template)."""
    return [word for word in ("tools", "tool_calls") if not re.search(rf"\b{word}\b", template)]


def check_tool_support(tokenizer, messages: list[dict]) -> None:
    """A chat with tools, tool calls or tool results needs a template that renders them (Qwen2.5,
    Llama 3.1+, Mistral, Hermes-style ones take `tools` and read `tool_calls`); one that does not
    would silently drop them from the text the model trains on."""
    if not uses_tools(messages):
        return
    missing = _unread_tool_names(chat_template_of(tokenizer))
    if missing:
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise ChatTemplateError(
            f"{name}: its chat template does not render tool calls (it never reads {' or '.join(missing)}), so the chats with tools "
            "cannot be rendered as the model would see them; use a base whose template supports tools (Qwen2.5, Llama 3.1+, "
            "Mistral, Hermes-style) or leave the tool chats out"
        )


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """`messages` as text through the chat template, with the chat's tools (`tools_of`)."""
    if not messages:
        return ""
    messages, tools = tools_of(messages)
    return apply_template(tokenizer, messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, date_string=DATE_STRING)


def apply_template(owner, messages, **kwargs):
    """`owner.apply_chat_template(messages, **kwargs)` (a tokenizer's or a processor's) under
    `TEMPLATE_LOCK`: every rendering of a chat template goes through it or holds the lock."""
    with TEMPLATE_LOCK:
        return owner.apply_chat_template(messages, **kwargs)


def render_jinja(conversations: list[list[dict]], chat_template: str, **kwargs):
    """transformers' `render_jinja_template(conversations, chat_template=...)` (a template's text,
    no tokenizer) under `TEMPLATE_LOCK`, as every rendering here is: its compiled template is
    shared with the tokenizers of the same text."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with TEMPLATE_LOCK:
        return render_jinja_template(conversations, chat_template=chat_template, **kwargs)


@contextlib.contextmanager
def left_padding(tokenizer) -> Iterator[None]:
    """The tokenizer pads on the left inside the block (batched generation), and on the side it had
    after: a tokenizer that is saved later (with a model) keeps its own setting."""
    saved = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        yield
    finally:
        tokenizer.padding_side = saved


def render_prompt(tokenizer, messages: list[dict]) -> str:
    """A prompt (the turns before the answer) as the model sees it at generation: the chat
    template with its generation prompt, and the chat's tools."""
    return render_chat(tokenizer, messages, add_generation_prompt=True)


_NEXT_TURN = {"role": "user", "content": "\x00"}  # what follows a turn, to see where the turn ends


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    mismatch = next((i for i in range(n) if a[i] != b[i]), n)
    return mismatch


def _token_boundary(tokenizer, text: str, end: int) -> int:
    """`end` moved back to the end of the last token of `text` that ends by `end`: the two
    renderings may share the first characters of different special tokens (`<|` of Phi-3's
    `<|endoftext|>` and `<|user|>`)."""
    if end >= len(text):
        return end
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return max((stop for _, stop in offsets if stop <= end), default=0)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int, int]]]:
    """The rendered conversation and `(start, end, turn)` character spans of its assistant turns,
    found by rendering turn by turn (see the module docstring). `turn` is the message index.

    A turn starts where `render(turns[:i], add_generation_prompt=True)` ends and ends where the
    renderings of `turns[:i+1]` with and without a following user turn part (so text a template
    writes only after the last turn, e.g. Phi-3's closing `<|endoftext|>`, is not an answer),
    trailing whitespace left out.
    """
    full = render_chat(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        after = render_chat(tokenizer, messages[: i + 1])
        end = _token_boundary(tokenizer, after, _common_prefix(after, render_chat(tokenizer, [*messages[: i + 1], _NEXT_TURN])))
        if end <= len(before) and i == len(messages) - 1:
            end = len(after)  # the template rewrites a turn once another follows: the last one is whole
        end = len(after[:end].rstrip())
        if not after.startswith(before) or not full.startswith(after[:end]) or end < len(before):
            raise ChatTemplateError(
                f"chat template: rendering turns 1-{i + 1} is not a prefix of the whole conversation "
                f"(turn {i + 1}, {message.get('role')}): the template rewrites earlier turns, so the "
                "assistant tokens cannot be found; use a template with {% generation %} markers"
            )
        if end > len(before):
            spans.append((len(before), end, i))
    return full, spans


def _mask_from_offsets(offsets, spans: list[tuple[int, int, int]]) -> np.ndarray:
    """Tokens whose characters overlap a span (transformers' rule for `{% generation %}`)."""
    starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
    ends = np.maximum(np.asarray([o[1] for o in offsets], dtype=np.int64), starts + 1)
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end, _ in spans:
        mask |= (starts < end) & (ends > start)
    return mask


def _untrained_turns(messages: list[dict]) -> bool:
    return any(m.get("role") == "assistant" and m.get("weight", 1) == 0 for m in messages)


def render_with_assistant_mask(tokenizer, messages: list[dict]) -> dict:
    """`input_ids` and `assistant_masks` of a conversation rendered with the chat template.

    Templates with `{% generation %}` markers give the mask directly; others through
    `assistant_spans`. Assistant turns with `"weight": 0` (OpenAI's fine-tuning format: context,
    not a target) are left out of the mask either way.

    Under `TEMPLATE_LOCK`: the tracker behind `{% generation %}` belongs to the compiled template,
    which every thread of the process shares.
    """
    check_tool_support(tokenizer, messages)
    with TEMPLATE_LOCK:
        if has_generation_marks(tokenizer):
            plain, tools = tools_of(messages)
            out = tokenizer.apply_chat_template(plain, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                                date_string=DATE_STRING)  # fmt: skip
            if not _untrained_turns(messages):
                return out
            full, spans = assistant_spans(tokenizer, messages)
            marked = np.asarray(out["assistant_masks"], dtype=bool)
        else:
            full, spans = assistant_spans(tokenizer, messages)
            marked = None
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError(f"{tokenizer.name_or_path}: completion-only masks without {{% generation %}} markers need a fast tokenizer (tokenizer.json)")
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    skipped = [s for s in spans if messages[s[2]].get("weight", 1) == 0]
    kept = [s for s in spans if messages[s[2]].get("weight", 1) != 0]
    mask = _mask_from_offsets(encoded["offset_mapping"], kept) if marked is None else marked & ~_mask_from_offsets(encoded["offset_mapping"], skipped)
    return {"input_ids": list(encoded["input_ids"]), "assistant_masks": mask.astype(int).tolist()}


def end_of_turn_token(tokenizer) -> int | None:
    """The special token that closes an assistant turn in the chat template (`<|im_end|>`,
    `<|eot_id|>`, `<end_of_turn>`, `<|end|>`, `</s>`...), or None when the template has none."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    from jinja2 import TemplateError

    try:
        with TEMPLATE_LOCK:
            full, spans = assistant_spans(tokenizer, probe)
    except (ChatTemplateError, TemplateError, ValueError):  # no template, or one that rejects the probe
        return None
    if not spans:
        return None
    start, end, _ = spans[-1]
    tail = full[start:end]
    tail = tail[tail.rfind("ok") + 2 :].strip()
    if not tail:
        return None
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return ids[0] if ids and ids[0] in special else None

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, PAD]
MASK = "<|mask|>"
"""The masked-diffusion objective's mask token: `train_tokenizer` adds it after the trained vocabulary
(`train_tokenizer.mask_token`), so that every other id stays what it was."""
ROLES = ("system", "user", "assistant", "tool")

# HF renders templates with trim_blocks: the newline after a block tag is dropped, hence {{ '\n' }}.
# With `tools` (a chat's schemas, `TOOLS_KEY`), a system turn lists them first (compactly: name, arguments
# with their JSON types, description; a small model's context is short), and an assistant turn's
# `tool_calls` are written after its content as `<tool_call>` blocks (Hermes' and Qwen2.5's format, which
# `tools.parse_tool_calls(..., "hermes")` reads); a chat without tools renders as it always did.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system: Tools, each called as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    " {{ f.name }}({% if f.parameters is defined and f.parameters.properties is defined %}"
    "{% for name, spec in f.parameters.properties.items() %}{{ ', ' if not loop.first }}{{ name }}: {{ spec.type }}{% endfor %}{% endif %})"
    "{% if f.description is defined %} {{ f.description }}{% endif %}"
    "{% endfor %}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant:{% generation %} {{ message['content'] }}"
    "{% if message.tool_calls is defined and message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{\"name\": {{ call.function.name | tojson }}, \"arguments\": "
    "{% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}{{ call.function.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>{% endgeneration %}{{ '\n' }}"
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


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORDS = re.compile(r"\w+")


def _word_run(text: str) -> str:
    """`text`'s words, case-folded, one space apart, with a space at each end: a whole-word run of
    words is a substring of another's."""
    return f" {' '.join(_WORDS.findall(text.casefold()))} "


def _as_number(text: str) -> float | None:
    """The number a whole (normalised) answer is, else None: `12`, `-3`, `4.50`, `1,200`."""
    text = normalize_answer(text).replace(",", "")
    return float(text) if _NUMBER.fullmatch(text) else None


def extract_answer(prediction: str, reference: str) -> str:
    """The part of a free-form `prediction` that answers like `reference` (lm-eval's "flexible
    extract"): for a numeric reference the last number in the whole answer ("1 + 6 = 7." -> `7`),
    else the answer's first line with words only ("Tosasa lives in Elsgrove." -> `tosasa lives
    in elsgrove`), in which `flexible_match` looks for the reference's words."""
    if _as_number(reference) is not None:
        numbers = _NUMBER.findall(prediction.replace(",", ""))
        return numbers[-1] if numbers else ""
    first = prediction.strip().split("\n", 1)[0] if prediction.strip() else ""
    return _word_run(first).strip()


def flexible_match(prediction: str, reference: str) -> bool:
    """Whether a free-form answer holds the reference answer: equal numbers for a numeric
    reference (the last number of the answer: `extract_answer`), else the reference's words as a
    whole-word run of the answer's first line. Scores what a real model answers, not its phrasing,
    and is lenient by design: an answer that names the reference among other words counts, a list
    of every candidate too; `strict_match` also gives 0 to an answer naming another candidate (the
    rule GRPO's reward scores by), `exact_match` (`normalize_answer` on both sides) is the strictest."""
    extracted = extract_answer(prediction, reference)
    number = _as_number(reference)
    if number is not None:
        return bool(extracted) and float(extracted) == number
    words = _word_run(reference)
    return bool(words.strip()) and words in f" {extracted} "


def answer_group(example_id: str) -> str:
    """The group of questions an id belongs to: the id without its trailing `-<n>` (`heldout-fact-city-7`:
    `heldout-fact-city`; a user's record without an id of its own is `<source>-<n>`, so its source)."""
    return re.sub(r"-\d+$", "", example_id)


def _names(text: str, value: str) -> bool:
    """Whether `text` names `value` anywhere: an equal number for a numeric value, else its words as
    a whole-word run."""
    number = _as_number(value)
    if number is not None:
        return any(float(n) == number for n in _NUMBER.findall(text.replace(",", "")))
    words = _word_run(value)
    return bool(words.strip()) and words in _word_run(text)


def strict_match(prediction: str, reference: str, candidates: Iterable[str] = (), question: str = "") -> bool:
    """The strict fact score: `flexible_match`, and the answer names no other candidate answer, so
    that listing every value the question could have ("Pelora, Dunmar or Kestwick") scores 0.
    `candidates`: the answers the question's kind can have (the references of its group's questions:
    every city for "Where does X live?"); one is named when the answer holds it anywhere (an equal
    number; its words as a whole-word run, any line). Not counted: a candidate equal to the
    reference, one inside the reference's words ("York" for "New York"), and one the `question`
    itself names (the operands of "What is 1 plus 6?" in "1 + 6 = 7")."""
    if not flexible_match(prediction, reference):
        return False
    reference_words = _word_run(reference)
    number = _as_number(reference)
    for candidate in candidates:
        value = _as_number(candidate)
        if (value is not None and value == number) or normalize_answer(candidate) == normalize_answer(reference):
            continue
        if value is None and _word_run(candidate) in reference_words:
            continue
        if _names(prediction, candidate) and not _names(question, candidate):
            return False
    return True

"""Retention: how much of its base model a fine-tuned model keeps on general prompts (issue 80).

Fine-tuning a small chat model on a narrow task can cost it what it could do before: answer a
request for code with code, a request for a list with a list. This module measures that on
`general_prompts.jsonl`, prompts written for this project in six families (code, lists,
explanations, short facts, translation, word problems; 33 each), every one a plain user turn with no
system message (the chat template adds its own default, as at generation). The base model answers
them once; the scores compare the fine-tuned model with the base on those answers:

- the retention log-loss, `retention_loss(answer_nll(model, ...), answer_nll(base, ...))`: the mean
  per-token negative log-likelihood of the base's answers under the model, minus the same under the
  base (token-weighted over all answers, in nats). 0: the model predicts the base's answers as well
  as the base does; larger: it has moved away from them.
- the form kept, `form_kept(base_answers, answers)`: of the test prompts whose base answer has a
  recognisable form (`form_of`: code, a list of at least 3 items, several sentences, a short fact),
  the share whose answer from the model has the same form, by the named checks below.

The prompts are split by hash into train, validation and test thirds (`split_of`): within each family
the ids are ordered by the SHA-256 of the id and cut into thirds, so every split holds a third of
every family (11 each of 33). A prompt's split depends on its id and on the other ids of its family,
not on the order of the file or the interpreter (no `hash()`): adding prompts to a family may move
others between splits, so the file changes only with a new version of the measure.

The form checks are pure standard library and read only the answer's layout, never its content:

- `is_code`: a fenced block (a line opening with three backticks and at least one non-blank line
  after it, closed or cut off by the generation limit), or at least two lines that look like code:
  a Python or C-family keyword starting the line (`def`, `class`, `return`, `import`, `from x
  import`, `for x in y:`, `while ...:`, `if ...:`, `print(`, `function`, `const`, `let`, `var`,
  `SELECT`...), a line ending in `{`, `}` or `;`, or one assignment (`name = value`, `x += 1`, a
  single `=` in the line, so `total = 3 + 4 = 7` of a worked sum is not code).
- `is_list`: at least `at_least` (3) lines that are items: starting with `-`, `*`, `+` or `•`, or
  numbered `1.` / `1)`, followed by text. Items written on one line separated by commas are not a
  list: the form is the layout (a small model asked to "list five fruits" writes one item a line),
  and an answer that folds them into a sentence has changed form.
- `is_sentences`: at least `at_least` (2) sentences of at least 3 words each, a sentence being text
  of one line that ends in `.`, `!` or `?` before whitespace or the line's end (so `3.5` does not
  split); a line without such an end (a heading, a sentence cut by the generation limit) is none.
- `is_short_fact`: one non-blank line of at most 12 words that is neither code, a list item nor a
  line that looks like code (`Paris.`, `8`, `The capital of France is Paris.`).

`form_of` takes the first that holds in the order code, list, sentences, short fact. The forms
nest: a code answer usually has sentences around its block and may hold list-like lines, a list's
items are often sentences, and two short sentences may fit on one line; the most structured form
that holds is the one the answer was written in.

    from pipelines.core.evaluation import retention
    prompts = retention.load_prompts("test")
    messages = [[{"role": "user", "content": p["prompt"]}] for p in prompts]
    base_nll = retention.answer_nll(base, tokenizer, messages, base_answers)
    model_nll = retention.answer_nll(model, tokenizer, messages, base_answers)
    loss = retention.retention_loss(model_nll, base_nll)
    kept, counted = retention.form_kept(base_answers, model_answers)
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from pipelines.core.data import replay
from pipelines.core.data.chat_template import TEMPLATE_LOCK, assistant_spans
from pipelines.core.errors import QllmError

PROMPTS_FILE = Path(__file__).with_name("general_prompts.jsonl")
FAMILIES = ("code", "lists", "explanations", "short_facts", "translation", "word_problems")
Split = Literal["train", "validation", "test"]
SPLITS: tuple[Split, ...] = ("train", "validation", "test")
ID_PATTERN = re.compile(r"(?P<family>[a-z_]+)-(?P<number>\d{2,})")


def _hash(prompt_id: str) -> str:
    return hashlib.sha256(prompt_id.encode("utf-8")).hexdigest()


def family_of(prompt_id: str) -> str:
    """The family an id names: `code-07` -> `code`."""
    return prompt_id.rsplit("-", 1)[0]


def assign_splits(ids: Iterable[str]) -> dict[str, Split]:
    """Each id's split: within its family (`family_of`), the ids ordered by the SHA-256 of the id
    (hex) and cut into thirds, the `i`-th of `n` in `SPLITS[3 * i // n]` (train, validation, test);
    every split then holds a third of every family (n/3 each, the remainder in the first ones)."""
    by_family: dict[str, list[str]] = {}
    for prompt_id in ids:
        by_family.setdefault(family_of(prompt_id), []).append(prompt_id)
    splits: dict[str, Split] = {}
    for members in by_family.values():
        ordered = sorted(members, key=lambda i: (_hash(i), i))
        for position, prompt_id in enumerate(ordered):
            splits[prompt_id] = SPLITS[3 * position // len(ordered)]
    return splits


def _read(path: Path) -> list[dict]:
    """The rows of a prompts file, validated: each a JSON object `{"id", "family", "prompt"}`, the
    family one of `FAMILIES`, the id `<family>-<nn>`, the prompt non-blank; ids and prompts unique."""
    rows: list[dict] = []
    seen_ids: dict[str, int] = {}
    seen_prompts: dict[str, int] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise QllmError(f"{path}: cannot read the general prompts ({exc})") from exc
    for number, line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QllmError(f'{where}: not JSON ({exc.msg}); expected one object {{"id": ..., "family": ..., "prompt": ...}} a line') from exc
        if not isinstance(row, dict) or set(row) != {"id", "family", "prompt"}:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise QllmError(f'{where}: expected an object with exactly the keys "id", "family", "prompt", got {keys}')
        prompt_id, family, prompt = row["id"], row["family"], row["prompt"]
        if family not in FAMILIES:
            raise QllmError(f"{where}: unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
        match = ID_PATTERN.fullmatch(prompt_id) if isinstance(prompt_id, str) else None
        if match is None or match["family"] != family:
            raise QllmError(f"{where}: id {prompt_id!r}; expected {family}-<nn> (the family, a hyphen, two or more digits)")
        if not isinstance(prompt, str) or not prompt.strip():
            raise QllmError(f"{where}: {prompt_id}: empty prompt; expected the text of a user turn")
        if prompt_id in seen_ids:
            raise QllmError(f"{where}: duplicate id {prompt_id!r} (first on line {seen_ids[prompt_id]}); expected unique ids")
        if prompt in seen_prompts:
            raise QllmError(f"{where}: {prompt_id}: duplicate prompt (first on line {seen_prompts[prompt]}); expected unique prompts")
        seen_ids[prompt_id], seen_prompts[prompt] = number, number
        rows.append({"id": prompt_id, "family": family, "prompt": prompt})
    if not rows:
        raise QllmError(f"{path}: no prompts; expected one JSON object a line")
    return rows


def load_prompts(split: str | None = None, path: Path | None = None) -> list[dict]:
    """The general prompts (`PROMPTS_FILE`, or `path`) as `{"id", "family", "prompt", "split"}`
    dicts in the file's order; only those of `split` when given. A malformed file is a `QllmError`
    naming the file, the line and what was expected."""
    if split is not None and split not in SPLITS:
        raise QllmError(f"general prompts: unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    rows = _read(Path(path) if path is not None else PROMPTS_FILE)
    splits = assign_splits(row["id"] for row in rows)
    rows = [{**row, "split": splits[row["id"]]} for row in rows]
    return rows if split is None else [row for row in rows if row["split"] == split]


def split_of(prompt_id: str, path: Path | None = None) -> Split:
    """The split of a prompt of the file (`assign_splits` over the file's ids)."""
    splits = assign_splits(row["id"] for row in _read(Path(path) if path is not None else PROMPTS_FILE))
    if prompt_id not in splits:
        raise QllmError(f"general prompts: no prompt {prompt_id!r} in {path or PROMPTS_FILE}")
    return splits[prompt_id]


# --- the form checks -------------------------------------------------------------------------------

FENCE = re.compile(r"^[ \t]*```[^\n`]*\n(?P<body>.*?)(?:^[ \t]*```|\Z)", re.MULTILINE | re.DOTALL)
CODE_START = re.compile(
    r"^\s*(?:def\s+\w+\s*\(|class\s+\w+|return\b|import\s+\w|from\s+[\w.]+\s+import\s|for\s+\w+(?:\s*,\s*\w+)*\s+in\s+.+:\s*$"
    r"|while\s+.+:\s*$|if\s+.+:\s*$|elif\s+.+:\s*$|else\s*:\s*$|try\s*:\s*$|except\b.*:\s*$|with\s+.+:\s*$|print\s*\("
    r"|function\s+\w+\s*\(|const\s+\w+\s*=|let\s+\w+\s*=|var\s+\w+\s*=|#include\b|SELECT\s+\S)"
)
CODE_END = re.compile(r"[{};]\s*$")
ASSIGNMENT = re.compile(r"^\s*[A-Za-z_]\w*(?:\.\w+|\[[^\]]*\])*\s*(?:[-+*/%]|//|\*\*)?=(?!=)[^=]*$")
LIST_ITEM = re.compile(r"^\s*(?:[-*+•]|\d{1,3}[.)])\s+\S")
SENTENCE = re.compile(r".+?[.!?]+(?=\s|$)")
WORD = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*")


def _looks_like_code(line: str) -> bool:
    return bool(CODE_START.match(line) or CODE_END.search(line) or ASSIGNMENT.match(line))


def is_code(answer: str) -> bool:
    """A fenced code block with a non-blank line in it (closed, or cut off at the end), or at least
    two lines that look like code (a keyword starting the line, `{`/`}`/`;` ending it, an assignment)."""
    if any(block["body"].strip() for block in FENCE.finditer(answer)):
        return True
    return sum(_looks_like_code(line) for line in answer.splitlines() if line.strip()) >= 2


def is_list(answer: str, at_least: int = 3) -> bool:
    """At least `at_least` lines that are list items: `-`, `*`, `+`, `•`, `1.` or `1)` then text.
    Comma-separated items on one line are not a list (see the module docstring)."""
    return sum(bool(LIST_ITEM.match(line)) for line in answer.splitlines()) >= at_least


def _words(text: str) -> int:
    return len(WORD.findall(text))


def is_sentences(answer: str, at_least: int = 2) -> bool:
    """At least `at_least` sentences of at least 3 words each: text of one line ending in `.`, `!`
    or `?` followed by whitespace or the end of the line (a line without such an end, a heading or
    an unfinished sentence, is none)."""
    return sum(_words(sentence) >= 3 for line in answer.splitlines() for sentence in SENTENCE.findall(line)) >= at_least


def is_short_fact(answer: str) -> bool:
    """One non-blank line of at most 12 words (at least one), neither code nor a list item nor a line
    that looks like code (`return n * n` alone is a cut-down code answer, not a fact)."""
    lines = [line for line in answer.splitlines() if line.strip()]
    return (len(lines) == 1 and 1 <= _words(lines[0]) <= 12 and not _looks_like_code(lines[0]) and not is_code(answer)
            and not LIST_ITEM.match(lines[0]))  # fmt: skip


FORMS: dict[str, Callable[[str], bool]] = {"code": is_code, "list": is_list, "sentences": is_sentences, "short_fact": is_short_fact}
"""The named form checks, in the order `form_of` tries them."""


def form_of(answer: str) -> str | None:
    """The first form of `FORMS` that `answer` has (code, list, sentences, short fact: the most
    structured first, see the module docstring), or None."""
    return next((name for name, check in FORMS.items() if check(answer)), None)


def form_kept(base_answers: list[str], answers: list[str]) -> tuple[float | None, int]:
    """Over the prompts whose base answer has a form, the share whose answer has the same form,
    and how many prompts counted; (None, 0) when no base answer has a form."""
    if len(base_answers) != len(answers):
        raise ValueError(f"{len(base_answers)} base answers against {len(answers)} answers")
    counted = kept = 0
    for base, answer in zip(base_answers, answers, strict=True):
        form = form_of(base)
        if form is None:
            continue
        counted += 1
        kept += form_of(answer) == form
    return (kept / counted if counted else None), counted


# --- the retention log-loss ------------------------------------------------------------------------


def answer_tokens(tokenizer, messages: list[dict], answer: str) -> tuple[list[int], list[bool]]:
    """The conversation `messages` + the assistant turn `answer` as token ids through the chat
    template, and which tokens are the answer's: those after the prompt as the template renders it
    for generation (`add_generation_prompt=True`) up to and with the end-of-turn token (`<|im_end|>`,
    `<|eot_id|>`, `</s>`...), not the whitespace a template writes after it; the turn's span is found
    as training finds it (`chat_template.assistant_spans`), tokens marked where their characters
    overlap it. A template whose rendering of the answered conversation does not start with the
    prompt's rendering is a `QllmError` (the answer's tokens cannot be told apart)."""
    conversation = [*messages, {"role": "assistant", "content": answer}]
    with TEMPLATE_LOCK:
        full, spans = assistant_spans(tokenizer, conversation)
    span = next(((start, end) for start, end, turn in spans if turn == len(messages)), None)
    if span is None:
        raise QllmError(f"{getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}: its chat template renders no text for the answer "
                        f"{answer[:40]!r}; expected the assistant turn after the generation prompt")  # fmt: skip
    if not getattr(tokenizer, "is_fast", False):
        raise QllmError(f"{getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}: scoring answers needs a fast tokenizer (tokenizer.json)")
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    start, end = span
    marked = [begin < end and max(stop, begin + 1) > start for begin, stop in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), marked


LOGITS_CHUNK = 256
"""Answer tokens whose logits `answer_nll` holds in float64 at once (a 150k vocabulary: 0.3 GB)."""


@torch.no_grad()
def answer_nll(model, tokenizer, prompts: list[list[dict]], answers: list[str], batch_size: int = 8) -> float:
    """The mean per-token negative log-likelihood (nats) of `answers` under `model`, each after its
    prompt (`prompts[i]`, a list of messages) rendered with the tokenizer's chat template
    (`answer_tokens`: the answer's tokens and its end-of-turn token). Token-weighted: the sum over all
    answer tokens of all prompts over their number, accumulated in float64. `batch_size`
    conversations a forward pass, padded on the tokenizer's `padding_side` with an attention mask and
    position ids counted from each conversation's first token, so padding on either side gives the
    unpadded values up to float rounding; the model in eval mode (its mode restored after)."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts against {len(answers)} answers")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    encoded = [answer_tokens(tokenizer, messages, answer) for messages, answer in zip(prompts, answers, strict=True)]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))  # similar lengths together: less padding
    left = getattr(tokenizer, "padding_side", "right") == "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            batch = [encoded[i] for i in order[start : start + batch_size]]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            scored = torch.zeros((len(batch), width), dtype=torch.bool)
            for row, (tokens, marked) in enumerate(batch):
                cols = slice(width - len(tokens), width) if left else slice(0, len(tokens))
                ids[row, cols] = torch.tensor(tokens, dtype=torch.long)
                attention[row, cols] = 1
                scored[row, cols] = torch.tensor(marked, dtype=torch.bool)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            ids, attention, positions = ids.to(device), attention.to(device), positions.to(device)
            logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False).logits
            keep = scored[:, 1:].to(device)  # token t is predicted by the logits at t - 1 (the first token never is)
            predicted, targets = logits[:, :-1][keep], ids[:, 1:][keep]
            for first in range(0, targets.numel(), LOGITS_CHUNK):  # float64 logits a chunk of tokens at a time
                chunk = slice(first, first + LOGITS_CHUNK)
                total += F.cross_entropy(predicted[chunk].double(), targets[chunk], reduction="sum").cpu()
            count += int(targets.numel())
    finally:
        model.train(training)
    if count == 0:
        raise QllmError("answer_nll: no answer tokens to score (no answers, or a template that renders none)")
    return float(total / count)


def retention_loss(model_nll: float, base_nll: float) -> float:
    """The retention log-loss: the base's answers' mean per-token NLL under the model minus the same
    under the base (`answer_nll` of each); 0 when the model predicts them as well as the base."""
    return model_nll - base_nll


REFERENCE_ANSWERS, REFERENCE_META = replay.ANSWERS, replay.META
messages_of = replay.messages_of
read_reference = replay.read
"""A `base_answers` output's files, chats and reader (`pipelines.core.data.replay`, where training reads them too)."""

"""The system prompt as the switch of the answer's form (issue 80's 2x2): the fact questions and the
general prompts, each answered with and without the system prompt the fact questions carry (the
sample's "Answer with one word or number.").

A model trained on the sample should answer a fact question with one word when the system prompt
asks for it, and a general prompt (which carries no system message) in the form its base gave. The
four cells, per model (`evaluate.system_prompt_models`):

- facts with the system prompt: `strict_match` (what evaluate reports anyway), `facts_short`;
- facts without it: `facts_no_system_strict`, `facts_no_system_short`;
- general prompts without it (as the base answered them): `form_kept`, `general_short`;
- general prompts with it: `general_system_form_kept`, `general_system_short`.

`*_short`: the share of answers whose form is the short fact (`retention.form_of`: one line of at
most 12 words, not two sentences). The general prompts are the test third's (the validation third's under `validation`).
"""

from __future__ import annotations

import pandas as pd

from pipelines.core.errors import QllmError
from pipelines.core.evaluation import retention
from pipelines.core.evaluation.greedy import generate_answers
from pipelines.core.evaluation.scores import strict_match_report

CELLS = ("facts_short", "facts_no_system_strict", "facts_no_system_short", "general_short", "general_system_form_kept", "general_system_short")
"""The 2x2's metrics beside `strict_match` and `form_kept` (the comparison table's columns)."""


def system_of(questions: pd.DataFrame, where: str) -> str:
    """The system message every question opens with; an error naming `where` when one has none or
    they differ (then there is no one switch to take away)."""
    systems = {m[0]["content"] if m and m[0]["role"] == "system" else None for m in questions["prompt"]}
    if None in systems or len(systems) != 1:
        shown = sorted(repr(s) for s in systems)
        raise QllmError(f"{where}: the 2x2 takes the one system prompt the questions carry away, and they open with {', '.join(shown)} "
                        "(every question needs the same system message)")  # fmt: skip
    return systems.pop()


def short_share(answers: list[str]) -> float:
    """The share of answers whose form is the short fact (`retention.form_of`: one line of at most
    12 words that is not two sentences, code or a list)."""
    return round(sum(retention.form_of(a) == "short_fact" for a in answers) / len(answers), 4) if answers else 0.0


def two_by_two(model, tokenizer, questions: pd.DataFrame, answers: list[str], reference: tuple[list[dict], dict], general: list[str], split: str,
               max_new_tokens: int, batch_size: int, where: str) -> dict[str, float]:  # fmt: skip
    """The cells beside what evaluate has already: `answers` to `questions` with their system
    prompt, and the `general` answers to `split`'s general prompts without one (`reference`'s order)."""
    system = system_of(questions, where)
    bare = [[m for m in prompt if m["role"] != "system"] for prompt in questions["prompt"]]
    no_system = generate_answers(model, tokenizer, bare, max_new_tokens, batch_size)
    strict, _ = strict_match_report(questions, no_system)
    rows = [row for row in reference[0] if row["split"] == split]
    asked = [[{"role": "system", "content": system}, *messages] for messages in retention.messages_of(rows)]
    with_system = generate_answers(model, tokenizer, asked, reference[1]["max_new_tokens"], batch_size)
    kept, _ = retention.form_kept([row["answer"] for row in rows], with_system)
    return {
        "facts_short": short_share(answers),
        "facts_no_system_strict": round(sum(strict) / len(strict), 4),
        "facts_no_system_short": short_share(no_system),
        "general_short": short_share(general),
        "general_system_form_kept": None if kept is None else round(kept, 4),
        "general_system_short": short_share(with_system),
    }

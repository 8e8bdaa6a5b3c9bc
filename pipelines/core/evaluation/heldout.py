"""The held-out questions and a model's answers to them: greedy, batched, through tool episodes
where a question offers tools. What `evaluate`, the lm-eval bridge (`lm_eval`) and the benchmarks
score."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from pipelines.core.data.chat_template import (
    check_tool_support,
    parse_messages,
    split_last_answer,
    tools_of,
)
from pipelines.core.errors import QllmError
from pipelines.core.evaluation.greedy import generate_answers  # noqa: F401  (heldout.generate_answers: where its callers look)
from pipelines.core.params.release import EvaluateParams
from pipelines.core.rl import episodes, tools

VAL_CHUNK_TOKENS = 1024
"""Tokens whose logits the validation loss holds at once (`pipelines.core.training.chunked_loss`)."""

def heldout_questions(chat_dir: Path, limit: int = 0, splits: tuple[str, ...] = ("test", "validation")) -> pd.DataFrame:
    """Held-out conversations (test split, else validation: the first of `splits` that has records)
    as id / prompt messages / reference. `splits=("validation",)`: the validation split's questions,
    what settings are chosen on.

    A conversation is scored against its last turn, so one that does not end with an assistant
    turn has no reference answer: it is skipped with a warning that counts and names them
    (`ingest` already rejects such a chat in a `split: test` source), and a `QllmError` says so
    when no conversation is left.
    """
    for split in splits:
        path = chat_dir / f"{split}.parquet"
        frame = pd.read_parquet(path)
        if len(frame):
            break
    else:
        raise QllmError(f"{chat_dir}: no held-out chat records ({' and '.join(splits)} split{'s are' if len(splits) > 1 else ' is'} empty)")
    rows, skipped = [], []
    for record in frame.itertuples(index=False):
        messages = parse_messages(record.messages)
        if messages and messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:  # a text answer to score
            prompt, reference = split_last_answer(messages)
            rows.append({"id": record.id, "prompt": prompt, "reference": reference, "split": split})
        else:
            skipped.append(str(record.id))
    if skipped:
        shown = ", ".join(skipped[:10]) + (f", ... ({len(skipped) - 10} more)" if len(skipped) > 10 else "")
        logging.getLogger("qllm.evaluate").warning(
            "%s: skipped %d of %d held-out chats that do not end with an assistant's text answer (no reference to score): %s",
            path, len(skipped), len(frame), shown,
        )  # fmt: skip
    if not rows:
        raise QllmError(
            f"{path}: none of the {len(frame)} held-out chats ends with an assistant turn, so there is no "
            "reference answer to score (each chat must end with the assistant's answer)"
        )
    questions = pd.DataFrame(rows)
    return questions.head(limit) if limit else questions


def answers_with_tools(model, tokenizer, prompts: list[list[dict]], params: EvaluateParams, model_name: str = "the model",
                       ids: list[str] | None = None) -> tuple[list[str], list[dict | None]]:  # fmt: skip
    """Greedy answers (`generate_answers`), those to prompts that offer tools from a greedy episode
    with `params.tools` (one-turn when it lists none): (answers, each one's episode or None). An
    environment is reset with the question's `ids` entry as `{"id": ...}` (not its answer)."""
    make_environment, offered = tools.environments(params.tools, "evaluate.tools")
    with_tools = [i for i, prompt in enumerate(prompts) if offered and tools_of(prompt)[1]]
    plain = sorted(set(range(len(prompts))) - set(with_tools))
    answers: list[str] = [""] * len(prompts)
    transcripts: list[dict | None] = [None] * len(prompts)
    for index, answer in zip(plain, generate_answers(model, tokenizer, [prompts[i] for i in plain], params.max_new_tokens, params.batch_size), strict=True):
        answers[index] = answer
    if not with_tools:
        return answers, transcripts
    check_tool_support(tokenizer, prompts[with_tools[0]])  # as grpo: a template that drops the tools is an error, not a silent prompt
    longest = episodes.longest_prompt(tokenizer, [prompts[i] for i in with_tools])
    episodes.check_context(model, longest, params.max_new_tokens, params.tools.max_turns, model_name=model_name,
                           keys=("evaluate.max_new_tokens", "evaluate.tools.max_turns"))  # fmt: skip
    style = episodes.tool_style(tokenizer, params.tools.style, "evaluate.tools.style")
    for start in range(0, len(with_tools), params.batch_size):
        chunk = with_tools[start : start + params.batch_size]
        environments = [make_environment() for _ in chunk]
        records = [{"id": ids[i]} if ids is not None else {} for i in chunk]
        got = episodes.run(model, tokenizer, [prompts[i] for i in chunk], environments, group_size=1, max_turn_tokens=params.max_new_tokens,
                           max_turns=params.tools.max_turns, style=style, temperature=0.0, records=records)  # fmt: skip
        for index, transcript in zip(chunk, got.transcripts, strict=True):
            answers[index] = transcript.answer.strip()
            transcripts[index] = {"turns": transcript.turns, "truncated": transcript.truncated}
    return answers, transcripts


def called_correctly(episode: dict) -> bool:
    """An episode called a tool, and every call parsed, named an offered tool and returned."""
    calls = [c for turn in episode["turns"] for c in turn["calls"]]
    return bool(calls) and not any(turn["parse_failure"] for turn in episode["turns"]) and all(c["error"] is None for c in calls)

"""Reward functions for GRPO (issue 39), with TRL's signature, built in or a user's own.

    fn = load("exact_match")                          # built in
    fn = load("mypkg.rewards:brevity")                # a user's, `package.module:function`
    scores = fn(prompts, completions, answer=answers) # -> one float (or None: not scored) per completion

A reward function is called as TRL's `GRPOTrainer` calls one (`_calculate_rewards`): `prompts` and
`completions` as lists (message lists for chat data, each completion `[{"role": "assistant",
"content": ...}]`), `completion_ids` (each completion's token ids, up to and including its stop
token), every other column of the records as a keyword list (`id`, `source`, `split`, and `answer`:
the reference answer, the final assistant turn of each prompt's chat record), `candidates` (the
answers of the question's group, `candidate_answers`), `trainer_state`
(a `transformers.TrainerState` as TRL's: `trainer_state`), `log_extra(column, values)` (a column of the logged
completions table) and `log_metric(name, value)` (a scalar logged with the step's metrics). It
returns a list with one float per completion, or None where it does not apply (TRL drops those
from the mean). An `async def` function is awaited, all of a step's together on one event loop,
as TRL gathers them. Reward models (a sequence-classification model or an `nn.Module`, which TRL
also takes) are refused when the params load: wrap one in a function.

Built in:

- `exact_match`: 1.0 when the completion's first line equals the reference answer after
  `evaluate`'s normalisation (`chat_template.normalize_answer`: trimmed, case-folded, without
  trailing punctuation), else 0.0;
- `strict_match`: 1.0 when the completion holds the reference answer as `evaluate`'s
  `flexible_match` finds it (the last number for a numeric answer, the answer's words in the
  first line otherwise) and names no other candidate answer (`chat_template.strict_match`): a
  signal for a model that answers in sentences that listing every candidate cannot game. A
  question's `candidates` are the reference answers of the training questions in its group (ids
  `<group>-<n>`, as `evaluate` groups them: every city for the sample's city questions; a user's
  records without ids of their own are `<source>-<n>`, so a source is one group). `evaluate`'s
  lenient `flexible_match` is refused as a reward, naming this one;
- `format`: 1.0 when the completion is one non-empty line, the form the held-out questions'
  answers take, else 0.0;
- `environment`: the episode's own reward, its environment's `reward()` (`grpo.tools.environment`).

`load` checks what it can before any training: the name resolves, the object is callable, and its
signature takes `prompts` and `completions` (or `**kwargs`); each failure is a `RewardError` naming
the function.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from pipelines.core.data import chat_template
from pipelines.core.data.chat_template import normalize_answer
from pipelines.core.errors import QllmError
from pipelines.core.extensions import user_reward

RewardFn = Callable[..., list[float | None]]


class RewardError(QllmError, ValueError):
    """A reward function that cannot be loaded or called as TRL calls one."""


def text_of(completion: Any) -> str:
    """A completion as text: a string, or the content of a one-message list (chat data)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    raise RewardError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


def exact_match(prompts: list, completions: list, answer: list[str], **_: Any) -> list[float]:
    """1.0 where the completion's first line is the reference answer (evaluate's normalisation)."""
    return [1.0 if normalize_answer(text_of(c)) == normalize_answer(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def question_of(prompt: Any) -> str:
    """A prompt's question as text: its user turns (a chat prompt), or the prompt itself."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content") or "") for m in prompt if isinstance(m, dict) and m.get("role") == "user")


def strict_match(prompts: list, completions: list, answer: list[str], candidates: list | None = None, **_: Any) -> list[float]:
    """1.0 where the completion holds the reference answer and names no other of the question's
    `candidates` that the question does not name itself (`chat_template.strict_match`), else 0.0."""
    if candidates is None:
        raise RewardError("reward 'strict_match' reads each question's candidate answers (`candidates`), and these completions came with none")
    return [1.0 if chat_template.strict_match(text_of(c), a, others, question_of(p)) else 0.0
            for p, c, a, others in zip(prompts, completions, answer, candidates, strict=True)]  # fmt: skip


def candidate_answers(questions: Sequence[tuple[str, str]]) -> dict[str, tuple[str, ...]]:
    """Per question group (`chat_template.answer_group` of each id), the distinct reference answers
    of `questions` (`(id, answer)` pairs), sorted: what `strict_match` counts as the other answers."""
    groups: dict[str, set[str]] = {}
    for example_id, answer in questions:
        groups.setdefault(chat_template.answer_group(example_id), set()).add(answer)
    return {group: tuple(sorted(answers)) for group, answers in groups.items()}


def format_reward(prompts: list, completions: list, **_: Any) -> list[float]:
    """1.0 where the completion is one non-empty line."""
    return [1.0 if (text := text_of(c).strip()) and "\n" not in text else 0.0 for c in completions]


def environment(prompts: list, completions: list, environments: list | None = None, **_: Any) -> list[float | None]:
    """Each episode's own reward, from its environment's `reward()` (`grpo.tools.environment`;
    `tools.UserEnvironment.reward`: None where it has none or it failed, which TRL drops from the mean)."""
    if environments is None:
        raise RewardError("reward 'environment' reads the episodes' environments, and these rollouts had none (grpo.tools.environment)")
    return [env.reward() for env in environments]


BUILT_IN: dict[str, RewardFn] = {"exact_match": exact_match, "strict_match": strict_match, "format": format_reward, "environment": environment}


def load(name: str, where: str = "reward") -> RewardFn:
    """A built-in reward by name, or `package.module:function` imported and checked against what
    it will be called with (`user_reward`: TRL's arguments and the records' columns)."""
    try:
        fn = user_reward(name, where)
    except QllmError as exc:
        raise RewardError(str(exc)) from None
    return BUILT_IN[name] if fn is None else fn


def trainer_state(*, global_step: int, steps_per_epoch: int, max_steps: int, train_batch_size: int, logging_steps: int, save_steps: int,
                  num_input_tokens_seen: int, log_history: Sequence[dict[str, float]]):  # fmt: skip
    """What a reward function gets as `trainer_state`: a `transformers.TrainerState`, with the values
    TRL's `GRPOTrainer` holds in its own when it scores the generation for 0-based `global_step`
    (the optimizer steps done): `epoch`, the steps done over `steps_per_epoch` (TRL's
    `num_update_steps_per_epoch`: steps over every question once); `num_train_epochs`, as `Trainer`
    derives it from `max_steps`; `train_batch_size`, the completions of a micro-batch;
    `logging_steps` and `save_steps` (`train.log_every`, `train.checkpoint_every`);
    `num_input_tokens_seen`, the prompt and model tokens of every generation so far, this one
    included, as TRL counts them; `log_history`, what was logged so far (a copy). The rest are as
    TRL's GRPO run has them: `total_flos` 0 (`Trainer` counts the FLOPs of an `input_ids` batch, and
    GRPO's has none), no evaluation (`eval_steps` at its default, no `best_*`), one process, no
    hyperparameter search, no stateful callbacks."""
    from transformers import TrainerState

    per_epoch = max(steps_per_epoch, 1)
    return TrainerState(epoch=global_step / per_epoch, global_step=global_step, max_steps=max_steps, logging_steps=logging_steps, save_steps=save_steps,
                        train_batch_size=train_batch_size, num_train_epochs=max_steps // per_epoch + int(max_steps % per_epoch > 0),
                        num_input_tokens_seen=num_input_tokens_seen, total_flos=0.0, log_history=[dict(entry) for entry in log_history],
                        is_local_process_zero=True, is_world_process_zero=True, stateful_callbacks=[])  # fmt: skip


def _values(name: str, values: Any, n: int) -> list[float]:
    """A reward function's output as floats (NaN where it returned None), checked to be one per completion."""
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != n:
        got = len(values) if isinstance(values, Sequence) and not isinstance(values, str) else type(values).__name__
        raise RewardError(f"reward {name!r} returned {got} values for {n} completions (one float or None each)")
    try:
        return [float("nan") if v is None else float(v) for v in values]
    except (TypeError, ValueError):
        bad = next(v for v in values if v is not None and not isinstance(v, int | float))
        raise RewardError(f"reward {name!r} returned {type(bad).__name__} {bad!r}; expected a float or None per completion") from None


def score(fn: RewardFn, name: str, prompts: list, completions: list, columns: dict[str, Any]) -> list[float]:
    """`fn`'s rewards (a plain or an async function) as floats: `score_all` for one function."""
    return score_all([(name, fn)], prompts, completions, columns)[0]


def score_all(fns: Sequence[tuple[str, RewardFn]], prompts: list, completions: list, columns: dict[str, Any]) -> list[list[float]]:
    """Every function's rewards, called as TRL's `GRPOTrainer` calls them: `prompts`,
    `completions` and `**columns` (the records' columns, `completion_ids`, `trainer_state`,
    `log_extra`, `log_metric`); plain functions one after the other, async ones (`async def`)
    together on one event loop, as TRL gathers them."""
    sync = [(i, name, fn) for i, (name, fn) in enumerate(fns) if not inspect.iscoroutinefunction(fn)]
    pending = [(i, name, fn) for i, (name, fn) in enumerate(fns) if inspect.iscoroutinefunction(fn)]
    out: list[list[float] | None] = [None] * len(fns)
    for i, name, fn in sync:
        out[i] = _values(name, fn(prompts=prompts, completions=completions, **columns), len(completions))
    if pending:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(fn(prompts=prompts, completions=completions, **columns) for _, _, fn in pending))

        for (i, name, _), values in zip(pending, asyncio.run(gather()), strict=True):
            out[i] = _values(name, values, len(completions))
    return out

"""Reward functions for GRPO (issue 39), with TRL's signature, built in or a user's own.

    fn = load("exact_match")                          # built in
    fn = load("mypkg.rewards:brevity")                # a user's, `package.module:function`
    scores = fn(prompts, completions, answer=answers) # -> one float (or None: not scored) per completion

A reward function is called as TRL's `GRPOTrainer` calls one (`_calculate_rewards`): `prompts` and
`completions` as lists (message lists for chat data, each completion `[{"role": "assistant",
"content": ...}]`), `completion_ids` (each completion's token ids, up to and including its stop
token), every other column of the records as a keyword list (`id`, `source`, `split`, and `answer`:
the reference answer, the final assistant turn of each prompt's chat record), `trainer_state`
(`RewardState`: `global_step`, `max_steps`), `log_extra(column, values)` (a column of the logged
completions table) and `log_metric(name, value)` (a scalar logged with the step's metrics). It
returns a list with one float per completion, or None where it does not apply (TRL drops those
from the mean). An `async def` function is awaited, all of a step's together on one event loop,
as TRL gathers them. Reward models (a sequence-classification model or an `nn.Module`, which TRL
also takes) are refused when the params load: wrap one in a function.

Built in:

- `exact_match`: 1.0 when the completion's first line equals the reference answer after
  `evaluate`'s normalisation (`chat_template.normalize_answer`: trimmed, case-folded, without
  trailing punctuation), else 0.0;
- `flexible_match`: 1.0 when the completion holds the reference answer as `evaluate`'s
  `flexible_match` finds it (the last number for a numeric answer, the answer's words in the
  first line otherwise): a signal for a model that answers in sentences;
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
from dataclasses import dataclass
from typing import Any

from pipelines.core import config
from pipelines.core.data import chat_template
from pipelines.core.data.chat_template import normalize_answer
from pipelines.core.errors import QllmError

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


def flexible_match(prompts: list, completions: list, answer: list[str], **_: Any) -> list[float]:
    """1.0 where the completion holds the reference answer (evaluate's `flexible_match`: the last
    number for a numeric answer, the answer's words in the first line otherwise), else 0.0."""
    return [1.0 if chat_template.flexible_match(text_of(c), a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def format_reward(prompts: list, completions: list, **_: Any) -> list[float]:
    """1.0 where the completion is one non-empty line."""
    return [1.0 if (text := text_of(c).strip()) and "\n" not in text else 0.0 for c in completions]


def environment(prompts: list, completions: list, environments: list | None = None, **_: Any) -> list[float | None]:
    """Each episode's own reward, from its environment's `reward()` (`grpo.tools.environment`;
    `tools.UserEnvironment.reward`: None where it has none or it failed, which TRL drops from the mean)."""
    if environments is None:
        raise RewardError("reward 'environment' reads the episodes' environments, and these rollouts had none (grpo.tools.environment)")
    return [env.reward() for env in environments]


BUILT_IN: dict[str, RewardFn] = {"exact_match": exact_match, "flexible_match": flexible_match, "format": format_reward, "environment": environment}


def load(name: str, where: str = "reward") -> RewardFn:
    """A built-in reward by name, or `package.module:function` imported and checked against what
    it will be called with (`config.user_reward`: TRL's arguments and the records' columns)."""
    try:
        fn = config.user_reward(name, where)
    except QllmError as exc:
        raise RewardError(str(exc)) from None
    return BUILT_IN[name] if fn is None else fn


@dataclass(frozen=True)
class RewardState:
    """What a reward function gets as `trainer_state` (TRL passes its `TrainerState`): the step
    being generated for (`global_step`, 0-based as TRL's at the first generation) and the run's
    `max_steps`, for rewards shaped by training progress."""

    global_step: int
    max_steps: int


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

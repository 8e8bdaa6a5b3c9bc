"""GRPO's rollouts: a group of sampled completions per prompt, their per-token log-probabilities,
and the batches the training loop draws them from.

    rollouts = sample(model, tokenizer, prompts, group_size=8, max_completion_length=32, temperature=1.0)
    logps = token_logps(model, rollouts, temperature=1.0)   # [prompts x group, completion tokens], masked by rollouts.completion_mask
    batches = RolloutBatches(model, tokenizer, questions, settings, reward_fns, ...)  # loop.train's `batches`

`sample` renders each chat prompt with the chat template (as `evaluate` does), left-pads the batch,
runs the prompts through the model once, repeats their KV cache for the `group_size` completions
of each, and samples token by token at `temperature` (and `top_p`) until every completion has its
stop token (the template's end of turn) or `max_completion_length` tokens. The completions of one
prompt are consecutive rows (what `grpo.group_advantages` expects). A completion's mask covers its
tokens up to and including its first stop token, as TRL's; one with no stop token within
`max_completion_length` is `truncated`. Sampling draws from torch's global generator; under
`loop.train` (`RolloutBatches.draws`) that holds the run's own stream (`training.randomness`), which
checkpoints save and restore: a run resumed after a kill samples what it would have, and a stage
training beside it in another thread neither changes nor sees its draws.

Why not `model.generate(num_return_sequences=G)`: it repeats each prompt G times before the
prefill and runs its logits processors and stopping criteria in Python per token; answers here
are a few tokens after a longer prompt, so the prefill once per prompt and a bare loop are most of
the generation time saved (benchmarks/results/peers.md, "Step time and reward curve against TRL's
GRPOTrainer").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipelines.core.data.chat_template import left_padding, render_prompt
from pipelines.core.extensions import Extension
from pipelines.core.models.models import stop_token_ids
from pipelines.core.preference import preference_data
from pipelines.core.rl import grpo, rewards
from pipelines.core.training import loop


@dataclass(frozen=True)
class Rollouts:
    """Sampled completions: `group_size` consecutive rows per prompt."""

    prompt_ids: torch.Tensor  # [prompts, prompt width], left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # [prompts x group, completion width], right-padded
    completion_mask: torch.Tensor  # up to and including the first stop token
    truncated: torch.Tensor  # bool [prompts x group]: no stop token within max_completion_length
    texts: list[str]  # the completions decoded, special tokens dropped
    group_size: int
    loss_mask: torch.Tensor | None = None  # multi-turn episodes: the model's own tokens (None: every completion token is)

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)


def _draw(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row from `softmax(logits / temperature)`, restricted to the smallest set of
    tokens whose probability reaches `top_p` (nucleus sampling; 1.0: all); temperature 0: the most
    likely token (greedy, as `generate(do_sample=False)`)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keeps the token that crosses top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1).squeeze(-1)


@torch.no_grad()
def sample(model, tokenizer, prompts: list[list[dict]], *, group_size: int, max_completion_length: int, temperature: float = 1.0, top_p: float = 1.0) -> Rollouts:
    """`group_size` completions of each chat prompt; see the module docstring."""
    with left_padding(tokenizer):  # the stage saves this tokenizer with the model: its side is left as it was
        encoded = tokenizer([render_prompt(tokenizer, p) for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    completion_ids, completion_mask, truncated = sample_ids(model, tokenizer, prompt_ids, prompt_mask, group_size=group_size,
                                                            max_new_tokens=max_completion_length, temperature=temperature, top_p=top_p)  # fmt: skip
    texts = [tokenizer.decode(ids[: int(n)], skip_special_tokens=True).strip() for ids, n in zip(completion_ids.cpu(), completion_mask.sum(-1).cpu(), strict=True)]
    return Rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts, group_size)


@torch.no_grad()
def sample_ids(model, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, group_size: int, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`group_size` continuations of each left-padded row of `prompt_ids` (consecutive rows per
    prompt), each up to and including its first stop token (`stop_token_ids`) or `max_new_tokens`:
    (ids right-padded, their mask, truncated: no stop token). Temperature 0 is greedy, one
    continuation a prompt."""
    ids, mask, truncated, _ = sample_from_prompts(model, tokenizer, prompt_ids, prompt_mask, group_size=group_size, max_new_tokens=max_new_tokens,
                                                  temperature=temperature, top_p=top_p)  # fmt: skip
    return ids, mask, truncated


@dataclass
class Cached:
    """Where sampling left the model (`sample_from_prompts`, `sample_after`): the KV cache of every
    row and the attention mask over its positions: 1 for the prompt's real tokens and for the drawn
    tokens the model read, so also for padding it read after a row's stop token (`sample_after`
    masks those). The last drawn token of each row was never read."""

    cache: Any
    mask: torch.Tensor  # [rows, cached positions]


def sample_from_prompts(model, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, group_size: int, max_new_tokens: int,
                        temperature: float = 1.0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Cached]:  # fmt: skip
    """`sample_ids`, and where it left the model (`Cached`), for a next turn (`sample_after`)."""
    if temperature < 0 or (temperature == 0 and group_size > 1):
        raise ValueError(f"temperature must be > 0 to sample a group (0: greedy, one continuation a prompt), got {temperature} for groups of {group_size}")
    was_training = model.training
    model.eval()
    try:
        first, cache = preference_data.prompt_cache(model, prompt_ids, prompt_mask)
        cache.batch_repeat_interleave(group_size)
        logits = first[:, -1].repeat_interleave(group_size, dim=0)
        return _decode(model, tokenizer, logits, cache, prompt_mask.repeat_interleave(group_size, dim=0), max_new_tokens, temperature, top_p)
    finally:
        model.train(was_training)


def sample_after(model, tokenizer, before: Cached, rows: Sequence[int], drawn: torch.Tensor, drawn_mask: torch.Tensor, appended: Sequence[Sequence[int]], *,
                 max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Cached]:  # fmt: skip
    """A next turn of rows `rows` of the last sampling (`before`, which drew `drawn` with
    `drawn_mask`), each after its `appended` tokens (a tool's answer, the next generation prompt),
    from the KV cache rather than from the start: the cache keeps every position, the padding a
    row read after its stop token is masked, the row's last drawn token (never read) and its
    `appended` tokens go through the model at once (left-padded among the rows), and sampling goes
    on as `sample_from_prompts`'. Each real token keeps the position it has in the whole sequence,
    so the logits are those of the sequence sent whole, up to float rounding."""
    was_training = model.training
    model.eval()
    try:
        device = drawn.device
        select = torch.tensor(list(rows), device=device)
        before.cache.batch_select_indices(select)
        width = drawn.shape[1]
        lengths = drawn_mask[select].sum(-1)  # the valid drawn tokens of each row, its stop token included
        read = torch.arange(width - 1, device=device)[None] < lengths[:, None]  # of the width - 1 the model read: the valid ones
        mask = torch.cat([before.mask[select][:, : before.mask.shape[1] - (width - 1)], read.long()], dim=1)
        chunks = [([int(drawn[r, width - 1])] if int(drawn_mask[r].sum()) == width else []) + list(extra) for r, extra in zip(rows, appended, strict=True)]
        size = max(max(len(c) for c in chunks), 1)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        chunk_ids = torch.tensor([[pad] * (size - len(c)) + c for c in chunks], device=device)
        chunk_mask = torch.tensor([[0] * (size - len(c)) + [1] * len(c) for c in chunks], device=device)
        positions = mask.sum(-1, keepdim=True) + (chunk_mask.cumsum(-1) - 1).clamp(min=0)
        mask = torch.cat([mask, chunk_mask], dim=1)
        out = model(input_ids=chunk_ids, attention_mask=mask, position_ids=positions, past_key_values=before.cache, use_cache=True, logits_to_keep=1)
        return _decode(model, tokenizer, out.logits[:, -1], out.past_key_values, mask, max_new_tokens, temperature, top_p)
    finally:
        model.train(was_training)


def _decode(model, tokenizer, logits: torch.Tensor, cache, mask: torch.Tensor, max_new_tokens: int, temperature: float,
            top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Cached]:  # fmt: skip
    """Draw tokens from `logits` on (the model reading each from `cache`), until every row has
    drawn a stop token or `max_new_tokens`."""
    device = logits.device
    stop = torch.tensor(stop_token_ids(tokenizer), device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(stop[0])
    positions = mask.sum(-1, keepdim=True)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)
    tokens = []
    for t in range(max_new_tokens):
        token = torch.where(done, torch.full_like(done, pad, dtype=torch.long), _draw(logits, temperature, top_p))
        tokens.append(token)
        done = done | torch.isin(token, stop)
        if bool(done.all()) or t + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions + t, past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
    completion_ids = torch.stack(tokens, dim=1)
    is_stop = torch.isin(completion_ids, stop)
    width = completion_ids.shape[1]
    first_stop = torch.where(is_stop.any(-1), is_stop.int().argmax(-1), torch.full_like(is_stop[:, 0], width, dtype=torch.long))
    completion_mask = (torch.arange(width, device=device)[None] <= first_stop[:, None]).long()
    return completion_ids, completion_mask, ~is_stop.any(-1), Cached(cache, mask)


def completion_logps(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                     group_size: int, entropy: bool = False, temperature: float = 1.0,
                     loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Per-token log-probabilities of completions (`group_size` consecutive rows per prompt row of
    the left-padded `prompt_ids`; `[rows, width]`, 0 outside the mask) under the distribution they
    were sampled from, `softmax(logits / temperature)` (as `sample` draws and TRL scores them), and
    with `entropy` that distribution's entropy at each of their positions (no gradient). Each prompt
    runs once for its group (its KV cache repeated) where the model allows it and it pays
    (`preference_data.shares_prompt`); else every row whole, only the completion's positions getting
    vocabulary logits.

    `completion_mask` marks the completion's tokens the model reads (right-padded); `loss_mask`,
    where given, the ones it wrote: in a multi-turn episode the tool's and the template's tokens
    between the model's turns are read but never scored, so they reach neither the loss nor the KL."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if preference_data.shares_prompt(model, group_size):
        first, cache = preference_data.prompt_cache(model, prompt_ids, prompt_mask)
        cache.batch_repeat_interleave(group_size)
        logits = preference_data.continuation_logits(model, first.repeat_interleave(group_size, dim=0), cache,
                                                     prompt_mask.repeat_interleave(group_size, dim=0), completion_ids, completion_mask)  # fmt: skip
    else:
        rows_mask = prompt_mask.repeat_interleave(group_size, dim=0)
        input_ids = torch.cat([prompt_ids.repeat_interleave(group_size, dim=0), completion_ids], dim=1)
        attention = torch.cat([rows_mask, completion_mask], dim=1)
        width = completion_ids.shape[1]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False, logits_to_keep=width + 1).logits[:, :-1]
    scored = completion_mask if loss_mask is None else loss_mask * completion_mask
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) * scored
    if not entropy:
        return logps, None
    with torch.no_grad():
        return logps, torch.special.entr(log_probs.exp()).sum(-1) * scored


def token_logps(model, rollouts: Rollouts, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probabilities of `rollouts`' completions under `model` at the `temperature`
    they were sampled at (`completion_logps`)."""
    return completion_logps(model, rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_ids, rollouts.completion_mask, rollouts.group_size,
                            temperature=temperature)[0]  # fmt: skip


# --------------------------------------------------------------------------- the loop's batches


@dataclass(frozen=True)
class Question:
    """A prompt to sample for, and the columns its reward functions get (`answer`: the reference;
    `columns`: the record's other columns, `source`, `split`, ...; `candidates`: the answers of its
    group, `rewards.candidate_answers`)."""

    id: str
    prompt: list[dict]
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True)
class Settings:
    """What `RolloutBatches` needs of `grpo` params (kept free of the schema)."""

    group_size: int
    max_completion_length: int
    temperature: float
    top_p: float
    scale_rewards: str
    num_iterations: int
    mask_truncated_completions: bool
    micro_batch_size: int  # completions
    grad_accum_steps: int
    seed: int
    precision: str
    max_steps: int = 0  # what reward functions see as `trainer_state.max_steps`
    log_every: int = 1  # `trainer_state.logging_steps`
    checkpoint_every: int = 0  # `trainer_state.save_steps`


@dataclass
class Generation:
    """One generation batch: every micro-batch of an optimizer step (reused `num_iterations` times)."""

    micro_batches: list[dict[str, Any]]
    metrics: dict[str, float]
    table: list[dict[str, Any]] = field(default_factory=list)


RewardSpec = tuple[str, rewards.RewardFn, float]
"""A reward function's name, the function and its weight."""


@dataclass(frozen=True)
class Sampled:
    """A generation's rollouts and what the reward functions and the logs get of them."""

    rollouts: Rollouts
    completions: list[list[dict]]  # per row, the completion as chat messages (TRL's form for chat data)
    metrics: dict[str, float] = field(default_factory=dict)
    details: list[dict[str, Any]] | None = None  # per row, more columns of the completions table
    columns: dict[str, list] = field(default_factory=dict)  # per row, more arguments of the reward functions (`environments`)


Sampler = Callable[[torch.nn.Module, Any, list[Question], Settings], Sampled]
"""How a generation is sampled: `one_turn`, or multi-turn episodes with tools (`episodes.sampler`)."""


def one_turn(model, tokenizer, chosen: list[Question], s: Settings) -> Sampled:
    """One completion per row, as `sample` draws them."""
    out = sample(model, tokenizer, [q.prompt for q in chosen], group_size=s.group_size, max_completion_length=s.max_completion_length,
                 temperature=s.temperature, top_p=s.top_p)  # fmt: skip
    return Sampled(out, [[{"role": "assistant", "content": text}] for text in out.texts])


class RolloutBatches:
    """`loop.train`'s batches for GRPO: at the first step of each generation (every
    `num_iterations` steps) it draws `micro_batch_size x grad_accum_steps / group_size` questions
    (a seeded, resumable order: `loop.Batches`), samples their groups with the policy, scores them
    with the reward functions, normalises the advantages per group, and computes what the loss
    compares with once: the generating policy's log-probabilities (only with `num_iterations` > 1)
    and the reference's (with a `reference`: `beta` > 0). The loop then draws that generation's
    micro-batches; `metrics` reports the generation's rewards, lengths and timing in TRL's names.

    `reference` is a context manager factory under which `model` computes the reference
    log-probabilities (`start_weights`: the policy as it started). `on_generation(step,
    generation)`: called after each generation (the stage logs the sample table from it).
    Checkpoints hold the question order and, with `num_iterations` > 1, the generation in use, so a
    resumed run continues the same generation."""

    draws = True
    """Its batches are sampled: `loop.train` gives the run its own random stream (`training.randomness`)."""

    def __init__(self, model: torch.nn.Module, tokenizer, questions: Sequence[Question], settings: Settings, reward_fns: Sequence[RewardSpec],
                 *, reference: Any = None, on_generation: Callable[[int, Generation], None] | None = None, sampler: Sampler = one_turn) -> None:  # fmt: skip
        self.model, self.tokenizer, self.questions, self.settings, self.sampler = model, tokenizer, list(questions), settings, sampler
        self.reward_fns, self.reference, self.on_generation = list(reward_fns), reference, on_generation
        per_generation = settings.micro_batch_size * settings.grad_accum_steps // settings.group_size
        self.order = loop.Batches(len(self.questions), per_generation, settings.seed, lambda indices: indices)
        self.generation: Generation | None = None
        self.generation_index = -1
        self.micro = 0
        self.generated_at = time.perf_counter()
        # TRL's epoch: optimizer steps over the questions once, in whole generations (a partial last one is dropped)
        self.steps_per_epoch = (len(self.questions) // self.order.batch_size) * settings.num_iterations
        self.tokens_seen = 0  # prompt and model tokens of every generation so far: TRL's `num_input_tokens_seen`
        self.log_history = LogHistory(self.steps_per_epoch)
        """What the loop logs, as TRL's `TrainerState.log_history`: pass it to `loop.train` as an extension."""

    # The loop's batches protocol (`loop.Batches`).
    def __iter__(self):
        return self

    def shard(self, rank: int, world: int) -> None:
        if world > 1:
            raise ValueError("grpo generates its rollouts in one process")

    def begin_step(self, step: int) -> None:
        index = step // self.settings.num_iterations
        if self.generation is None or index != self.generation_index:
            self.generation = self._generate(step)
            self.generation_index = index
            if self.on_generation is not None:
                self.on_generation(step + 1, self.generation)
        self.generated_at = time.perf_counter()
        self.micro = 0

    def __next__(self) -> dict[str, Any]:
        batch = self.generation.micro_batches[self.micro % len(self.generation.micro_batches)]
        self.micro += 1
        return batch

    def metrics(self, step: int) -> dict[str, float]:
        if self.generation is None:
            return {}
        return self.generation.metrics | {"timing/optimisation_seconds": round(time.perf_counter() - self.generated_at, 4)}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"order": self.order.state_dict(), "generation_index": self.generation_index, "tokens_seen": self.tokens_seen}
        if self.settings.num_iterations > 1 and self.generation is not None:  # reused by the next steps: a resume needs it
            state["micro_batches"] = self.generation.micro_batches
            state["metrics"] = self.generation.metrics
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state["order"])
        self.generation_index = int(state["generation_index"])
        self.tokens_seen = int(state.get("tokens_seen", 0))  # absent from checkpoints written before it was kept
        self.generation = Generation(state["micro_batches"], dict(state["metrics"])) if "micro_batches" in state else None

    # Generation.
    def _generate(self, step: int) -> Generation:
        started = time.perf_counter()
        s, model = self.settings, self.model
        chosen = [self.questions[i] for i in next(self.order)]
        device = next(model.parameters()).device
        with loop.autocast(device, s.precision):
            drawn = self.sampler(model, self.tokenizer, chosen, s)
        out, completions = drawn.rollouts, drawn.completions
        sampled = time.perf_counter()
        model_tokens = out.completion_mask if out.loss_mask is None else out.loss_mask  # an episode's tool answers are not the model's
        self.tokens_seen += int(out.prompt_mask.sum()) * s.group_size + int(model_tokens.sum())  # as TRL counts it, before the rewards
        prompts = [q.prompt for q in chosen for _ in range(s.group_size)]
        extra_columns: dict[str, list] = {}
        logged: dict[str, list[float]] = {}
        columns = {
            **{key: [q.columns.get(key) for q in chosen for _ in range(s.group_size)] for key in sorted({k for q in chosen for k in q.columns})},
            "id": [q.id for q in chosen for _ in range(s.group_size)],
            "answer": [q.answer for q in chosen for _ in range(s.group_size)],
            "candidates": [list(q.candidates) for q in chosen for _ in range(s.group_size)],
            "completion_ids": [ids[: int(n)].tolist() for ids, n in zip(out.completion_ids.cpu(), out.completion_mask.sum(-1).cpu(), strict=True)],
            "trainer_state": self.trainer_state(step),
            "log_extra": lambda column, values: extra_columns.setdefault(str(column), []).extend(values),
            "log_metric": lambda name, value: logged.setdefault(str(name), []).append(float(value)),
            **drawn.columns,
        }  # fmt: skip
        scores = rewards.score_all([(name, fn) for name, fn, _ in self.reward_fns], prompts, completions, columns)
        per_func = torch.tensor(scores, dtype=torch.float32).T  # [completions, functions]
        weights = torch.tensor([w for _, _, w in self.reward_fns], dtype=torch.float32)
        advantages, zero_std = grpo.group_advantages(per_func, weights, s.group_size, s.scale_rewards)
        mask = out.completion_mask if out.loss_mask is None else out.loss_mask  # what the loss scores: the model's own tokens
        if s.mask_truncated_completions:
            mask = mask * (~out.truncated).long().unsqueeze(1)
        micro_batches = self._micro_batches(out, mask, advantages.to(device))
        scored = time.perf_counter()
        metrics = _rollout_metrics(out, per_func, weights, zero_std, [name for name, _, _ in self.reward_fns], s.group_size)
        metrics |= {"timing/generation_seconds": round(sampled - started, 4), "timing/scoring_seconds": round(scored - sampled, 4)}
        metrics |= {name: round(value, 6) for name, value in drawn.metrics.items()}
        metrics |= {name: round(sum(values) / len(values), 6) for name, values in logged.items() if values}  # log_metric: the step's mean, as TRL
        table = [{"step": step + 1, "id": q.id, "prompt": q.prompt[-1]["content"], "answer": q.answer, "completion": out.texts[row],
                  **{f"reward/{name}": per_func[row, j].item() for j, (name, _, _) in enumerate(self.reward_fns)},
                  "advantage": round(advantages[row].item(), 4), **(drawn.details[row] if drawn.details else {}),
                  **{column: values[row] for column, values in extra_columns.items() if row < len(values)}}
                 for row, q in ((r, chosen[r // s.group_size]) for r in range(len(out.texts)))]  # fmt: skip
        return Generation(micro_batches, metrics, table)

    def trainer_state(self, step: int):
        """What reward functions get as `trainer_state` at the generation for 0-based `step`: TRL's
        `TrainerState` as its `GRPOTrainer` holds it then (`rewards.trainer_state`)."""
        s = self.settings
        return rewards.trainer_state(global_step=step, steps_per_epoch=self.steps_per_epoch, max_steps=s.max_steps, train_batch_size=s.micro_batch_size,
                                     logging_steps=s.log_every, save_steps=s.checkpoint_every, num_input_tokens_seen=self.tokens_seen,
                                     log_history=self.log_history.history)  # fmt: skip

    def _micro_batches(self, out: Rollouts, mask: torch.Tensor, advantages: torch.Tensor) -> list[dict[str, Any]]:
        """The generation cut into micro-batches of whole groups, each with what the loss needs."""
        s = self.settings
        prompts_per_micro = s.micro_batch_size // s.group_size
        num_items = float(mask.sum()) / s.grad_accum_steps  # dapo: the generation's tokens; the loop divides each micro-batch's loss by the steps
        batches = []
        for start in range(0, out.prompt_ids.shape[0], prompts_per_micro):
            rows = slice(start * s.group_size, (start + prompts_per_micro) * s.group_size)
            prompt_mask = out.prompt_mask[start : start + prompts_per_micro]
            keep = int(prompt_mask.sum(0).nonzero().min())  # drop the columns of left padding no prompt here needs
            width = max(int(out.completion_mask[rows].sum(-1).max()), 1)
            batch = {
                "prompt_ids": out.prompt_ids[start : start + prompts_per_micro, keep:], "prompt_mask": prompt_mask[:, keep:],
                "completion_ids": out.completion_ids[rows, :width],
                **({"completion_mask": mask[rows, :width]} if out.loss_mask is None else
                   {"completion_mask": out.completion_mask[rows, :width], "loss_mask": mask[rows, :width]}),
                "advantages": advantages[rows], "num_items": torch.tensor(num_items), "group_size": torch.tensor(s.group_size),
                "num_tokens": torch.tensor(int(prompt_mask.sum()) * s.group_size + int(out.completion_mask[rows].sum())),
            }  # fmt: skip
            with torch.no_grad(), loop.autocast(out.prompt_ids.device, s.precision):
                if s.num_iterations > 1:  # the generating policy's, for the ratio of the later iterations
                    batch["old_logps"] = batch_logps(self.model, batch, s.temperature)
                if self.reference is not None:
                    batch["ref_logps"] = self._reference_logps(batch)
            batches.append(batch)
        return batches

    def _reference_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        with self.reference():
            return batch_logps(self.model, batch, self.settings.temperature)


def start_weights(model: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """A context manager factory under which `model` computes with the weights it has now: GRPO's
    reference, the policy as it starts. Its trainable parameters are copied once (a LoRA policy: the
    adapter's weights, not the base; full training: every weight, as a frozen copy of the model
    would hold), and put in their modules' places for the block, then the trained ones back.

    Not the adapter switched off: PiSSA and OLoRA start the adapter from the principal part of each
    weight and leave only the rest in the base, so the base alone is not the start model (nor is a
    quantized base under QLoRA's init, which this also covers: the start is what the policy computes).
    The copies are other tensors, never requiring grad, so an autocast cache of the trained weights
    stays theirs; keyed by name, so a tied weight is one copy in both places, and a resume that
    loads a checkpoint into the parameters leaves the copies as they started."""
    copies: dict[int, torch.nn.Parameter] = {}
    at_start: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            copy = copies.setdefault(id(param), torch.nn.Parameter(param.detach().clone(), requires_grad=False))
            at_start[name] = copy

    @contextlib.contextmanager
    def swapped():
        trained = []
        try:
            for prefix, module in model.named_modules(remove_duplicate=False):
                for name in list(module._parameters):
                    copy = at_start.get(f"{prefix}.{name}" if prefix else name)
                    if copy is not None:
                        trained.append((module, name, module._parameters[name]))
                        module._parameters[name] = copy
            yield
        finally:
            for module, name, param in reversed(trained):
                module._parameters[name] = param

    return swapped


TRL_LOGGED = {"train/loss": "loss", "train/lr": "learning_rate", "train/grad_norm": "grad_norm"}
"""The loop's names of what TRL's `Trainer.log` calls otherwise (the rest already have TRL's names)."""


class LogHistory(Extension):
    """TRL's `TrainerState.log_history` for GRPO's reward functions: what the loop logs (`on_log`:
    the training metrics every `train.log_every` steps, under TRL's names, with `epoch` and `step`
    as `Trainer.log` adds them). In checkpoints (`state_dict`), so a resumed run's reward functions
    read the whole history, as TRL's read it from `trainer_state.json`."""

    name = "grpo_log_history"

    def __init__(self, steps_per_epoch: int) -> None:
        self.steps_per_epoch = steps_per_epoch
        self.history: list[dict[str, float]] = []

    def on_log(self, state, metrics: dict[str, float], step: int) -> None:
        epoch = step / self.steps_per_epoch if self.steps_per_epoch else 0.0  # as Trainer.log adds it, unrounded
        self.history.append({TRL_LOGGED.get(k, k): v for k, v in metrics.items()} | {"epoch": epoch, "step": step})

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [dict(entry) for entry in state["history"]]


def batch_logps(model, batch: dict[str, Any], temperature: float) -> torch.Tensor:
    """The completions' per-token log-probabilities of a training batch (`completion_logps` of its
    fields) under `model` in eval mode, its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        return completion_logps(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"], int(batch["group_size"]),
                                temperature=temperature, loss_mask=batch.get("loss_mask"))[0]  # fmt: skip
    finally:
        model.train(was_training)


def _rollout_metrics(out: Rollouts, per_func: torch.Tensor, weights: torch.Tensor, zero_std: torch.Tensor, names: list[str], group_size: int) -> dict[str, float]:
    """What TRL's GRPOTrainer logs about a generation, under its names."""
    lengths = out.lengths.float().cpu()
    truncated = out.truncated.cpu()
    terminated = lengths[~truncated]
    summed = (per_func * weights).nansum(dim=1)
    summed[torch.isnan(per_func).all(dim=1)] = float("nan")
    metrics = {
        "reward": torch.nanmean(summed).item(),
        "reward_std": np.nanstd(summed.numpy(), ddof=1).item() if int((~torch.isnan(summed)).sum()) > 1 else 0.0,  # TRL's: over the whole batch
        "frac_reward_zero_std": zero_std.float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
    }
    for j, name in enumerate(names):
        column = per_func[:, j]
        scored = column[~torch.isnan(column)]
        metrics[f"rewards/{name}/mean"] = scored.mean().item() if len(scored) else float("nan")
        metrics[f"rewards/{name}/std"] = scored.std().item() if len(scored) > 1 else 0.0
    return {k: round(v, 6) for k, v in metrics.items()}

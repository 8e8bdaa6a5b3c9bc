"""Reinforcement learning with verifiable rewards: GRPO (and Dr. GRPO, DAPO) from the SFT model.

    python -m pipelines.grpo       # what dvc.yaml runs; writes data/models/grpo/
    qllm run --set grpo.beta=0.04  # reruns grpo, evaluate and register only

The questions are the prepared chat records' training split: each conversation's turns before its
final assistant turn are the prompt, that turn's text the reference `answer` its rewards get. Each
optimizer step samples `grpo.group_size` completions per question with the current policy
(`pipelines.core.rl.rollouts`: a KV cache, the prompt run once per group), scores them with
`grpo.rewards` (built-in `exact_match` and `format`, or a user's `package.module:function` with
TRL's signature; `pipelines.core.rl.rewards`), normalises the weighted sum within each group
and optimises the clipped surrogate of `grpo.loss_type` (`pipelines.core.rl.grpo`), with
`beta` times the KL to the SFT model (its log-probabilities computed once per generation). The
policy trains all its weights or a LoRA (or QLoRA) adapter (`grpo.adapter`), in the shared loop:
checkpoints, exact resume (the sampler's generator and, with `num_iterations` > 1, the generation
in use are in them), stop signals, MLflow.

Logged per step (TRL's names): `reward`, `reward_std`, `rewards/<function>/mean|std`,
`frac_reward_zero_std`, `completions/mean_length|min_length|max_length|clipped_ratio|
mean_terminated_length`, `kl` (beta > 0), `clip_ratio/low_mean|high_mean|region_mean`, `entropy`,
`timing/generation_seconds`, `timing/scoring_seconds`, `timing/optimisation_seconds`; every
`grpo.log_completions_every` steps a table of the completions with their rewards and advantages
(MLflow artifact `completions/step-<N>.json`). With `grpo.enabled: false` it writes only a README.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pandas as pd
import torch

from pipelines.core import paths
from pipelines.core.data.chat_template import (
    TOOLS_KEY,
    answer_group,
    check_tool_support,
    parse_messages,
    split_last_answer,
)
from pipelines.core.errors import QllmError
from pipelines.core.models import adapters, footprint, quantize
from pipelines.core.models.models import (
    load_for_inference,
    load_tokenizer,
    parameter_counts,
    save_pretrained,
    seeded,
)
from pipelines.core.params.rl import GrpoParams
from pipelines.core.rl import episodes, grpo, rewards, rollouts, tools
from pipelines.core.run import stage
from pipelines.core.training import diffusion, loop
from pipelines.core.training.checkpoint import CheckpointManager

NAME = "grpo"
SECTION = "grpo.adapter"
"""Where the adapter's settings are in params (errors name their keys under it)."""
log = logging.getLogger(f"qllm.{NAME}")

DISABLED_README = """\
# GRPO stage disabled

`grpo.enabled` is false, so no model was trained with reinforcement learning. To train one:
`qllm run --set grpo.enabled=true` (docs/grpo.md).
"""


class Questions(list):
    """GRPO's questions, and `tool_calls`: how many records were left out for ending with a tool
    call (no text answer to score)."""

    def __init__(self, items=(), tool_calls: int = 0):
        super().__init__(items)
        self.tool_calls = tool_calls


def questions(chat_dir: Path, split: str = "train", offered: list[dict] | None = None) -> Questions:
    """The chat records of `split` that end with an assistant's text answer, as prompts and
    reference answers (the others have nothing to check a completion against). With `offered`
    (tool schemas: episodes), a record's prompt is its turns up to the model's first reply to the
    last user turn (a demonstration's calls and tool answers are what the episode produces), with
    the schemas on its first message for the template to render."""
    path = chat_dir / f"{split}.parquet"
    found, tool_calls = [], 0
    for record in pd.read_parquet(path).itertuples(index=False):
        messages = parse_messages(record.messages)
        if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
            tool_calls += 1  # an answer that is a tool call has no text to check
        elif messages and messages[-1]["role"] == "assistant" and len(messages) > 1:
            prompt, answer = split_last_answer(messages)
            if offered is not None:
                last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(prompt) - 1)
                prompt = [{**m, TOOLS_KEY: offered} if i == 0 else m for i, m in enumerate(messages[: last_user + 1])]
            columns = {k: v for k, v in record._asdict().items() if k not in ("id", "messages")}  # source, split: reward functions get them
            found.append(rollouts.Question(str(record.id), prompt, answer, columns))
    if tool_calls:
        log.warning("%s: %d of the chat records end with a tool call, not a text answer: not GRPO questions (no reference to score)", path, tool_calls)
    if not found:
        raise QllmError(f"{path}: no chat record ends with an assistant's text answer, so GRPO has no questions with a reference answer"
                        + (f" ({tool_calls} end with a tool call)" if tool_calls else ""))  # fmt: skip
    groups = rewards.candidate_answers([(q.id, q.answer) for q in found])  # what `strict_match` counts as another answer
    return Questions([dataclasses.replace(q, candidates=groups[answer_group(q.id)]) for q in found], tool_calls)


def grpo_loss(params: GrpoParams):
    """`loss_fn(model, batch)` for the loop over `RolloutBatches`' micro-batches."""

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        mask = batch.get("loss_mask", batch["completion_mask"])  # a multi-turn episode's tool and template tokens are read, never scored
        logps, entropy = rollouts.completion_logps(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
                                                   int(batch["group_size"]), entropy=True, temperature=params.temperature,
                                                   loss_mask=batch.get("loss_mask"))  # fmt: skip
        loss, metrics = grpo.policy_loss(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"], mask, loss_type=params.loss_type,
                                         beta=params.beta, epsilon_low=params.epsilon, epsilon_high=params.epsilon_high,
                                         max_completion_length=params.max_completion_length, num_items=float(batch["num_items"]))  # fmt: skip
        metrics["entropy"] = (entropy.sum() / mask.sum().clamp(min=1)).item()
        return loss, metrics

    return loss_fn


def completions_logger(tracker, every: int):
    """`on_generation` for `RolloutBatches`: the generation's completions as an MLflow table every
    `every` steps (one file per step, so a resumed run rewrites rather than repeats one)."""

    def log(step: int, generation: rollouts.Generation) -> None:
        if tracker is not None and every and (step == 1 or step % every == 0):
            tracker.log_table(pd.DataFrame(generation.table), f"completions/step-{step:06d}.json")

    return log


def run(root: Path, start_dir: Path, chat_dir: Path, out: Path, params: GrpoParams, tracker=None, checkpoint_dir: Path | None = None) -> dict:
    """Train the policy from the model in `start_dir` (the SFT model: also `beta`'s reference) on the
    questions of `chat_dir`; write it to `out`. The summary metrics."""
    cfg = params.train
    start = paths.named(start_dir, root)  # as users name it (an adapter's base)
    make_environment, offered = tools.environments(params.tools, "grpo.tools")
    train = questions(chat_dir, offered=[t.schema for t in offered] if offered else None)
    # an episode: each turn's tokens and, between turns, the tools' answers as the template renders them, cut to as many (episodes.fit_answers)
    episode_tokens = episodes.added_tokens(params.max_completion_length, params.tools.max_turns if offered else 1)
    reward_fns = [(spec.name, rewards.load(spec.function, f"grpo.rewards[{i}]"), spec.weight) for i, spec in enumerate(params.rewards)]
    adapter = params.adapter
    qconfig = quantize.from_params(adapter.base_quantization, cfg.precision, SECTION) if adapter.enabled else None
    method = footprint.method_for(adapter.enabled, adapter.quantization)
    longest = episodes.longest_prompt(load_tokenizer(start_dir), [q.prompt for q in train])  # before the model loads: the memory estimate needs it
    estimates = footprint.preflight(start_dir, cfg, method=method, seq_len=longest + episode_tokens, micro_batch=cfg.micro_batch_size,
                                    lora_rank=max([adapter.r, *adapter.rank_pattern.values()]) if adapter.enabled else 0, desc=NAME)  # fmt: skip
    model, tokenizer = load_for_inference(start_dir, root) if qconfig is None else quantize.load(start_dir, qconfig, SECTION)
    if diffusion.objective_of(model) == "masked_diffusion":
        raise QllmError(f"{start}: a masked-diffusion model has no left-to-right sampling or token log-probabilities for GRPO; set grpo.enabled: false")
    with seeded(cfg.seed):
        model = quantize.for_adapters(model, qconfig, cfg.gradient_checkpointing)
        if adapter.enabled:
            model = adapters.wrap(adapter, SECTION)(model, tokenizer)
    # beta's reference: the policy as it starts (its trainable weights copied: a LoRA's adapter, or every weight)
    reference = rollouts.start_weights(model) if params.beta else None
    counts = parameter_counts(model)
    if qconfig is not None:
        counts |= quantize.linear_weight_bytes(model)
    if tracker is not None:
        tracker.log_params({f"grpo.{k}": v for k, v in counts.items()} | {"grpo.start_model": start, "grpo.questions": len(train)})
    settings = rollouts.Settings(group_size=params.group_size, max_completion_length=params.max_completion_length, temperature=params.temperature,
                                 top_p=params.top_p, scale_rewards=params.scale_rewards, num_iterations=params.num_iterations,
                                 mask_truncated_completions=params.mask_truncated_completions, micro_batch_size=cfg.micro_batch_size,
                                 grad_accum_steps=cfg.grad_accum_steps, seed=cfg.seed, precision=cfg.precision, max_steps=cfg.max_steps,
                                 log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every)  # fmt: skip
    sampler = rollouts.one_turn
    if offered:  # episodes: the template must render the tools, and says how calls are written
        check_tool_support(tokenizer, train[0].prompt)
        episodes.check_context(model, longest, params.max_completion_length, params.tools.max_turns, model_name=start,
                               keys=("grpo.max_completion_length", "grpo.tools.max_turns"))  # fmt: skip
        style = episodes.tool_style(tokenizer, params.tools.style)
        sampler = episodes.sampler(make_environment, max_turns=params.tools.max_turns, style=style)
    batches = rollouts.RolloutBatches(model, tokenizer, train, settings, reward_fns, reference=reference,
                                      on_generation=completions_logger(tracker, params.log_completions_every), sampler=sampler)  # fmt: skip
    checkpoints = CheckpointManager(checkpoint_dir, cfg.keep_checkpoints) if checkpoint_dir else None
    result = loop.train(model, grpo_loss(params), batches, cfg, tracker=tracker, checkpoints=checkpoints, extensions=[batches.log_history], desc=NAME)
    last = batches.metrics(result["steps"])

    def save(tmp: Path) -> None:
        if adapter.enabled:
            quantized_base = (str(start_dir), qconfig) if qconfig is not None else None
            adapters.save(start, adapter.merge, quantized_base)(model if qconfig is not None else model.cpu(), tokenizer, tmp)
        else:
            save_pretrained(model.cpu(), tokenizer, tmp, max_length=model.config.max_position_embeddings)

    result = loop.finish(result, out, save)
    final = {k: v for k, v in last.items() if k in ("reward", "frac_reward_zero_std", "completions/mean_length") or k.startswith("rewards/")}
    return {**result, **counts, **final, "questions": len(train), "questions_skipped_tool_call": train.tool_calls, "start": start, **estimates}


def body(ctx: stage.StageContext) -> dict:
    p = ctx.params
    if not p.enabled:
        return stage.switched_off(ctx, DISABLED_README)
    metrics = run(ctx.root, ctx.input("models/sft"), ctx.input("chat"), ctx.output(), p, ctx.tracker, ctx.checkpoint_dir)
    rewards_text = ", ".join(f"{k.removeprefix('rewards/').removesuffix('/mean')} {v:.3f}" for k, v in metrics.items() if k.startswith("rewards/") and k.endswith("/mean"))
    ctx.log.info("grpo %s (beta %g, groups of %d): %d steps on %d questions; last generation's rewards: %s", p.loss_type, p.beta, p.group_size,
                 metrics["steps"], metrics["questions"], rewards_text)  # fmt: skip
    return {"enabled": True, **metrics}


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())

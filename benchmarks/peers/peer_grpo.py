"""GRPO step time and reward curve: the `grpo` stage's step vs TRL's `GRPOTrainer`.

    python -m benchmarks.peers.peer_grpo [--steps 30] [--trials 3] [--precision auto|fp32|bf16] [--project .] [--set grpo.KEY=VALUE]

Reads a finished `qllm run --until sft` of the project (nothing is written there): the SFT model,
its tokenizer and chat template, and the chat questions GRPO trains on (`pipelines.grpo.questions`:
each record's turns before its final answer, the answer as the `answer` column). Both sides start
from a fresh copy of the SFT model and train params.yaml's `grpo` policy with the same reward
(the built-in `exact_match`, passed to TRL as a reward function with TRL's signature), group size
(TRL's `num_generations`), completions a step (`per_device_train_batch_size`), completion length,
temperature, top_p, beta, loss type, epsilon, learning rate, betas, clipping, cosine schedule,
optimizer and precision (`auto`: what this machine trains in); no evaluation or saving. TRL
generates with `model.generate`, told to stop at the chat template's end of turn as ours is
(`generation_kwargs`), so both sample completions of the same lengths.

Step time, in one process, trials alternating (ours, TRL, ours, ...) so that machine noise hits
both alike; the first steps of every trial are warm-up and not timed. Generation is timed apart:
ours is its `timing/generation_seconds` (sampling; scoring is separate and tiny), TRL's the time
inside `generate` (wrapped). Prints ms/step per trial (total and generation), the medians, the
ratios ours/TRL (below 1: ours is faster), and each side's mean reward per step over the trials
(the reward curves: the same learning problem, different random samples).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import REPO
from benchmarks.peers.peer_dpo import WARMUP, fresh_policy, trainer_args
from pipelines import grpo
from pipelines.core.errors import QllmError
from pipelines.core.extensions import Hook
from pipelines.core.models import adapters
from pipelines.core.models.models import load_for_inference, stop_token_ids
from pipelines.core.params import files as params_file
from pipelines.core.rl import rewards, rollouts
from pipelines.core.training import loop, precision


def settings(p, cfg) -> rollouts.Settings:
    return rollouts.Settings(group_size=p.group_size, max_completion_length=p.max_completion_length, temperature=p.temperature, top_p=p.top_p,
                             scale_rewards=p.scale_rewards, num_iterations=p.num_iterations, mask_truncated_completions=p.mask_truncated_completions,
                             micro_batch_size=cfg.micro_batch_size, grad_accum_steps=cfg.grad_accum_steps, seed=cfg.seed, precision=cfg.precision)  # fmt: skip


def time_ours(base, tokenizer, questions, p, cfg) -> tuple[float, float, list[float]]:
    """(seconds a step, generation seconds a step, mean reward per step) of the stage's loop."""
    policy = fresh_policy(base, tokenizer, p, "grpo", cfg.seed)
    marks: list[float] = []
    generation: list[float] = []
    reward: list[float] = []

    def seen(step: int, g: rollouts.Generation) -> None:
        generation.append(g.metrics["timing/generation_seconds"])
        reward.append(g.metrics["reward"])

    batches = rollouts.RolloutBatches(policy, tokenizer, questions, settings(p, cfg), [("exact_match", rewards.exact_match, 1.0)], on_generation=seen)
    loop.train(policy, grpo.grpo_loss(p), batches, cfg, extensions=[Hook("on_step_end", lambda state, metrics: marks.append(time.perf_counter()))])
    timed = cfg.max_steps - WARMUP
    return (marks[-1] - marks[WARMUP - 1]) / timed, sum(generation[WARMUP:]) / timed, reward


def trl_reward(prompts, completions, answer, **kwargs):
    """The built-in exact match, as TRL calls a reward function."""
    return rewards.exact_match(prompts, completions, answer)


def time_trl(base, tokenizer, questions, p, cfg) -> tuple[float, float, list[float]]:
    """(seconds a step, seconds in `generate` a step, mean reward per step) of TRL's `GRPOTrainer.train`."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    marks: list[float] = []
    in_generate: list[float] = []

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    policy = copy.deepcopy(base)
    peft_config = None
    if p.adapter.enabled:
        peft_config = adapters.lora_config(p.adapter, adapters.token_ids(tokenizer, p.adapter.trainable_tokens, "grpo.adapter"),
                                           adapters.layer_indices(policy, p.adapter, "grpo.adapter"))  # fmt: skip
    data = Dataset.from_dict({"prompt": [q.prompt for q in questions], "answer": [q.answer for q in questions]})
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(**trainer_args(cfg, out) | {"logging_steps": 1}, num_generations=p.group_size, max_completion_length=p.max_completion_length,
                          temperature=p.temperature, top_p=p.top_p, beta=p.beta, loss_type=p.loss_type, epsilon=p.epsilon,
                          epsilon_high=p.epsilon_high or p.epsilon, num_iterations=p.num_iterations, scale_rewards=p.scale_rewards,
                          mask_truncated_completions=p.mask_truncated_completions, generation_kwargs={"eos_token_id": stop_token_ids(tokenizer)})  # fmt: skip
        trainer = GRPOTrainer(policy, reward_funcs=[trl_reward], args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config,
                              callbacks=[Mark()])  # fmt: skip
        trainer.remove_callback(PrinterCallback)  # its per-step log lines (kept in state.log_history)
        model = trainer.model
        generate = model.generate

        def timed_generate(*a, **k):
            started = time.perf_counter()
            try:
                return generate(*a, **k)
            finally:
                in_generate.append(time.perf_counter() - started)

        model.generate = timed_generate
        trainer.train()
        reward = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    timed = cfg.max_steps - WARMUP
    return (marks[-1] - marks[WARMUP - 1]) / timed, sum(in_generate[WARMUP:]) / timed, reward


def _curve(runs: list[list[float]]) -> str:
    steps = min(len(r) for r in runs)
    means = [statistics.mean(r[i] for r in runs) for i in range(steps)]
    return " ".join(f"{m:.2f}" for m in means)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--project", type=Path, default=REPO, help="a project with a finished `qllm run --until sft`")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="grpo.KEY=VALUE")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")

    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")  # transformers 5's renames TRL 1.16 still uses
    os.environ.setdefault("TQDM_DISABLE", "1")
    root = args.project.resolve()
    sft_dir, chat_dir = root / "data/models/sft", root / "data/prepared/chat"
    if not (sft_dir / "config.json").exists():
        raise QllmError(f"{sft_dir}: no SFT model; run `qllm run --until sft` in {root} first")
    base, tokenizer = load_for_inference(sft_dir, root)
    questions = grpo.questions(chat_dir)
    params, _ = params_file.load(root, overrides=args.overrides)
    resolved = precision.resolve(args.precision)
    cfg = params.grpo.train.model_copy(update={"max_steps": args.steps, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
                                               "log_every": 1, "precision": resolved, "extensions": []})  # fmt: skip
    p = params.grpo.model_copy(update={"train": cfg})
    print(f"grpo step: {sum(x.numel() for x in base.parameters()) / 1e6:.2f}M-parameter model, policy {'LoRA' if p.adapter.enabled else 'all weights'}, {len(questions)} questions, "
          f"{cfg.micro_batch_size} completions a step in groups of {p.group_size}, max_completion_length {p.max_completion_length}, loss {p.loss_type}, "
          f"beta {p.beta}, {resolved}, {torch.get_num_threads()} threads, {args.steps - WARMUP} timed steps x {args.trials} trials", flush=True)  # fmt: skip
    ours, trl, ours_gen, trl_gen, ours_reward, trl_reward_runs = [], [], [], [], [], []
    for trial in range(args.trials):
        step, gen, reward = time_ours(base, tokenizer, questions, p, cfg)
        ours.append(step), ours_gen.append(gen), ours_reward.append(reward)
        step, gen, reward = time_trl(base, tokenizer, questions, p, cfg)
        trl.append(step), trl_gen.append(gen), trl_reward_runs.append(reward)
        print(f"  trial {trial + 1}: ours {1000 * ours[-1]:.1f} ms/step ({1000 * ours_gen[-1]:.1f} generating), "
              f"TRL {1000 * trl[-1]:.1f} ms/step ({1000 * trl_gen[-1]:.1f} in generate)", flush=True)  # fmt: skip
    ratios = sorted(a / b for a, b in zip(ours, trl, strict=True))
    gen_ratios = sorted(a / b for a, b in zip(ours_gen, trl_gen, strict=True))
    rest = sorted((a - ag) / (b - bg) for a, ag, b, bg in zip(ours, ours_gen, trl, trl_gen, strict=True))
    print(f"grpo: median ours {1000 * statistics.median(ours):.1f}, TRL {1000 * statistics.median(trl):.1f} ms/step; ours/TRL per trial median "
          f"{statistics.median(ratios):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}; generation {statistics.median(gen_ratios):.3f} "
          f"({gen_ratios[0]:.3f}-{gen_ratios[-1]:.3f}); the rest of the step {statistics.median(rest):.3f} ({rest[0]:.3f}-{rest[-1]:.3f})")  # fmt: skip
    print(f"reward per step, mean of {args.trials} trials: ours {_curve(ours_reward)}")
    print(f"                                    TRL {_curve(trl_reward_runs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

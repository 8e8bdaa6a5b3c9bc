"""Sequence-length curriculum vs plain pretraining: tokens and time to the baseline's final loss.

    python -m benchmarks.quality.curriculum --project <run> [--seeds 0,1,2] [--start-length 64] [--warmup-steps 200] [--schedule linear] [--lr 0.003]

Reads a finished `qllm run --until tokenize` of the project (`data/tokenized`, `data/tokenizer`;
nothing is written there) and pretrains params.yaml's `pretrain` model in this process, per seed,
once plainly and once with `train.curriculum: {strategy: length, start_length, steps:
warmup-steps, schedule}` (end: the full sequence length), alternating, validating every 50 steps
on the same full-length validation batches. Prints per run the final validation loss, tokens and
wall seconds, and the tokens and seconds at which the curriculum run first reached the plain
run's final validation loss (none: it did not).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pipelines import pretrain
from pipelines.core.data import packed
from pipelines.core.extensions import Hook
from pipelines.core.models.models import build_llama, load_tokenizer
from pipelines.core.outputs import read_json
from pipelines.core.params import files as params_file
from pipelines.core.params.training import CurriculumParams
from pipelines.core.training import curriculum, loop


def one_run(root: Path, params, seed: int, curriculum_params: CurriculumParams, lr: float) -> dict:
    tokenizer = load_tokenizer(root / "data/tokenizer")
    meta = read_json(root / "data/tokenized/meta.json")
    train_rows, val_rows = packed.load(root / "data/tokenized", "train"), packed.load(root / "data/tokenized", "validation")
    cfg = params.pretrain.train.model_copy(update={"seed": seed, "lr": lr, "eval_every": 50, "checkpoint_every": 0, "extensions": [],
                                                   "precision": params.pretrain.train.precision, "curriculum": curriculum_params})  # fmt: skip
    from pipelines.core.training import precision

    cfg = cfg.model_copy(update={"precision": precision.resolve(cfg.precision)})
    torch.manual_seed(seed)
    model = build_llama(params.pretrain.model, tokenizer, max_positions=meta["seq_len"], seed=seed)
    batches = curriculum.wrap(loop.Batches(len(train_rows), cfg.micro_batch_size, cfg.seed, packed.collate(train_rows)), cfg, meta["seq_len"])
    started, points = time.perf_counter(), []
    plain_tokens = cfg.micro_batch_size * cfg.grad_accum_steps * meta["seq_len"]

    def record(state, metrics):
        tokens = batches.tokens_seen(state.step) if hasattr(batches, "tokens_seen") else state.step * plain_tokens
        points.append((state.step, metrics["val/loss"], tokens, time.perf_counter() - started))

    val_fn = pretrain.validation_fn(val_rows, cfg.micro_batch_size, cfg.eval_batches, cfg.precision)
    loop.train(model, loop.causal_lm_loss, batches, cfg, val_fn=val_fn, extensions=[Hook("on_evaluate", record)], desc="pretrain")
    return {"points": points, "final": points[-1][1], "tokens": points[-1][2], "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--start-length", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--schedule", default="linear", choices=["linear", "root"])
    parser.add_argument("--lr", type=float, default=None, help="default: params.yaml's pretrain.train.lr")
    args = parser.parse_args(argv)
    root = args.project.resolve()
    params, _ = params_file.load(root)
    lr = args.lr or params.pretrain.train.lr
    plan = CurriculumParams(strategy="length", start_length=args.start_length, steps=args.warmup_steps, schedule=args.schedule)
    print(f"pretrain {params.pretrain.train.max_steps} steps, lr {lr:g}; curriculum {plan.start_length} -> full over {plan.steps} steps ({plan.schedule}); "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        plain = one_run(root, params, seed, CurriculumParams(), lr)
        warm = one_run(root, params, seed, plan, lr)
        reached = next(((tokens, seconds) for _, loss, tokens, seconds in warm["points"] if loss <= plain["final"]), None)
        rows.append((seed, plain, warm, reached))
        where = f"reached plain's final loss at {reached[0]:,} tokens ({reached[0] / plain['tokens']:.2f}x), {reached[1]:.0f} s ({reached[1] / plain['seconds']:.2f}x)" if reached else "never reached plain's final loss"  # noqa: E501
        print(f"seed {seed}: plain val/loss {plain['final']:.4f} ({plain['tokens']:,} tokens, {plain['seconds']:.0f} s); "
              f"curriculum {warm['final']:.4f} ({warm['tokens']:,} tokens, {warm['seconds']:.0f} s); {where}")  # fmt: skip
    diffs = [w["final"] - p["final"] for _, p, w, _ in rows]
    print(f"final val/loss, curriculum - plain: mean {statistics.mean(diffs):+.4f}, per seed {', '.join(f'{d:+.4f}' for d in diffs)}; "
          f"wall time ratio {statistics.mean(w['seconds'] / p['seconds'] for _, p, w, _ in rows):.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Training strategies vs plain pretraining at equal training compute: progressive stack-wise growth
(duplicate / identity, frozen / trainable trunk) and the memory extension.

    python -m benchmarks.quality.strategies --project <run> [--seeds 0,1,2] [--variants plain,grow-dup,...] [--stack-fraction 0.25]

Reads a finished `qllm run --until tokenize` of the project (`data/tokenized`, `data/tokenizer`;
nothing is written there) and pretrains params.yaml's `pretrain` model in this process. Every
variant gets the plain run's training FLOPs: its `max_steps` is the largest whose FLOPs (counted
below) do not exceed the plain run's, with the same batch, lr and cosine schedule shape; growth
variants spend `--stack-fraction` of their steps on each stack (stacks of `num_layers / 2`
layers), then end-to-end (rackwise). Validation every 50 steps on the same batches.

FLOPs per token, matmuls only (`flops_per_token`): forward 2 x (layer matrices) + 4 x seq x hidden
per layer for attention + 2 x vocab x hidden for the head (+ the memory's matrices, key scoring
and reads); backward: activation gradients (2x matrices + attention) for every layer from the
lowest trainable one up, plus 2x matrices for the weight gradients of trainable layers, plus the
head's. The frozen trunk's forward is counted even when the activation cache skips it (the
cache's saving shows in the wall time, not in the budget).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import mean_sd
from pipelines import pretrain
from pipelines.core.data import packed
from pipelines.core.extensions import Hook
from pipelines.core.models.models import build_llama, load_tokenizer
from pipelines.core.outputs import read_json
from pipelines.core.params import files as params_file
from pipelines.core.params.pretraining import ActivationCacheParams, MemoryParams, ProgressiveParams
from pipelines.core.training import loop, precision, progressive

VARIANTS = {
    "plain": {},
    "grow-dup": {"growth": "duplicate", "trunk": "frozen"},
    "grow-id": {"growth": "identity", "trunk": "frozen"},
    "grow-dup-trainable": {"growth": "duplicate", "trunk": "trainable"},
    "memory": {"memory": True},
}


def layer_matrix_params(model_params) -> int:
    d, i, heads, kv = model_params.hidden_size, model_params.intermediate_size, model_params.num_heads, model_params.num_kv_heads
    head_dim = d // heads
    return d * d * 2 + 2 * d * kv * head_dim + 3 * d * i  # q, o; k, v; gate, up, down


def memory_flops(model_params) -> int:
    """Forward FLOPs per token of one memory layer: query, gate and output matrices, key scores, reads."""
    m, d = model_params.memory, model_params.hidden_size
    return 2 * (d * m.heads * m.key_dim + 2 * d * d + m.heads * m.num_keys * m.key_dim + m.heads * m.topk * d)


def flops_per_token(model_params, vocab: int, seq: int, layers: int, trainable: tuple[int, int] | None, tied: bool) -> float:
    """Training FLOPs per token of a model with `layers` layers, training `trainable` ([lo, hi) + head; None: all)."""
    d, p = model_params.hidden_size, layer_matrix_params(model_params)
    attention = 4 * seq * d
    memories = len(model_params.memory.layers) * memory_flops(model_params) if model_params.memory.enabled else 0
    forward = layers * (2 * p + attention) + 2 * vocab * d + memories
    lo, hi = trainable or (0, layers)
    activation_grads = (layers - lo) * (2 * p + attention) + 2 * vocab * d + (memories if trainable is None else 0)
    weight_grads = (hi - lo) * 2 * p + (memories if trainable is None else 0)
    head_weights = 2 * vocab * d if (trainable is None or not tied) else 0  # a tied head is the (frozen) embedding
    return forward + activation_grads + weight_grads + head_weights


def run_flops(model_params, vocab: int, seq: int, tokens_per_step: int, max_steps: int, grow: ProgressiveParams | None) -> float:
    tied = model_params.tie_word_embeddings
    if grow is None:
        return max_steps * tokens_per_step * flops_per_token(model_params, vocab, seq, model_params.num_layers, None, tied)
    phases = progressive.phases(grow, max_steps)
    total = 0.0
    for phase, after in zip(phases, [*phases[1:], None], strict=True):
        steps = (after.start if after else max_steps) - phase.start
        total += steps * tokens_per_step * flops_per_token(model_params, vocab, seq, phase.layers, phase.trainable, tied)
    return total


def growth_plan(variant: dict, num_layers: int, max_steps: int, fraction: float) -> ProgressiveParams:
    half = num_layers // 2
    return ProgressiveParams(enabled=True, stacks=[half, num_layers - half], steps_per_stack=max(1, round(fraction * max_steps)),
                             growth=variant["growth"], trunk=variant["trunk"],
                             activation_cache=ActivationCacheParams(enabled=variant["trunk"] == "frozen", memory_mb=1024))  # fmt: skip


def one_run(root: Path, params, name: str, seed: int, fraction: float, memory: MemoryParams) -> dict:
    variant = VARIANTS[name]
    tokenizer = load_tokenizer(root / "data/tokenizer")
    meta = read_json(root / "data/tokenized/meta.json")
    seq = meta["seq_len"]
    train_rows, val_rows = packed.load(root / "data/tokenized", "train"), packed.load(root / "data/tokenized", "validation")
    base = params.pretrain.train
    model_params = params.pretrain.model.model_copy(update={"memory": memory if variant.get("memory") else MemoryParams()})
    tokens_per_step = base.micro_batch_size * base.grad_accum_steps * seq
    budget = run_flops(params.pretrain.model, len(tokenizer), seq, tokens_per_step, base.max_steps, None)
    steps = base.max_steps
    if name != "plain":  # the most steps within the plain run's FLOPs
        def cost(m):
            plan = growth_plan(variant, model_params.num_layers, m, fraction) if "growth" in variant else None
            return run_flops(model_params, len(tokenizer), seq, tokens_per_step, m, plan)

        steps = max(m for m in range(base.max_steps // 4, base.max_steps * 4) if cost(m) <= budget)
    grow = growth_plan(variant, model_params.num_layers, steps, fraction) if "growth" in variant else None
    flops = run_flops(model_params, len(tokenizer), seq, tokens_per_step, steps, grow)
    cfg = base.model_copy(update={"seed": seed, "max_steps": steps, "eval_every": 50, "checkpoint_every": 0, "extensions": [],
                                  "precision": precision.resolve(base.precision)})  # fmt: skip
    model = build_llama(model_params, tokenizer, max_positions=seq, seed=seed)
    growth = progressive.Growth(grow, cfg, model, "pretrain") if grow is not None else None
    batches = loop.Batches(len(train_rows), cfg.micro_batch_size, cfg.seed, packed.collate(train_rows))
    points, started = [], time.perf_counter()
    record = Hook("on_evaluate", lambda state, metrics: points.append((state.step, metrics["val/loss"])))
    val_fn = pretrain.validation_fn(val_rows, cfg.micro_batch_size, cfg.eval_batches, cfg.precision)
    loop.train(model, loop.causal_lm_loss, batches, cfg, val_fn=val_fn, extensions=[record], schedule=growth, desc="pretrain")
    seconds = time.perf_counter() - started
    hit_rate = growth.cache.metrics()["train/activation_cache_hit_rate"] if growth is not None and growth.cache is not None else None
    return {"final": points[-1][1], "best": min(v for _, v in points), "steps": steps, "flops": flops, "budget": budget,
            "seconds": seconds, "hit_rate": hit_rate, "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--stack-fraction", type=float, default=0.25, help="share of the steps each stack trains before the next is added")
    parser.add_argument("--memory-layers", default="2", help="decoder layers with a memory (comma-separated)")
    parser.add_argument("--memory-keys", type=int, default=64)
    args = parser.parse_args(argv)
    root = args.project.resolve()
    params, _ = params_file.load(root)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    memory = MemoryParams(enabled=True, layers=[int(i) for i in args.memory_layers.split(",")], num_keys=args.memory_keys)
    m = params.pretrain.model
    print(f"{root.name}: pretrain {m.num_layers} layers x {m.hidden_size}, {params.pretrain.train.max_steps} plain steps, "
          f"precision {precision.resolve(params.pretrain.train.precision)}, {torch.get_num_threads()} threads; "
          f"stack fraction {args.stack_fraction}; memory {memory.num_keys}^2 rows in layers {memory.layers}")  # fmt: skip
    results: dict[str, list[dict]] = {n: [] for n in names}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in names:  # alternating, so machine noise spreads over the variants
            r = one_run(root, params, name, seed, args.stack_fraction, memory)
            results[name].append(r)
            cache = f", cache hit rate {r['hit_rate']:.2f}" if r["hit_rate"] is not None else ""
            print(f"seed {seed} {name}: {r['steps']} steps, {r['flops'] / r['budget']:.3f} of the budget, final val/loss {r['final']:.4f} "
                  f"(best {r['best']:.4f}), {r['seconds']:.0f} s, {r['parameters']:,} parameters{cache}", flush=True)  # fmt: skip
    plain = results.get("plain")
    print("\nvariant | steps | final val/loss mean +- std | minus plain (per seed) | wall time vs plain")
    for name, runs in results.items():
        finals = [r["final"] for r in runs]
        versus = wall = ""
        if plain and name != "plain":
            diffs = [r["final"] - p["final"] for r, p in zip(runs, plain, strict=True)]
            versus = f"{statistics.mean(diffs):+.4f} ({', '.join(f'{d:+.4f}' for d in diffs)})"
            wall = f"{statistics.mean(r['seconds'] / p['seconds'] for r, p in zip(runs, plain, strict=True)):.2f}x"
        print(f"{name} | {runs[0]['steps']} | {mean_sd(finals)} | {versus} | {wall}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""DPO step time with cached reference log-probs vs running the reference model every step.

    python -m benchmarks.speed.dpo_reference [--steps 30] [--trials 3] [--hidden-size H --layers L]

Same process, same model (params.yaml `pretrain.model`, vocabulary 2048), same pairs (batches of
16 prompt+answer pairs of ~48 tokens, the size of the sample data's), same loop
(`pipelines.core.training.loop.train` with `pipelines.dpo.dpo_loss`), for three policies: params.yaml's
`dpo` settings (`default`: a LoRA adapter on the last layer), all weights, and LoRA on every layer. "cached" reads the reference
log-probs from the batch, as the `dpo` stage does with `data/ref_logprobs/`; "live" computes them
every step with a frozen copy of the starting model (full fine-tuning) or with the adapter
disabled (LoRA). Trials alternate; the first steps of each are warm-up. Prints the median step
time of each and the ratio cached/live (expected <= 0.75). `--hidden-size`/`--layers` scale the
model up (intermediate size 4x hidden, heads of 64) to see the ratio where compute, not per-step
overhead, dominates.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import torch

from benchmarks.common import REPO
from benchmarks.speed.train_throughput import _Vocab
from pipelines import dpo
from pipelines.core.extensions import Hook
from pipelines.core.models import adapters
from pipelines.core.models.models import build_llama
from pipelines.core.params import files as params_file
from pipelines.core.preference import preference_data
from pipelines.core.training import loop

WARMUP = 3
# policy -> changes to params.yaml's `dpo` section ("default": none, i.e. what `make run` trains)
POLICIES = {
    "default": {},
    "all-weights": {"adapter": {"enabled": False}},
    "lora-every-layer": {"adapter": {"enabled": True, "layers_to_transform": []}},
}


def synthetic_pairs(n: int, vocab: int, prompt_len: int = 40, answer_len: int = 8) -> list[preference_data.Pair]:
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(n):
        prompt = rng.integers(4, vocab, prompt_len)
        chosen = np.concatenate([prompt, rng.integers(4, vocab, answer_len)])
        rejected = np.concatenate([prompt, rng.integers(4, vocab, answer_len)])
        pairs.append(preference_data.Pair(f"p{i}", prompt_len, chosen, rejected, -20.0, -22.0))
    return pairs


def step_seconds(model, loss_fn, pairs, cfg) -> float:
    marks: list[float] = []
    batches = loop.Batches(len(pairs), cfg.micro_batch_size, 0, preference_data.collate(pairs, pad_id=1))
    loop.train(model, loss_fn, batches, cfg, extensions=[Hook("on_step_end", lambda state, metrics: marks.append(time.perf_counter()))])
    durations = np.diff(marks[WARMUP - 1 :])
    return float(np.median(durations))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, help="default: params.yaml pretrain.model")
    parser.add_argument("--layers", type=int, help="default: params.yaml pretrain.model")
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    args = parser.parse_args(argv)

    params, _ = params_file.load(REPO)
    vocab = 2048
    cfg = params.dpo.train.model_copy(update={"max_steps": args.steps, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0, "log_every": 10})
    pairs = synthetic_pairs(256, vocab)
    model = params.pretrain.model
    if args.hidden_size:
        heads = max(1, args.hidden_size // 64)
        model = model.model_copy(update={"hidden_size": args.hidden_size, "intermediate_size": 4 * args.hidden_size, "num_heads": heads, "num_kv_heads": heads})
    if args.layers:
        model = model.model_copy(update={"num_layers": args.layers})
    base = build_llama(model, _Vocab(vocab), max_positions=256, seed=0)
    print(f"policy {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M parameters, {cfg.micro_batch_size} pairs/step, "
          f"{args.steps - WARMUP} timed steps x {args.trials} trials, precision {cfg.precision}")
    for name in args.policies:
        dpo_params = params.dpo.model_copy(update={"train": cfg})
        changes = POLICIES[name]
        if "adapter" in changes:
            adapter = {key: value for key, value in changes["adapter"].items() if changes["adapter"]["enabled"] or key == "enabled"}
            changes = {**changes, "adapter": (dpo_params.adapter if adapter["enabled"] else type(dpo_params.adapter)()).model_copy(update=adapter)}
        dpo_params = dpo_params.model_copy(update=changes)
        cached, live = [], []
        for _ in range(args.trials):
            for mode in ("cached", "live"):
                policy = copy.deepcopy(base)
                if dpo_params.adapter.enabled:
                    policy = adapters.wrap(dpo_params.adapter, "dpo.adapter")(policy, None)

                    def reference(batch, policy=policy):
                        with policy.disable_adapter(), loop.autocast(torch.device("cpu"), cfg.precision):
                            return preference_data.sequence_logps(policy, batch)
                else:
                    frozen = copy.deepcopy(base).eval().requires_grad_(False)

                    def reference(batch, frozen=frozen):
                        with loop.autocast(torch.device("cpu"), cfg.precision):
                            return preference_data.sequence_logps(frozen, batch)

                loss_fn = dpo.dpo_loss(dpo_params, None if mode == "cached" else reference)
                (cached if mode == "cached" else live).append(step_seconds(policy, loss_fn, pairs, cfg))
        ratio = statistics.median(cached) / statistics.median(live)
        layers = dpo_params.adapter.layers_to_transform or "all"
        print(f"{name} (adapter={'lora' if dpo_params.adapter.enabled else 'none'}{f', layers {layers}' if dpo_params.adapter.enabled else ''}): "
              f"cached {1000 * statistics.median(cached):.1f} ms/step, live reference "
              f"{1000 * statistics.median(live):.1f} ms/step, ratio {ratio:.3f} (expected <= 0.75)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

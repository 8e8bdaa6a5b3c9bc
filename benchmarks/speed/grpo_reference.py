"""What GRPO's KL reference costs under a LoRA policy (issue 78): the reference log-probabilities of
one micro-batch computed by the start weights swapped in (`rollouts.start_weights`, right for every
adapter init) against the adapter switched off (`disable_adapter`, the start model only when the
adapter starts at zero), at SmolLM2-135M's shape.

    python -m benchmarks.speed.grpo_reference [--completions 8] [--prompt 64] [--completion 16] [--rank 16] [--repeats 5]

The model is a randomly initialised Llama at SmolLM2-135M's shape, fp32, with a default-init LoRA
adapter of rank `--rank` on every projection (the stage's `grpo.lora` defaults otherwise). Prints
the bytes the start weights' copy holds beside the model's, each repeat's time of both ways (one
`rollouts.batch_logps` of `--completions` completions of `--completion` tokens after a `--prompt`-token prompt),
their medians and least, in wall and in CPU time, and the ratios, in the same command (on a shared
machine read the CPU time's least: other work slows the wall time of a repeat, not its own work).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import machine_line
from benchmarks.speed.episode_cache import SMOLLM2
from pipelines.core.rl import rollouts


def main(argv: list[str] | None = None) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipelines.core.models import fused_adapters
    from pipelines.core.params.finetuning import ALL_PROJECTIONS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**SMOLLM2, max_position_embeddings=2048)),
                           LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=list(ALL_PROJECTIONS), task_type="CAUSAL_LM"))  # fmt: skip
    fused_adapters.fuse(model)
    start = rollouts.start_weights(model)
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    group = 4
    prompts = args.completions // group
    batch = {"prompt_ids": torch.randint(0, SMOLLM2["vocab_size"], (prompts, args.prompt)), "prompt_mask": torch.ones(prompts, args.prompt, dtype=torch.long),
             "completion_ids": torch.randint(0, SMOLLM2["vocab_size"], (args.completions, args.completion)),
             "completion_mask": torch.ones(args.completions, args.completion, dtype=torch.long), "group_size": torch.tensor(group)}  # fmt: skip
    print(f"{machine_line()}; SmolLM2-135M's shape, fp32, LoRA rank {args.rank}; "
          f"{args.completions} completions of {args.completion} tokens after {args.prompt}-token prompts", flush=True)  # fmt: skip
    print(f"start weights' copy: {held / 2**20:.1f} MiB ({held / total:.1%} of the model's {total / 2**20:.1f} MiB)")
    ways = {"disable_adapter": model.disable_adapter, "start_weights": start}
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in ways}
    got: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            for name, way in ways.items():
                wall, cpu = time.perf_counter(), time.process_time()
                with way():
                    got[name] = rollouts.batch_logps(model, batch, 1.0)
                if repeat:
                    times[name]["wall"].append(time.perf_counter() - wall)
                    times[name]["cpu"].append(time.process_time() - cpu)
    # the adapter starts at zero here, so both are the start model's log-probabilities
    torch.testing.assert_close(got["start_weights"], got["disable_adapter"])
    for name, kinds in times.items():
        for kind, values in kinds.items():
            print(f"{name:16s} {kind:4s} " + " ".join(f"{v:.3f}" for v in values) + f"  median {statistics.median(values):.3f} s, least {min(values):.3f} s")
    for kind in ("wall", "cpu"):
        start, off = times["start_weights"][kind], times["disable_adapter"][kind]
        print(f"start_weights / disable_adapter, {kind} time: {statistics.median(start) / statistics.median(off):.2f}x the median, "
              f"{min(start) / min(off):.2f}x the least")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

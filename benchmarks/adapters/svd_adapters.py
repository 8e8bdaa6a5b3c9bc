"""PEFT's LoRA layers (the SVD form, or plain LoRA) against `fused_adapters`' two forms.

    python -m benchmarks.adapters.svd_adapters [--kind svd] [--hidden 128 192 256 384 576] [--rank 12]
                                               [--tokens 3792] [--trials 5] [--precision fp32] [--repeats 0]

For each hidden size d it wraps a linear layer of each shape of a Llama block (d x d as the
attention projections, d x 4d and 4d x d as the MLP's) in PEFT's `SVDLinear` (`--kind svd`, both
in-loop allocations; `--rank` as the lora stage's `adaptive.init_r`, 12) or `lora.Linear` (`--kind
lora`: the uniform and quantum_opt allocations, `dpo.lora`; give the `--rank`, 4 in the defaults),
and times one forward and backward over `--tokens` tokens (the default lora stage's micro-batch: 16
rows of about 237) with PEFT's own forward, the factored form and the merged form, alternating
within each trial. Prints the median milliseconds, each form against PEFT's, merged against
factored, and the form `merged_form` picks for that shape (`MERGED_FORM_SIZE`).
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from pipelines.core.models import fused_adapters
from pipelines.core.training import loop

FORWARDS = {"svd": fused_adapters.svd_forward, "lora": fused_adapters.lora_forward}


def adapted_layer(kind: str, d_in: int, d_out: int, rank: int, seed: int = 0) -> torch.nn.Module:
    """PEFT's `SVDLinear` (every Λ entry non-zero) or `lora.Linear` (B non-zero) around a frozen
    `d_in -> d_out` linear layer."""
    from peft import AdaLoraConfig, LoraConfig, get_peft_model

    torch.manual_seed(seed)
    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(d_in, d_out, bias=False)
    if kind == "svd":
        config = AdaLoraConfig(init_r=rank, target_r=rank, total_step=100, tinit=10, tfinal=10, target_modules=["proj"], lora_alpha=2 * rank)
    else:
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["proj"])
    layer = get_peft_model(holder, config).base_model.model.proj
    with torch.no_grad():
        (layer.lora_E["default"] if kind == "svd" else layer.lora_B["default"].weight).normal_()
    return layer


def time_forms(layer: torch.nn.Module, tokens: int, trials: int, precision: str, repeats: int = 0) -> dict[str, float]:
    """Median milliseconds of one forward and backward per form (trials alternate the forms), each
    timing `repeats` of them (0: about 40 of the default model's widest layer in work)."""
    d_out, d_in = layer.base_layer.weight.shape
    x = torch.randn(tokens, d_in, requires_grad=True)
    grad = torch.randn(tokens, d_out)
    forms = {"peft": None, "factored": 0, "merged": float("inf")}
    times: dict[str, list[float]] = {form: [] for form in forms}
    repeats = repeats or max(3, int(40 * 128 * 512 / (d_in * d_out)))
    fused = FORWARDS["svd" if hasattr(layer, "lora_E") else "lora"]
    saved = fused_adapters.MERGED_FORM_SIZE
    try:
        for trial in range(trials + 1):  # the first round warms up
            for form, size in forms.items():
                if size is None:
                    vars(layer).pop("forward", None)
                else:
                    fused_adapters.MERGED_FORM_SIZE = size
                    layer.forward = types.MethodType(fused, layer)
                started = time.perf_counter()
                for _ in range(repeats):
                    with loop.autocast(x.device, precision):
                        out = layer(x)
                    out.backward(grad)
                if trial:
                    times[form].append(1000 * (time.perf_counter() - started) / repeats)
    finally:
        fused_adapters.MERGED_FORM_SIZE = saved
    return {form: statistics.median(values) for form, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=sorted(FORWARDS), default="svd")
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 192, 256, 384, 576])
    parser.add_argument("--rank", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=16 * 237)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=0, help="passes per timing (0: about 40 of the default model's widest layer in work)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.kind}, {args.precision}, rank {args.rank}, {args.tokens} tokens")
    print("| shape | d_in·d_out / (d_in+d_out) | PEFT ms | factored ms | merged ms | factored / PEFT | merged / PEFT | merged / factored | rule picks |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for d in args.hidden:
        for d_in, d_out in [(d, d), (d, 4 * d), (4 * d, d)]:
            layer = adapted_layer(args.kind, d_in, d_out, args.rank)
            ms = time_forms(layer, args.tokens, args.trials, args.precision, args.repeats)
            with loop.autocast(torch.device("cpu"), args.precision):
                picks = "merged" if fused_adapters.merged_form(layer, torch.zeros(args.tokens, d_in)) else "factored"
            print(f"| {d_in} x {d_out} | {d_in * d_out / (d_in + d_out):.1f} | {ms['peft']:.2f} | {ms['factored']:.2f} | {ms['merged']:.2f} "
                  f"| {ms['factored'] / ms['peft']:.2f} | {ms['merged'] / ms['peft']:.2f} | {ms['merged'] / ms['factored']:.2f} | {picks} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Training tokens/s: the shared loop vs a bare PyTorch loop vs Hugging Face `Trainer`.

    python -m benchmarks.peers.peer_training [--size default|30m|smollm2] [--steps 30] [--trials 3] [--precision auto] [--optimizer adamw_fused] [--compile]

The same model (params.yaml `pretrain.model`, or about 34.6M parameters with `--size 30m`: hidden
512, intermediate 2048, 8 layers; or SmolLM2-135M's shape with `--size smollm2`: hidden 576,
intermediate 1536, 30 layers, 9 heads over 3 key-value heads, its 49,152-token vocabulary, tied
embeddings, randomly initialised, trained with the real-model profile's `pretrain.train`: 4 rows a
micro-batch, the head over 256 tokens at a time), the same random token rows (vocabulary 2048, or
the model's; sequence length 256), micro-batch, learning rate, clipping and precision (`auto`: what
this machine trains in) for all three, in one process. Trials alternate (bare, shared, Trainer, bare, ...) so that machine noise
hits all alike; the first steps of every trial are warm-up and not timed. Prints each trial, the
medians and the ratios to `Trainer` (the goal: shared loop >= 1.0x) and to the bare loop, and the
optimizer each one used. Model-FLOPs utilisation: 6 x parameters x tokens/s (forward and backward of
the matrix products; attention's score products are left out, as usual) over the peak this machine
measured for a large matrix product in the same precision, in this process, with every thread.

`--compile` adds the shared loop with `train.compile: true` (torch.compile): its steady tokens/s,
what its warm-up steps cost beyond eager ones (compilation) and after how many steps it pays back.
TorchInductor keeps what it compiled in a cache on disk (`TORCHINDUCTOR_CACHE_DIR`, by default
under the system's temporary directory) that later processes reuse; this one starts from an empty
cache, so its first trial pays the cold compilation (a stage's first run on a machine) and the
others the warm one (every later run).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import REPO
from benchmarks.speed.train_throughput import WARMUP, _Vocab, shared_loop
from pipelines.core.models.models import build_llama
from pipelines.core.params import files as params_file
from pipelines.core.training import loop, precision

SIZES = {"default": {}, "30m": {"hidden_size": 512, "intermediate_size": 2048, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8},
         "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "rope_theta": 100000.0}}
VOCAB = {"smollm2": 49152}
"""A size's vocabulary where it is not the default's 2048."""
PROFILES = {"smollm2": REPO / "params" / "smollm2.yaml"}
"""A size's training settings: the profile whose `pretrain.train` it trains with (default: params.yaml's)."""


def bare_loop(model, rows: np.ndarray, batch_size: int, steps: int, cfg) -> float:
    """Forward, backward, clip, AdamW (the loop's optimizer) under the same autocast; tokens/s."""
    optimizer = loop.build_optimizer(model, cfg)
    rng = np.random.default_rng(0)
    device = torch.device("cpu")
    start = 0.0
    for step in range(steps):
        if step == WARMUP:
            start = time.perf_counter()
        x = torch.from_numpy(rows[np.sort(rng.choice(len(rows), batch_size, replace=False))].astype(np.int64))
        with loop.autocast(device, cfg.precision):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (steps - WARMUP) * batch_size * rows.shape[1] / (time.perf_counter() - start)


def trainer_loop(model, rows: np.ndarray, cfg) -> tuple[float, str]:
    """`transformers.Trainer` with its defaults but for what must match; tokens/s and its optimizer."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    marks: list[float] = []

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            x = torch.from_numpy(rows[index].astype(np.int64))
            return {"input_ids": x, "labels": x}

    with tempfile.TemporaryDirectory() as out:
        arguments = TrainingArguments(
            output_dir=out, max_steps=cfg.max_steps, per_device_train_batch_size=cfg.micro_batch_size, learning_rate=cfg.lr,
            weight_decay=cfg.weight_decay, adam_beta1=cfg.beta1, adam_beta2=cfg.beta2, max_grad_norm=cfg.max_grad_norm,
            lr_scheduler_type="cosine", warmup_steps=0, bf16=cfg.precision == "bf16", fp16=cfg.precision == "fp16",
            use_cpu=True, save_strategy="no", report_to=[], logging_steps=10, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        )  # fmt: skip
        trainer = Trainer(model=model, args=arguments, train_dataset=Rows(), callbacks=[Mark()])
        trainer.train()
        optimizer = f"{type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, 'optimizer') else trainer.optimizer).__name__} ({arguments.optim})"
    timed = cfg.max_steps - WARMUP
    return timed * cfg.micro_batch_size * rows.shape[1] / (marks[-1] - marks[WARMUP - 1]), optimizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--optimizer", default=None, choices=["adamw", "adamw_fused"], help="train.optimizer of the shared and bare loops (default: params.yaml's)")
    parser.add_argument("--compile", action="store_true", help="also time the shared loop with train.compile: true")
    args = parser.parse_args(argv)

    params, _ = params_file.load(REPO, overlays=[PROFILES[args.size]] if args.size in PROFILES else [])
    vocab, seq_len = VOCAB.get(args.size, 2048), 256
    model_params = params.pretrain.model.model_copy(update=SIZES[args.size])
    resolved = precision.resolve(args.precision)
    cfg = params.pretrain.train.model_copy(update={"max_steps": args.steps, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
                                                   "log_every": 10, "precision": resolved, "extensions": []})  # fmt: skip
    if args.optimizer:
        cfg = cfg.model_copy(update={"optimizer": args.optimizer})
    if args.compile:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="qllm-inductor-")  # cold for the first trial
    rows = np.random.default_rng(0).integers(0, vocab, size=(512, seq_len)).astype(np.uint16)
    base = build_llama(model_params, _Vocab(vocab), max_positions=seq_len, seed=0)
    print(f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M parameters, batch {cfg.micro_batch_size} x {seq_len} tokens, "
          f"{resolved}, {torch.get_num_threads()} threads, {args.steps - WARMUP} timed steps x {args.trials} trials")  # fmt: skip
    results: dict[str, list[float]] = {"bare": [], "shared": [], "trainer": []} | ({"compiled": []} if args.compile else {})
    warmups: dict[str, list[float]] = {"shared": [], "compiled": []}
    optimizer = ""
    for trial in range(args.trials):
        results["bare"].append(bare_loop(copy.deepcopy(base), rows, cfg.micro_batch_size, args.steps, cfg))
        timing: dict[str, float] = {}
        results["shared"].append(shared_loop(copy.deepcopy(base), rows, cfg, timing))
        warmups["shared"].append(timing["warmup_s"])
        speed, optimizer = trainer_loop(copy.deepcopy(base), rows, cfg)
        results["trainer"].append(speed)
        if args.compile:
            torch._dynamo.reset()  # every trial compiles afresh, as a stage does
            results["compiled"].append(shared_loop(copy.deepcopy(base), rows, cfg.model_copy(update={"compile": True}), timing))
            warmups["compiled"].append(timing["warmup_s"])
        print(f"trial {trial + 1}: " + ", ".join(f"{name} {values[-1]:,.0f} tok/s" for name, values in results.items()))
    median = {name: statistics.median(values) for name, values in results.items()}
    print(f"optimizers: shared and bare AdamW ({cfg.optimizer}), Trainer {optimizer}")
    print(f"median: bare {median['bare']:,.0f}, shared {median['shared']:,.0f}, Trainer {median['trainer']:,.0f} tok/s; "
          f"shared/Trainer {median['shared'] / median['trainer']:.3f} (goal >= 1.0), shared/bare {median['shared'] / median['bare']:.3f}")
    n_params = sum(p.numel() for p in base.parameters() if p.dim() > 1)  # the matrices (embedding lookups do no products; lm_head does)
    peak = matmul_peak(resolved)
    print(f"model FLOPs utilisation (6 x {n_params / 1e6:.2f}M matrix parameters x tokens/s over a measured {peak / 1e9:,.0f} GFLOP/s "
          f"{resolved} matrix-product peak): " + ", ".join(f"{name} {6 * n_params * m / peak:.1%}" for name, m in median.items()))  # fmt: skip
    if args.compile:
        tokens_per_step = cfg.micro_batch_size * seq_len
        step = {name: tokens_per_step / median[name] for name in ("shared", "compiled")}
        saved = step["shared"] - step["compiled"]
        for when, extra in (("cold", warmups["compiled"][0] - warmups["shared"][0]),
                            ("warm", statistics.median(warmups["compiled"][1:] or warmups["compiled"]) - statistics.median(warmups["shared"]))):  # fmt: skip
            print(f"train.compile, {when} cache: {median['compiled'] / median['shared']:.3f}x the eager shared loop's tokens/s; its {WARMUP} "
                  f"warm-up steps took {extra:.1f} s longer (compilation), " + (f"paid back after {extra / saved:,.0f} steps" if saved > 0 else "never paid back"))  # fmt: skip
    return 0


def matmul_peak(precision_name: str, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` `size`x`size` matrix products in this precision (autocast as
    training uses it), with this process's threads: the machine's practical peak."""
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with loop.autocast(torch.device("cpu"), precision_name):
        a @ a
        for _ in range(repeats):
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


if __name__ == "__main__":
    raise SystemExit(main())

"""Training tokens/s: the shared loop vs a bare PyTorch loop vs Hugging Face `Trainer`.

    python -m benchmarks.peer_training [--size default|30m] [--steps 30] [--trials 3] [--precision auto] [--optimizer adamw_fused]

The same model (params.yaml `pretrain.model`, or about 34.6M parameters with `--size 30m`: hidden
512, intermediate 2048, 8 layers), the same random token rows (vocabulary 2048, sequence length
256), micro-batch, learning rate, clipping and precision (`auto`: what this machine trains in) for
all three, in one process. Trials alternate (bare, shared, Trainer, bare, ...) so that machine noise
hits all alike; the first steps of every trial are warm-up and not timed. Prints each trial, the
medians and the ratios to `Trainer` (the goal: shared loop >= 1.0x) and to the bare loop, and the
optimizer each one used.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.train_throughput import WARMUP, _Vocab, shared_loop
from pipelines.core import params_file, precision, training
from pipelines.core.models import build_llama

SIZES = {"default": {}, "30m": {"hidden_size": 512, "intermediate_size": 2048, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8}}


def bare_loop(model, rows: np.ndarray, batch_size: int, steps: int, cfg) -> float:
    """Forward, backward, clip, AdamW (the loop's optimizer) under the same autocast; tokens/s."""
    optimizer = training.build_optimizer(model, cfg)
    rng = np.random.default_rng(0)
    device = torch.device("cpu")
    start = 0.0
    for step in range(steps):
        if step == WARMUP:
            start = time.perf_counter()
        x = torch.from_numpy(rows[np.sort(rng.choice(len(rows), batch_size, replace=False))].astype(np.int64))
        with training.autocast(device, cfg.precision):
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
    args = parser.parse_args(argv)

    params, _ = params_file.load(Path(__file__).resolve().parents[1])
    vocab, seq_len = 2048, 256
    model_params = params.pretrain.model.model_copy(update=SIZES[args.size])
    resolved = precision.resolve(args.precision)
    cfg = params.pretrain.train.model_copy(update={"max_steps": args.steps, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
                                                   "log_every": 10, "precision": resolved, "extensions": []})  # fmt: skip
    if args.optimizer:
        cfg = cfg.model_copy(update={"optimizer": args.optimizer})
    rows = np.random.default_rng(0).integers(0, vocab, size=(512, seq_len)).astype(np.uint16)
    base = build_llama(model_params, _Vocab(vocab), max_positions=seq_len, seed=0)
    print(f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M parameters, batch {cfg.micro_batch_size} x {seq_len} tokens, "
          f"{resolved}, {torch.get_num_threads()} threads, {args.steps - WARMUP} timed steps x {args.trials} trials")  # fmt: skip
    results: dict[str, list[float]] = {"bare": [], "shared": [], "trainer": []}
    optimizer = ""
    for trial in range(args.trials):
        results["bare"].append(bare_loop(copy.deepcopy(base), rows, cfg.micro_batch_size, args.steps, cfg))
        results["shared"].append(shared_loop(copy.deepcopy(base), rows, cfg))
        speed, optimizer = trainer_loop(copy.deepcopy(base), rows, cfg)
        results["trainer"].append(speed)
        print(f"trial {trial + 1}: " + ", ".join(f"{name} {values[-1]:,.0f} tok/s" for name, values in results.items()))
    median = {name: statistics.median(values) for name, values in results.items()}
    print(f"optimizers: shared and bare AdamW ({cfg.optimizer}), Trainer {optimizer}")
    print(f"median: bare {median['bare']:,.0f}, shared {median['shared']:,.0f}, Trainer {median['trainer']:,.0f} tok/s; "
          f"shared/Trainer {median['shared'] / median['trainer']:.3f} (goal >= 1.0), shared/bare {median['shared'] / median['bare']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

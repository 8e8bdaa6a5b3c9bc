"""Tokens/s of the shared training loop vs a bare PyTorch loop: same model, data, batch, bf16.

    python -m benchmarks.speed.train_throughput [--steps 30] [--trials 3]

Both loops run in this process on identical copies of the default pretraining model (params.yaml
`pretrain.model`, vocabulary 2048, sequence length 256, micro-batch 16). Trials alternate
(bare, shared, bare, shared, ...) so machine noise hits both alike; the first steps of every trial
are warm-up and not timed. Prints the median tokens/s of each and their ratio (target >= 0.9).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import torch

from benchmarks.common import REPO
from pipelines.core.extensions import Hook
from pipelines.core.models.models import build_llama
from pipelines.core.params import files as params_file
from pipelines.core.params.training import TrainParams
from pipelines.core.training import loop

WARMUP = 3


class _Vocab:
    """Just what `build_llama` reads from a tokenizer."""

    eos_token_id, pad_token_id, unk_token_id = 0, 1, None

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def convert_tokens_to_ids(self, token: str) -> int:
        return 2


def bare_loop(model, rows: np.ndarray, batch_size: int, steps: int, lr: float) -> float:
    """Forward, backward, AdamW step under bf16 autocast; returns timed tokens/s."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = np.random.default_rng(0)
    start = None
    for step in range(steps):
        if step == WARMUP:
            start = time.perf_counter()
        x = torch.from_numpy(rows[np.sort(rng.choice(len(rows), batch_size, replace=False))].astype(np.int64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (steps - WARMUP) * batch_size * rows.shape[1] / (time.perf_counter() - start)


def shared_loop(model, rows: np.ndarray, cfg: TrainParams, timing: dict | None = None) -> float:
    """`pipelines.core.training.loop.train` (schedule, clipping, metrics, progress bar); timed tokens/s.
    `timing`, if given, gets `warmup_s`: from the call to the end of the untimed warm-up steps."""
    marks: list[float] = []
    started = time.perf_counter()
    loop.train(
        model,
        loop.causal_lm_loss,
        loop.Batches(len(rows), cfg.micro_batch_size, 0, lambda idx: {"input_ids": torch.from_numpy(rows[np.sort(idx)].astype(np.int64))}),
        cfg,
        extensions=[Hook("on_step_end", lambda state, metrics: marks.append(time.perf_counter()))],
    )
    timed_steps = cfg.max_steps - WARMUP
    if timing is not None:
        timing["warmup_s"] = marks[WARMUP - 1] - started
    return timed_steps * cfg.micro_batch_size * rows.shape[1] / (marks[-1] - marks[WARMUP - 1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)

    params, _ = params_file.load(REPO)
    vocab, seq_len, batch = 2048, 256, params.pretrain.train.micro_batch_size
    cfg = params.pretrain.train.model_copy(
        update={"max_steps": args.steps, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0, "log_every": 10, "precision": "bf16"}
    )
    rows = np.random.default_rng(0).integers(0, vocab, size=(512, seq_len)).astype(np.uint16)
    base = build_llama(params.pretrain.model, _Vocab(vocab), max_positions=seq_len, seed=0)
    print(f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M parameters, batch {batch} x {seq_len} tokens, "
          f"bf16 autocast, {torch.get_num_threads()} threads, {args.steps - WARMUP} timed steps x {args.trials} trials")
    bare, shared = [], []
    for trial in range(args.trials):
        bare.append(bare_loop(copy.deepcopy(base), rows, batch, args.steps, cfg.lr))
        shared.append(shared_loop(copy.deepcopy(base), rows, cfg))
        print(f"trial {trial + 1}: bare {bare[-1]:,.0f} tok/s, shared loop {shared[-1]:,.0f} tok/s")
    ratio = statistics.median(shared) / statistics.median(bare)
    print(f"median: bare {statistics.median(bare):,.0f} tok/s, shared loop {statistics.median(shared):,.0f} tok/s, ratio {ratio:.3f} (target >= 0.9)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

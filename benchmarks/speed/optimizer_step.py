"""One AdamW step over the default pretraining model's parameters: per-tensor (`adamw`) vs fused
(`adamw_fused`), at the default size and at 34.6M parameters.

    python -m benchmarks.speed.optimizer_step

Random gradients, `loop.param_groups` (decay on matrices only), one warm-up step, then the
median of 3 alternating trials of 10 steps each.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from benchmarks.common import REPO
from benchmarks.peers.peer_training import SIZES
from benchmarks.speed.train_throughput import _Vocab
from pipelines.core.models.models import build_llama
from pipelines.core.params import files as params_file
from pipelines.core.training import loop


def step_seconds(model: torch.nn.Module, cfg, fused: bool, steps: int = 10) -> float:
    model = copy.deepcopy(model)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter) * 1e-3
    optimizer = torch.optim.AdamW(loop.param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)
    optimizer.step()
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - started) / steps


def main() -> int:
    params, _ = params_file.load(REPO)
    cfg = params.pretrain.train
    for size, update in SIZES.items():
        model = build_llama(params.pretrain.model.model_copy(update=update), _Vocab(2048), max_positions=256, seed=0)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(3):
            for fused in (False, True):
                times[fused].append(step_seconds(model, cfg, fused))
        plain, fused = statistics.median(times[False]), statistics.median(times[True])
        print(f"{size} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M): adamw {plain * 1e3:.2f} ms, "
              f"adamw_fused {fused * 1e3:.2f} ms per step ({plain / fused:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

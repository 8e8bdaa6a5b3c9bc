"""Training stages side by side in one process: each with every core, or the cores shared out.

    python -m benchmarks.speed.side_by_side [--stages 2] [--steps 40] [--trials 3] [--precision auto]

`qllm run` runs independent stages at once, in threads of one process (sft beside probe_lora,
quantum_opt and lora; lora beside ref_logprobs and dpo). PyTorch's intra-op thread count applies
per calling thread, so by default every stage asks for all the cores and N stages put N x cores
busy threads on the machine. This times `--stages` identical shared-loop trainings (the default
pretraining model and batch) started together in threads, first each with the default thread count,
then each with `cores // stages` threads, and one alone as the reference; trials alternate.
Prints the wall time of the whole group, its ratio split/default and each group against the
stages run one after the other (N x the lone time).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import threading
import time

import numpy as np
import torch

from benchmarks.common import REPO
from benchmarks.speed.train_throughput import _Vocab, shared_loop
from pipelines.core.models.models import build_llama
from pipelines.core.params import files as params_file
from pipelines.core.training import precision


def group(base, rows: np.ndarray, cfg, stages: int, threads: int | None) -> float:
    """Wall seconds of `stages` trainings started together, each in its own thread with
    `threads` intra-op threads (None: the default)."""
    models = [copy.deepcopy(base) for _ in range(stages)]
    errors: list[BaseException] = []

    def train(model) -> None:
        try:
            if threads is not None:
                torch.set_num_threads(threads)
            shared_loop(model, rows, cfg)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    workers = [threading.Thread(target=train, args=(m,)) for m in models]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    args = parser.parse_args(argv)

    params, _ = params_file.load(REPO)
    resolved = precision.resolve(args.precision)
    cfg = params.pretrain.train.model_copy(update={"max_steps": args.steps, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
                                                   "log_every": 10, "precision": resolved, "extensions": []})  # fmt: skip
    rows = np.random.default_rng(0).integers(0, 2048, size=(512, 256)).astype(np.uint16)
    base = build_llama(params.pretrain.model, _Vocab(2048), max_positions=256, seed=0)
    cores = torch.get_num_threads()
    split = max(1, cores // args.stages)
    print(f"{args.stages} stages x {args.steps} steps, {resolved}, {cores} threads by default ({os.cpu_count()} CPUs), split: {split} each")
    times: dict[str, list[float]] = {"alone": [], "default": [], "split": []}
    for trial in range(args.trials):
        times["alone"].append(group(base, rows, cfg, 1, None))
        times["default"].append(group(base, rows, cfg, args.stages, None))
        times["split"].append(group(base, rows, cfg, args.stages, split))
        print(f"trial {trial + 1}: " + ", ".join(f"{name} {values[-1]:.2f} s" for name, values in times.items()))
    median = {name: statistics.median(values) for name, values in times.items()}
    serial = args.stages * median["alone"]
    print(f"median: one alone {median['alone']:.2f} s; {args.stages} side by side: default threads {median['default']:.2f} s "
          f"({median['default'] / serial:.3f}x running them one after the other), {split} thread(s) each {median['split']:.2f} s "
          f"({median['split'] / serial:.3f}x); split/default {median['split'] / median['default']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

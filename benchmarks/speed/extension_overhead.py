"""What the extension API costs per training step, against a default pretraining step.

    python -m benchmarks.speed.extension_overhead [--calls 20000] [--steps 8]

Times the dispatch of the per-step points (`on_gradients`, `on_step_end`) to 0, 1 and 3 no-op
extensions, and to the default loggers (`train.extensions` of params.yaml, with no MLflow run they
log nothing per step), then one optimizer step of the default pretraining model (params.yaml
`pretrain`: its model and micro-batch, vocabulary 2048, sequence length 256, precision as resolved
here) in the same process, and prints
each dispatch as a share of that step (the target is under 1%).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.speed.train_throughput import _Vocab
from pipelines.core import extensions
from pipelines.core.models.models import build_llama
from pipelines.core.params import files as params_file
from pipelines.core.params.training import DEFAULT_EXTENSIONS
from pipelines.core.training import loop, precision


class _Noop(extensions.Extension):
    def on_gradients(self, state):
        pass

    def on_step_end(self, state, metrics):
        pass


def dispatch_seconds(hooks: extensions.Extensions, calls: int) -> float:
    state, metrics = loop.TrainState(), {}
    started = time.perf_counter()
    for _ in range(calls):
        hooks.call("on_gradients", state)
        hooks.call("on_step_end", state, metrics)
    return (time.perf_counter() - started) / calls


def pretrain_step_seconds(steps: int) -> float:
    params, _ = params_file.load(".")
    pretrain = params.pretrain
    seq = 256  # the tokenize stage's default sequence length
    model = build_llama(pretrain.model, _Vocab(2048), max_positions=seq, seed=0)
    rows = np.random.default_rng(0).integers(0, 2048, (256, seq))
    collate = lambda idx: {"input_ids": torch.as_tensor(rows[idx])}  # noqa: E731
    cfg = pretrain.train.model_copy(update={"max_steps": steps, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
                                            "precision": precision.resolve("auto"), "extensions": []})  # fmt: skip
    result = loop.train(model, loop.causal_lm_loss, loop.Batches(len(rows), cfg.micro_batch_size, 0, collate), cfg)
    return result["train_seconds"] / result["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    step = pretrain_step_seconds(args.steps)
    defaults = extensions.build(list(DEFAULT_EXTENSIONS), extensions.ExtensionContext("pretrain"))
    cases = {
        "0 extensions": [],
        "1 no-op extension": [_Noop()],
        "3 no-op extensions": [type(f"N{i}", (_Noop,), {"name": f"n{i}"})() for i in range(3)],
        "default loggers, no MLflow run": defaults,
    }
    print(f"default pretrain step: {step * 1e3:.1f} ms ({precision.resolve('auto')})")
    for label, items in cases.items():
        seconds = dispatch_seconds(extensions.Extensions(items), args.calls)
        print(f"{label}: {seconds * 1e6:.2f} us per step = {100 * seconds / step:.5f}% of a step")


if __name__ == "__main__":
    main()

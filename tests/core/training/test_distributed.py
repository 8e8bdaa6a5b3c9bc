"""Data-parallel training: 2 gloo processes on CPU train the tiny model as 1 process does.

The comparison runs `loop.train` in two processes (`torch.multiprocessing`) with a gloo process group
(what `torchrun` sets up for a stage) against a plain single-process run with the same global batch
(micro_batch_size 4 x grad_accum_steps 2). With 2 ranks each runs 1 micro-batch per step (rank r
takes micro-batches r, r+2, ... of the shared order), DDP averages the gradients, so the two runs
see the same micro-batches per step and can differ only in float summation order. Measured on CPU
(fp32, 8 steps, torch 2.13): loss curves, validation losses and weights are bitwise equal (difference 0:
the mean of two rank gradients rounds as the sum of two halves does); the test allows each step's
rounding of the backward's chain and AdamW's update (tests/numerics.py), since a rank's kernels
(one thread) may block the products otherwise than the single process's.

`strategy: fsdp` (FSDP2 `fully_shard` per decoder layer and at the root) is held to the same
tolerances; measured the same way it is bitwise equal too (curve, validation, weights; clipping is
active in the first steps), and so is a 2-rank FSDP run resumed from its step-6 checkpoint.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from pipelines.core.errors import QllmError
from pipelines.core.params.training import TrainParams
from pipelines.core.training import distributed, loop
from pipelines.core.training.checkpoint import CheckpointManager
from qllm.services.local_api import free_port
from tests import numerics
from tests.core.training.test_loop import cfg, collate, rows, tiny_model, training_roundings


def assert_same_history(got, expected) -> None:
    """Logged rows ([step, loss] or [step, loss, lr]) of two runs of 8 steps: the steps and the
    schedule's learning rates exact, the losses within 8 steps of the chain's rounding."""
    got, expected = np.array(got), np.array(expected)
    assert got.shape == expected.shape and np.array_equal(got[:, 0], expected[:, 0]) and np.array_equal(got[:, 2:], expected[:, 2:])
    numerics.assert_close_as(got[:, 1], expected[:, 1], n=training_roundings(tiny_model()), steps=8, what="losses")


def assert_same_weights(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    numerics.assert_within(got, expected, numerics.weights_tolerance(training_roundings(tiny_model()), steps=8, lr=0.01), name)


class RecordingTracker:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def flush(self):
        """Calls are recorded as they come: nothing is buffered."""


def _run(checkpoint_dir=None, tracker=None, strategy="ddp", max_steps=8) -> tuple[dict, dict]:
    data, val = rows(), rows(8, seed=1)
    model = tiny_model()
    val_batches = [collate(val)(np.arange(8))]
    val_fn = lambda m: {"val/loss": loop.mean_loss(m, loop.causal_lm_loss, val_batches, torch.device("cpu"), "fp32")}  # noqa: E731
    checkpoints = CheckpointManager(checkpoint_dir, 2) if checkpoint_dir else None
    result = loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(data)), cfg(max_steps=max_steps, grad_accum_steps=2, eval_every=4, strategy=strategy),
                            val_fn=val_fn, tracker=tracker, checkpoints=checkpoints)  # fmt: skip
    return result, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, port: int, out: str, strategy: str = "ddp", max_steps: int = 8) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tracker = RecordingTracker()
        result, weights = _run(os.path.join(out, "checkpoints"), tracker, strategy, max_steps)
        torch.save({"result": result, "weights": weights, "tracked": tracker.calls}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _two_ranks(*args) -> None:
    """`_worker(rank, 2, *args)` in two processes forked from one forkserver that imported this
    module (torch, transformers, the loop) once for every test here: a spawned process imports them
    anew, about 6 s of CPU for each of the six ranks (2-core EPYC, capped to AVX2). The forkserver
    itself has imported, not computed, so it forks no OpenMP or other threads."""
    forkserver = torch.multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload([__name__])
    torch.multiprocessing.start_processes(_worker, args=(2, *args), nprocs=2, join=True, start_method="forkserver")


def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    _two_ranks(free_port(), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    single, single_weights = _run()

    expected = np.array(single["history"]["train"])
    for saved in ranks:  # every rank logs the same averaged curve
        assert_same_history(saved["result"]["history"]["train"], expected)
        assert_same_history(saved["result"]["history"]["eval"], single["history"]["eval"])
        assert saved["result"]["tokens"] == single["tokens"] == 8 * 2 * 4 * 8  # tokens summed over ranks
        for name, tensor in single_weights.items():
            assert_same_weights(saved["weights"][name], tensor, name)
    # rank 0 alone logs metrics and writes checkpoints
    assert [step for step, _ in ranks[0]["tracked"] if step is not None][:3] == [1, 2, 3]
    assert ranks[1]["tracked"] == []
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) != []


def test_batches_shards_are_disjoint_and_together_the_single_process_order():
    single = loop.Batches(10, 2, seed=3, collate=lambda idx: tuple(idx.tolist()))
    expected = [next(single) for _ in range(8)]  # 5 per epoch: crosses an epoch boundary
    shards = []
    for rank in (0, 1):
        shard = loop.Batches(10, 2, seed=3, collate=lambda idx: tuple(idx.tolist()))
        shard.shard(rank, 2)
        shards.append([next(shard) for _ in range(4)])
    assert shards[0] == expected[0::2] and shards[1] == expected[1::2]
    assert shard.state_dict() == single.state_dict()  # the same resume point on every rank


def test_grad_accum_steps_must_divide_by_the_process_count():
    assert distributed.local_accum_steps(4, 2, "pretrain") == 2
    with pytest.raises(QllmError, match=r"train.grad_accum_steps \(3\) must be divisible by the number of processes \(2\)"):
        distributed.local_accum_steps(3, 2, "pretrain")
    with pytest.raises(ValueError, match=r"grad_accum_steps \(3\) must be divisible by nproc \(2\)"):
        TrainParams(grad_accum_steps=3, nproc=2, warmup_steps=0)
    assert TrainParams().nproc == 1
    assert TrainParams().strategy == "ddp"


def test_fsdp_two_processes_match_one_and_resume(tmp_path):
    """`strategy: fsdp`: the same curve and full weights as 1 process; checkpoints hold the full
    weights and optimizer state, and a 2-rank FSDP run resumed from step 4 ends where the
    uninterrupted single-process run does."""
    _two_ranks(free_port(), str(tmp_path), "fsdp")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    single, single_weights = _run()
    for saved in ranks:
        assert_same_history(saved["result"]["history"]["train"], single["history"]["train"])
        assert_same_history(saved["result"]["history"]["eval"], single["history"]["eval"])
        assert saved["result"]["tokens"] == single["tokens"]
        for name, tensor in single_weights.items():  # full (gathered) weights on every rank, plain tensors
            assert type(saved["weights"][name]) is torch.Tensor
            assert_same_weights(saved["weights"][name], tensor, name)
    assert ranks[1]["tracked"] == []

    # resume: keep only the newest checkpoint before the end of the 8-step run, rerun to 8 on 2 FSDP ranks
    resumed = tmp_path / "resumed"
    earlier = max(p for p in (tmp_path / "checkpoints").glob("step-*") if p.name != "step-00000008")
    shutil.copytree(earlier, resumed / "checkpoints" / earlier.name)
    _two_ranks(free_port(), str(resumed), "fsdp")
    again = torch.load(resumed / "rank0.pt", weights_only=False)
    assert_same_history(again["result"]["history"]["train"], single["history"]["train"])
    for name, tensor in single_weights.items():
        assert_same_weights(again["weights"][name], tensor, name)

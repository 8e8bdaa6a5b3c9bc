"""Data-parallel training: 2 gloo processes on CPU train the tiny model as 1 process does.

The comparison runs `training.train` under `torch.multiprocessing.spawn` with a gloo process group
(what `torchrun` sets up for a stage) against a plain single-process run with the same global batch
(micro_batch_size 4 x grad_accum_steps 2). With 2 ranks each runs 1 micro-batch per step (rank r
takes micro-batches r, r+2, ... of the shared order), DDP averages the gradients, so the two runs
see the same micro-batches per step and can differ only in float summation order. Measured on CPU
(fp32, 8 steps, torch 2.13): loss curves, validation losses and weights are bitwise equal (difference 0:
the mean of two rank gradients rounds as the sum of two halves does); the test allows
rtol 1e-4 per logged step and atol 1e-5 on the weights.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch

from pipelines import distributed, training
from pipelines.checkpoint import CheckpointManager
from pipelines.config import TrainParams
from pipelines.errors import QllmError
from tests.test_training import cfg, collate, rows, tiny_model

LOSS_RTOL = 1e-4
WEIGHT_ATOL = 1e-5


class RecordingTracker:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))


def _run(checkpoint_dir=None, tracker=None) -> tuple[dict, dict]:
    data, val = rows(), rows(8, seed=1)
    model = tiny_model()
    val_batches = [collate(val)(np.arange(8))]
    val_fn = lambda m: {"val/loss": training.mean_loss(m, training.causal_lm_loss, val_batches, torch.device("cpu"), "fp32")}  # noqa: E731
    checkpoints = CheckpointManager(checkpoint_dir, 2) if checkpoint_dir else None
    result = training.train(model, training.causal_lm_loss, training.Batches(32, 4, 0, collate(data)), cfg(max_steps=8, grad_accum_steps=2, eval_every=4),
                            val_fn=val_fn, tracker=tracker, checkpoints=checkpoints)  # fmt: skip
    return result, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tracker = RecordingTracker()
        result, weights = _run(os.path.join(out, "checkpoints"), tracker)
        torch.save({"result": result, "weights": weights, "tracked": tracker.calls}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    single, single_weights = _run()

    expected = np.array(single["history"]["train"])
    for saved in ranks:  # every rank logs the same averaged curve
        got = np.array(saved["result"]["history"]["train"])
        np.testing.assert_allclose(got, expected, rtol=LOSS_RTOL)
        np.testing.assert_allclose(np.array(saved["result"]["history"]["eval"]), np.array(single["history"]["eval"]), rtol=LOSS_RTOL)
        assert saved["result"]["tokens"] == single["tokens"] == 8 * 2 * 4 * 8  # tokens summed over ranks
        for name, tensor in single_weights.items():
            torch.testing.assert_close(saved["weights"][name], tensor, rtol=0, atol=WEIGHT_ATOL)
    # rank 0 alone logs metrics and writes checkpoints
    assert [step for step, _ in ranks[0]["tracked"] if step is not None][:3] == [1, 2, 3]
    assert ranks[1]["tracked"] == []
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) != []


def test_batches_shards_are_disjoint_and_together_the_single_process_order():
    single = training.Batches(10, 2, seed=3, collate=lambda idx: tuple(idx.tolist()))
    expected = [next(single) for _ in range(8)]  # 5 per epoch: crosses an epoch boundary
    shards = []
    for rank in (0, 1):
        shard = training.Batches(10, 2, seed=3, collate=lambda idx: tuple(idx.tolist()))
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

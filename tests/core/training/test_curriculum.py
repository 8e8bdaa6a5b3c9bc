"""Sequence-length curriculum: the schedule, what the loop trains on, logging, exact resume, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.core.errors import QllmError
from pipelines.core.extensions import ExtensionError, Hook
from pipelines.core.params.project import Params
from pipelines.core.params.training import CurriculumParams
from pipelines.core.training import curriculum, loop
from pipelines.core.training.checkpoint import CheckpointManager
from tests.core.training.test_loop import Interrupt, cfg, collate, rows, tiny_model


def test_length_schedule_linear_root_and_rounding():
    linear = CurriculumParams(strategy="length", start_length=8, end_length=64, steps=8, step_size=8)
    # 8 + 56 * step/8 = 8 + 7*step, rounded down to a multiple of 8 (never below 8)
    assert [curriculum.length_at(s, linear, 128) for s in range(10)] == [8, 8, 16, 24, 32, 40, 48, 56, 64, 64]
    root = linear.model_copy(update={"schedule": "root"})
    assert [curriculum.length_at(s, root, 128) for s in (0, 2, 4, 8)] == [8, 32, 40, 64]  # 8 + 56*sqrt(s/8): 8, 36, 47.6, 64
    assert curriculum.length_at(3, linear.model_copy(update={"end_length": None}), 128) == 48  # 8 + 120*3/8 = 53 -> 48
    assert curriculum.length_at(0, CurriculumParams(), 128) == 128  # strategy none: always full length


def train_with_curriculum(directory=None, stop_at=None, steps=6):
    """6 steps of 4 sequences of 8 tokens, warming up 2 -> 8 tokens over 4 steps; records each batch's length."""
    data, seen, logged = rows(32, seq=8), [], []

    def loss_fn(model, batch):
        seen.append(batch["input_ids"].shape[1])
        return loop.causal_lm_loss(model, batch)

    def stopper(state, metrics):
        logged.append(dict(metrics))
        if state.step == stop_at:
            raise Interrupt

    c = cfg(max_steps=steps, curriculum=CurriculumParams(strategy="length", start_length=2, steps=4, step_size=2))
    batches = curriculum.wrap(loop.Batches(32, 4, 0, collate(data)), c, full_length=8)
    model = tiny_model()
    checkpoints = CheckpointManager(directory, 2) if directory else None
    result = loop.train(model, loss_fn, batches, c, checkpoints=checkpoints, extensions=[Hook("on_step_end", stopper)])
    return model, result, seen, logged


def test_the_loop_trains_on_the_scheduled_lengths_and_logs_them():
    _, result, seen, logged = train_with_curriculum()
    assert seen == [2, 2, 4, 6, 8, 8]  # 2 + 6*step/4 rounded down to even: 2, 3.5->2, 5->4, 6.5->6, then full
    assert [m["train/seq_len"] for m in logged] == [2, 2, 4, 6, 8, 8]
    assert [m["train/tokens_seen"] for m in logged] == [4 * sum(seen[: i + 1]) for i in range(6)]
    assert result["tokens"] == 4 * sum(seen)  # the loop's own count agrees


def test_resume_mid_curriculum_is_bitwise_exact(tmp_path):
    reference, _, seen, _ = train_with_curriculum(tmp_path / "straight")
    with pytest.raises(ExtensionError):
        train_with_curriculum(tmp_path / "killed", stop_at=5)  # checkpoint at step 3, in the warmup
    resumed, _, resumed_seen, _ = train_with_curriculum(tmp_path / "killed")
    assert resumed_seen == seen[3:]  # steps 4-6 again, at their scheduled lengths
    for (name, a), (_, b) in zip(reference.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_validation_batches_are_not_cut():
    data = rows(32, seq=8)
    c = cfg(max_steps=2, eval_every=1, curriculum=CurriculumParams(strategy="length", start_length=2, steps=10, step_size=2))
    lengths = []

    def val_fn(model):
        batch = collate(rows(8, seq=8, seed=1))(np.arange(8))
        lengths.append(batch["input_ids"].shape[1])
        return {"val/loss": loop.mean_loss(model, loop.causal_lm_loss, [batch], torch.device("cpu"), "fp32")}

    loop.train(tiny_model(), loop.causal_lm_loss, curriculum.wrap(loop.Batches(32, 4, 0, collate(data)), c, 8), c, val_fn=val_fn)
    assert lengths and set(lengths) == {8}


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"end_length \(16\) must be at least start_length \(32\)"):
        CurriculumParams(strategy="length", start_length=32, end_length=16)
    too_long = cfg(curriculum=CurriculumParams(strategy="length", start_length=8, end_length=512))
    with pytest.raises(QllmError, match=r"pretrain.train.curriculum.end_length is 512 but the sequences have 256 tokens"):
        curriculum.wrap(loop.Batches(4, 2, 0, lambda idx: idx), too_long, full_length=256)
    with pytest.raises(ValueError, match=r"sft.train.curriculum.strategy: the sequence-length curriculum is for pretrain"):
        Params.model_validate({"ingest": {"sources": [{"path": "x.txt", "kind": "text"}]}, "sft": {"train": {"curriculum": {"strategy": "length"}}}})

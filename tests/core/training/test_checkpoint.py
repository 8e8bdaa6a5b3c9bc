"""Checkpoints: safetensors + weights_only state, rotation, corruption fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from pipelines.core.training.checkpoint import CheckpointManager


def model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4))
    net[1].weight = net[0].weight  # a tied pair, like tied input/output embeddings
    return net


def test_save_load_roundtrip_with_tied_weights(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    net = model()
    manager.save(5, net, {"step": 5, "opt": {"exp_avg": torch.ones(2)}})
    other = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4))
    other[1].weight = other[0].weight
    state = manager.load(manager.latest_valid().path, other)
    assert torch.equal(other[0].weight, net[0].weight) and other[1].weight is other[0].weight
    assert state["step"] == 5 and torch.equal(state["opt"]["exp_avg"], torch.ones(2))


def test_only_trainable_weights_are_saved(tmp_path):
    net = model()
    net[0].weight.requires_grad_(False)  # a frozen base, as under LoRA; the bias stays trainable
    path = CheckpointManager(tmp_path).save(1, net, {})
    from safetensors.torch import load_file

    assert set(load_file(str(path / "model.safetensors"))) == {"1.bias"}


def test_keeps_last_k_plus_best(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    net = model()
    for step in (1, 2, 3, 4, 5):
        manager.save(step, net, {}, best=step == 2)
    assert [c.step for c in manager.list()] == [2, 4, 5]
    assert manager.best_step == 2
    assert not list(tmp_path.glob(".tmp-*"))


def test_corrupt_newest_checkpoint_falls_back_with_warning(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep_last=3)
    net = model()
    manager.save(1, net, {"step": 1})
    newest = manager.save(2, net, {"step": 2})
    data = (newest / "state.pt").read_bytes()
    (newest / "state.pt").write_bytes(data[: len(data) // 2])  # truncated, as by a crash or full disk
    with caplog.at_level(logging.WARNING, logger="qllm.checkpoint"):
        chosen = manager.latest_valid()
    assert chosen.step == 1
    assert "corrupt" in caplog.text and "step-00000002" in caplog.text


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def _flip_one_byte(path):  # same size, different content: only the checksum can tell
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [
    pytest.param(lambda c: _truncate(c / "model.safetensors"), id="truncated-weights"),
    pytest.param(lambda c: _flip_one_byte(c / "model.safetensors"), id="checksum-mismatch-weights"),
    pytest.param(lambda c: _flip_one_byte(c / "state.pt"), id="checksum-mismatch-state"),
    pytest.param(lambda c: (c / "manifest.json").unlink(), id="no-manifest"),
    pytest.param(lambda c: (c / "manifest.json").write_text("{not json"), id="garbled-manifest"),
    pytest.param(lambda c: (c / "state.pt").unlink(), id="missing-file"),
])  # fmt: skip
def test_every_kind_of_damage_falls_back_to_the_previous_checkpoint(tmp_path, caplog, damage):
    manager = CheckpointManager(tmp_path, keep_last=3)
    net = model()
    manager.save(1, net, {"step": 1})
    damage(manager.save(2, net, {"step": 2}))
    with caplog.at_level(logging.WARNING, logger="qllm.checkpoint"):
        chosen = manager.latest_valid()
    assert chosen.step == 1 and manager.load(chosen.path, model())["step"] == 1
    assert "step-00000002" in caplog.text and "corrupt" in caplog.text

"""ref_logprobs + dpo on a tiny model: the cache is the reference, and DPO never runs it."""

from __future__ import annotations

import math
import shutil

import pandas as pd
import pytest

from pipelines import dpo, ref_logprobs
from pipelines.core.config import DpoParams, RefLogprobsParams, TrainParams
from pipelines.core.training import preference_data
from tests.conftest import record_dpo_losses

TRAIN = TrainParams(max_steps=4, micro_batch_size=2, warmup_steps=1, lr=0.01, eval_every=2, log_every=1,
                    checkpoint_every=0, precision="fp32", weight_decay=0.0)


@pytest.fixture
def workspace(tiny_base, tmp_path):
    """A project-like tree: the SFT model at data/models/sft and the prepared preference pairs."""
    shutil.copytree(tiny_base / "model", tmp_path / "data/models/sft")
    shutil.copytree(tiny_base / "preference", tmp_path / "data/prepared/preference")
    metrics = ref_logprobs.run(tmp_path, tmp_path / "data/models/sft", tmp_path / "data/prepared/preference", tmp_path / "data/ref_logprobs", RefLogprobsParams())
    return tmp_path, metrics


def test_reference_pass_caches_every_split_keyed_by_id(workspace):
    root, metrics = workspace
    assert {s: metrics[s]["pairs"] for s in ("train", "validation", "test")} == {"train": 6, "validation": 2, "test": 4}
    cached = pd.read_parquet(root / "data/ref_logprobs/train.parquet")
    assert list(cached["id"]) == [f"train-{i}" for i in range(6)]
    assert (cached["ref_chosen_logp"] < 0).all() and (cached["ref_rejected_logp"] < 0).all()


def test_dpo_starts_at_log2_and_never_runs_the_reference(workspace, monkeypatch):
    root, _ = workspace
    calls = []
    original = preference_data.sequence_logps

    def counting(model, batch):
        calls.append(batch["input_ids"].shape[0])
        return original(model, batch)

    monkeypatch.setattr(preference_data, "sequence_logps", counting)
    first_losses = record_dpo_losses(monkeypatch)
    metrics = dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", DpoParams(beta=0.1, train=TRAIN))
    # Step 1: the policy *is* the reference, so every pair's logits are 0 and the loss is log 2.
    loss, step_metrics = first_losses[0]
    assert loss == pytest.approx(math.log(2), abs=1e-4)
    assert step_metrics["rewards/chosen"] == pytest.approx(0, abs=1e-4) and step_metrics["kl/chosen"] == pytest.approx(0, abs=1e-4)
    # One policy forward per batch (chosen and rejected concatenated): 4 training batches of 2
    # pairs, 2 validation evaluations of 1 batch, 2 held-out batches. No reference forward at all.
    assert calls == [4] * 4 + [4] * 2 + [4, 4]
    assert metrics["steps"] == 4 and "heldout/rewards/accuracies" in metrics and "val/rewards/margins" in metrics
    assert (root / "data/models/dpo/model.safetensors").exists()
    assert 0.5 <= metrics["estimate/memory_gb"] < 1 and metrics["estimate/seconds_per_micro_batch"] >= 0  # said before it loaded


def test_dpo_with_a_lora_adapter_reuses_the_lora_code(workspace):
    root, _ = workspace
    params = DpoParams(adapter="lora", train=TRAIN, lora={"r": 2, "trainable_tokens": []})
    metrics = dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", params)
    assert metrics["trainable_parameters"] < metrics["total_parameters"] * 0.2
    assert (root / "data/models/dpo/adapter_config.json").exists() and (root / "data/models/dpo/merged/config.json").exists()


def test_dpo_on_the_last_layer_leaves_the_earlier_layers_as_sft_made_them(workspace):
    """The default `dpo.lora.layers_to_transform: [-1]`: the merged policy differs from SFT in
    the last decoder layer only (embeddings, earlier layers and norms are bit-identical)."""
    from safetensors.torch import load_file

    root, _ = workspace
    params = DpoParams(adapter="lora", train=TRAIN, lora={"r": 2, "trainable_tokens": [], "layers_to_transform": [-1]})
    dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", params)
    sft = load_file(root / "data/models/sft/model.safetensors")
    merged = load_file(root / "data/models/dpo/merged/model.safetensors")
    changed = sorted(name for name in sft if not (sft[name] == merged[name]).all())
    assert changed and all(name.startswith("model.layers.1.") for name in changed)  # the tiny model has 2 layers
    assert {name.rsplit(".", 2)[-2] for name in changed} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

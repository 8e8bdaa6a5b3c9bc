"""pipelines.core.models.footprint: what a stage will need, from the base's config, before it loads it."""

from __future__ import annotations

import logging

import pytest
import torch

from benchmarks.scale.real_sizes import SHAPES
from pipelines.core.errors import QllmError
from pipelines.core.models import footprint
from tests import numerics

GB = 1e9


def test_the_parameter_count_is_the_models_own():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES["qwen2.5-tiny"])
    model = Qwen2ForCausalLM(config)
    actual = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    biases = sum(p.numel() for name, p in model.named_parameters() if name.endswith(".bias"))
    total, linear = footprint.parameters(footprint.shape(config.to_dict()))
    assert total == actual - biases  # counts: exact, Qwen2's attention biases aside
    # the real 0.5B shape: 494M parameters, of which 358M in the decoder's linear layers
    total, linear = footprint.parameters(footprint.shape(SHAPES["qwen2.5-0.5b"]))
    assert 490e6 < total < 495e6 and 355e6 < linear < 360e6


def test_qlora_chunking_and_checkpointing_each_lower_the_need():
    config = SHAPES["qwen2.5-1.5b"]
    kw = {"micro_batch": 4, "seq_len": 1024, "gradient_checkpointing": True, "loss_chunk_tokens": 1024}
    lora, qlora = footprint.estimate(config, method="lora", **kw), footprint.estimate(config, method="qlora", **kw)
    full = footprint.estimate(config, method="full", **kw)
    assert qlora.weights < 0.3 * lora.weights and qlora.total < 0.6 * lora.total
    # byte counts are integers: exact
    assert full.trainable_state == 12 * full.parameters and lora.trainable_state < 0.01 * full.trainable_state
    assert footprint.estimate(config, method="full", optimizer="adamw_bnb_8bit", **kw).trainable_state == 6 * full.parameters
    unchunked = footprint.estimate(config, method="qlora", **(kw | {"loss_chunk_tokens": 0}))
    assert unchunked.logits == 4 * qlora.logits  # 4,096 scored tokens against a 1,024-token chunk
    assert unchunked.logits > 7 * GB  # 3 copies of 4,096 x 151,936 fp32 logits
    assert footprint.estimate(config, method="qlora", **(kw | {"gradient_checkpointing": False})).activations > 5 * qlora.activations


def test_a_stage_that_cannot_fit_says_so_with_its_numbers_and_one_that_may_not_warns(caplog):
    need = footprint.estimate(SHAPES["qwen2.5-1.5b"], method="full", micro_batch=4, seq_len=1024, gradient_checkpointing=True)
    with pytest.raises(QllmError, match=r"sft \(full, 1.5\dB parameters, 4096 tokens a micro-batch\) needs about \d+\.\d GB \(weights 6\.\d+, "
                                        r"gradients and optimizer 18\.\d+, .*\), more than this machine's 16\.0 GB; try sft\.train\.gradient_checkpointing=true"):
        footprint.check(need, "sft", micro_batches=800, memory=(16 * GB, 12 * GB), flops=1e11)
    qlora = footprint.estimate(SHAPES["qwen2.5-0.5b"], method="qlora", micro_batch=1, seq_len=256, gradient_checkpointing=True, loss_chunk_tokens=1024)
    with caplog.at_level(logging.INFO, logger="qllm.footprint"):
        out = footprint.check(qlora, "lora", micro_batches=10, memory=(24 * GB, 1 * GB), flops=1e11)
    assert "it may swap or be killed" in caplog.text and "1.0 GB are free now" in caplog.text
    assert 1 < out["estimate/memory_gb"] < 3 and out["estimate/seconds_per_micro_batch"] > 0
    # the stage's whole training time too, said before it starts: 10 micro-batches of the estimate;
    # both are rounded to 0.1 from seconds at most 0.005 apart (the reported ones are rounded to 0.01),
    # so they may be one step apart where the value is near a step's middle
    minutes = round(10 * out["estimate/seconds_per_micro_batch"] / 60, 1)
    assert out["estimate/train_minutes"] == pytest.approx(minutes, abs=0.1 + numerics.tolerance(4, torch.float64, minutes + 0.1))
    assert "s a micro-batch on this machine, so about " in caplog.text and "for its 10 micro-batches" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qllm.footprint"):
        footprint.check(qlora, "lora", micro_batches=100_000, memory=(24 * GB, 20 * GB), flops=1e11)
    assert "h for its 100000 micro-batches on this machine" in caplog.text


def test_a_probe_that_cannot_measure_leaves_the_time_out(monkeypatch):
    need = footprint.estimate(SHAPES["qwen2.5-tiny"], method="lora", micro_batch=1, seq_len=64, gradient_checkpointing=False)
    monkeypatch.setattr(footprint, "matmul_flops_per_second", lambda: None)
    assert footprint.check(need, "lora", micro_batches=10, memory=(24 * GB, 20 * GB)) == {"estimate/memory_gb": round(need.total / GB, 2)}  # to 2 decimals


def test_timing_the_machine_draws_nothing_from_torchs_global_generator():
    """Every training stage times a product before it trains, beside the stages already training:
    a draw from the global generator there moved another stage's adapter initialisation (the
    same-bytes test in tests/e2e/test_pipeline_e2e.py failed now and then on a busy machine)."""
    import torch

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    footprint.matmul_flops_per_second.cache_clear()  # timed now, not remembered from an earlier test
    assert footprint.matmul_flops_per_second(size=64, repeats=1) > 0
    assert torch.equal(torch.get_rng_state(), before)


def test_the_machine_is_timed_once_per_process(monkeypatch):
    """Every training stage asks for the figure; the stages of one process share the first timing."""
    import torch

    footprint.matmul_flops_per_second.cache_clear()
    products = []
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: products.append(a.shape) or real(a, b))
    first = footprint.matmul_flops_per_second(size=32, repeats=2)
    assert len(products) == 3  # the warm-up and two timed
    assert footprint.matmul_flops_per_second(size=32, repeats=2) == first and len(products) == 3
    footprint.matmul_flops_per_second.cache_clear()


def test_the_lora_stage_reports_its_estimate(tiny_base, tmp_path):
    from pipelines import lora
    from tests.stages.test_lora import lora_params

    metrics = lora.run(tiny_base / "chat", tmp_path / "out", lora_params(tiny_base))
    assert 0.5 <= metrics["estimate/memory_gb"] < 1  # a tiny model: the libraries, mostly
    assert metrics["estimate/seconds_per_micro_batch"] >= 0


def test_a_frozen_probe_needs_the_weights_and_two_gradients_not_an_optimizer():
    config = SHAPES["qwen2.5-0.5b"]
    kw = {"micro_batch": 4, "seq_len": 1024, "gradient_checkpointing": True, "loss_chunk_tokens": 256}
    full, probe, qprobe = (footprint.estimate(config, method=m, **kw) for m in ("full", "probe", "qprobe"))
    _, linear = footprint.parameters(footprint.shape(config))
    assert probe.trainable_state == 8 * linear and probe.weights == full.weights  # byte counts: exact
    assert probe.total < 0.7 * full.total and qprobe.weights < 0.4 * probe.weights  # the embeddings stay fp32
    assert probe.step_flops < full.step_flops  # no weight gradient of the embeddings, no update
    with pytest.raises(ValueError, match="method must be one of"):
        footprint.estimate(config, method="dora", **kw)


def test_the_probe_stage_reports_its_estimate(tiny_base, tmp_path):
    from pipelines import probe_lora
    from pipelines.core.params.finetuning import ProbeLoraParams
    from tests.stages.test_probe_lora import TRAIN

    params = ProbeLoraParams(base_model=str(tiny_base / "model"), train=TRAIN.model_copy(update={"max_steps": 1}))
    trained = probe_lora.run(tiny_base / "chat", tmp_path / "a", params)
    frozen = probe_lora.run(tiny_base / "chat", tmp_path / "b", params.model_copy(update={"frozen_base": True}))
    assert trained["frozen_base"] is False and frozen["frozen_base"] is True
    assert 0.5 <= frozen["estimate/memory_gb"] <= trained["estimate/memory_gb"] < 1  # a tiny model: the libraries, mostly


def test_the_advice_names_only_what_the_stage_does_not_do_yet(tmp_path, monkeypatch):
    """sft at the 1.5B shape, one 256-token row, checkpointing and chunking already on: the error
    comes before anything loads and suggests what is left (LoRA), not what is already set."""
    from transformers import Qwen2Config

    from pipelines.core.params.training import TrainParams

    Qwen2Config(**SHAPES["qwen2.5-1.5b"]).save_pretrained(tmp_path)
    monkeypatch.setattr(footprint, "_memory", lambda: (24 * GB, 20 * GB))
    cfg = TrainParams(gradient_checkpointing=True, loss_chunk_tokens=256, micro_batch_size=1)
    with pytest.raises(QllmError, match=r"sft \(full, 1\.5\dB parameters, 256 tokens a micro-batch\) needs about 25\.\d GB") as error:
        footprint.preflight(tmp_path, cfg, method="full", seq_len=256, micro_batch=1, lora_rank=8, desc="sft")
    assert "more than this machine's 24.0 GB; try a smaller sft.train.micro_batch_size or max_seq_len; LoRA instead of all weights" in str(error.value)
    assert "gradient_checkpointing" not in str(error.value) and "loss_chunk_tokens" not in str(error.value)
    assert footprint.preflight(tmp_path / "missing", cfg, method="full", seq_len=256, micro_batch=1, lora_rank=8, desc="sft") == {}


def test_the_estimate_is_for_the_rows_training_will_have_not_the_models_context(tiny_base, tmp_path, caplog):
    """Unpacked rows are padded to the longest example of a batch: a stage estimates micro-batches of
    its longest row, not of the model's whole context (SmolLM2's 8,192 tokens made it refuse rows of
    40 as needing 350 GB)."""
    import json

    import pandas as pd

    from pipelines import sft
    from pipelines.core.data import chat_examples
    from pipelines.core.data.chat_template import parse_messages
    from pipelines.core.models.models import load_tokenizer
    from pipelines.core.params.finetuning import SftParams
    from pipelines.core.params.training import TrainParams

    config = json.loads((tiny_base / "model" / "config.json").read_text())
    cfg = TrainParams(max_steps=2, micro_batch_size=2, warmup_steps=0, eval_every=0, checkpoint_every=0, precision="fp32", extensions=[])
    params = SftParams(base_model=str(tiny_base / "model"), packing=False, max_seq_len=0, train=cfg)
    chats = [parse_messages(m) for m in pd.read_parquet(tiny_base / "chat" / "train.parquet")["messages"]]
    examples, _ = chat_examples.encode(load_tokenizer(tiny_base / "model"), chats, config["max_position_embeddings"])
    longest = max(len(e.input_ids) for e in examples)
    assert longest < config["max_position_embeddings"]
    with caplog.at_level(logging.INFO, logger="qllm.footprint"):
        sft.run(tiny_base / "chat", tmp_path / "out", params)
    assert f"parameters, {2 * longest} tokens a micro-batch)" in caplog.text, caplog.text

"""The shared training loop: schedule, parameter groups, data order, resume, guards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipelines.core.errors import QllmError
from pipelines.core.extensions import ExtensionError, Hook
from pipelines.core.models.models import build_llama
from pipelines.core.params.pretraining import ModelParams
from pipelines.core.params.training import TrainParams
from pipelines.core.training import loop
from pipelines.core.training.checkpoint import CheckpointManager
from tests import numerics


class FakeTokenizer:
    eos_token_id, pad_token_id, unk_token_id = 0, 1, None

    def __len__(self):
        return 16

    def convert_tokens_to_ids(self, token):
        return 2


def training_roundings(model) -> int:
    """One training step of `tiny_model` on `rows()` batches (4 rows of 8): the backward's chain and
    AdamW's update (tests/numerics.py)."""
    return numerics.model_roundings(model.config, 8, tokens=4 * 8, backward=True) + numerics.OPTIMIZER_STEP


def tiny_model(seed: int = 0):
    params = ModelParams(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2)
    return build_llama(params, FakeTokenizer(), max_positions=16, seed=seed)


def cfg(**kw) -> TrainParams:
    base = dict(max_steps=6, micro_batch_size=4, warmup_steps=2, lr=0.01, eval_every=3, eval_batches=1, log_every=1,
                checkpoint_every=3, keep_checkpoints=2, precision="fp32")
    return TrainParams(**(base | kw))


def rows(n=32, seq=8, seed=0) -> np.ndarray:
    # A learnable pattern: each row counts up modulo 16 from a random start.
    starts = np.random.default_rng(seed).integers(0, 16, n)
    return ((starts[:, None] + np.arange(seq)[None, :]) % 16).astype(np.int64)


def collate(data):
    return lambda idx: {"input_ids": torch.from_numpy(data[np.sort(idx)])}


def test_lr_schedule_values():
    c = cfg(max_steps=10, warmup_steps=2, min_lr_ratio=0.1, schedule="cosine")
    # warmup: (step+1)/warmup -> 0.5, 1.0; then cosine from 1 down to 0.1 over the 8 remaining steps
    assert [loop.lr_multiplier(s, c) for s in (0, 1)] == [0.5, 1.0]
    # float64 in another order: the progress, the cosine (a function) and the scaling (tests/numerics.py)
    n = numerics.FUNCTION + 8
    assert loop.lr_multiplier(2, c) == numerics.approx(1.0, n=n, dtype=torch.float64)
    assert loop.lr_multiplier(6, c) == numerics.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), n=n, dtype=torch.float64)  # = 0.55
    assert loop.lr_multiplier(10, c) == numerics.approx(0.1, n=n, dtype=torch.float64)
    linear = cfg(max_steps=10, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert loop.lr_multiplier(5, linear) == numerics.approx(0.5, n=n, dtype=torch.float64)
    assert loop.lr_multiplier(7, cfg(max_steps=10, warmup_steps=0, schedule="constant")) == 1.0


def test_no_weight_decay_for_biases_norms_and_embeddings():
    model = tiny_model()
    decay, no_decay = loop.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" in names[id(p)] or "embed" in names[id(p)] for p in no_decay["params"])
    assert any("embed" in names[id(p)] for p in no_decay["params"])
    assert all(p.ndim == 2 and "embed" not in names[id(p)] for p in decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_batches_are_seeded_epoch_permutations_and_resumable():
    order = lambda b, k: [tuple(next(b).tolist()) for _ in range(k)]  # noqa: E731
    a = loop.Batches(10, 3, seed=7, collate=lambda idx: idx)
    first = order(a, 7)  # 3 batches per epoch (the last partial one dropped), so epochs 0, 1, 2
    assert all(len(set(batch)) == 3 for batch in first)
    assert set(sum(first[:3], ())) <= set(range(10)) and first[:3] != first[3:6]
    b = loop.Batches(10, 3, seed=7, collate=lambda idx: idx)
    order(b, 4)
    state = b.state_dict()
    c = loop.Batches(10, 3, seed=7, collate=lambda idx: idx)
    c.load_state_dict(state)
    assert order(c, 3) == first[4:7]


def test_training_learns_and_reports_metrics():
    data, val = rows(), rows(8, seed=1)
    model = tiny_model()
    val_fn = lambda m: {"val/loss": loop.mean_loss(m, loop.causal_lm_loss, [collate(val)(np.arange(8))], torch.device("cpu"), "fp32")}  # noqa: E731
    before = val_fn(model)["val/loss"]
    result = loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(data)), cfg(max_steps=40, lr=0.03), val_fn=val_fn)
    assert result["steps"] == 40 and result["tokens"] == 40 * 4 * 8
    assert result["val/loss"] < before - 1.0
    assert result["best_val_loss"] <= result["val/loss"]


class Interrupt(Exception):
    pass


def test_resume_after_interruption_is_bitwise_exact(tmp_path):
    data = rows()

    def run(directory, stop_at=None):
        model = tiny_model()
        def stopper(state, metrics):
            if state.step == stop_at:
                raise Interrupt
        batches = loop.Batches(32, 4, 0, collate(data))
        loop.train(model, loop.causal_lm_loss, batches, cfg(precision="bf16"), checkpoints=CheckpointManager(directory, 2), extensions=[Hook("on_step_end", stopper)])
        return model

    reference = run(tmp_path / "straight")
    with pytest.raises(ExtensionError, match="extension 'hook:on_step_end' failed in on_step_end: Interrupt") as err:
        run(tmp_path / "killed", stop_at=5)
    assert isinstance(err.value.__cause__, Interrupt)  # checkpoints at step 3 exist; step 4-5 work is lost
    resumed = run(tmp_path / "killed")
    for (name, a), (_, b) in zip(reference.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_non_finite_loss_stops_with_the_step():
    def nan_loss(model, batch):
        loss, metrics = loop.causal_lm_loss(model, batch)
        return loss * float("nan"), metrics

    with pytest.raises(loop.NonFiniteLossError, match="non-finite loss .* at step 1"):
        loop.train(tiny_model(), nan_loss, loop.Batches(32, 4, 0, collate(rows())), cfg())


def test_early_stopping_restores_best_weights(tmp_path):
    losses = iter([1.0, 0.5, 0.7, 0.9, 0.95])
    model = tiny_model()
    result = loop.train(
        model, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(rows())),
        cfg(max_steps=20, eval_every=2, early_stopping_patience=2, checkpoint_every=0),
        val_fn=lambda m: {"val/loss": next(losses)}, checkpoints=CheckpointManager(tmp_path, 2),
    )
    # evals at steps 2, 4, 6, 8: best 0.5 at step 4, then two evals without improvement -> stop at 8
    assert result["stopped_early"] and result["steps"] == 8 and result["best_step"] == 4
    best = CheckpointManager(tmp_path).latest_valid(step=4)
    reloaded = tiny_model(seed=1)
    CheckpointManager(tmp_path).load(best.path, reloaded)
    for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_stop_signal_checkpoints_the_step_and_resumes_exactly(tmp_path, signum):
    import os
    import signal

    data = rows()
    sent = []

    def run(directory, signal_at=None):
        model = tiny_model()

        def sender(state):  # the signal arrives in the middle of step 4 (after its backward)
            if state.step + 1 == signal_at and not sent:
                sent.append(state.step + 1)
                os.kill(os.getpid(), getattr(signal, signum))

        batches = loop.Batches(32, 4, 0, collate(data))
        loop.train(model, loop.causal_lm_loss, batches, cfg(checkpoint_every=0), checkpoints=CheckpointManager(directory, 2), extensions=[Hook("on_gradients", sender)])
        return model

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    reference = run(tmp_path / "straight")
    with pytest.raises(loop.TrainingInterrupted, match=rf"train: {signum} at step 4: checkpoint saved in .*killed; rerun the same command to resume"):
        run(tmp_path / "killed", signal_at=4)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # handlers restored
    assert [c.step for c in CheckpointManager(tmp_path / "killed", 2).list()] == [4]  # step 4 finished, then saved
    resumed = run(tmp_path / "killed")
    for (name, a), (_, b) in zip(reference.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_fused_adamw_takes_the_same_steps_up_to_rounding():
    results = {}
    for optimizer in ("adamw", "adamw_fused"):
        model = tiny_model()
        summary = loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(rows())),
                                 cfg(optimizer=optimizer, max_steps=20, eval_every=0, checkpoint_every=0))  # fmt: skip
        results[optimizer] = (model, summary["train_loss"])
    (plain, plain_loss), (fused, fused_loss) = results["adamw"], results["adamw_fused"]
    # the same gradients at the first step, updates rounded otherwise: 20 steps of the chain's rounding
    n = training_roundings(plain)
    assert fused_loss == numerics.approx(plain_loss, n=n, steps=20)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        numerics.assert_within(q, p, numerics.weights_tolerance(n, steps=20, lr=0.01), name)
    assert loop.build_optimizer(plain, cfg(optimizer="adamw_fused")).defaults["fused"] is True
    assert not loop.build_optimizer(plain, cfg(optimizer="adamw")).defaults["fused"]
    assert cfg().optimizer == "adamw_fused"  # the default


def test_compiled_training_takes_the_same_steps_and_saves_the_same_names(tmp_path):
    results = {}
    for compiled in (False, True):
        model = tiny_model()
        summary = loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(rows())),
                                 cfg(compile=compiled, max_steps=4, eval_every=0, checkpoint_every=0))  # fmt: skip
        results[compiled] = (model, summary)
    (eager, eager_summary), (compiled, compiled_summary) = results[False], results[True]
    assert hasattr(compiled, "_compiled_call_impl") and compiled._compiled_call_impl is not None  # it did compile
    # TorchInductor's fused kernels sum in orders of their own: 4 steps of the chain's rounding
    n = training_roundings(eager)
    assert compiled_summary["train_loss"] == numerics.approx(eager_summary["train_loss"], n=n, steps=4)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no `_orig_mod.` prefix: same checkpoints and outputs
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        numerics.assert_within(q, p, numerics.weights_tolerance(n, steps=4, lr=0.01), name)
    assert cfg().compile is False  # the default


def test_compile_keeps_a_kernel_cache_per_cpu_cap():
    from pipelines.core import startup

    # a kernel compiled under ATEN_CPU_CAPABILITY=avx2 and loaded uncapped (or the reverse) crashed
    # the process when both shared the default cache directory
    capped = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    chosen = startup.inductor_cache_dir(capped)
    assert chosen is not None and chosen.endswith("aten_cpu_capability-avx2_onednn_max_cpu_isa-avx2")
    assert capped["TORCHINDUCTOR_CACHE_DIR"] == chosen
    assert startup.inductor_cache_dir({"ATEN_CPU_CAPABILITY": "default"}) != chosen
    assert startup.inductor_cache_dir({}) is None  # uncapped: torch's own default
    mine = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/somewhere"}
    assert startup.inductor_cache_dir(mine) is None and mine["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere"


@pytest.mark.parametrize("optimizer", ["adamw_bnb_8bit", "paged_adamw_8bit"])
def test_8bit_adamw_keeps_8bit_moments_trains_and_resumes_exactly(tmp_path, optimizer):
    data = rows()

    def model():  # matrices of 64 x 128: bitsandbytes keeps 8-bit state for tensors of 4,096 elements or more
        return build_llama(ModelParams(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=2), FakeTokenizer(), 16, 0)

    def run(directory, stop_at=None):
        net = model()
        seen = {}

        def on_step_end(state, metrics):
            seen["dtypes"] = {v["state1"].dtype for v in run.optimizer.state.values() if "state1" in v}
            if state.step == stop_at:
                raise Interrupt
        original = loop.build_optimizer

        def spy(m, c):
            run.optimizer = original(m, c)
            return run.optimizer

        loop.build_optimizer = spy
        try:
            summary = loop.train(net, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(data)), cfg(optimizer=optimizer, max_steps=8),
                                     checkpoints=CheckpointManager(directory, 2), extensions=[Hook("on_step_end", on_step_end)])  # fmt: skip
        finally:
            loop.build_optimizer = original
        return net, summary, seen

    reference, summary, seen = run(tmp_path / "straight")
    assert torch.uint8 in seen["dtypes"]  # the big matrices' moments are 8-bit
    history = summary["history"]["train"]
    assert history[-1][1] < history[0][1]  # [step, loss, lr]
    with pytest.raises(ExtensionError):
        run(tmp_path / "killed", stop_at=5)
    resumed, _, _ = run(tmp_path / "killed")  # from the checkpoint at step 3, optimizer state included
    for (name, a), (_, b) in zip(reference.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_the_attention_kernel_is_swapped_while_training_and_restored(tiny_base):
    """`train.attention: eager` trains with the eager kernel (the same loss to rounding) and gives
    the model back with its own; a kernel the model cannot use is a clear error."""
    from pipelines.core.models.models import load_causal_lm

    model = load_causal_lm(tiny_base / "model")
    assert model.config._attn_implementation == "sdpa"
    seen = []

    def loss_fn(m, batch):
        seen.append(m.config._attn_implementation)
        return loop.causal_lm_loss(m, batch)

    ids = torch.randint(5, 300, (4, 16))
    batches = loop.Batches(4, 2, 0, lambda idx: {"input_ids": ids[idx], "num_tokens": 32})
    cfg = TrainParams(max_steps=2, micro_batch_size=2, warmup_steps=0, eval_every=0, checkpoint_every=0, precision="fp32", extensions=[], attention="eager")
    loop.train(model, loss_fn, batches, cfg)
    assert seen == ["eager", "eager"] and model.config._attn_implementation == "sdpa"
    with pytest.raises(QllmError, match="train.attention: .* cannot use the 'flash_attention_2' attention kernel"), loop._attention(model, "flash_attention_2", "x"):
        raise AssertionError("not reached: entering the context fails")

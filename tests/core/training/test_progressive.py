"""Progressive stack-wise growth: phases, growth that keeps the function, frozen trunk and its
optimizer, re-warm, exact resume across growth points, saved stacks, the activation cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.core.errors import QllmError
from pipelines.core.extensions import ExtensionError, Hook
from pipelines.core.models.models import build_llama
from pipelines.core.params.pretraining import ActivationCacheParams, ModelParams, PretrainParams, ProgressiveParams
from pipelines.core.params.project import Params
from pipelines.core.training import loop, progressive
from pipelines.core.training.checkpoint import CheckpointManager
from tests import numerics
from tests.core.training.test_loop import FakeTokenizer, Interrupt, cfg, collate, rows


def model4(seed: int = 0, tie: bool = True):
    params = ModelParams(hidden_size=16, intermediate_size=32, num_layers=4, num_heads=2, num_kv_heads=2, tie_word_embeddings=tie)
    return build_llama(params, FakeTokenizer(), max_positions=16, seed=seed)


def grow_params(**kw) -> ProgressiveParams:
    return ProgressiveParams(**({"enabled": True, "stacks": [2, 2], "steps_per_stack": 3, "rewarm_steps": 2} | kw))


def test_phases_rackwise_stackwise_and_trunk():
    frozen = progressive.phases(grow_params(stacks=[1, 2, 1], steps_per_stack=5), max_steps=21)
    assert [(p.name, p.start, p.layers, p.trainable) for p in frozen] == [
        ("stack 1/3", 0, 1, None), ("stack 2/3", 5, 3, (1, 3)), ("stack 3/3", 10, 4, (3, 4)), ("end-to-end", 15, 4, None)]  # fmt: skip
    trainable = progressive.phases(grow_params(trunk="trainable"), max_steps=6)
    assert [(p.start, p.layers, p.trainable) for p in trainable] == [(0, 2, None), (3, 4, None)]  # no end-to-end steps left
    stackwise = progressive.phases(grow_params(end_to_end={"scope": "stackwise"}), max_steps=10)  # 4 steps left: 2 per stack
    assert [(p.name, p.start, p.trainable) for p in stackwise][2:] == [("end-to-end stack 1/2", 6, None), ("end-to-end stack 2/2", 8, (2, 4))]


def test_params_check_layers_steps_and_loop_settings():
    def params(progress, **train):
        data = {"model": {"num_layers": 4}, "train": {"max_steps": 10, "warmup_steps": 0} | train, "progressive": {"enabled": True} | progress}
        return PretrainParams.model_validate(data)

    assert params({"stacks": [1, 3], "steps_per_stack": 4}).progressive.stacks == [1, 3]
    with pytest.raises(ValueError, match=r"add up to 3 layers but model.num_layers is 4"):
        params({"stacks": [1, 2]})
    with pytest.raises(ValueError, match=r"train.max_steps is 10 but progressive needs 12 \(2 stacks x 6"):
        params({"steps_per_stack": 6})
    with pytest.raises(ValueError, match=r"needs 9 .*end_to_end.steps 1"):
        params({"steps_per_stack": 4, "end_to_end": {"steps": 1}})
    with pytest.raises(ValueError, match="train.nproc 1"):
        params({"steps_per_stack": 4}, nproc=2, grad_accum_steps=2)
    with pytest.raises(ValueError, match="one or more stacks"):
        params({"stacks": [4, 0]})


@pytest.mark.parametrize("tie", [True, False])
def test_identity_growth_keeps_the_logits_and_duplicate_copies_the_top_stack(tie):
    model = model4(tie=tie).eval()
    progressive.truncate(model, 2)
    ids = torch.from_numpy(rows(3, seq=8))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        progressive.grow(model, 2, range(0, 2), "identity")
        after = model(input_ids=ids).logits
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4
    assert torch.equal(after, before)  # the new layers add exact zeros (zeroed output projections) to the residual stream
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2, 3]
    assert model.model.layers[2].mlp.down_proj.weight.abs().sum() == 0 and model.model.layers[2].mlp.up_proj.weight.abs().sum() > 0

    duplicated = model4(tie=tie)
    progressive.truncate(duplicated, 2)
    progressive.grow(duplicated, 3, range(1, 2), "duplicate")  # a taller new stack repeats the source
    layers = duplicated.model.layers
    for new in (2, 3, 4):
        assert torch.equal(layers[new].self_attn.q_proj.weight, layers[1].self_attn.q_proj.weight)
        assert layers[new].self_attn.q_proj.weight.data_ptr() != layers[1].self_attn.q_proj.weight.data_ptr()  # a copy, not shared


def train_growing(directory=None, stop_at=None, grow=None, steps=9, seed=0, tie=True, watch=None):
    """9 steps: stack 1 (2 layers) for 3, stack 2 (frozen trunk) for 3, end-to-end for 3."""
    c = cfg(max_steps=steps, warmup_steps=2, lr=0.01, checkpoint_every=2, eval_every=3, seed=seed)
    model = model4(seed, tie)
    growth = progressive.Growth(grow or grow_params(), c, model, "test")
    data, logged = rows(32, seq=8, seed=seed), []

    def stopper(state, metrics):
        logged.append({"step": state.step, "lr": metrics.get("train/lr"), "layers": metrics.get("train/layers")})
        if watch is not None:
            watch(state, model)
        if state.step == stop_at:
            raise Interrupt

    val = lambda m: {"val/loss": loop.mean_loss(m, loop.causal_lm_loss, [{"input_ids": torch.from_numpy(data[:8])}],  # noqa: E731
                                                    torch.device("cpu"), "fp32")}  # fmt: skip
    checkpoints = CheckpointManager(directory, 2) if directory else None
    result = loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, seed, collate(data)), c, val_fn=val,
                            checkpoints=checkpoints, schedule=growth, extensions=[Hook("on_step_end", stopper)], desc="test")  # fmt: skip
    return model, result, logged, growth


def test_frozen_trunk_trains_only_the_new_stack_and_head_with_fresh_optimizer_and_rewarm():
    snapshots, optimizers = {}, {}

    def watch(state, model):
        snapshots[state.step] = {name: p.detach().clone() for name, p in model.named_parameters()}

    original_build = loop.build_optimizer

    def spy(net, c):
        optimizer = original_build(net, c)
        optimizers[len(optimizers)] = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return optimizer

    loop.build_optimizer = spy
    try:
        model, result, logged, _ = train_growing(grow=grow_params(growth="identity"), watch=watch)
    finally:
        loop.build_optimizer = original_build
    assert [m["layers"] for m in logged] == [2, 2, 2, 4, 4, 4, 4, 4, 4]
    names = {id(p): n for n, p in model.named_parameters()}
    # three optimizers: stack 1 (everything it had), stack 2 (layers 2-3 + the final norm; the head is the tied embedding), end-to-end
    assert len(optimizers) == 3
    stack2 = sorted(names[i] for i in optimizers[1])
    assert all(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm.")) for n in stack2) and "model.norm.weight" in stack2
    assert len(optimizers[2]) == len(list(model.parameters()))
    changed = {n for n in snapshots[3] if not torch.equal(snapshots[6][n], snapshots[3][n])}
    assert changed == {"model.norm.weight"}  # of what existed before the growth, only the final norm trained
    assert not torch.equal(snapshots[6]["model.layers.2.mlp.down_proj.weight"], snapshots[4]["model.layers.2.mlp.down_proj.weight"])
    # lr: global cosine times a 2-step re-warm after each growth point (steps 3 and 6); the logged lr
    # after step s is the one the phase's schedule set for the next step (s + 1)
    c = cfg(max_steps=9, warmup_steps=2, lr=0.01)
    expected = [loop.lr_multiplier(s + 1, c) * (min(1.0, (s + 1 - start + 1) / 2) if start else 1.0)
                for s, start in zip(range(9), [0, 0, 0, 3, 3, 3, 6, 6, 6], strict=True)]  # fmt: skip
    # float64 in another order: the cosine (a function and 6 operations), the re-warm's 3 and the scaling
    assert [m["lr"] for m in logged] == numerics.approx([0.01 * e for e in expected], n=numerics.FUNCTION + 10, dtype=torch.float64)
    assert result["steps"] == 9 and np.isfinite(result["val/loss"])
    assert all(p.requires_grad for p in model.parameters())  # end-to-end left everything trainable


def test_untied_head_trains_with_the_new_stack():
    optimizers = []
    original_build = loop.build_optimizer
    loop.build_optimizer = lambda net, c: optimizers.append(original_build(net, c)) or optimizers[-1]
    try:
        model, *_ = train_growing(tie=False, steps=6)
    finally:
        loop.build_optimizer = original_build
    names = {id(p): n for n, p in model.named_parameters()}
    stack2 = {names[id(p)] for group in optimizers[1].param_groups for p in group["params"]}
    assert "lm_head.weight" in stack2 and "model.embed_tokens.weight" not in stack2


def test_resume_across_growth_points_is_bitwise_exact(tmp_path):
    reference, reference_result, _, _ = train_growing(tmp_path / "straight")
    for stop_at in (3, 5):  # checkpoints at step 2 (before the first growth) and step 4 (just after it)
        with pytest.raises(ExtensionError):
            train_growing(tmp_path / f"killed{stop_at}", stop_at=stop_at)
        resumed, result, _, _ = train_growing(tmp_path / f"killed{stop_at}")
        for (name, a), (_, b) in zip(reference.state_dict().items(), resumed.state_dict().items(), strict=True):
            assert torch.equal(a, b), (stop_at, name)
        assert result["val/loss"] == reference_result["val/loss"]


def test_activation_cache_gives_the_same_weights_and_skips_the_trunk():
    calls = {"layer0": 0}
    plain, plain_result, _, _ = train_growing(grow=grow_params(steps_per_stack=8), steps=24)
    cached_params = grow_params(steps_per_stack=8, activation_cache=ActivationCacheParams(enabled=True))

    def count(state, model):
        calls["hit_rate"] = growth.cache.hits / max(1, growth.cache.hits + growth.cache.misses)

    model = model4()
    c = cfg(max_steps=24, warmup_steps=2, lr=0.01, checkpoint_every=2, eval_every=3)
    growth = progressive.Growth(cached_params, c, model, "test")
    first = model.model.layers[0]

    def count_first(module, args):  # growth copies the layer with its hooks: count the original only
        if module is first:
            calls["layer0"] += 1

    first.register_forward_pre_hook(count_first)
    data = rows(32, seq=8)
    loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(data)), c, schedule=growth,
                   extensions=[Hook("on_step_end", count)], desc="test")  # fmt: skip
    # cached activations come from other batches: 24 steps whose backward passes may round otherwise (tests/numerics.py)
    n = numerics.model_roundings(model.config, 8, tokens=4 * 8, backward=True) + numerics.OPTIMIZER_STEP
    for (name, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items(), strict=True):
        numerics.assert_within(b, a, numerics.weights_tolerance(n, steps=24, lr=0.01), name)
    # the frozen-trunk phase (steps 8-15) is the second epoch of the 32 rows, which hold repeated sequences:
    # each distinct sequence misses once, the repeats hit; the trunk runs only for batches with a miss
    order = loop.Batches(32, 4, 0, lambda idx: [tuple(data[i]) for i in np.sort(idx)])
    epoch = [next(order) for _ in range(16)][8:]
    seen, misses, batches_with_misses = set(), 0, 0
    for batch in epoch:
        new = [row for row in batch if row not in seen]  # a sequence twice in one batch misses twice
        misses, batches_with_misses = misses + len(new), batches_with_misses + bool(new)
        seen |= set(batch)
    assert (growth.cache.misses, growth.cache.hits) == (misses, 32 - misses) and misses < 32
    assert calls["layer0"] == 8 + batches_with_misses + 8 < 24  # stack 1, the frozen phase, end-to-end


def test_activation_cache_hits_on_the_second_epoch_and_spills_to_disk():
    model = model4().train()
    progressive.truncate(model, 2)
    progressive.grow(model, 2, range(0, 2), "duplicate")
    model.requires_grad_(False)
    cache = progressive.ActivationCache(ActivationCacheParams(enabled=True, memory_mb=2 * 8 * 16 * 4 / 2**20, disk_mb=1))
    cache.attach(model)
    cache.reset(2)
    ids = torch.from_numpy(np.stack([np.arange(8) + i for i in range(6)]) % 16)  # six different sequences
    with torch.no_grad():
        first = model(input_ids=ids).logits
        second = model(input_ids=ids).logits
        model.eval()
        plain = model(input_ids=ids).logits  # eval mode: no cache
    # the cache's rows read back are the bits it stored; the trunk it ran, another batch's order of the chain
    assert torch.equal(first, second)
    numerics.assert_close_as(first, plain, n=numerics.model_roundings(model.config, 8))
    assert (cache.hits, cache.misses) == (6, 6)
    assert len(cache.memory) == 2 and len(cache.disk) == 4  # two rows of 8x16 fp32 fit in memory, the rest spilled
    assert cache.metrics()["train/activation_cache_hit_rate"] == 0.5
    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4  # the split forward put the layers back
    cache.close()


def test_save_and_load_stacks(tmp_path):
    model = model4()
    progressive.save_stacks(model, [1, 3], tmp_path)
    listing = (tmp_path / "stacks" / "stacks.json").read_text()
    assert '"layers": [\n        1,\n        4\n      ]' in listing
    other = model4(seed=1)
    progressive.load_stack(other, tmp_path / "stacks" / "stack-01.safetensors", first_layer=1)
    assert torch.equal(other.model.layers[3].mlp.up_proj.weight, model.model.layers[3].mlp.up_proj.weight)
    assert not torch.equal(other.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(QllmError, match="does not fit from layer 2"):
        progressive.load_stack(other, tmp_path / "stacks" / "stack-01.safetensors", first_layer=2)


def test_growth_refuses_a_model_of_the_wrong_depth():
    with pytest.raises(QllmError, match=r"stacks \[1, 2\]: the model has 4 layers; expected 3 \(all stacks"):
        progressive.Growth(grow_params(stacks=[1, 2]), cfg(max_steps=6), model4())


def test_pretrain_stage_grows_saves_stacks_and_logs_to_mlflow(tmp_path, mlflow_template_db):
    """The stage end to end on the tiny profile: 2 stacks of 1 layer, identity growth, the cache."""
    import json

    from mlflow import MlflowClient

    from pipelines.core.models.models import load_model_and_tokenizer
    from pipelines.core.run import repro
    from tests.conftest import make_project
    from tests.e2e.test_resume_kill import UPSTREAM

    grow = {"enabled": True, "stacks": [1, 1], "steps_per_stack": 4, "growth": "identity", "save_stacks": True,
            "activation_cache": {"enabled": True}}  # fmt: skip
    root = make_project(tmp_path / "project", mlflow_template_db, {"pretrain": {"model": {"num_layers": 2}, "progressive": grow}})
    try:
        for name in [*UPSTREAM, "pretrain"]:
            repro.reproduce(root, name)
    finally:
        repro.close(root)
    out = root / "data/models/pretrain"
    model, _ = load_model_and_tokenizer(out)  # a normal save_pretrained directory with both stacks
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    listing = json.loads((out / "stacks/stacks.json").read_text())["stacks"]
    assert [entry["layers"] for entry in listing] == [[0, 1], [1, 2]]
    other = model.__class__(model.config)
    progressive.load_stack(other, out / "stacks/stack-01.safetensors", first_layer=1)
    assert torch.equal(other.model.layers[1].self_attn.o_proj.weight, model.model.layers[1].self_attn.o_proj.weight)
    assert model.model.layers[1].self_attn.o_proj.weight.abs().sum() > 0  # the identity block trained away from zero
    metrics = json.loads((root / "data/metrics/pretrain.json").read_text())
    assert metrics["steps"] == 12
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("qllm").experiment_id], "tags.qllm.stage = 'pretrain'")
    layers = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/layers")]
    assert (4, 2.0) in layers and min(v for _, v in layers) == 1.0  # the growth point at step 4, and stack 1 before it
    assert run.data.params["pretrain.progressive.growth"] == "identity"


def test_cache_spills_and_reads_back_bf16_and_drops_beyond_its_budget():
    cache = progressive.ActivationCache(ActivationCacheParams(enabled=True, memory_mb=0, disk_mb=3 * 64 * 2 / 2**20))
    tensors = {bytes([i]): torch.randn(8, 8).to(torch.bfloat16) for i in range(4)}
    for key, tensor in tensors.items():
        cache.put(key, tensor)
    assert not cache.memory and list(cache.disk) == [bytes([1]), bytes([2]), bytes([3])]  # room for three on disk: the oldest dropped
    assert cache.get(bytes([0])) is None
    for key in (bytes([3]), bytes([1])):
        back = cache.get(key)
        assert back.dtype == torch.bfloat16 and torch.equal(back, tensors[key])
    cache.close()


def test_sft_grows_the_base_llama_pro_style(tiny_base, tmp_path):
    """sft with identity growth: the 2-layer base is the first stack, one identity block is added
    and trained on a frozen base (block expansion, LLaMA-Pro), then end to end; the output has 3 layers."""
    from pipelines import sft
    from pipelines.core.models.models import load_causal_lm
    from pipelines.core.params.finetuning import SftParams

    params = SftParams(base_model=str(tiny_base / "model"), train=cfg(max_steps=6, micro_batch_size=2, eval_every=3),
                            progressive=grow_params(stacks=[2, 1], steps_per_stack=2, growth="identity", save_stacks=True))  # fmt: skip
    metrics = sft.run(tiny_base / "chat", tmp_path / "out", params)
    model = load_causal_lm(tmp_path / "out")
    base = load_causal_lm(tiny_base / "model")
    assert model.config.num_hidden_layers == 3 and metrics["steps"] == 6
    assert (tmp_path / "out/stacks/stack-01.safetensors").exists()
    assert model.model.layers[2].mlp.down_proj.weight.abs().sum() > 0  # the zeroed projection trained
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)  # end to end trained the base too
    with pytest.raises(QllmError, match=r"stacks \[3, 2\]: the model has 2 layers; expected 3 \(the first stack: the trained model"):
        sft.run(tiny_base / "chat", tmp_path / "bad", params.model_copy(update={"progressive": grow_params(stacks=[3, 2], steps_per_stack=2)}))


def test_progressive_is_refused_for_adapter_stages():
    with pytest.raises(ValueError, match=r"lora.progressive\n  Extra inputs are not permitted"):
        Params.model_validate(yaml_params({"lora": {"progressive": {"enabled": True}}}))
    with pytest.raises(ValueError, match=r"sft.progressive: train.max_steps is 5 but progressive needs 80"):
        Params.model_validate(yaml_params({"sft": {"progressive": {"enabled": True}, "train": {"max_steps": 5, "warmup_steps": 0}}}))


def yaml_params(overlay: dict) -> dict:
    from pathlib import Path

    import yaml

    from pipelines.core.params.files import deep_merge

    return deep_merge(yaml.safe_load((Path(__file__).parents[3] / "params.yaml").read_text()), overlay)

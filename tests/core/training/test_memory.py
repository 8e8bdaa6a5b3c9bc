"""The memory extension: product-key lookup arithmetic, the model class saved and loaded (in the
pipeline and through transformers' custom code), training with usage metrics, exact resume, the stage."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from pipelines.core.extensions import ExtensionError, Hook
from pipelines.core.models.memory_model import ProductKeyMemory, QllmMemoryLlamaForCausalLM
from pipelines.core.models.models import build_llama, load_causal_lm
from pipelines.core.params.pretraining import MemoryParams, ModelParams
from pipelines.core.training import loop
from pipelines.core.training.checkpoint import CheckpointManager
from pipelines.core.training.memory import MemoryUsage
from tests import numerics
from tests.conftest import load_with_remote_code
from tests.core.training.test_loop import FakeTokenizer, Interrupt, cfg, collate, rows


def memory_model(seed: int = 0, layers=(0,)):
    memory = MemoryParams(enabled=True, layers=list(layers), num_keys=8, heads=2, key_dim=8, topk=3)
    params = ModelParams(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=2, memory=memory)
    return build_llama(params, FakeTokenizer(), max_positions=16, seed=seed)


def test_product_keys_find_the_exact_top_k_of_all_rows():
    """The best k of the k*k sums of each half's best k are the best k of all num_keys**2 sums
    (a sum can only be in the overall top k if each half is in its own top k)."""
    torch.manual_seed(0)
    memory = ProductKeyMemory(hidden=12, num_keys=6, heads=2, key_dim=4, topk=3)
    x = torch.randn(5, 12)
    rows, weights = memory.lookup(x)
    query = memory.query_norm(memory.query(x).view(-1, 2, 4)).view(-1, 2, 2, 2)
    for token, head in itertools.product(range(5), range(2)):
        left = query[token, head, 0] @ memory.keys[head, 0].T  # [num_keys]
        right = query[token, head, 1] @ memory.keys[head, 1].T
        every = (left[:, None] + right[None, :]).flatten()  # row i * num_keys + j scores left[i] + right[j]
        best = every.topk(3)
        assert rows[token, head].tolist() == best.indices.tolist()
        # the scores in another order (two half-key dot products of 2 and their sum: 4 roundings, on
        # at most key_dim x max|query| x max|key|), then the softmax over 3 (its sum, exp and division: 6);
        # a softmax moves by at most its inputs' error (tests/numerics.py)
        scores = 4 * float(query.abs().max() * memory.keys.abs().max())
        numerics.assert_close_as(weights[token, head], torch.softmax(best.values, -1), n=4 + 6, magnitude=scores)
    numerics.assert_close_as(weights.sum(-1), torch.ones(5, 2), n=3 + 3)  # three weights, each one division, summed


def test_memory_output_is_the_gated_weighted_sum_of_the_rows_read():
    torch.manual_seed(1)
    memory = ProductKeyMemory(hidden=8, num_keys=4, heads=1, key_dim=4, topk=2)
    x = torch.randn(3, 8)
    rows, weights = memory.lookup(x)
    read = (memory.values.weight[rows[:, 0]] * weights[:, 0, :, None]).sum(1)  # [3, 8]
    gated = read * torch.nn.functional.silu(memory.gate(x))
    expected = memory.out(gated)
    # EmbeddingBag's weighted sum of 2 rows in another order, the gate's product (8) and silu, then
    # the output product (8): worst case on the chain in absolute values (tests/numerics.py)
    magnitude = numerics.abs_product((memory.values.weight[rows[:, 0]].abs() * weights[:, 0, :, None]).sum(1) * torch.nn.functional.silu(memory.gate(x)).abs(), memory.out.weight)
    numerics.assert_within(memory(x), expected, numerics.tolerance(2 + 8 + numerics.FUNCTION + 1 + 8, magnitude=magnitude, worst=True))
    assert memory.last_indices.shape == (3, 2)


def test_model_class_saves_loads_and_adds_the_memory_to_the_mlp(tmp_path):
    model = memory_model().eval()
    assert isinstance(model, QllmMemoryLlamaForCausalLM) and model.config.memory_layers == [0]
    names = [name for name, _ in model.named_parameters() if ".memory." in name]
    assert names and all(name.startswith("model.layers.0.mlp.memory.") for name in names)
    ids = torch.from_numpy(rows(2, seq=8))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        memory = model.model.layers[0].mlp.memory
        original_out = memory.out.weight.clone()
        memory.out.weight.zero_()  # a silent memory: the model is a plain Llama with the same weights
        silent = model(input_ids=ids).logits
        memory.out.weight.copy_(original_out)
    assert not numerics.within(logits, silent, numerics.tolerance(numerics.model_roundings(model.config, 8), magnitude=float(silent.abs().max())))
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m/config.json").read_text())
    assert config["model_type"] == "qllm_memory_llama" and config["auto_map"]["AutoModelForCausalLM"].startswith("memory_model.")
    assert (tmp_path / "m/memory_model.py").exists()
    loaded = load_causal_lm(tmp_path / "m").eval()  # the pipeline's loader: the registered class, no remote code
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, logits)
    # elsewhere: transformers' custom-code path, in a fresh interpreter that cannot import the pipeline
    name, imported, total = load_with_remote_code(tmp_path / "m", ids.tolist())
    assert name == "QllmMemoryLlamaForCausalLM" and not imported
    # another process: the forward's chain, and the sum of its 2 x 8 x 16 logits (tests/numerics.py)
    assert total == numerics.approx(logits.sum().item(), n=numerics.model_roundings(model.config, 8) + logits.numel(), magnitude=float(logits.abs().sum()))


def test_memory_layers_must_exist():
    with pytest.raises(ValueError, match=r"memory.layers \[3\]: the model has layers 0..1"):
        ModelParams(num_layers=2, memory={"enabled": True, "layers": [3]})
    with pytest.raises(ValueError, match="topk"):
        MemoryParams(num_keys=4, topk=5)


def train_memory(directory=None, stop_at=None):
    model, logged = memory_model(), []

    def stopper(state, metrics):
        logged.append(dict(metrics))
        if state.step == stop_at:
            raise Interrupt

    c = cfg(max_steps=6, checkpoint_every=2)
    data = rows(32, seq=8)
    checkpoints = CheckpointManager(directory, 2) if directory else None
    loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(data)), c, checkpoints=checkpoints,
                   extensions=[MemoryUsage(model), Hook("on_step_end", stopper)])  # fmt: skip
    return model, logged


def test_a_step_updates_exactly_the_memory_rows_it_read():
    model = memory_model()
    memory = model.model.layers[0].mlp.memory
    before = memory.values.weight.detach().clone()
    data = rows(32, seq=2)  # 4 sequences x 2 tokens x 2 heads x 3 rows: at most 48 of 64 rows read
    loop.train(model, loop.causal_lm_loss, loop.Batches(32, 4, 0, collate(data)), cfg(max_steps=1, warmup_steps=0, weight_decay=0.5))
    changed = set(torch.nonzero((memory.values.weight != before).any(1)).flatten().tolist())
    # the reads of every position but the last (whose prediction has no label, so no gradient); no weight decay on the table
    read = memory.last_indices.view(4, 2, -1)[:, :-1]
    assert changed == set(read.flatten().tolist()) and len(changed) < 64
    _, no_decay = loop.param_groups(model, 0.1)
    assert any(p is memory.values.weight for p in no_decay["params"])


def test_training_reports_usage_and_resumes_exactly(tmp_path):
    reference, logged = train_memory(tmp_path / "straight")
    usage = [m["memory/usage_layer0"] for m in logged]
    assert all(0 < u <= 1 for u in usage)  # log_every 1: each step's reads, 4 rows x 8 tokens x 2 heads x 3 rows of 64
    with pytest.raises(ExtensionError):
        train_memory(tmp_path / "killed", stop_at=3)
    resumed, resumed_logged = train_memory(tmp_path / "killed")
    for (name, a), (_, b) in zip(reference.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert [m["memory/usage_layer0"] for m in resumed_logged] == usage[2:]
    assert np.isfinite(usage).all()


def test_pretrain_with_memory_then_sft_through_the_stages(tmp_path, mlflow_template_db):
    from mlflow import MlflowClient

    from pipelines.core.models.models import load_model_and_tokenizer
    from pipelines.core.run import repro
    from tests.conftest import make_project
    from tests.e2e.test_resume_kill import UPSTREAM

    memory = {"enabled": True, "layers": [0], "num_keys": 16, "heads": 2, "key_dim": 16, "topk": 4}
    root = make_project(tmp_path / "project", mlflow_template_db, {"pretrain": {"model": {"memory": memory}}})
    try:
        for name in [*UPSTREAM, "pretrain", "sft"]:
            repro.reproduce(root, name)
    finally:
        repro.close(root)
    for stage in ("pretrain", "sft"):  # sft loaded the memory model and saved it as one
        model, _ = load_model_and_tokenizer(root / "data/models" / stage)
        assert isinstance(model, QllmMemoryLlamaForCausalLM) and model.model.layers[0].mlp.memory.values.weight.shape == (256, 32)
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("qllm").experiment_id], "tags.qllm.stage = 'pretrain'")
    usage = [m.value for m in client.get_metric_history(run.info.run_id, "memory/usage_layer0")]
    assert len(usage) == 6 and all(0 < u <= 1 for u in usage)  # log_every 2 over 12 steps

"""LoRA: parameter counts, target validation, adapter save/load; SFT and LoRA share one path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines import lora, sft
from pipelines.core.errors import QllmError
from pipelines.core.models import adapters
from pipelines.core.models.models import load_causal_lm, load_tokenizer, parameter_counts
from pipelines.core.params.finetuning import FinetuneParams, LoraAdapterParams, LoraParams
from pipelines.core.params.training import TrainParams
from tests import numerics

TRAIN = TrainParams(max_steps=4, micro_batch_size=2, warmup_steps=1, lr=0.01, eval_every=2, eval_batches=1,
                    log_every=1, checkpoint_every=0, precision="fp32", weight_decay=0.0)


def lora_params(tiny_base, **kw) -> LoraParams:
    """`LoraParams` from flat keywords: the adapter's go to `adapter`; plain LoRA (`allocation:
    uniform`) unless `allocation` says otherwise."""
    adapter = {"lora_alpha": 8} | ({} if kw.get("allocation") == "quantum_opt" else {"r": 4})  # quantum_opt's ranks are its stage's
    adapter |= {k: kw.pop(k) for k in list(kw) if k in LoraAdapterParams.model_fields}
    return LoraParams(base_model=str(tiny_base / "model"), train=TRAIN, adapter=adapter, **{"allocation": "uniform", **kw})


def logits_tolerance(model, ids, merge: int) -> float:
    """Two computations of `model`'s logits on `ids`, one through merged weights: the forward's chain
    (tests/numerics.py) and `merge` more roundings of each weight, on the largest |logit|."""
    with torch.no_grad():
        magnitude = float(model.eval()(ids).logits.abs().max())
    return numerics.tolerance(numerics.model_roundings(model.config, ids.shape[1]) + merge, magnitude=magnitude)


def wrapped(tiny_base, params):
    return adapters.wrap(params.adapter, lora.SECTION)(load_causal_lm(tiny_base / "model"), load_tokenizer(tiny_base / "model"))


def test_trainable_parameters_are_r_times_in_plus_out(tiny_base):
    # tiny model: hidden 32, MLP 64, 2 layers; q,k,v,o are 32->32, gate/up 32->64, down 64->32
    per_layer = 4 * (32 + 32) + 3 * (32 + 64)
    counts = parameter_counts(wrapped(tiny_base, lora_params(tiny_base, trainable_tokens=[])))
    assert counts["trainable_parameters"] == 4 * per_layer * 2
    base_total = parameter_counts(load_causal_lm(tiny_base / "model"))["total_parameters"]
    assert counts["total_parameters"] == base_total + counts["trainable_parameters"]
    # plus one embedding row (hidden 32) per trainable token: the two chat markers by default
    with_tokens = parameter_counts(wrapped(tiny_base, lora_params(tiny_base)))
    assert with_tokens["trainable_parameters"] == 4 * per_layer * 2 + 2 * 32


def test_rank_pattern_sets_per_module_ranks(tiny_base):
    params = lora_params(tiny_base, target_modules=["q_proj"], rank_pattern={"model.layers.0.self_attn.q_proj": 2}, trainable_tokens=[])
    assert parameter_counts(wrapped(tiny_base, params))["trainable_parameters"] == 2 * 64 + 4 * 64  # layer 0 rank 2, layer 1 rank 4


@pytest.mark.parametrize(("layers", "adapted"), [([-1], [1]), ([0], [0]), ([-2, 1], [0, 1]), ([], [0, 1])])
def test_layers_to_transform_adapts_only_those_layers(tiny_base, layers, adapted):
    # 2 layers; negative indices count from the end
    model = wrapped(tiny_base, lora_params(tiny_base, allocation="uniform", layers_to_transform=layers, trainable_tokens=[]))
    with_adapters = sorted({int(name.split(".layers.")[1].split(".")[0]) for name, _ in model.named_parameters() if "lora_A" in name})
    assert with_adapters == adapted
    per_layer = 4 * (32 + 32) + 3 * (32 + 64)
    assert parameter_counts(model)["trainable_parameters"] == 4 * per_layer * len(adapted)
    assert model.peft_config["default"].layers_to_transform == (adapted if layers else None)


@pytest.mark.parametrize("index", [2, -3])
def test_layer_outside_the_model_is_a_clear_error(tiny_base, index):
    with pytest.raises(QllmError, match=rf"lora.adapter.layers_to_transform: {index} is outside the model's 2 layers \(0..1, or -2..-1 from the end\)"):
        wrapped(tiny_base, lora_params(tiny_base, allocation="uniform", layers_to_transform=[index]))


@pytest.mark.parametrize("allocation", ["quantum_opt", "adalora", "qubo_in_loop"])
def test_layers_to_transform_needs_the_uniform_allocation(tiny_base, allocation):
    with pytest.raises(ValueError, match=rf"adapter.layers_to_transform: applies only with allocation: uniform \(here allocation is {allocation}\)"):
        lora_params(tiny_base, layers_to_transform=[-1], allocation=allocation)


@pytest.mark.parametrize(("field", "value"), [("target_modules", ["q_projx"]), ("rank_pattern", {"layers.9.mlp.up_proj": 2})])
def test_targets_that_match_nothing_are_a_clear_error(tiny_base, field, value):
    params = lora_params(tiny_base, **{field: value})
    with pytest.raises(QllmError, match=rf"lora.adapter.{field}: .* matches no linear module of the model \(its linear modules are: down_proj, gate_proj, k_proj"):
        wrapped(tiny_base, params)


def test_unknown_trainable_token_is_a_clear_error(tiny_base):
    with pytest.raises(QllmError, match=r"lora.adapter.trainable_tokens: '<\|nope\|>' is not in the tokenizer's vocabulary"):
        wrapped(tiny_base, lora_params(tiny_base, trainable_tokens=["<|nope|>"]))


def test_adapter_round_trip_and_merge(tiny_base, tmp_path):
    from peft import PeftModel

    out = tmp_path / "lora"
    metrics = lora.run(tiny_base / "chat", out, lora_params(tiny_base), base_for_users="data/models/pretrain")
    assert metrics["steps"] == 4 and metrics["trainable_fraction"] < 0.2
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert (out / "merged" / "model.safetensors").exists()
    ids = torch.tensor([[1, 5, 9, 12, 40]])
    adapted = PeftModel.from_pretrained(load_causal_lm(tiny_base / "model"), str(out)).eval()
    merged = load_causal_lm(out / "merged").eval()
    base = load_causal_lm(tiny_base / "model").eval()
    with torch.no_grad():
        a, m, b = (x(input_ids=ids).logits for x in (adapted, merged, base))
    tol = logits_tolerance(merged, ids, merge=4 + 2)  # merging W + B A s: a product of rank 4, the scale and the sum
    numerics.assert_within(a, m, tol, "merged")
    assert not numerics.within(a, b, tol)  # the adapter learned something
    import json

    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "data/models/pretrain"


def test_adapter_files_name_no_local_path_and_no_set_order(tiny_base, tmp_path):
    """The model card and adapter_config.json are the same bytes in any directory and process:
    PEFT would write the base's absolute path into README.md and `target_modules` in set order."""
    import json

    model = wrapped(tiny_base, lora_params(tiny_base, target_modules=["v_proj", "q_proj", "up_proj", "k_proj", "o_proj"]))
    adapters.save("data/models/pretrain", merge=False)(model, load_tokenizer(tiny_base / "model"), tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert str(tiny_base) not in card
    assert "base_model: data/models/pretrain" in card and "base_model:adapter:data/models/pretrain" in card
    settings = json.loads((tmp_path / "adapter_config.json").read_text())
    assert settings["target_modules"] == ["k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert settings["base_model_name_or_path"] == "data/models/pretrain"
    assert model.get_base_model().name_or_path == str(tiny_base / "model")  # the live model keeps its path


def test_sft_trains_all_weights_and_lowers_the_loss(tiny_base, tmp_path):
    params = FinetuneParams(base_model=str(tiny_base / "model"), train=TRAIN.model_copy(update={"max_steps": 12, "eval_every": 12}))
    metrics = sft.run(tiny_base / "chat", tmp_path / "sft", params)
    assert metrics["trainable_fraction"] == 1.0
    assert metrics["data/train_examples"] == 10 and metrics["data/train_rows"] < 10  # packed
    model = load_causal_lm(tmp_path / "sft")
    assert load_tokenizer(tmp_path / "sft").chat_template
    base = load_causal_lm(tiny_base / "model")
    changed = [n for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters(), strict=True) if not torch.equal(p, q)]
    assert len(changed) == len(list(base.parameters()))
    assert np.isfinite(metrics["val/loss"])


def test_sft_and_lora_can_run_side_by_side_in_threads(tiny_base, tmp_path):
    """Prefect runs independent stages in worker threads: model construction must not race
    (transformers builds models under process-wide patches; see models.CONSTRUCTION)."""
    from concurrent.futures import ThreadPoolExecutor

    sft_params = FinetuneParams(base_model=str(tiny_base / "model"), train=TRAIN)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(sft.run, tiny_base / "chat", tmp_path / f"sft{i}", sft_params) for i in range(2)]
        futures += [pool.submit(lora.run, tiny_base / "chat", tmp_path / f"lora{i}", lora_params(tiny_base)) for i in range(2)]
        results = [f.result() for f in futures]
    assert [r["steps"] for r in results] == [4, 4, 4, 4]
    for i in range(2):
        model = load_causal_lm(tmp_path / f"lora{i}" / "merged")
        assert all(p.device.type == "cpu" for p in model.parameters())


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


def test_dora_trains_magnitudes_and_its_merge_is_the_adapter_on_the_base(tiny_base, tmp_path):
    from peft import PeftModel

    metrics = lora.run(tiny_base / "chat", tmp_path / "out", lora_params(tiny_base, use_dora=True, lora_dropout=0.0))
    assert np.isfinite(metrics["val/loss"])
    config = __import__("json").loads((tmp_path / "out/adapter_config.json").read_text())
    assert config["use_dora"] is True
    adapter = PeftModel.from_pretrained(load_causal_lm(tiny_base / "model"), str(tmp_path / "out"))
    magnitudes = [n for n, _ in adapter.named_parameters() if "lora_magnitude_vector" in n]
    assert magnitudes  # DoRA's magnitude vectors were trained and saved
    ids = torch.arange(3, 30).reshape(1, -1)
    merged = load_causal_lm(tmp_path / "out/merged")
    # DoRA's merge: the rank-4 product, the scale, the sum, each column's norm over d_in (up to 64) and its rescaling
    numerics.assert_within(_logits(merged, ids), _logits(adapter, ids), logits_tolerance(merged, ids, merge=4 + 2 + 64 + 3))


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora"])
def test_pissa_and_olora_adapters_load_on_the_original_base(tiny_base, tmp_path, init):
    """The base keeps the residual while training; the saved adapter is converted to a plain LoRA
    of rank 2r against the original base, so base + adapter is the trained model (merged/)."""
    from peft import PeftModel

    lora.run(tiny_base / "chat", tmp_path / "out", lora_params(tiny_base, init_lora_weights=init, lora_dropout=0.0, trainable_tokens=[]))
    config = __import__("json").loads((tmp_path / "out/adapter_config.json").read_text())
    assert config["r"] == 8 and config["init_lora_weights"] is True  # 2r, and loading it decomposes nothing
    merged = load_causal_lm(tmp_path / "out/merged")
    base = load_causal_lm(tiny_base / "model")
    ids = torch.arange(3, 30).reshape(1, -1)
    trained = _logits(merged, ids)
    # merged/ holds the residual plus the trained factors; the converted adapter the original base
    # plus both factors of rank 2r (8) against the start's: the same terms summed in another order
    tol = logits_tolerance(merged, ids, merge=8 + 4)
    assert not numerics.within(trained, _logits(base, ids), tol)  # it did train
    numerics.assert_within(_logits(PeftModel.from_pretrained(base, str(tmp_path / "out")), ids), trained, tol)


def test_dora_and_pissa_need_a_plain_lora_allocation(tiny_base, tmp_path):
    with pytest.raises(ValueError, match=r"adapter.use_dora: applies only with allocation: uniform or quantum_opt \(here allocation is qubo_in_loop\)"):
        lora_params(tiny_base, use_dora=True, allocation="qubo_in_loop", adaptive={"tinit": 1, "tfinal": 1, "every": 1})
    with pytest.raises(QllmError, match=r"lora.adapter.init_lora_weights: pissa moves part of each weight into the adapter"):
        lora.run(tiny_base / "chat", tmp_path / "b", lora_params(tiny_base, init_lora_weights="pissa", quantization="nf4"))
    with pytest.raises(ValueError, match="init_lora_weights"):
        LoraAdapterParams(init_lora_weights="svd")


class _EstimateSeen(Exception):
    """Raised in place of loading the base: the stage's memory estimate has been made."""


@pytest.mark.parametrize(
    ("allocation", "settings", "expected"),
    [
        ("uniform", {"adapter": {"r": 4, "rank_pattern": {"q_proj": 6}}}, 6),
        ("qubo_in_loop", {"adapter": {"r": 4}, "adaptive": {"init_r": 12, "tinit": 1, "tfinal": 1}}, 12),  # every module starts at init_r, masked down to r
        ("adalora", {"adapter": {"r": 4}, "adaptive": {"init_r": 10, "tinit": 1, "tfinal": 1}}, 10),
        ("quantum_opt", {"adapter": {"rank_pattern": {"q_proj": 16, "v_proj": 4}}}, 16),  # rank_pattern as apply_allocation sets it
    ],
)
def test_the_memory_estimate_counts_the_rank_training_starts_at(tiny_base, tmp_path, monkeypatch, allocation, settings, expected):
    """Issue 78: preflight estimated at `adapter.r` (4) while the in-training allocations train at
    `init_r` from the first step."""
    from pipelines.core.models import footprint
    from pipelines.core.training import finetune

    seen = []
    monkeypatch.setattr(footprint, "preflight", lambda *args, **kw: seen.append(kw["lora_rank"]) or {})
    monkeypatch.setattr(finetune, "load_model_and_tokenizer", lambda *args: (_ for _ in ()).throw(_EstimateSeen()))
    params = LoraParams(base_model=str(tiny_base / "model"), allocation=allocation, train=TRAIN.model_copy(update={"max_steps": 6}),
                        **{key: value for key, value in settings.items() if key != "adapter"})  # fmt: skip
    params = params.model_copy(update={"adapter": params.adapter.model_copy(update=settings["adapter"])})
    with pytest.raises(_EstimateSeen):
        lora.run(tiny_base / "chat", tmp_path / "out", params)
    assert seen == [expected]

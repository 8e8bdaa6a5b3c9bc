"""ref_logprobs + dpo on a tiny model: the cache is the reference, and DPO never runs it."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from pipelines import dpo, ref_logprobs
from pipelines.core.errors import QllmError
from pipelines.core.models.models import load_for_inference
from pipelines.core.params.preference import DpoParams, RefLogprobsParams
from pipelines.core.params.training import TrainParams
from pipelines.core.preference import preference_data
from tests import numerics
from tests.conftest import record_dpo_losses

TRAIN = TrainParams(max_steps=4, micro_batch_size=2, warmup_steps=1, lr=0.01, eval_every=2, log_every=1,
                    checkpoint_every=0, precision="fp32", weight_decay=0.0)


FORMULA = 24
"""A preference loss's own roundings: at most four elementwise functions and 16 other operations."""


def logp_tolerance(root, magnitude: float) -> float:
    """How far two forward passes of the start model in other batch shapes (the reference cache's,
    the policy's at step 1, one sequence at a time here) may put a log-probability sum of size
    `magnitude` apart: the tiny model's chain at up to 128 positions (tests/numerics.py)."""
    from transformers import AutoConfig

    return numerics.tolerance(numerics.model_roundings(AutoConfig.from_pretrained(root / "data/models/sft"), 128), magnitude=magnitude)


def cached_magnitude(root) -> float:
    """The largest |log-probability sum| in the reference cache."""
    cached = pd.read_parquet(root / "data/ref_logprobs/train.parquet")
    return float(cached[["ref_chosen_logp", "ref_rejected_logp"]].abs().max().max())


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
    # Step 1: the policy *is* the reference, so every pair's logits are 0 and the loss is log 2, up
    # to two forward passes' rounding of each log-ratio's two sums (-logsigmoid's slope at 0 is 1/2)
    loss, step_metrics = first_losses[0]
    tol = logp_tolerance(root, cached_magnitude(root))
    assert loss == pytest.approx(math.log(2), abs=0.5 * 0.1 * 2 * tol + numerics.tolerance(FORMULA, magnitude=math.log(2)))
    assert step_metrics["rewards/chosen"] == pytest.approx(0, abs=0.1 * tol) and step_metrics["kl/chosen"] == pytest.approx(0, abs=tol)
    # One policy forward per batch (chosen and rejected concatenated): 4 training batches of 2
    # pairs, 2 validation evaluations of 1 batch, 2 held-out batches. No reference forward at all.
    assert calls == [4] * 4 + [4] * 2 + [4, 4]
    assert metrics["steps"] == 4 and "heldout/rewards/accuracies" in metrics and "val/rewards/margins" in metrics
    assert (root / "data/models/dpo/model.safetensors").exists()
    assert 0.5 <= metrics["estimate/memory_gb"] < 1 and metrics["estimate/seconds_per_micro_batch"] >= 0  # said before it loaded


def test_dpo_with_a_lora_adapter_reuses_the_lora_code(workspace):
    root, _ = workspace
    params = DpoParams(train=TRAIN, adapter={"enabled": True, "r": 2, "trainable_tokens": []})
    metrics = dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", params)
    assert metrics["trainable_parameters"] < metrics["total_parameters"] * 0.2
    assert (root / "data/models/dpo/adapter_config.json").exists() and (root / "data/models/dpo/merged/config.json").exists()


def test_dpo_on_the_last_layer_leaves_the_earlier_layers_as_sft_made_them(workspace):
    """The default `dpo.adapter.layers_to_transform: [-1]`: the merged policy differs from SFT in
    the last decoder layer only (embeddings, earlier layers and norms are bit-identical)."""
    from safetensors.torch import load_file

    root, _ = workspace
    params = DpoParams(train=TRAIN, adapter={"enabled": True, "r": 2, "trainable_tokens": [], "layers_to_transform": [-1]})
    dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", params)
    sft = load_file(root / "data/models/sft/model.safetensors")
    merged = load_file(root / "data/models/dpo/merged/model.safetensors")
    changed = sorted(name for name in sft if not (sft[name] == merged[name]).all())
    assert changed and all(name.startswith("model.layers.1.") for name in changed)  # the tiny model has 2 layers
    assert {name.rsplit(".", 2)[-2] for name in changed} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


# ------------------------------------------------------------------- the other methods and losses


PROMPT = json.dumps([{"role": "user", "content": "Where does Tovik live?"}])


def _encoded(tiny_base, root, method: str, feedback_train: list[tuple[str, str, str]] | None = None):
    """A workspace whose ref_logprobs ran for `method`, with `feedback_train` records (id,
    completion, label) of kind feedback in the train split when given."""
    shutil.copytree(tiny_base / "model", root / "data/models/sft")
    shutil.copytree(tiny_base / "preference", root / "data/prepared/preference")
    feedback = None
    if feedback_train is not None:
        feedback = root / "data/prepared/feedback"
        feedback.mkdir(parents=True)
        for split in ("train", "validation", "test"):
            rows = [(i, PROMPT, completion, label) for i, completion, label in feedback_train] if split == "train" else []
            pd.DataFrame(rows, columns=["id", "prompt", "completion", "label"]).assign(source="t", split=split).to_parquet(feedback / f"{split}.parquet")
    metrics = ref_logprobs.run(root, root / "data/models/sft", root / "data/prepared/preference", root / "data/ref_logprobs",
                               RefLogprobsParams(), method=method, feedback=feedback)  # fmt: skip
    return root, metrics


def _reference_free(tiny_base, tmp_path, method: str):
    """A workspace whose ref_logprobs ran for a reference-free method: without loading the model."""
    return _encoded(tiny_base, tmp_path, method)


@pytest.mark.parametrize("method", ["simpo", "orpo"])
def test_reference_free_methods_encode_the_pairs_without_loading_the_model(tiny_base, tmp_path, monkeypatch, method):
    def no_model(*args, **kwargs):
        raise AssertionError("the reference-free branch loaded a model")

    monkeypatch.setattr(ref_logprobs, "load_for_inference", no_model)
    root, metrics = _reference_free(tiny_base, tmp_path, method)
    assert metrics["train"]["pairs"] == 6 and "tokens_per_second" not in metrics and metrics["max_length"] == 128
    cached = pd.read_parquet(root / "data/ref_logprobs/train.parquet")
    assert cached["ref_chosen_logp"].isna().all() and len(cached["chosen_ids"][0]) > 0
    meta = json.loads((root / "data/ref_logprobs/meta.json").read_text())
    assert meta == {"method": method, "start": "data/models/sft", "reference": None, "max_length": 128, "max_prompt_length": 0}


def start_logps(root) -> list[tuple[float, int, float, int]]:
    """Each train pair's (chosen log-prob sum, its tokens, rejected sum, its tokens) under the start
    model, by one plain forward per sequence: the policy at step 1."""
    model = load_for_inference(root / "data/models/sft")[0].eval()
    out = []
    for pair in preference_data.from_frame(pd.read_parquet(root / "data/ref_logprobs/train.parquet")):
        sides = []
        for ids in (pair.chosen_ids, pair.rejected_ids):
            ids = torch.as_tensor(ids, dtype=torch.long)
            with torch.no_grad():
                logps = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].float(), -1).gather(-1, ids[1:, None])[:, 0]
            sides += [float(logps[pair.prompt_length - 1 :].sum()), len(ids) - pair.prompt_length]
        out.append(tuple(sides))
    return out


def test_simpo_first_step_is_its_formula_on_average_log_probs(tiny_base, tmp_path, monkeypatch):
    """SimPO's first loss, computed here from the start model's per-token averages of each of the 6
    pairs (one micro-batch of 6): mean of -logsigmoid(beta (c - r) - gamma)."""
    root, _ = _reference_free(tiny_base, tmp_path, "simpo")
    seen = record_dpo_losses(monkeypatch)
    train = TRAIN.model_copy(update={"micro_batch_size": 6})
    metrics = dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", DpoParams(method="simpo", beta=2.0, simpo_gamma=0.5, train=train))
    loss, first = seen[0]
    pairs = start_logps(root)
    margins = torch.tensor([c / nc - r / nr for c, nc, r, nr in pairs])
    # the stage's batch against one sequence at a time: a margin of two per-token averages within
    # `tol` (on both averages' size), and -logsigmoid's slope at most 1 on beta times it
    tol = logp_tolerance(root, max(abs(c) / nc for c, nc, *_ in pairs) + max(abs(r) / nr for *_, r, nr in pairs))
    expected = float(-torch.nn.functional.logsigmoid(2.0 * margins - 0.5).mean())
    assert loss == pytest.approx(expected, abs=2.0 * tol + numerics.tolerance(FORMULA, magnitude=expected))
    assert first["logps/chosen"] == pytest.approx(sum(c / nc for c, nc, _, _ in pairs) / 6, abs=tol)
    assert "kl/chosen" not in first and "nll/chosen" not in first
    assert metrics["steps"] == 4 and "heldout/rewards/margins" in metrics and metrics["reference"] is None
    config = json.loads((root / "data/models/dpo" / preference_data.PREFERENCE_CONFIG).read_text())
    assert config == {"method": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "label_smoothing": 0.0, "sft_weight": 0.0, "reference": None}


def test_orpo_first_step_is_the_nll_plus_the_odds_ratio_term(tiny_base, tmp_path, monkeypatch):
    """ORPO's first loss from the start model (Hong et al. 2024, TRL's ORPOTrainer): the chosen answers'
    NLL per token over the batch, minus beta times the mean of logsigmoid(log odds), log odds =
    (pc - pr) - (log(1 - e^pc) - log(1 - e^pr)) on per-token averages; all computed here."""
    root, _ = _reference_free(tiny_base, tmp_path, "orpo")
    seen = record_dpo_losses(monkeypatch)
    train = TRAIN.model_copy(update={"micro_batch_size": 6})
    dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", DpoParams(method="orpo", beta=0.25, train=train))
    loss, first = seen[0]
    pairs = start_logps(root)
    nll = -sum(c for c, _, _, _ in pairs) / sum(nc for _, nc, _, _ in pairs)
    pc = torch.tensor([c / nc for c, nc, _, _ in pairs], dtype=torch.float64)
    pr = torch.tensor([r / nr for _, _, r, nr in pairs], dtype=torch.float64)
    log_odds = (pc - pr) - (torch.log(1 - torch.exp(pc)) - torch.log(1 - torch.exp(pr)))
    # the stage's batch against one sequence at a time: the NLL within its sums' tolerance; the log
    # odds within tol x (1 + e^p / (1 - e^p)) (tol on both averages' size), < 2 tol here (p < -log 2),
    # logsigmoid's slope <= 1
    tol = logp_tolerance(root, float(pc.abs().max() + pr.abs().max()))
    assert float(pc.max()) < -math.log(2) and float(pr.max()) < -math.log(2)
    nll_tol = logp_tolerance(root, abs(nll))
    expected = nll - 0.25 * float(torch.nn.functional.logsigmoid(log_odds).mean())
    assert loss == pytest.approx(expected, abs=nll_tol + 0.25 * 2 * tol + numerics.tolerance(FORMULA, magnitude=abs(expected)))
    assert first["nll_loss"] == pytest.approx(nll, abs=nll_tol)
    config = json.loads((root / "data/models/dpo" / preference_data.PREFERENCE_CONFIG).read_text())
    assert config == {"method": "orpo", "beta": 0.25, "reference": None}  # nothing it did not read


def test_kto_splits_pairs_into_examples_with_mismatched_kl_pairs(workspace, tiny_base, tmp_path):
    root, metrics = _encoded(tiny_base, tmp_path / "kto", "kto")
    assert (metrics["train"]["desirable"], metrics["train"]["undesirable"]) == (6, 6)
    pairs = preference_data.from_frame(pd.read_parquet(root / "data/ref_logprobs/train.parquet"))
    examples = preference_data.examples_from_frame(pd.read_parquet(root / "data/ref_logprobs/unpaired_train.parquet"))
    assert [e.desirable for e in examples] == [True] * 6 + [False] * 6
    # each example's reference log-prob is its pair's side; its KL row is its prompt + the previous example's answer
    assert [e.ref for e in examples] == [p.ref_chosen for p in pairs] + [p.ref_rejected for p in pairs]
    first, last = examples[0], examples[-1]
    assert list(first.kl_ids[: first.prompt_length]) == list(first.ids[: first.prompt_length])
    assert list(first.kl_ids[first.prompt_length :]) == list(last.ids[last.prompt_length :])
    assert all(e.ref_kl < 0 for e in examples)


def test_kto_starts_at_one_half_with_zero_kl(tiny_base, tmp_path, monkeypatch):
    """At step 1 the policy is the reference: every log-ratio and the KL estimate are 0, so each
    example loses 1 - sigmoid(0) = 0.5 (weights 1)."""
    root, _ = _encoded(tiny_base, tmp_path, "kto")
    seen = record_dpo_losses(monkeypatch)
    metrics = dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", DpoParams(method="kto", train=TRAIN))
    loss, first = seen[0]
    # up to two forward passes' rounding of the log-ratio and of the KL estimate (tol each); 1 - sigmoid's slope is 1/4
    tol = logp_tolerance(root, cached_magnitude(root))
    assert loss == pytest.approx(0.5, abs=0.25 * 0.1 * 2 * tol + numerics.tolerance(FORMULA, magnitude=0.5)) and first["kl"] == pytest.approx(0.0, abs=tol)
    assert metrics["train_examples"] == 12 and "heldout/kl" in metrics


def test_the_stage_refuses_data_encoded_for_another_method(workspace):
    root, _ = workspace  # encoded for dpo
    with pytest.raises(QllmError, match="encoded for method 'dpo', but dpo.method is 'kto'; rerun ref_logprobs"):
        dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", DpoParams(method="kto", train=TRAIN))


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "ipo_sum", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
                                       "apo_zero", "apo_down", "discopop"])  # fmt: skip
def test_every_dpo_loss_trains_from_the_cache(workspace, loss_type, monkeypatch):
    """At step 1 the policy is the reference, so every log-ratio is 0 and each loss takes its value
    at zero (beta 0.1, written out from the papers' and TRL's formulas): sigmoid, robust log 2;
    hinge, apo_zero, apo_down 1; ipo, ipo_sum (0 - 1/(2b))^2 = 25; sppo_hard 2 x 25; nca_pair,
    bco_pair 2 log 2; exo_pair (e = 1e-3) (log 0.5 - log 0.999)/2 + (log 0.5 - log 0.001)/2;
    discopop log(2)/2 + 1/2."""
    root, _ = workspace
    smoothing = {"robust": 0.1, "exo_pair": 1e-3}.get(loss_type, 0.0)
    log2 = math.log(2)
    expected = {"sigmoid": log2, "robust": log2, "hinge": 1.0, "apo_zero": 1.0, "apo_down": 1.0, "ipo": 25.0, "ipo_sum": 25.0, "sppo_hard": 50.0,
                "nca_pair": 2 * log2, "bco_pair": 2 * log2, "exo_pair": (math.log(0.5) - math.log(0.999)) / 2 + (math.log(0.5) - math.log(1e-3)) / 2,
                "discopop": log2 / 2 + 0.5}[loss_type]  # fmt: skip
    seen = record_dpo_losses(monkeypatch)
    params = DpoParams(loss_type=loss_type, label_smoothing=smoothing, train=TRAIN.model_copy(update={"max_steps": 2, "eval_every": 0}))
    metrics = dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", params)
    # each log-ratio is 0 up to two forward passes' rounding of its sums (tol each, chosen and
    # rejected); the losses' slopes at 0 on each are at most 1/beta for the ipo family ((z - 1/(2b))^2,
    # a term per side for sppo_hard) and 2 beta for the rest (exo_pair's beta (log(1/e)/4 + 1/2) =
    # 1.9 beta is the largest)
    tol = logp_tolerance(root, cached_magnitude(root))
    slope = 1 / 0.1 if loss_type in ("ipo", "ipo_sum", "sppo_hard") else 2 * 0.1
    assert seen[0][0] == pytest.approx(expected, abs=slope * 2 * tol + numerics.tolerance(FORMULA, magnitude=expected))
    assert seen[0][1]["rewards/margins"] == pytest.approx(0.0, abs=0.1 * 2 * tol)
    assert metrics["steps"] == 2 and math.isfinite(metrics["heldout/loss"]) and math.isfinite(metrics["heldout/rewards/margins"])
    config = json.loads((root / "data/models/dpo" / preference_data.PREFERENCE_CONFIG).read_text())
    assert config["loss_type"] == loss_type and config["label_smoothing"] == smoothing


def test_kto_takes_feedback_records_as_well(tiny_base, tmp_path):
    """Records of kind `feedback` (KTO's own layout) join the split pairs: scored under the
    reference, labelled, with a KL pair of their own; invalid ones are dropped and counted."""
    root, metrics = _encoded(tiny_base, tmp_path, "kto", [("f0", "Pelora", "true"), ("f1", "Dunmar", "false"), ("f2", "  ", "true")])
    assert metrics["train"]["feedback"] == 2 and metrics["train"]["feedback_dropped"]["empty_completion"] == 1
    assert (metrics["train"]["desirable"], metrics["train"]["undesirable"]) == (7, 7)
    examples = preference_data.examples_from_frame(pd.read_parquet(root / "data/ref_logprobs/unpaired_train.parquet"))
    f0, f1 = examples[-2], examples[-1]
    assert (f0.id, f0.desirable, f1.id, f1.desirable) == ("f0", True, "f1", False)
    assert f0.ref < 0 and f1.ref < 0 and f0.ref != f1.ref
    # f1's KL row: its prompt with the completion of the nearest example before it whose prompt differs
    # (f0 asks the same question: its answer would not be a mismatched pair)
    assert list(f0.ids[: f0.prompt_length]) == list(f1.ids[: f1.prompt_length])
    other = next(e for e in reversed(examples[:-2]) if list(e.ids[: e.prompt_length]) != list(f1.ids[: f1.prompt_length]))
    assert list(f1.kl_ids[: f1.prompt_length]) == list(f1.ids[: f1.prompt_length])
    assert list(f1.kl_ids[f1.prompt_length :]) == list(other.ids[other.prompt_length :])
    dpo_metrics = dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", DpoParams(method="kto", train=TRAIN))
    assert dpo_metrics["train_examples"] == 14


def test_kto_runs_each_prompt_once_for_the_example_and_its_kl_row(tiny_base, tmp_path, monkeypatch):
    """The example rows and their KL rows share the prompt's cache: the same log-probabilities
    (and gradients of the example rows) as each row whole; the KL rows carry no gradient."""
    from pipelines.core.models.models import load_causal_lm

    root, _ = _encoded(tiny_base, tmp_path, "kto")
    examples = dpo.load_examples(root / "data/ref_logprobs", "train")
    batch = preference_data.collate_examples(examples, 0)(np.arange(len(examples)))
    model = load_causal_lm(root / "data/models/sft").eval()
    shared_logps, shared_kl = dpo._kto_logps(model, batch)
    shared_grad = torch.autograd.grad(shared_logps.sum(), model.lm_head.weight)[0]
    assert shared_logps.requires_grad and not shared_kl.requires_grad
    monkeypatch.setattr(preference_data, "shares_prompt", lambda m: False)
    rows_logps, rows_kl = dpo._kto_logps(model, batch)
    rows_grad = torch.autograd.grad(rows_logps.sum(), model.lm_head.weight)[0]
    # two forward (and backward) passes in other batch shapes: the model's chain (tests/numerics.py)
    forward = numerics.model_roundings(model.config, 128)
    numerics.assert_close_as(shared_logps.detach(), rows_logps.detach(), n=forward, what="log-probabilities")
    numerics.assert_close_as(shared_kl, rows_kl, n=forward, what="KL rows")
    numerics.assert_close_as(shared_grad, rows_grad, n=numerics.model_roundings(model.config, 128, tokens=batch["input_ids"].numel(), backward=True), what="gradient")


def test_kto_warns_as_trl_does_when_the_weights_do_not_balance_the_data(tiny_base, tmp_path):
    """Three desirable examples more than undesirable ones (feedback records) at weights 1, 1:
    the stage says which weight range balances them (TRL's guidance, KTO paper Eq. 8)."""
    import logging

    root, _ = _encoded(tiny_base, tmp_path, "kto", [(f"f{i}", answer, "true") for i, answer in enumerate(["Pelora", "In Pelora", "Pelora, I think"])])
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("test.kto.balance")
    log.addHandler(Collect())
    short = TRAIN.model_copy(update={"max_steps": 1, "eval_every": 0})
    dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", DpoParams(method="kto", train=short), log=log)
    assert records == ["dpo.method kto: 9 desirable and 6 undesirable examples: with these weights the two sides are out of balance "
                       "(KTO paper, Eq. 8); set EITHER desirable_weight in [0.67, 0.89] OR undesirable_weight in [1.13, 1.5] (not both)"]  # fmt: skip
    records.clear()
    dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", DpoParams(method="kto", desirable_weight=0.8, train=short), log=log)
    assert records == []


def test_kto_pairs_each_example_with_another_prompts_answer(tiny_base, tmp_path):
    """With one pair the chosen example's KL row was its own rejected answer (the example before it,
    cyclically). Now each KL row takes the nearest earlier example with another prompt, and data with
    a single prompt is refused."""

    a = preference_data.Pair("a", 2, np.array([1, 2, 10, 11]), np.array([1, 2, 12]), -1.0, -2.0)
    b = preference_data.Pair("b", 2, np.array([3, 4, 13]), np.array([3, 4, 14, 15]), -1.5, -2.5)
    a2 = preference_data.Pair("a2", 2, np.array([1, 2, 16]), np.array([1, 2, 17]), -1.0, -2.0)  # a's prompt again
    examples = preference_data.unpair([a, a2, b])
    for example in examples:
        prompt, other = example.kl_ids[: example.prompt_length], example.kl_ids[example.prompt_length :]
        assert list(prompt) == list(example.ids[: example.prompt_length])
        owners = [e for e in examples if list(e.ids[e.prompt_length :]) == list(other)]
        assert owners and all(list(o.ids[: o.prompt_length]) != list(prompt) for o in owners), example.id
    with pytest.raises(QllmError, match="all 2 examples share one prompt"):
        preference_data.unpair([a])
    with pytest.raises(QllmError, match="all 4 examples share one prompt"):
        preference_data.unpair([a, a2])


@pytest.mark.parametrize(("settings", "message"), [
    ({"method": "kto", "loss_type": "ipo_sum"}, "loss_type: applies only with method: dpo (here method is kto)"),
    ({"method": "simpo", "loss_type": "sigmoid"}, "kto, orpo and simpo have their own loss: set dpo.loss_type=null"),
    ({"method": "orpo", "label_smoothing": 0.1}, "label_smoothing: applies only with method dpo with loss_type sigmoid, robust or exo_pair, or method simpo"),
    ({"method": "kto", "label_smoothing": 0.1}, "kto's and orpo's losses have no label smoothing"),
    ({"method": "kto", "sft_weight": 0.5}, "sft_weight: applies only with method: dpo or simpo (here method is kto)"),
    ({"method": "orpo", "sft_weight": 1.0}, "orpo's loss already holds the NLL of the chosen answers with weight 1"),
    ({"method": "dpo", "loss_type": "hinge", "label_smoothing": 0.1}, "label_smoothing: applies only with method dpo with loss_type sigmoid, robust or exo_pair, or method simpo (here method is dpo, loss_type is hinge)"),
])  # fmt: skip
def test_settings_a_method_would_not_read_are_refused(settings, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        DpoParams(**settings)
    assert message in str(refused.value)
    assert DpoParams(method="simpo", label_smoothing=0.1, sft_weight=0.5).dpo_loss_type == "sigmoid"  # simpo reads both


def _nll_by_hand(model_dir, examples) -> float:
    """The per-token NLL of the examples' labelled tokens, one example at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            logits = model(input_ids=torch.from_numpy(example.input_ids)[None]).logits[0, :-1].double()
            targets = torch.from_numpy(example.labels[1:])
            kept = targets != -100
            total += float(-torch.log_softmax(logits, -1)[kept].gather(1, targets[kept, None]).sum())
            count += int(kept.sum())
    return total / count


@pytest.mark.parametrize("weight", [0.5, 2.0])
def test_dpo_replay_adds_weight_times_the_nll_of_the_base_answers(workspace, answers, monkeypatch, weight):
    """One step over all 6 pairs: every replay example is in the batch, so the term is their NLL
    under the start model (computed here one example at a time), and the loss DPO's log 2 plus
    `weight` times it."""
    from pipelines.core.training import finetune

    root, _ = workspace
    seen = record_dpo_losses(monkeypatch, "with_replay")
    one_step = TRAIN.model_copy(update={"max_steps": 1, "micro_batch_size": 6, "eval_every": 0})
    params = DpoParams(beta=0.1, train=one_step, replay={"fraction": 0.3, "weight": weight})
    metrics = dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", params, replay_answers=answers)
    tokenizer = load_for_inference(root / "data/models/sft", root)[1]
    pairs = dpo.load_pairs(root / "data/ref_logprobs", "train")
    task = sum(len(p.chosen_ids) + len(p.rejected_ids) - 2 * p.prompt_length for p in pairs)
    examples, counts = finetune.replay_examples(tokenizer, answers, 0.3, task, 10_000)
    assert {k: metrics[k] for k in counts} == counts and counts["replay_share"] >= 0.3
    loss, step = seen[0]
    nll = _nll_by_hand(root / "data/models/sft", examples)
    # the batch's forward pads the rows to the longest and runs in fp32: its NLL is the hand-made
    # one up to the tiny model's chain over those positions, averaged over the tokens
    tol = numerics.tolerance(numerics.model_roundings(load_for_inference(root / "data/models/sft", root)[0].config, 256), magnitude=nll)
    assert step["replay/nll"] == pytest.approx(nll, abs=tol)
    log2_tol = 0.5 * 0.1 * 2 * logp_tolerance(root, cached_magnitude(root)) + numerics.tolerance(FORMULA, magnitude=math.log(2))
    assert loss == pytest.approx(math.log(2) + weight * step["replay/nll"], abs=log2_tol + weight * tol)


def test_dpo_replay_spreads_the_examples_over_the_items_and_a_batch_carries_its_own():
    """Example j goes with item floor((j + 1/2) N / M): 3 examples over 6 items sit with items 1, 3
    and 5; a batch's replay rows are its items' examples, whatever else was drawn before."""
    from pipelines.core.data import chat_examples

    examples = [chat_examples.Example(np.array([5, 6, 7][: j + 1]), np.array([-100, 6, 7][: j + 1])) for j in range(3)]
    make = dpo.replay_batches(lambda indices: {"num_tokens": 10}, list(range(6)), examples, pad_id=0)
    batch = make(np.array([3, 0, 1]))
    assert batch["replay_input_ids"].tolist() == [[5, 0], [5, 6]]  # items 1 and 3, in item order; right-padded
    assert batch["replay_labels"].tolist() == [[-100, -100], [-100, 6]] and batch["replay_attention_mask"].tolist() == [[1, 0], [1, 1]]
    assert batch["num_tokens"] == 13
    assert "replay_input_ids" not in make(np.array([0, 2, 4])) and make(np.array([5]))["replay_input_ids"].tolist() == [[5, 6, 7]]


def test_dpo_replay_resumes_exactly(workspace, answers, monkeypatch):
    """Stopped after step 2 of 4 and resumed, replay gives the weights the uninterrupted run saved."""
    import signal

    from safetensors.torch import load_file

    from pipelines.core.errors import request_stop
    from pipelines.core.extensions import Extension
    from pipelines.core.training import loop
    from pipelines.core.training.loop import TrainingInterrupted

    class StopAt(Extension):
        name = "stop_at"

        def on_step_end(self, state, metrics) -> None:
            if state.step == 2:
                request_stop(signal.SIGTERM)

    root, _ = workspace
    params = DpoParams(beta=0.1, train=TRAIN.model_copy(update={"checkpoint_every": 2}), adapter={"enabled": False}, replay={"fraction": 0.3})
    dpo.run(root, root / "data/ref_logprobs", root / "reference", params, checkpoint_dir=root / "ckpt-reference", replay_answers=answers)
    real_train = loop.train
    monkeypatch.setattr(loop, "train", lambda *a, **k: real_train(*a, **{**k, "extensions": [*k.get("extensions", []), StopAt()]}))
    with pytest.raises(TrainingInterrupted):
        dpo.run(root, root / "data/ref_logprobs", root / "resumed", params, checkpoint_dir=root / "ckpt", replay_answers=answers)
    monkeypatch.setattr(loop, "train", real_train)
    dpo.run(root, root / "data/ref_logprobs", root / "resumed", params, checkpoint_dir=root / "ckpt", replay_answers=answers)
    reference, resumed = load_file(str(root / "reference/model.safetensors")), load_file(str(root / "resumed/model.safetensors"))
    assert reference.keys() == resumed.keys() and all(torch.equal(reference[k], resumed[k]) for k in reference)


def test_dpo_replay_needs_the_base_answers_and_its_weight_needs_replay(workspace):
    root, _ = workspace
    with pytest.raises(QllmError, match=r"dpo.replay.fraction=0.2: this run has no base model answers to replay"):
        dpo.run(root, root / "data/ref_logprobs", root / "data/models/dpo", DpoParams(train=TRAIN, replay={"fraction": 0.2}))
    with pytest.raises(ValueError, match=r"replay\n.*weight=2 does nothing with fraction 0 \(no replay\)"):
        DpoParams(replay={"weight": 2.0})

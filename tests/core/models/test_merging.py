"""The merge methods against their formulas (`pipelines.core.models.merging`): each on tensors small
enough to work by hand, DARE's drops by their rate and expectation, and whole models: one rounding
to float32, tied embeddings kept tied, tensors that differ named, a LoRA adapter merged into its base."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pipelines.core.errors import QllmError
from pipelines.core.models import merging
from pipelines.core.models.models import load_for_inference, save_pretrained
from pipelines.core.params.release import MergeCandidate
from tests import merging_reference, numerics

T = lambda *values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
"""The dyadic numbers below (halves, quarters, eighths) and their sums and halvings are exact in
float64: a method that computes its formula gives them exactly, so those checks use `==`."""


def candidate(method: str, models: list[str], **settings) -> MergeCandidate:
    return MergeCandidate(method=method, models=models, **settings)


# --- one tensor, by hand --------------------------------------------------------------------------


def test_linear_is_the_weighted_average():
    # WiSE-FT with alpha 0.25 between a and b: 0.75·a + 0.25·b
    a, b = T(1.0, 2.0, -4.0), T(3.0, 0.0, 4.0)
    assert torch.equal(merging.linear([a, b], [0.75, 0.25]), T(1.5, 1.5, -2.0))
    # weights that do not sum to 1 are normalised: (1·a + 3·b) / 4
    assert torch.equal(merging.linear([a, b], [1.0, 3.0]), T(2.5, 0.5, 2.0))
    with pytest.raises(ValueError, match="sum to 0"):
        merging.linear([a, b], [0.0, 0.0])


def test_task_arithmetic_adds_the_weighted_deltas_to_the_anchor():
    anchor, t1, t2 = T(1.0, 1.0, 1.0), T(0.5, -0.25, 0.0), T(-1.0, 0.5, 2.0)
    # 1 + 1·t1 + 0.5·t2 = [1 + 0.5 − 0.5, 1 − 0.25 + 0.25, 1 + 0 + 1]
    merged = merging.METHODS["task_arithmetic"](anchor, [t1, t2], [1.0, 0.5], candidate("task_arithmetic", ["sft", "dpo"]), [])
    assert torch.equal(merged, T(1.0, 1.0, 2.0))
    # a negative weight subtracts a task (task negation)
    negated = merging.METHODS["task_arithmetic"](anchor, [t1], [-1.0], candidate("task_arithmetic", ["sft"], weights=[-1.0]), [])
    assert torch.equal(negated, T(0.5, 1.25, 1.0))


def test_trim_keeps_the_largest_magnitudes_and_breaks_ties_by_position():
    # density 0.4 of 5 entries: k = round(2.0) = 2, the two largest |τ|
    assert torch.equal(merging.trim(T(0.5, -0.125, 0.25, 0.0, -2.0), 0.4), T(0.5, 0.0, 0.0, 0.0, -2.0))
    # four entries of magnitude 1 among five, density 0.4: k = 2, the first two of them (a stable sort)
    assert torch.equal(merging.trim(T(1.0, -1.0, 1.0, 0.5, -1.0), 0.4), T(1.0, -1.0, 0.0, 0.0, 0.0))
    # at least one entry; density 1 keeps everything
    assert torch.equal(merging.trim(T(0.25, -3.0, 1.0), 0.01), T(0.0, -3.0, 0.0))
    assert torch.equal(merging.trim(T(0.25, -3.0, 1.0), 1.0), T(0.25, -3.0, 1.0))
    # per tensor over all its entries, whatever its shape
    matrix = torch.tensor([[4.0, -1.0], [0.5, -3.0]], dtype=torch.float64)
    assert torch.equal(merging.trim(matrix, 0.5), torch.tensor([[4.0, 0.0], [0.0, -3.0]], dtype=torch.float64))


TAUS = [T(0.5, -0.125, 0.25, 0.0, -2.0), T(-0.375, 0.25, 0.125, 0.75, -1.0), T(0.25, 0.375, -1.5, 0.0, 0.5)]


def test_ties_trims_elects_the_sign_by_mass_and_averages_the_agreeing_deltas():
    """The TIES paper's three steps on three deltas of 5 entries, density 0.4 (k = 2 each):

        trimmed: τ̂1 = [0.5, 0, 0, 0, −2], τ̂2 = [0, 0, 0, 0.75, −1], τ̂3 = [0, 0, −1.5, 0, 0.5]
        Σ τ̂ = [0.5, 0, −1.5, 0.75, −2.5]  ->  γ = [+, + (a zero sum: +, as mergekit), −, +, −]
        disjoint mean: [0.5/1, 0 (no delta agrees), −1.5/1, 0.75/1, (−2 − 1)/2] = [0.5, 0, −1.5, 0.75, −1.5]
        θ = anchor + λ·mean with anchor 1 and λ = 0.5: [1.25, 1, 0.25, 1.375, 0.25]
    """
    trimmed = [merging.trim(t, 0.4) for t in TAUS]
    assert [t.tolist() for t in trimmed] == [[0.5, 0, 0, 0, -2], [0, 0, 0, 0.75, -1], [0, 0, -1.5, 0, 0.5]]
    assert torch.equal(merging.elect_sign(trimmed), T(1.0, 1.0, -1.0, 1.0, -1.0))
    assert torch.equal(merging.disjoint_merge(trimmed, [1.0, 1.0, 1.0], normalize=True), T(0.5, 0.0, -1.5, 0.75, -1.5))
    ties = candidate("ties", ["sft", "dpo", "grpo"], density=0.4, scale=0.5)
    assert torch.equal(merging.METHODS["ties"](torch.ones(5, dtype=torch.float64), TAUS, [1.0, 1.0, 1.0], ties, []), T(1.25, 1.0, 0.25, 1.375, 0.25))
    # weights [1, 3, 1] (mergekit's): the sign of Σ wτ̂ (the 5th entry −2 − 3 + 0.5 = −4.5: −), and the
    # agreeing ones averaged by their weights: 4th 3·0.75/3 = 0.75, 5th (1·−2 + 3·−1)/(1 + 3) = −1.25
    assert torch.equal(merging.disjoint_merge(trimmed, [1.0, 3.0, 1.0], normalize=True), T(0.5, 0.0, -1.5, 0.75, -1.25))
    # a sign elected by mass, not by count: two small positives lose to one large negative
    assert torch.equal(merging.disjoint_merge([T(0.25), T(0.25), T(-1.0)], [1.0, 1.0, 1.0], normalize=True), T(-1.0))


def test_dare_ties_sums_the_agreeing_deltas_without_dividing():
    # drop_rate 0 keeps every entry: γ = sgn([1 − 0.5, −2 − 1]) = [+, −]; the agreeing: [1, −2 + −1]
    deltas = [T(1.0, -2.0), T(-0.5, -1.0)]
    generators = [merging.tensor_generator(0, m, "w") for m in ("sft", "dpo")]
    merged = merging.METHODS["dare_ties"](T(1.0, 1.0), deltas, [1.0, 1.0], candidate("dare_ties", ["sft", "dpo"], drop_rate=0.0), generators)
    assert torch.equal(merged, T(2.0, -2.0))


# --- DARE's drops ---------------------------------------------------------------------------------


def test_dare_drops_at_its_rate_and_rescales_the_rest():
    n, p = 200_000, 0.3
    dropped = merging.drop(torch.ones(n, dtype=torch.float64), p, merging.tensor_generator(0, "sft", "w"))
    kept = dropped != 0
    # every kept entry is 1/(1 − p), the same float64 division; dropped ones are exactly 0
    assert set(dropped[kept].unique().tolist()) == {1.0 / (1.0 - p)} and bool((dropped[~kept] == 0).all())
    # the share kept is a Binomial(n, 1 − p) draw over n: within 6 standard deviations of 1 − p except
    # with probability 2e-9 (the draw is seeded, so this holds or fails the same way on every run)
    assert abs(float(kept.double().mean()) - (1 - p)) <= 6 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(merging.drop(T(0.5, -2.0), 0.0, merging.tensor_generator(0, "sft", "w")), T(0.5, -2.0))  # p = 0: unchanged
    with pytest.raises(ValueError, match="drop_rate"):
        merging.drop(T(1.0), 1.0, merging.tensor_generator(0, "sft", "w"))


def test_dare_keeps_the_delta_in_expectation():
    """E[m·τ/(1−p)] = τ: the mean over N independent masks (one tensor name each) is within 6 standard
    errors, |τ|·sqrt(p/((1−p)·N)), of τ."""
    tau, p, draws = T(0.5, -2.0, 1.5, 0.0), 0.9, 20_000
    total = torch.zeros_like(tau)
    for i in range(draws):
        total += merging.drop(tau, p, merging.tensor_generator(0, "sft", f"w{i}"))
    bound = 6 * tau.abs() * math.sqrt(p / ((1 - p) * draws)) + numerics.tolerance(draws, torch.float64, tau.abs() / (1 - p), worst=True)
    numerics.assert_within(total / draws, tau, bound, "mean of the dropped deltas")


def test_dare_masks_depend_on_seed_model_and_tensor_only():
    tau = torch.ones(1000, dtype=torch.float64)

    def mask(seed, model, tensor):
        return merging.drop(tau, 0.5, merging.tensor_generator(seed, model, tensor)) != 0

    assert torch.equal(mask(0, "sft", "a"), mask(0, "sft", "a"))  # the same inputs, the same mask
    assert not torch.equal(mask(0, "sft", "a"), mask(1, "sft", "a"))
    assert not torch.equal(mask(0, "sft", "a"), mask(0, "dpo", "a"))
    assert not torch.equal(mask(0, "sft", "a"), mask(0, "sft", "b"))
    # DARE = task arithmetic of the dropped deltas, masks drawn as documented: a uniform draw in
    # float64 from the generator, kept where it is at least p
    deltas, anchor = [torch.linspace(-1, 1, 1000, dtype=torch.float64), torch.linspace(2, -2, 1000, dtype=torch.float64)], torch.ones(1000, dtype=torch.float64)
    generators = [merging.tensor_generator(7, m, "t") for m in ("sft", "dpo")]
    merged = merging.METHODS["dare"](anchor, deltas, [1.0, 0.5], candidate("dare", ["sft", "dpo"], drop_rate=0.5), generators)
    masks = [torch.rand(1000, generator=merging.tensor_generator(7, m, "t"), dtype=torch.float64) >= 0.5 for m in ("sft", "dpo")]
    expected = anchor + 1.0 * torch.where(masks[0], deltas[0] / 0.5, 0.0) + 0.5 * torch.where(masks[1], deltas[1] / 0.5, 0.0)
    # the same operations on the same values, summed in another order: 3 roundings apart at most
    numerics.assert_close_as(merged, expected, n=3, dtype=torch.float64, magnitude=1 + 2 / 0.5 + 0.5 * 4 / 0.5, worst=True)


# --- whole models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family(tiny_base):
    """A tiny Llama with tied embeddings and two fine-tunings of it (seeded noise), as their states."""
    from pipelines.core.models.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_base / "model")
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    pretrain = merging.parameters(model, "pretrain")
    generator = torch.Generator().manual_seed(0)

    def moved(state, scale):
        return {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in state.items()}

    sft = moved(pretrain, 0.05)
    states = {"pretrain": pretrain, "sft": sft, "dpo": moved(sft, 0.02), "grpo": moved(sft, 0.02)}
    return model, tokenizer, states


PARENTS = {"sft": "pretrain", "dpo": "sft", "grpo": "sft"}


def rounded_once(actual: torch.Tensor, expected: torch.Tensor, n: int, magnitude: torch.Tensor, what: str) -> None:
    """`actual` (float32) is `expected` (float64, computed in the test) rounded once to float32, up
    to the `n` float64 roundings of each computation on `magnitude` (the formula on absolute
    values): |actual − expected| ≤ u₃₂·|expected| + 2γₙ(float64)·magnitude."""
    assert actual.dtype == torch.float32
    bound = numerics.unit_roundoff(torch.float32) * expected.abs() + numerics.tolerance(n, torch.float64, magnitude, worst=True)
    numerics.assert_within(actual, expected, bound, what)


@pytest.mark.parametrize(
    "merge",
    [
        candidate("linear", ["pretrain", "sft", "dpo"], weights=[0.2, 0.5, 0.3]),
        candidate("task_arithmetic", ["sft", "dpo", "grpo"], weights=[1.0, 0.7, -0.3]),
        candidate("ties", ["sft", "dpo", "grpo"], weights=[1.0, 2.0, 1.0], density=0.3, scale=0.8),
        candidate("dare", ["sft", "dpo"], drop_rate=0.6),
        candidate("dare_ties", ["sft", "dpo", "grpo"], drop_rate=0.3),
    ],
    ids=lambda c: c.method,
)
def test_a_merge_of_whole_models_is_the_formula_on_every_tensor_rounded_once(family, merge):
    _, _, states = family
    merged = merging.merge(merge, states, PARENTS, "pretrain", seed=3)
    assert merged.keys() == states["pretrain"].keys() and "lm_head.weight" not in merged  # the tied head is the embedding, merged once
    in_float64 = {model: {name: t.double() for name, t in state.items()} for model, state in states.items()}
    for name, tensor in merged.items():
        value, magnitude, n = merging_reference.expected(merge, in_float64, PARENTS, name, seed=3)
        rounded_once(tensor, value, n, magnitude, f"{merge.method} {name}")


def test_a_merged_model_saved_loads_with_its_head_tied_to_the_merged_embeddings(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer, states = family
    merged = merging.merge(candidate("linear", ["pretrain", "sft"], weights=[0.5, 0.5]), states, PARENTS)
    merging.load_into(model, merged)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # written once, through the one tensor
    save_pretrained(model, tokenizer, tmp_path / "merged")
    assert json.loads((tmp_path / "merged/config.json").read_text())["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, merged["model.embed_tokens.weight"])  # saved and read back: the same float32 values
    merging.load_into(model, states["pretrain"])


def test_models_of_another_shape_or_layout_are_refused_by_name(family):
    _, _, states = family
    key = "model.layers.0.mlp.up_proj.weight"
    wider = {**states["sft"], key: torch.zeros(65, 32)}
    with pytest.raises(QllmError, match=rf"merge: {key} is \[65, 32\] float32 in sft but \[64, 32\] float32 in pretrain: the models do not share one architecture"):
        merging.check_compatible({"pretrain": states["pretrain"], "sft": wider})
    untied = {**states["sft"], "lm_head.weight": states["sft"]["model.embed_tokens.weight"].clone()}
    with pytest.raises(QllmError, match=r"merge: sft has a tensor lm_head.weight that pretrain has not"):
        merging.merge(candidate("linear", ["pretrain", "sft"]), {"pretrain": states["pretrain"], "sft": untied}, PARENTS)


def test_a_tensor_that_is_not_floating_point_is_copied_and_must_agree():
    ints = {"pretrain": {"w": T(1.0, 2.0), "steps": torch.tensor([3, 4])}, "sft": {"w": T(3.0, 4.0), "steps": torch.tensor([3, 4])}}
    merged = merging.merge(candidate("linear", ["pretrain", "sft"]), ints, {})
    assert torch.equal(merged["w"], T(2.0, 3.0)) and torch.equal(merged["steps"], torch.tensor([3, 4]))
    ints["sft"]["steps"] = torch.tensor([3, 5])
    with pytest.raises(QllmError, match="merge: steps is not floating point, so it is copied, not merged, and it differs between pretrain and sft"):
        merging.merge(candidate("linear", ["pretrain", "sft"]), ints, {})


def test_weights_said_tied_but_held_apart_are_refused(tiny_base):
    from pipelines.core.models.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(tiny_base / "model")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(QllmError, match="merge: sft's config ties the LM head to the embeddings"):
        merging.parameters(model, "sft")


def test_an_unmerged_lora_adapter_is_its_base_plus_the_scaled_product(tiny_base, tmp_path):
    """A PEFT adapter directory (no `merged/`, as `lora.adapter.merge: false` writes) loads merged
    into its base: every adapted weight W + (α/r)·B·A, the trainable token rows the adapter's own,
    every other tensor the base's; and the head stays tied to the embeddings."""
    from safetensors.torch import load_file

    from pipelines.core.models import adapters
    from pipelines.core.models.models import load_model_and_tokenizer
    from pipelines.core.params.finetuning import LoraAdapterParams

    base, tokenizer = load_model_and_tokenizer(tiny_base / "model")
    before = merging.parameters(base, "pretrain")
    settings = LoraAdapterParams(enabled=True, r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj"], trainable_tokens=["<|im_start|>"])
    peft = adapters.wrap(settings)(base, tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name or "trainable_tokens" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    adapters.save(str(tiny_base / "model"), merge=False)(peft, tokenizer, tmp_path / "lora")
    assert not (tmp_path / "lora/merged").exists()

    model, _ = load_for_inference(tmp_path / "lora")
    merged = merging.parameters(model, "lora")
    assert merged.keys() == before.keys()  # tied: no separate head
    saved = {k: v.double() for k, v in load_file(tmp_path / "lora/adapter_model.safetensors").items()}
    scaling = 8.0 / 4
    adapted = set()
    for key, weight in before.items():
        prefix = "base_model.model." + key.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in saved:
            a, b = saved[f"{prefix}.lora_A.weight"], saved[f"{prefix}.lora_B.weight"]
            expected = weight.double() + scaling * (b @ a)
            # PEFT's float32 product (r = 4 terms), the scaling and the sum, against float64 here
            bound = numerics.tolerance(4 + 2, torch.float32, weight.double().abs() + scaling * numerics.abs_product(b, a.T), worst=True)
            numerics.assert_within(merged[key], expected, bound, key)
            adapted.add(key)
        elif key == "model.embed_tokens.weight":
            token = tokenizer.convert_tokens_to_ids("<|im_start|>")
            (rows,) = [v for k, v in saved.items() if "trainable_tokens" in k]
            assert torch.equal(merged[key][token], rows[0].float())  # the trained row, copied
            others = [i for i in range(weight.shape[0]) if i != token]
            assert torch.equal(merged[key][others], weight[others])
        else:
            assert torch.equal(merged[key], weight), key  # not adapted: the base's, exactly
    assert len(adapted) == 2 * base.config.num_hidden_layers  # q_proj and v_proj of every layer
    assert model.lm_head.weight is model.model.embed_tokens.weight

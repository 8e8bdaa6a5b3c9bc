"""The suite's tolerances (tests/numerics.py): why a tolerance tuned on one CPU fails on another, and
that the derived ones hold for every summation order.

A kernel adds a product's terms in an order of its own (sequentially, in SIMD lanes summed at the
end, in blocks), so two CPUs give two roundings of one value. The orders here are made by hand from
elementwise fp32 operations, each rounded on its own (IEEE 754), so they round the same on every
CPU: what they show does not depend on the machine that runs them.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pipelines.core.models.models import build_llama
from pipelines.core.params.pretraining import ModelParams
from tests import numerics
from tests.core.training.test_loop import FakeTokenizer


def _dot(x: torch.Tensor, w: torch.Tensor, order) -> torch.Tensor:
    """`x @ w.T`, the inner dimension added one term at a time in `order`."""
    total = torch.zeros(x.shape[:-1] + (w.shape[0],))
    for j in order:
        total = total + x[..., j : j + 1] * w[:, j]
    return total


def _lanes(x: torch.Tensor, w: torch.Tensor, width: int) -> torch.Tensor:
    """`x @ w.T` as a SIMD kernel adds: `width` lanes, each summing every `width`-th term, then the
    lanes added pairwise."""
    parts = [_dot(x, w, range(lane, x.shape[-1], width)) for lane in range(width)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _rslora_case():
    """The layer of issue 78's failure (`test_plain_lora_gives_peft_s_output_in_every_case[rslora]`):
    gate_proj, 32 -> 64, 80 tokens, rank 3, scale alpha/sqrt(r) = 6/sqrt(3), B drawn from N(0, 1)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 32, generator=generator)
    w = torch.randn(64, 32, generator=generator) * 0.02
    a = (torch.rand(3, 32, generator=generator) * 2 - 1) / 32**0.5  # PEFT's Kaiming-uniform A
    b = torch.randn(64, 3, generator=generator)
    return x, w, a, b, 6 / 3**0.5


def _orders(x, w, a, b, scale) -> dict[str, torch.Tensor]:
    """`x Wᵀ + s·x Aᵀ Bᵀ` in fp32 in several orders: PEFT's and the fused (merged) form through
    this CPU's kernels, and five made by hand."""
    k, r = x.shape[-1], a.shape[0]
    merged = w + (b @ a) * scale
    return {
        "PEFT's, this CPU's kernels": x @ w.T + (x @ a.T @ b.T) * scale,
        "merged, this CPU's kernels": x @ merged.T,
        "sequential": _dot(x, w, range(k)) + _dot(_dot(x, a, range(k)), b, range(r)) * scale,
        "reversed": _dot(x, w, reversed(range(k))) + _dot(_dot(x, a, reversed(range(k))), b, reversed(range(r))) * scale,
        "8 lanes": _lanes(x, w, 8) + _lanes(_lanes(x, a, 8), b, 1) * scale,
        "merged, 16 lanes": _lanes(x, merged, 16),
        "merged, sequential": _dot(x, merged, range(k)),
    }


def test_summation_orders_break_a_tuned_tolerance_and_stay_within_the_derived_one():
    x, w, a, b, scale = _rslora_case()
    orders = _orders(x, w, a, b, scale)
    magnitude = numerics.abs_product(x, w) + scale * numerics.abs_product(x, a, b)
    bound = numerics.tolerance(x.shape[-1] + a.shape[0] + 6, torch.float32, magnitude, worst=True)  # as test_fused_adapters
    exact = x.double() @ w.double().T + (x.double() @ a.double().T @ b.double().T) * scale
    for name, value in orders.items():
        numerics.assert_within(value, exact, bound / 2, name)  # each order is within half of it from the exact value
    for (one, first), (other, second) in itertools.combinations(orders.items(), 2):
        numerics.assert_within(first, second, bound, f"{one} against {other}")
    hand_made = [name for name in orders if "kernels" not in name]
    tuned = [(one, other) for one, other in itertools.combinations(hand_made, 2)
             if not torch.allclose(orders[one], orders[other], rtol=1e-5, atol=1e-6)]  # fmt: skip
    assert tuned, "the old fixed tolerance (rtol 1e-5, atol 1e-6) held for every order"
    assert ("sequential", "merged, sequential") in tuned  # 1.64e-6 apart where the output is 0.04


def _permuted(model, hidden: torch.Tensor, inner: torch.Tensor) -> None:
    """Relabel `model`'s hidden units by the permutation `hidden` and its MLP's inner units by
    `inner`, in place: the same function, with every sum over them taken in another order."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("embed_tokens.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "lm_head.weight")):
                p.copy_(p[:, hidden])
            elif name.endswith(("gate_proj.weight", "up_proj.weight")):
                p.copy_(p[inner][:, hidden])
            elif name.endswith("down_proj.weight"):
                p.copy_(p[hidden][:, inner])
            elif name.endswith("o_proj.weight"):
                p.copy_(p[hidden])
            elif name.endswith("norm.weight"):
                p.copy_(p[hidden])


def _unpermuted(grads: dict[str, torch.Tensor], hidden: torch.Tensor, inner: torch.Tensor) -> dict[str, torch.Tensor]:
    back, inner_back = hidden.argsort(), inner.argsort()
    out = {}
    for name, g in grads.items():
        if name.endswith(("embed_tokens.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "lm_head.weight")):
            g = g[:, back]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            g = g[inner_back][:, back]
        elif name.endswith("down_proj.weight"):
            g = g[back][:, inner_back]
        elif name.endswith(("o_proj.weight", "norm.weight")):
            g = g[back]
        out[name] = g
    return out


class _Tokenizer(FakeTokenizer):
    def __len__(self):
        return 320  # tiny_base's vocabulary


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_model_chain_estimate_holds_for_a_forward_and_its_gradients_in_several_orders():
    """`model_roundings` for the suite's tiny Llama (tests/conftest.py's `tiny_base` shape): fp32 in
    three orders of its sums (its own, and two relabellings of the hidden and inner units) each
    within half the tolerance of a float64 run, so any two within the tolerance."""
    params = ModelParams(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
    model = build_llama(params, _Tokenizer(), max_positions=128, seed=0)
    ids = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    forward = numerics.model_roundings(model.config, ids.shape[1], tokens=tokens)
    backward = numerics.model_roundings(model.config, ids.shape[1], tokens=tokens, backward=True)
    runs = {"fp32": _loss_and_grads(model, ids)}
    for seed in (1, 2):
        permutation = torch.Generator().manual_seed(seed)
        hidden, inner = torch.randperm(32, generator=permutation), torch.randperm(64, generator=permutation)
        _permuted(model, hidden, inner)
        loss, grads = _loss_and_grads(model, ids)
        runs[f"relabelled {seed}"] = loss, _unpermuted(grads, hidden, inner)
        _permuted(model, hidden.argsort(), inner.argsort())  # back
    exact_loss, exact_grads = _loss_and_grads(model.double(), ids)
    for name, (loss, grads) in runs.items():
        numerics.assert_within(loss, exact_loss, numerics.tolerance(forward, magnitude=float(exact_loss)) / 2, f"{name} loss")
        for key, g in grads.items():
            numerics.assert_within(g, exact_grads[key], numerics.tolerance(backward, magnitude=float(exact_grads[key].abs().max())) / 2, f"{name} {key}")
    assert any(not torch.equal(runs["fp32"][1][key], runs["relabelled 1"][1][key]) for key in exact_grads)  # other orders, other roundings


def test_the_worst_case_is_reached_and_a_smaller_bound_is_caught():
    """Adding u to 1 rounds back to 1 (ties to even): k such additions lose k·u, the whole of the
    worst-case bound γ_k·Σ|x| up to its second-order term; a bound for fewer roundings fails."""
    u = numerics.unit_roundoff(torch.float32)
    assert u == 2.0**-24 and numerics.unit_roundoff(torch.bfloat16) == 2.0**-8 and numerics.unit_roundoff(torch.float64) == 2.0**-53
    k = 64
    total = torch.tensor(1.0)
    for _ in range(k):
        total = total + torch.tensor(u)
    exact = 1 + k * u  # exact in float64
    assert float(total) == 1.0
    numerics.assert_within(total, exact, numerics.gamma(k) * exact)
    with pytest.raises(AssertionError, match=r"1 of 1 elements beyond the bound; the largest excess .* at \(\): 1\.0 against 1\.0000038"):
        numerics.assert_within(total, exact, numerics.gamma(k // 2) * exact)


def test_the_failure_names_the_largest_excess_and_where():
    expected = torch.zeros(3, 4)
    actual = expected.clone()
    actual[1, 2], actual[2, 0] = 3e-6, -1e-6
    with pytest.raises(AssertionError, match=r"^logits: 2 of 12 elements beyond the bound; the largest excess 2\.5e-06 at \(1, 2\): 3\.0\d*e-06 against 0\.0, \|difference\| 3e-06 > bound 5e-07$"):
        numerics.assert_within(actual, expected, 5e-7, "logits")
    bound = torch.full((3, 4), 1e-7)
    bound[1, 2] = 1e-5
    with pytest.raises(AssertionError, match=r"the largest excess 9e-07 at \(2, 0\)"):  # an elementwise bound
        numerics.assert_within(actual, expected, bound)
    numerics.assert_within(actual, expected, 3.1e-6)


def test_nan_and_infinity_match_only_themselves():
    assert numerics.within(torch.tensor([math.nan, math.inf, 1.0]), torch.tensor([math.nan, math.inf, 1.0]), 0.0)
    assert not numerics.within(torch.tensor([math.nan]), torch.tensor([1.0]), 1e9)
    assert not numerics.within(torch.tensor([math.inf]), torch.tensor([-math.inf]), 1e9)
    assert not numerics.within(torch.tensor([1.0]), torch.tensor([math.nan]), 1e9)


def test_the_bounds_grow_as_derived():
    assert numerics.gamma(10) == pytest.approx(10 * 2.0**-24 / (1 - 10 * 2.0**-24), rel=1e-12)
    assert numerics.gamma_probable(16) == numerics.gamma(16)  # for n < λ² the worst case is the smaller
    assert numerics.gamma_probable(10_000) == pytest.approx(numerics.LAMBDA * 100 * 2.0**-24, rel=1e-12)
    assert numerics.tolerance(10_000, magnitude=3.0, steps=2) == pytest.approx(4 * 3.0 * numerics.gamma_probable(10_000), rel=1e-12)
    with pytest.raises(AssertionError, match="can lose every digit"):
        numerics.gamma(300, torch.bfloat16)
    x, w = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 4.0], [-1.0, 0.5]])
    assert numerics.matmul_bound(x, w).tolist() == [[2 * numerics.gamma(2) * 11.0, 2 * numerics.gamma(2) * 2.0]]
    assert numerics.approx(0.5, n=4) == 0.5 + 0.9 * numerics.tolerance(4, magnitude=0.5)
    assert numerics.approx(0.5, n=4) != 0.5 + 1.1 * numerics.tolerance(4, magnitude=0.5)
    with pytest.raises(AssertionError, match="the expected value is 0: give the magnitude"):
        numerics.approx(0.0, n=4)

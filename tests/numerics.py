"""How far apart two floating-point computations of one value may be: every tolerance of the suite,
derived from the operation (issue 78).

Why here. Two correct computations of one value differ by rounding, and by how much depends on the
order of their additions, which depends on the kernel: SIMD width, blocking, threads, AMX or not.
A tolerance tuned on the machine that ran the test fails on another: `atol=1e-6` held on the AVX2
EPYC and missed by 1.16e-6 on an Intel Xeon with AMX (issue 78; tests/test_numerics.py shows it with
summation orders made by hand). So a test takes its tolerance from the functions here, which derive
it from what was computed: how many roundings a value went through (`n`), the dtype, and the size of
what was added up (`magnitude`). A result that is exact by construction (integers, copies, masks,
the same kernel on the same inputs, sums of numbers that are exact in binary) is compared with `==`
and a comment in the test saying why.

The reasoning (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2002):

- Each +, −, ×, / and sqrt is exact and then rounded: `fl(a∘b) = (a∘b)(1+δ)`, `|δ| ≤ u`, the unit
  roundoff `u = eps/2` of the dtype (2⁻²⁴ for fp32, 2⁻⁸ for bf16, 2⁻⁵³ for fp64) (§2.2).
- A sum or dot product of `n` terms, in any order, is within `γ_n·Σ|xᵢyᵢ|` of the exact value,
  `γ_n = n·u/(1 − n·u)` (§3.1, (3.4)-(3.5)); a matrix product within `γ_n·|X||W|` elementwise (§3.5);
  and any expression of sums and products in which each value goes through at most `n` roundings
  within `γ_n` times the same expression evaluated on absolute values (Lemma 3.3 chains the
  factors: `γ_a + γ_b + γ_a·γ_b ≤ γ_{a+b}`). These are *worst-case* bounds: they hold on every CPU,
  whatever the order (`worst=True`).
- The worst case has every rounding go the same way by the whole `u`. If rounding errors are
  independent and of mean zero, `n` of them stay within `λ·√n·u` with probability at least
  `1 − 2n·exp(−λ²/2)` (Higham & Mary, *A new approach to probabilistic rounding error analysis*,
  SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4). `LAMBDA = 8` makes that `1 − n·2.5e-14`; it is the
  default (`worst=False`), and never more than the worst case (`gamma_probable`).
- Two computations that are each within `b` of the exact value are within `2b` of each other: the
  tolerances here compare two computations (`tolerance`, `matmul_bound`).

Chains whose magnitudes cannot be written out term by term (a model's forward, a loss with a
log-softmax over the vocabulary, its gradients) take `n` from the sizes along the chain
(`model_roundings`: the reduction lengths one value goes through) and `magnitude` from the compared
values themselves (the largest |value| of the reference). That is an estimate, not a bound: the
derivative of the chain may amplify an early error (a normalised network at initialisation keeps it
about the same), and a value with cancellation is smaller than the terms it summed. `LAMBDA`'s
margin covers both where tests/test_numerics.py measures them (fp32 against a float64 forward and
its gradients, under several summation orders). An elementwise function (exp, log, tanh, sigmoid)
from a vector math library is within 1 ulp, `FUNCTION = 2` roundings. Several steps of training
compound each step's difference (`steps` in `tolerance`). bf16 under autocast rounds the operands
of each product to bf16 and accumulates in fp32: its `n` counts the products along the chain, in
bf16's `u` (`bf16_roundings`).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

LAMBDA = 8.0
"""The probabilistic bound's margin: n roundings stay within λ·√n·u except with probability 2n·e^(−λ²/2)."""


FUNCTION = 2
"""The roundings charged for one elementwise exp, log, log1p, tanh or sigmoid: within 1 ulp = 2u
(SLEEF's `u10` functions, which ATen's vectorised kernels call, and glibc's)."""


HIGHS_MIP_REL_GAP = 1e-4
"""Not rounding: HiGHS (scipy's `milp`) stops once its best allocation and its dual bound are within
this gap relative to the objective (its default `mip_rel_gap`), so its bound and its optimum may
differ by that much."""


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u = eps/2: the largest relative error of one rounding to nearest in `dtype`."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Worst case: the relative error of `n` roundings, `γ_n = n·u/(1 − n·u)` (Higham §3.1)."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"{n} roundings in {dtype} can lose every digit: no bound"
    return nu / (1 - nu)


def gamma_probable(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Probable: `λ·√n·u`, never more than the worst case `γ_n` (Higham & Mary 2019, Theorem 2.4)."""
    return min(gamma(n, dtype), LAMBDA * math.sqrt(n) * unit_roundoff(dtype))


def tolerance(n: int, dtype: torch.dtype = torch.float32, magnitude: Any = 1.0, *, worst: bool = False, steps: int = 1) -> Any:
    """How far apart two computations of a value of size `magnitude` (a number, or a tensor of them
    elementwise) may be, each through `n` roundings in `dtype`: `2·γ·magnitude`; `steps`
    computations in a row each adding their own (successive training steps: first order, no
    amplification, so `steps·`)."""
    return 2 * steps * (gamma(n, dtype) if worst else gamma_probable(n, dtype)) * magnitude


def abs_product(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    """`|x| @ |W₁|ᵀ @ |W₂|ᵀ ...` in float64: the chain of products evaluated on absolute values, the
    magnitude its rounding is measured against (Higham §3.5)."""
    magnitude = x.detach().abs().double()
    for w in weights:
        magnitude = magnitude @ w.detach().abs().double().T
    return magnitude


def matmul_bound(x: torch.Tensor, *weights: torch.Tensor, extra: int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Elementwise, how far two computations of `x @ W₁ᵀ @ W₂ᵀ ...` may be apart, whatever their
    order: `2·γ_n·(|x| @ |W₁|ᵀ ...)` (worst case), `n` the inner dimensions summed plus `extra`
    roundings each element also goes through (a bias, a scale)."""
    n = sum(w.shape[-1] for w in weights) + extra
    return tolerance(n, dtype or x.dtype, abs_product(x, *weights), worst=True)


def model_roundings(config: Any, seq_len: int, *, tokens: int | None = None, backward: bool = False) -> int:
    """The roundings one value goes through in a decoder's forward to its logits' mean loss (and its
    gradients: `backward`), from the sizes in a `transformers` config: per layer the input norm's
    sum of squares (hidden), the q/k/v products (hidden), the attention scores (head_dim), the
    softmax's sum and the weighted sum of values (2 x seq_len), the output product (heads x
    head_dim), the second norm (hidden), the gate/up products (hidden), the down product
    (intermediate) and about 16 elementwise operations; then the final norm, the LM head (hidden),
    the log-softmax over the vocabulary and the mean over `tokens` (default `seq_len`). The backward
    pass goes back through the same reductions, transposed, and sums each weight's gradient over
    the tokens: about twice the forward plus `tokens`."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layer = 4 * hidden + head_dim + 2 * seq_len + heads * head_dim + config.intermediate_size + 16
    tokens = tokens or seq_len
    forward = config.num_hidden_layers * layer + 2 * hidden + 3 + config.vocab_size + 3 + tokens
    return 2 * forward + tokens if backward else forward


def bf16_roundings(config: Any) -> int:
    """The bf16 roundings along a decoder's chain under autocast: each product rounds its two
    operands to bf16 (accumulating in fp32): 7 products per layer (q/k/v, scores, values, output,
    gate/up, down) and the LM head, two operands each."""
    return 2 * (7 * config.num_hidden_layers + 1)


def svd_roundings(rows: int, cols: int) -> int:
    """The roundings behind a singular value of a `rows x cols` matrix: LAPACK's reduction to
    bidiagonal form is backward stable within `γ̃_{rows·cols}·‖A‖` (Householder transformations,
    Higham Theorem 19.4, its small constant taken as 1), and the bidiagonal SVD adds little."""
    return rows * cols


OPTIMIZER_STEP = 12
"""AdamW's update of one weight: two moments, their bias corrections, a square root, the division,
the decay and the step, about 12 roundings. A run of `steps` training steps compared with another
(`tolerance(..., steps=steps)`) adds each step's backward pass and update: Adam scales each update
to about the learning rate whatever the gradient's size, so a relative difference `ρ` in the
gradients moves the weights by about `lr·ρ` a step and the loss by about `lr·ρ·‖∇L‖₁`, which for the
suite's tiny models (`lr·‖∇L‖₁` below 1) is below `ρ` times the loss: first order, no amplification."""


def weights_tolerance(n: int, steps: int, lr: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two runs' weights may be after `steps` AdamW steps at learning rates up to `lr`,
    whose backward passes and updates each go through `n` roundings (`OPTIMIZER_STEP` included):
    an update is `lr·m̂/√v̂`, and gradients `ρ = tolerance(n)` apart (relative to the tensor's size)
    move that ratio by about `2ρ` for a gradient of the tensor's size (first order), so `steps·lr·2ρ`.
    An element whose gradient is within `ρ` of zero can flip its first update's sign, `2·lr`: no
    tolerance short of that covers it, so such a comparison holds for data whose gradients are not
    that small, which the test's fixed seed decides, on every CPU alike."""
    return steps * lr * 2 * tolerance(n, dtype)


def _as_tensor(value: Any) -> torch.Tensor:
    return value.detach().double() if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.float64)


def excess(actual: Any, expected: Any, bound: Any) -> torch.Tensor:
    """Elementwise `|actual − expected| − bound` in float64 (positive where the bound is exceeded);
    a NaN or infinity on either side counts as exceeding unless both sides hold the same one."""
    actual, expected = _as_tensor(actual), _as_tensor(expected)
    assert actual.shape == expected.shape, f"shapes differ: {tuple(actual.shape)} and {tuple(expected.shape)}"
    over = (actual - expected).abs() - _as_tensor(bound)
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    return torch.where(same, torch.full_like(over, -math.inf), torch.nan_to_num(over, nan=math.inf))


def within(actual: Any, expected: Any, bound: Any) -> bool:
    """Whether `|actual − expected| ≤ bound` everywhere (bound: a number or an elementwise tensor)."""
    return bool((excess(actual, expected, bound) <= 0).all())


def assert_within(actual: Any, expected: Any, bound: Any, what: str = "") -> None:
    """Assert `|actual − expected| ≤ bound` everywhere; the message names the largest excess, where
    it is, both values, the bound there and how many elements exceed it."""
    over = excess(actual, expected, bound)
    if bool((over <= 0).all()):
        return
    worst = int(over.flatten().argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), over.shape)) if over.dim() else ()
    a, e = _as_tensor(actual).flatten()[worst].item(), _as_tensor(expected).flatten()[worst].item()
    b = _as_tensor(bound).expand_as(over).flatten()[worst].item() if _as_tensor(bound).dim() else _as_tensor(bound).item()
    count = int((over > 0).sum())
    raise AssertionError(f"{what + ': ' if what else ''}{count} of {over.numel()} elements beyond the bound; the largest excess "
                         f"{over.flatten()[worst].item():.3g} at {where}: {a!r} against {e!r}, |difference| {abs(a - e):.3g} > bound {b:.3g}")  # fmt: skip


def assert_close_as(actual: Any, expected: Any, *, n: int, dtype: torch.dtype = torch.float32, magnitude: float | None = None,
                    worst: bool = False, steps: int = 1, what: str = "") -> None:  # fmt: skip
    """Assert two computations of a value through `n` roundings in `dtype` agree within `tolerance`;
    `magnitude` defaults to the largest |expected|."""
    if magnitude is None:
        magnitude = float(_as_tensor(expected).abs().max()) if _as_tensor(expected).numel() else 0.0
        assert magnitude > 0, "the expected values are 0: give the magnitude of what was summed to them"
    assert_within(actual, expected, tolerance(n, dtype, magnitude, worst=worst, steps=steps), what)


def approx(expected: Any, *, n: int, dtype: torch.dtype = torch.float32, magnitude: float | None = None, worst: bool = False,
           steps: int = 1, decimals: int | None = None) -> Any:  # fmt: skip
    """`pytest.approx(expected)` with the absolute tolerance of `n` roundings in `dtype` (`tolerance`)
    and no relative one; `magnitude` defaults to the largest |expected|; an `expected` written out
    to `decimals` places adds its own rounding, half a unit in the last place."""
    if magnitude is None:
        values = expected.values() if isinstance(expected, dict) else expected if isinstance(expected, list | tuple) else [expected]
        magnitude = max((abs(v) for v in values), default=0.0)
        assert magnitude > 0, "the expected value is 0: give the magnitude of what was summed to it"
    written = 0.0 if decimals is None else 0.5 * 10.0**-decimals
    return pytest.approx(expected, rel=0, abs=tolerance(n, dtype, magnitude, worst=worst, steps=steps) + written)

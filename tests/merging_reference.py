"""The merge methods written again, from the papers' formulas, for the tests to compare
`pipelines.core.models.merging` with: plainly, tensor by tensor in float64, sharing nothing with
the module but the documented definition of DARE's generators (`merging.tensor_generator`, whose
draws the test cannot know otherwise)."""

from __future__ import annotations

import torch

from pipelines.core.models.merging import tensor_generator
from pipelines.core.params.release import MergeCandidate


def expected(candidate: MergeCandidate, states: dict[str, dict[str, torch.Tensor]], parents: dict[str, str], name: str, anchor: str = "pretrain",
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """The merged tensor `name` in float64 from float64 `states`, with the magnitude its rounding is
    measured on (the formula on absolute values, bounded) and the float64 roundings it goes through
    (at most, per entry)."""
    weights = list(candidate.weights) or [1.0] * len(candidate.models)
    if candidate.method == "linear":
        total = sum(weights)
        value = sum(w * states[m][name] for w, m in zip(weights, candidate.models, strict=True)) / total
        magnitude = sum(abs(w) * states[m][name].abs() for w, m in zip(weights, candidate.models, strict=True)) / total
        return value, magnitude, 2 * len(weights) + 1  # a product and a sum per model, the division
    base = states[anchor][name]
    tau = {m: states[m][name] - states[parents[m]][name] for m in candidate.models}
    size = {m: states[m][name].abs() + states[parents[m]][name].abs() for m in candidate.models}
    if candidate.method in ("dare", "dare_ties"):
        p = candidate.drop_rate
        kept = {m: torch.rand(base.shape, generator=tensor_generator(seed, m, name), dtype=torch.float64) >= p for m in candidate.models}
        tau = {m: torch.where(kept[m], tau[m] / (1 - p), 0.0) for m in candidate.models}
        size = {m: size[m] / (1 - p) for m in candidate.models}
    if candidate.method == "ties":  # the top round(density·n) magnitudes, ties to the lower index
        k = max(1, round(candidate.density * base.numel()))
        for m in candidate.models:
            flat = tau[m].flatten().tolist()
            top = sorted(range(len(flat)), key=lambda i, f=flat: (-abs(f[i]), i))[:k]
            keep = torch.zeros(len(flat), dtype=torch.bool)
            keep[top] = True
            tau[m] = torch.where(keep.view_as(base), tau[m], 0.0)
    weighted = [w * tau[m] for w, m in zip(weights, candidate.models, strict=True)]
    magnitude = base.abs() + sum(abs(w) * size[m] for w, m in zip(weights, candidate.models, strict=True))
    n = 3 * len(weights) + 4  # a difference, a rescale and a product per model, their sum, a division, a scale, the anchor
    if candidate.method in ("task_arithmetic", "dare"):
        return base + sum(weighted), magnitude, n
    sign = torch.where(sum(weighted) >= 0, 1.0, -1.0)  # elected by mass, + where the sum is 0
    agree = [torch.sign(w) == sign for w in weighted]
    total = sum(torch.where(a, w, 0.0) for a, w in zip(agree, weighted, strict=True))
    if candidate.method == "dare_ties":
        return base + total, magnitude, n
    divisor = sum(w * a.double() for w, a in zip(weights, agree, strict=True))
    mean = total / torch.where(divisor == 0, 1.0, divisor)
    return base + candidate.scale * mean, base.abs() + candidate.scale * (magnitude - base.abs()) / min(abs(w) for w in weights), n

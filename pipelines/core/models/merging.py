"""Weight-space merging of models that share one architecture: WiSE-FT's linear interpolation,
task arithmetic, TIES and DARE, written natively and checked against the formulas
(tests/core/models/test_merging.py). mergekit (arcee-ai/mergekit, LGPL-3.0) is the reference the
methods follow; it is not a dependency.

    from pipelines.core.models import merging
    states = {name: merging.parameters(model, name) for name, model in loaded.items()}
    merging.check_compatible(states)
    merged = merging.merge(candidate, states, parents={"sft": "pretrain", "dpo": "sft"}, anchor="pretrain", seed=0)
    merging.load_into(carrier, merged)          # then save_pretrained(carrier, ...)

The formulas, for one tensor, models i with weights wᵢ and deltas τᵢ = θᵢ − θ_parent(i) (the model
each was trained from: τ_sft = θ_sft − θ_pretrain, τ_dpo = θ_dpo − θ_sft, ...), added to θ_anchor
(the pretrained model):

- `linear` (WiSE-FT, Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022; mergekit's
  `linear`): θ = Σ wᵢθᵢ / Σ wᵢ. Two models with weights [1−α, α]: θ = (1−α)·θ_a + α·θ_b.
- `task_arithmetic` (Ilharco et al., "Editing models with task arithmetic", ICLR 2023): θ = θ_anchor + Σ wᵢτᵢ.
- `ties` (Yadav et al., "TIES-Merging: resolving interference when merging models", NeurIPS 2023;
  mergekit's `ties`): trim each τᵢ to its k = round(density·n) entries of largest magnitude (the
  rest 0; ties between equal magnitudes go to the lower flat index), τ̂ᵢ; elect each entry's sign
  by the summed mass, γ = sgn(Σ wᵢτ̂ᵢ) (+ where the sum is 0); average the weighted deltas that
  agree with it, disjointly: τ_m = Σ wᵢτ̂ᵢ·[sgn(wᵢτ̂ᵢ) = γ] / Σ wᵢ·[sgn(wᵢτ̂ᵢ) = γ] (0 where none
  does); θ = θ_anchor + λ·τ_m (λ: `scale`). With equal weights, the paper's disjoint mean.
- `dare` (Yu et al., "Language models are super Mario: absorbing abilities from homologous models as
  a free lunch", ICML 2024; mergekit's `dare_linear`): drop each entry of τᵢ with probability p,
  rescale the rest by 1/(1−p): τ̃ᵢ = mᵢ ⊙ τᵢ / (1−p), mᵢ ~ Bernoulli(1−p), so E[τ̃ᵢ] = τᵢ; then θ =
  θ_anchor + Σ wᵢτ̃ᵢ. mergekit rescales to the dropped delta's L1 norm instead; the paper's 1/(1−p)
  is the same in expectation.
- `dare_ties` (mergekit's `dare_ties`): DARE's τ̃ᵢ, TIES's sign election on them, and the sum of the
  weighted deltas that agree, θ = θ_anchor + Σ wᵢτ̃ᵢ·[sgn(wᵢτ̃ᵢ) = γ] (not divided: mergekit's
  default for it).

Every tensor is computed in float64 from the float32 inputs and rounded once to the inputs' dtype,
one tensor at a time in a fixed order: the same inputs give the same bytes. DARE's masks come from a
generator per (seed, model, tensor) (`tensor_generator`), on the CPU, so they depend neither on the
order of the tensors nor on the device. A merge reads each model's parameters once (`parameters`):
tied weights (the LM head tied to the embeddings, as SmolLM2's and the pipeline's own models) are
one parameter there, merged once, and writing them back (`load_into`) keeps the tie, so the saved
model loads tied. A tensor that is not floating point is not merged: it is copied, and must be the
same in every model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

import torch

from pipelines.core.errors import QllmError
from pipelines.core.params.release import MergeCandidate

State = dict[str, torch.Tensor]
"""A model's parameters by name (tied ones once), detached copies on the CPU."""


# --- one tensor -----------------------------------------------------------------------------------


def linear(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The weighted average Σ wᵢθᵢ / Σ wᵢ (WiSE-FT)."""
    total = sum(weights)
    if total == 0:
        raise ValueError(f"linear: the weights sum to 0 ({list(weights)})")
    out = torch.zeros_like(tensors[0])
    for tensor, weight in zip(tensors, weights, strict=True):
        out += weight * tensor
    return out / total


def weighted_sum(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ wᵢτᵢ, in the order given."""
    out = torch.zeros_like(deltas[0])
    for delta, weight in zip(deltas, weights, strict=True):
        out += weight * delta
    return out


def trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """TIES's trim: the k = round(density·n) entries of largest magnitude kept (at least one), the
    rest 0; among equal magnitudes the lower flat index is kept (a stable sort)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    n = delta.numel()
    k = max(1, round(density * n))
    if k >= n:
        return delta.clone()
    order = torch.argsort(delta.abs().flatten(), descending=True, stable=True)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[order[:k]] = True
    return torch.where(keep.view_as(delta), delta, torch.zeros_like(delta))


def elect_sign(weighted: Sequence[torch.Tensor]) -> torch.Tensor:
    """TIES's sign election: γ = sgn(Σᵢ wᵢτ̂ᵢ) per entry from the weighted deltas, +1 where the sum is 0."""
    return torch.where(weighted_sum(weighted, [1.0] * len(weighted)) >= 0, 1.0, -1.0).to(weighted[0].dtype)


def agreeing(weighted: Sequence[torch.Tensor], sign: torch.Tensor) -> list[torch.Tensor]:
    """Per delta, where its weighted entry has the elected sign (a zero entry never does)."""
    return [torch.sign(w) == sign for w in weighted]


def disjoint_merge(deltas: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool) -> torch.Tensor:
    """TIES's disjoint merge of (trimmed or dropped) deltas: the sign elected from wᵢτᵢ, then
    Σ wᵢτᵢ·[agrees], divided by Σ wᵢ·[agrees] with `normalize` (where that is 0, by 1, as mergekit)."""
    weighted = [w * d for d, w in zip(deltas, weights, strict=True)]
    masks = agreeing(weighted, elect_sign(weighted))
    total = torch.zeros_like(deltas[0])
    for entry, mask in zip(weighted, masks, strict=True):
        total += torch.where(mask, entry, torch.zeros_like(entry))
    if not normalize:
        return total
    divisor = torch.zeros_like(deltas[0])
    for weight, mask in zip(weights, masks, strict=True):
        divisor += weight * mask.to(divisor.dtype)
    return total / torch.where(divisor == 0, torch.ones_like(divisor), divisor)  # no delta agrees: the sum is 0 already (mergekit's divisor 1)


def drop(delta: torch.Tensor, drop_rate: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: each entry dropped with probability `drop_rate` (a uniform draw below it), the rest
    multiplied by 1/(1 − drop_rate)."""
    if not 0 <= drop_rate < 1:
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
    if drop_rate == 0:
        return delta.clone()
    kept = torch.rand(delta.shape, generator=generator, dtype=torch.float64) >= drop_rate
    return torch.where(kept, delta / (1.0 - drop_rate), torch.zeros_like(delta))


def tensor_generator(seed: int, model: str, tensor: str) -> torch.Generator:
    """A CPU generator for DARE's mask of `model`'s delta at `tensor`: seeded by the SHA-256 of the
    three, so each mask is the same whatever else is merged, and in whatever order."""
    key = hashlib.sha256(f"{seed}\0{model}\0{tensor}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(key[:8], "little") >> 1)


# Each method on one tensor: (anchor, inputs, weights, candidate, generators) -> the merged tensor in
# float64. `inputs` are the models' tensors for linear, their deltas for the others.
Method = Callable[[torch.Tensor, list[torch.Tensor], list[float], MergeCandidate, list[torch.Generator]], torch.Tensor]
METHODS: dict[str, Method] = {
    "linear": lambda anchor, tensors, w, c, g: linear(tensors, w),
    "task_arithmetic": lambda anchor, deltas, w, c, g: anchor + weighted_sum(deltas, w),
    "ties": lambda anchor, deltas, w, c, g: anchor + c.scale * disjoint_merge([trim(d, c.density) for d in deltas], w, normalize=True),
    "dare": lambda anchor, deltas, w, c, g: anchor + weighted_sum([drop(d, c.drop_rate, r) for d, r in zip(deltas, g, strict=True)], w),
    "dare_ties": lambda anchor, deltas, w, c, g: anchor + disjoint_merge([drop(d, c.drop_rate, r) for d, r in zip(deltas, g, strict=True)], w, normalize=False),
}  # fmt: skip


# --- whole models ---------------------------------------------------------------------------------


def parameters(model: torch.nn.Module, name: str) -> State:
    """`model`'s parameters by name, detached copies on the CPU; a parameter tied to another (the
    LM head to the embeddings) once, under its first name. A model whose config ties its
    embeddings but whose weights are not one tensor is refused: merging its two copies apart
    would untie them."""
    config, head = getattr(model, "config", None), model.get_output_embeddings()
    if getattr(config, "tie_word_embeddings", False) and head is not None and head.weight is not model.get_input_embeddings().weight:
        raise QllmError(f"merge: {name}'s config ties the LM head to the embeddings (tie_word_embeddings), but its weights are two tensors")
    return {key: value.detach().to("cpu", copy=True) for key, value in model.named_parameters()}


def check_compatible(states: Mapping[str, State]) -> None:
    """Every model has the same parameters, shapes and dtypes; else a `QllmError` naming the first
    tensor that differs and the two models."""
    (first, reference), *others = states.items()
    for name, state in others:
        for key in sorted(set(reference) ^ set(state)):
            holder, lacking = (first, name) if key in reference else (name, first)
            raise QllmError(f"merge: {holder} has a tensor {key} that {lacking} has not: the models do not share one architecture "
                            "(a tied and an untied LM head, another model family?)")  # fmt: skip
        for key, tensor in reference.items():
            other = state[key]
            if other.shape != tensor.shape or other.dtype != tensor.dtype:
                raise QllmError(f"merge: {key} is {list(other.shape)} {str(other.dtype).removeprefix('torch.')} in {name} but "
                                f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} in {first}: the models do not share one "
                                "architecture")  # fmt: skip


def merge(candidate: MergeCandidate, states: Mapping[str, State], parents: Mapping[str, str], anchor: str = "pretrain", seed: int = 0) -> State:
    """The merged parameters of `candidate`: `linear` over the states of its models; the other
    methods over their deltas from their `parents` (model -> the model it was trained from), added
    to the `anchor`'s state. Every tensor in float64, rounded once to its dtype; a non-float
    tensor copied (the same in every model, or a `QllmError`)."""
    models = list(candidate.models)
    weights = candidate.weight_list()
    method = METHODS[candidate.method]
    uses = models if candidate.method == "linear" else [anchor, *models, *(parents[m] for m in models)]
    missing = [m for m in dict.fromkeys(uses) if m not in states]
    if missing:
        raise QllmError(f"merge: {candidate.label()} needs {', '.join(missing)}, not loaded")
    check_compatible({m: states[m] for m in dict.fromkeys(uses)})
    merged: State = {}
    for key, like in states[uses[0]].items():
        if not like.is_floating_point():
            differ = [m for m in uses if not torch.equal(states[m][key], like)]
            if differ:
                raise QllmError(f"merge: {key} is not floating point, so it is copied, not merged, and it differs between {uses[0]} and {differ[0]}")
            merged[key] = like.clone()
            continue
        if candidate.method == "linear":
            value = method(like.double(), [states[m][key].double() for m in models], weights, candidate, [])
        else:
            deltas = [states[m][key].double() - states[parents[m]][key].double() for m in models]
            generators = [tensor_generator(seed, m, key) for m in models] if candidate.method in ("dare", "dare_ties") else []
            value = method(states[anchor][key].double(), deltas, weights, candidate, generators)
        merged[key] = value.to(like.dtype)
    return merged


@torch.no_grad()
def load_into(model: torch.nn.Module, state: State) -> None:
    """Write `state` into `model`'s parameters (a tied parameter once, so it stays tied)."""
    for key, parameter in model.named_parameters():
        parameter.copy_(state[key])

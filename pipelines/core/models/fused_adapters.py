"""PEFT's LoRA layers computed in fewer passes over their output: the same function and gradients up
to rounding, for every module `fuse` sets.

PEFT adds an adapter's update to the base layer's output as its own full-size tensor: plain LoRA
(`lora.Linear`) as `result + B(A(x)) · scaling`, AdaLoRA's SVD form (`SVDLinear`, both in-loop
allocations) as `result + (x (A⊙E)ᵀ Bᵀ) · scaling / ranknum`. Each product, scale and sum is a pass
over `tokens × d_out` numbers forward and again backward, for every module and step: on a small
model these cost as much as the base layer's own product. Here the scale goes into the small
`r × d_in` matrix and the sum into the second product (`addmm`): the *factored* form. Where
`merged_form` holds, the update goes into the weight instead (`W + B A s`, `d_out × d_in`) and the
input meets one product: the *merged* form, more arithmetic (the weight's gradient) and fewer
passes over activations, which is faster for small weights.

Anything else is PEFT's own forward: adapters disabled or merged, several active, mixed-batch
`adapter_names`, a LoRA variant (DoRA), a bias on `lora_B`, the base in another dtype than the
adapter, and PEFT's 4/8-bit layers (other classes). Nothing saved changes: the weights, their names
and PEFT's merging are PEFT's (benchmarks/results/adapters.md, "LoRA's SVD adapters in fewer passes" and
"Plain LoRA adapters in fewer passes").
"""

from __future__ import annotations

import types
from typing import Any

import torch

MERGED_FORM_SIZE = 128
"""The merged form applies when `d_in·d_out / (d_in + d_out) <= MERGED_FORM_SIZE`. Its extra product
(the weight's gradient) grows with `d_in·d_out`; the passes it saves are over `tokens × (d_in +
d_out)` numbers, whatever the rank, since products of rank 4-16 are as slow as their memory reads.
Measured on a 2-core AVX2 EPYC in fp32 (`benchmarks.adapters.svd_adapters`), one module's forward and
backward took 0.67-0.99x the factored form's time at sizes 64-128 (the default model's shapes: 64
and 102) at ranks 4, 12 and 16, and crossed 1.0 between 128 and 192, lower at higher ranks
(benchmarks/results/adapters.md, "LoRA's SVD adapters in fewer passes" and "Plain LoRA adapters in
fewer passes")."""


def fuse(model: torch.nn.Module) -> int:
    """Compute each of PEFT's plain `lora.Linear` and `SVDLinear` modules of `model` in fewer passes
    (their 4/8-bit siblings, other classes, keep their own forward); returns how many."""
    from peft.tuners.adalora.layer import SVDLinear
    from peft.tuners.lora.layer import Linear

    forwards = {Linear: lora_forward, SVDLinear: svd_forward}
    fused = 0
    for module in model.modules():
        forward = forwards.get(type(module))
        if forward is not None:
            module.forward = types.MethodType(forward, module)
            fused += 1
    return fused


def _single_adapter(module: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """The one adapter `module` applies in the plain way, or None where PEFT's forward must run."""
    if module.disable_adapters or module.merged or args or kwargs:
        return None
    active = list(module.active_adapters)
    if len(active) != 1 or active[0] not in module.lora_A:
        return None
    return active[0]


def _plain_dtypes(x: torch.Tensor, module: torch.nn.Module, *adapter: torch.Tensor) -> bool:
    """Under autocast the products take its dtype; without it, PEFT casts between the base's dtype
    and the adapter's, which only PEFT's forward does."""
    return torch.is_autocast_enabled(x.device.type) or all(x.dtype == t.dtype for t in (module.base_layer.weight, *adapter))


def merged_form(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `module`'s adapter is applied as one merged weight: in fp32 with no autocast, no
    dropout on the adapter's input, a small weight (`MERGED_FORM_SIZE`) and at least `d_in` tokens
    in `x` (building the weight then costs no more than the factored form's second product; never
    one token at a time in generation)."""
    name = module.active_adapters[0]
    a = module.lora_A[name]
    a = a.weight if isinstance(a, torch.nn.Linear) else a  # lora.Linear's is a layer, SVDLinear's a matrix
    base = module.base_layer
    if type(base) is not torch.nn.Linear or module.fan_in_fan_out or torch.is_autocast_enabled(x.device.type):
        return False
    if not isinstance(module.lora_dropout[name], torch.nn.Identity) or not x.dtype == base.weight.dtype == a.dtype == torch.float32:
        return False
    d_out, d_in = base.weight.shape
    tokens = x.numel() // d_in
    return tokens >= d_in and d_in * d_out <= MERGED_FORM_SIZE * (d_in + d_out)


def _factored(module: torch.nn.Module, x: torch.Tensor, dropout: torch.nn.Module, down_weight: torch.Tensor, up_weight: torch.Tensor) -> torch.Tensor:
    """`base(x) + dropout(x) down_weightᵀ up_weightᵀ`, the sum inside the second product."""
    result = module.base_layer(x)
    down = torch.nn.functional.linear(dropout(module._cast_input_dtype(x, down_weight.dtype)), down_weight)
    return torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]), up_weight.T).view(result.shape)


def lora_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's `lora.Linear.forward`, `W x + B A dropout(x) · s` with `s = scaling`, in fewer passes."""
    name = _single_adapter(self, args, kwargs)
    if name is None or name in self.lora_variant or self.lora_B[name].bias is not None:
        return type(self).forward(self, x, *args, **kwargs)
    a, b = self.lora_A[name].weight, self.lora_B[name].weight
    if not _plain_dtypes(x, self, a, b):
        return type(self).forward(self, x)
    scale = self.scaling[name]
    if merged_form(self, x):
        return torch.nn.functional.linear(x, self.base_layer.weight + (b @ a) * scale, self.base_layer.bias)
    return _factored(self, x, self.lora_dropout[name], a * scale, b)


def svd_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's `SVDLinear.forward`, `W x + (x (A⊙E)ᵀ Bᵀ)·s` with `s = scaling / (ranknum + 1e-5)`, in
    fewer passes (PEFT's makes three forward and two more backward)."""
    name = _single_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    a, b, e = self.lora_A[name], self.lora_B[name], self.lora_E[name]
    if not _plain_dtypes(x, self, a, b):
        return type(self).forward(self, x)
    scale = self.scaling[name] / (self.ranknum[name] + 1e-5)
    if merged_form(self, x):
        return torch.nn.functional.linear(x, self.base_layer.weight + (b @ (a * e)) * scale, self.base_layer.bias)
    return _factored(self, x, self.lora_dropout[name], a * (e * scale), b)

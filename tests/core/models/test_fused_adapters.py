"""PEFT's LoRA layers in fewer passes (`fused_adapters`): the same loss and gradients as PEFT's own
forward, for plain LoRA (`lora.Linear`: the uniform and quantum_opt allocations, `dpo.adapter`,
`grpo.adapter`) and the SVD form (`SVDLinear`: both in-loop allocations), and PEFT's forward wherever
the fused one does not apply."""

from __future__ import annotations

import pytest
import torch

from pipelines.core.models import adapters, fused_adapters
from pipelines.core.params.finetuning import AdaptiveParams, LoraAdapterParams
from pipelines.core.quantum import rank_allocation
from pipelines.core.training import loop
from tests import numerics

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def _model(tiny_base, kind: str, **adapter):
    """The tiny Llama with 2 layers x 4 adapted modules, each with a non-zero update (PEFT starts B,
    or Λ, at zero)."""
    from pipelines.core.models.models import load_causal_lm, load_tokenizer

    torch.manual_seed(0)  # PEFT's initialisation of A
    params = LoraAdapterParams(**{"enabled": True, "r": 3, "lora_alpha": 6, "lora_dropout": 0.0, "target_modules": TARGETS, "trainable_tokens": [], **adapter})
    base, tokenizer = load_causal_lm(tiny_base / "model"), load_tokenizer(tiny_base / "model")
    if kind == "svd":
        adaptive = AdaptiveParams(init_r=6, tinit=2, tfinal=4, every=3, ranks=[1, 2, 3, 4, 6])  # the budget: rank r=3
        model = rank_allocation.wrap(params, adaptive, 16)(base, tokenizer)
    else:
        model = adapters.wrap(params, "lora.adapter")(base, tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in _adapted(model).values():
            if kind == "svd":  # components masked as an allocation does
                entries = module.lora_E["default"]
                entries.copy_(torch.randn(entries.shape, generator=generator) * (torch.arange(entries.numel()).view_as(entries) % 3 != 0))
            else:
                weight = module.lora_B["default"].weight
                weight.copy_(torch.randn(weight.shape, generator=generator))
    return model


def _adapted(model) -> dict[str, torch.nn.Module]:
    return {name.removeprefix("base_model.model."): module for name, module in model.named_modules() if hasattr(module, "lora_A") and "default" in module.lora_A}


def _loss_and_grads(model, ids, precision="fp32", seed=0):
    model.zero_grad()
    torch.manual_seed(seed)
    with loop.autocast(torch.device("cpu"), precision):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _output_bound(module, x: torch.Tensor) -> torch.Tensor:
    """How far two computations of an adapted layer's output `W x + b + s·B (A⊙E) x` may be apart,
    elementwise, in whatever order the products, the scale and the sums are taken (merged into the
    weight, factored, PEFT's, merged and unmerged again): the worst case of `d_in + r` roundings for
    the two products plus 6 for the bias, the scales, and a merge and an unmerge of the weight
    (tests/numerics.py)."""
    a, b = module.lora_A["default"], module.lora_B["default"]
    a, b = (a.weight, b.weight) if isinstance(a, torch.nn.Linear) else (a * module.lora_E["default"], b)
    scale = module.scaling["default"] / (module.ranknum["default"] + 1e-5) if hasattr(module, "ranknum") else module.scaling["default"]
    base = module.base_layer
    magnitude = numerics.abs_product(x, base.weight) + abs(scale) * numerics.abs_product(x, a, b) + (0 if base.bias is None else base.bias.abs())
    return numerics.tolerance(x.shape[-1] + a.shape[0] + 6, x.dtype, magnitude, worst=True)


def _peft_forward(model) -> None:
    for module in _adapted(model).values():
        del module.forward  # PEFT's own forward again


@pytest.mark.parametrize("form", ["merged", "factored", "factored under bf16 autocast", "factored with dropout"])
@pytest.mark.parametrize("kind", ["lora", "svd"])
def test_fused_forward_computes_peft_s_loss_and_gradients(tiny_base, monkeypatch, kind, form):
    model = _model(tiny_base, kind, lora_dropout=0.3 if "dropout" in form else 0.0)
    model.train()
    modules = _adapted(model)
    assert len(modules) == 2 * 4 and all("forward" in vars(m) for m in modules.values())  # 2 layers x 4 target modules, each fused
    assert {type(m).__name__ for m in modules.values()} == {"SVDLinear" if kind == "svd" else "Linear"}
    if form != "merged":
        monkeypatch.setattr(fused_adapters, "MERGED_FORM_SIZE", 0 if form == "factored" else fused_adapters.MERGED_FORM_SIZE)
    precision = "bf16" if "bf16" in form else "fp32"
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with loop.autocast(torch.device("cpu"), precision):
        assert fused_adapters.merged_form(modules["model.layers.0.self_attn.q_proj"], torch.randn(2, 24, 32)) == (form == "merged")
    fused = _loss_and_grads(model, ids, precision)
    _peft_forward(model)
    peft = _loss_and_grads(model, ids, precision)
    assert fused[1].keys() == peft[1].keys() and any("lora_A" in n for n in peft[1])
    assert not torch.equal(fused[1][next(n for n in peft[1] if "lora_A" in n)], torch.zeros(()))
    if precision == "fp32":  # two orders of the model's chain, forward and backward (tests/numerics.py)
        config, tokens = model.config, ids.shape[0] * (ids.shape[1] - 1)
        numerics.assert_close_as(fused[0], peft[0], n=numerics.model_roundings(config, ids.shape[1], tokens=tokens), what="loss")
        for name in peft[1]:
            numerics.assert_close_as(fused[1][name], peft[1][name], n=numerics.model_roundings(config, ids.shape[1], tokens=tokens, backward=True), what=name)
        return
    # bf16 rounds each form differently, and the differences grow through the model: both are held
    # to the fp32 gradients, the fused form within twice PEFT's own distance (over 6 seeds on an AVX2
    # EPYC, plain LoRA's mean distances were 0.02-0.10 fused and 0.03-0.06 PEFT's; without the scale: 1.26)
    # the loss against fp32's: bf16's roundings of the products' operands along the chain, independent
    # from token to token, so their mean over the tokens is within 1/sqrt(tokens) of one token's
    exact = _loss_and_grads(model, ids, "fp32")
    numerics.assert_close_as(fused[0], exact[0], n=numerics.bf16_roundings(model.config), dtype=torch.bfloat16, magnitude=float(exact[0]) / ids[:, 1:].numel() ** 0.5)
    distance = {form: sum(float((grads[n] - exact[1][n]).norm() / exact[1][n].norm()) for n in grads) / len(grads)
                for form, (_, grads) in {"fused": fused, "peft": peft}.items()}  # fmt: skip
    assert distance["fused"] <= 2 * distance["peft"] + 0.01, distance


@pytest.mark.parametrize("kind", ["lora", "svd"])
def test_disabled_and_merged_adapters_are_left_to_peft(tiny_base, kind):
    model = _model(tiny_base, kind)
    module = _adapted(model)["model.layers.1.mlp.down_proj"]
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        base = module.base_layer(x)
        adapted = module(x)
        bound = _output_bound(module, x)
        assert not numerics.within(adapted, base, bound)
        with model.disable_adapter():
            assert torch.equal(module(x), base)  # the base layer's own product of the same input
        module.merge()
        numerics.assert_within(module(x), adapted, bound, "merged")
        module.unmerge()
        numerics.assert_within(module(x), adapted, bound, "unmerged")


def test_the_merged_form_needs_as_many_tokens_as_the_weight_has_inputs(tiny_base):
    module = _adapted(_model(tiny_base, "svd"))["model.layers.0.mlp.down_proj"]  # 64 -> 32
    assert fused_adapters.merged_form(module, torch.zeros(2, 32, 64))
    assert not fused_adapters.merged_form(module, torch.zeros(2, 31, 64))  # 62 tokens: one merged weight would cost more
    assert not fused_adapters.merged_form(module, torch.zeros(1, 1, 64))


@pytest.mark.parametrize("case", ["rslora", "dora", "two adapters", "adapter_names"])
def test_plain_lora_gives_peft_s_output_in_every_case(tiny_base, case):
    """Rank-stabilised scaling goes through the fused forward; DoRA, two active adapters and
    mixed-batch `adapter_names` through PEFT's: each gives PEFT's output."""
    model = _model(tiny_base, "lora", use_rslora=case == "rslora", use_dora=case == "dora")
    model.eval()  # PEFT takes adapter_names only in evaluation
    module = _adapted(model)["model.layers.0.mlp.gate_proj"]  # 32 -> 64
    if case == "two adapters":
        from peft import LoraConfig

        model.add_adapter("second", LoraConfig(r=2, target_modules=TARGETS, init_lora_weights="gaussian"))
        with torch.no_grad():
            module.lora_B["second"].weight.normal_()
        model.base_model.set_adapter(["default", "second"])
    kwargs = {"adapter_names": ["default", "__base__"]} if case == "adapter_names" else {}
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        fused = module(x, **kwargs)
        peft = type(module).forward(module, x, **kwargs)
        unadapted = module.base_layer(x)
    bound = _output_bound(module, x)
    if case == "rslora":  # the fused forward: PEFT's output up to the order of the sums
        numerics.assert_within(fused, peft, bound)
    else:  # PEFT's own forward, called again on the same input: the same kernels give the same bits
        assert torch.equal(fused, peft)
    assert not numerics.within(fused, unadapted, bound)
    if case == "rslora":  # scaling alpha / sqrt(r), applied once
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        numerics.assert_within(fused, unadapted + x @ a.T @ b.T * (6 / 3**0.5), bound)
    if case == "adapter_names":  # the second row is the base alone: the base layer's product of the same batch
        assert torch.equal(fused[1], unadapted[1])

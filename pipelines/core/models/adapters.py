"""LoRA adapters on a causal LM with PEFT: which modules, the config, wrapping, saving and merging.

Shared by the stages that train an adapter (`lora`, and `dpo` and `grpo` with `adapter.enabled`). `wrap(params)` and
`save(params, ...)` return the callables `finetune.run` and the DPO loop take; the checks name the
params section (`lora.adapter`, `dpo.adapter`, `grpo.adapter`) in their errors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipelines.core.errors import QllmError
from pipelines.core.models import fused_adapters
from pipelines.core.models.models import QUANTIZATION_FILE, merged_into_dequantized, save_pretrained, save_tokenizer
from pipelines.core.models.quantize import describe, embeddings_in_float32
from pipelines.core.params.finetuning import LoraAdapterParams

MERGED = "merged"
"""Subdirectory of an adapter directory holding the merged full model (`merge: true`)."""


def linear_module_names(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def module_matches(name: str, key: str) -> bool:
    """PEFT's rule for a `target_modules` entry or a `rank_pattern`/`alpha_pattern` key: the module
    name itself, a `.`-separated suffix of it, or a regular expression matching such a suffix."""
    return name == key or name.endswith(f".{key}") or re.fullmatch(rf"(.*\.)?{key}", name) is not None


def check_targets(model: torch.nn.Module, params: LoraAdapterParams, section: str = "lora.adapter") -> None:
    """Every `target_modules` entry and `rank_pattern`/`alpha_pattern` key must match a module
    (PEFT matches a name exactly or as a `.`-separated suffix); otherwise a clear error."""
    names = linear_module_names(model)

    short = sorted({name.rsplit(".", 1)[-1] for name in names if name != "lm_head"})
    for field in ("target_modules", "rank_pattern", "alpha_pattern"):
        for key in getattr(params, field):
            if not any(module_matches(name, key) for name in names):
                raise QllmError(f"{section}.{field}: {key!r} matches no linear module of the model (its linear modules are: {', '.join(short)})")


def layer_indices(model: torch.nn.Module, params: LoraAdapterParams, section: str = "lora.adapter") -> list[int] | None:
    """`layers_to_transform` as PEFT wants it (non-negative, sorted), or None for every layer;
    negative entries count from the end, and an index outside the model is an error."""
    if not params.layers_to_transform:
        return None
    count = model.config.num_hidden_layers
    resolved = set()
    for index in params.layers_to_transform:
        if not -count <= index < count:
            raise QllmError(f"{section}.layers_to_transform: {index} is outside the model's {count} layers (0..{count - 1}, or -{count}..-1 from the end)")
        resolved.add(index % count)
    return sorted(resolved)


def token_ids(tokenizer, tokens: list[str], section: str = "lora.adapter") -> list[int]:
    """Vocabulary ids of `lora.adapter.trainable_tokens`; an unknown token is an error."""
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise QllmError(f"{section}.trainable_tokens: {token!r} is not in the tokenizer's vocabulary")
        ids.append(token_id)
    return ids


def lora_config(params: LoraAdapterParams, trainable_token_ids: list[int] = (), layers: list[int] | None = None):
    """PEFT's `LoraConfig` for `params`; `layers` are the resolved `layers_to_transform`."""
    from peft import LoraConfig

    return LoraConfig(
        r=params.r,
        lora_alpha=params.lora_alpha,
        lora_dropout=params.lora_dropout,
        target_modules=list(params.target_modules),
        rank_pattern=dict(params.rank_pattern),
        alpha_pattern=dict(params.alpha_pattern),
        bias=params.bias,
        use_rslora=params.use_rslora,
        use_dora=params.use_dora,
        init_lora_weights=True if params.init_lora_weights == "default" else params.init_lora_weights,
        layers_to_transform=layers,
        trainable_token_indices={"embed_tokens": list(trainable_token_ids)} if trainable_token_ids else None,
        task_type="CAUSAL_LM",
    )


def wrap(params: LoraAdapterParams, section: str = "lora.adapter"):
    """`(model, tokenizer) -> PeftModel` with the adapter `params` describes (validated first), each
    module computed in fewer passes (`fused_adapters.fuse`)."""

    def apply(model: torch.nn.Module, tokenizer) -> torch.nn.Module:
        from peft import get_peft_model

        check_targets(model, params, section)
        layers = layer_indices(model, params, section)
        if moves_the_base(params) and getattr(model, "is_quantized", False):
            raise QllmError(f"{section}.init_lora_weights: {params.init_lora_weights} moves part of each weight into the adapter, "
                            f"which a quantized base cannot give back here; use default or gaussian, or {section}.quantization: none")  # fmt: skip
        tokens = token_ids(tokenizer, params.trainable_tokens, section)
        if tokens:
            embeddings_in_float32(model)  # PEFT writes fp32 rows into the embedding a 4-bit base holds in 16 bits
        peft_model = get_peft_model(model, lora_config(params, tokens, layers))
        if moves_the_base(params):
            keep_initial_adapter(peft_model)
        fused_adapters.fuse(peft_model)
        return peft_model

    return apply


def moves_the_base(params: LoraAdapterParams) -> bool:
    """PiSSA and OLoRA start the adapter from part of each weight and leave the rest in the base."""
    return params.init_lora_weights.startswith(("pissa", "olora"))


INITIAL_ADAPTER = "_qllm_initial_adapter"
"""Attribute of a PiSSA/OLoRA-wrapped model: the directory of its adapter before training."""


def keep_initial_adapter(model) -> None:
    """Save the untrained PiSSA/OLoRA adapter (PEFT's recipe: marked `init_lora_weights: true` so
    that loading it does not decompose again), so that `save` can convert the trained one into a
    plain LoRA against the original base (`path_initial_model_for_weight_conversion`)."""
    import tempfile
    import weakref

    directory = Path(tempfile.mkdtemp(prefix="qllm-initial-adapter-"))
    config = model.peft_config["default"]
    method, config.init_lora_weights = config.init_lora_weights, True
    try:
        model.save_pretrained(directory)
    finally:
        config.init_lora_weights = method
    setattr(model, INITIAL_ADAPTER, directory)
    import shutil

    weakref.finalize(model, shutil.rmtree, directory, True)


# PEFT keeps these as sets and writes them in set order, which changes with PYTHONHASHSEED.
SET_FIELDS = ("target_modules", "exclude_modules")


@contextmanager
def named_base(model, name: str) -> Iterator[None]:
    """Within the block the base model's `name_or_path` is `name`: PEFT's model card (README.md:
    `base_model` and the `base_model:adapter:` tag) records it, and it is this run's absolute path.
    (The adapter config's `base_model_name_or_path` stays: PEFT's save reads the base config there.)"""
    base = model.get_base_model()
    own_name, config_name = base.name_or_path, base.config.name_or_path
    base.name_or_path = base.config.name_or_path = name
    try:
        yield
    finally:
        base.name_or_path, base.config.name_or_path = own_name, config_name


def save(base_for_users: str, merge: bool = True, quantized_base: tuple[str, object] | None = None):
    """Write the adapter directory (and, with `merge`, `merged/`) recording `base_for_users`.

    The same adapter gives the same bytes in any directory and process: the base is named as
    users name it (a path relative to the project), not by this run's absolute path, and the
    module lists PEFT holds as sets are written sorted.

    `quantized_base` (QLoRA: the base's source and its quantization config): `merged/` is then a
    normal full-precision model, the adapter merged into the dequantized base, that is into the
    weights the adapter was trained against (`models.merged_into_dequantized`).
    """

    def write(model, tokenizer, directory: Path) -> None:
        initial = getattr(model, INITIAL_ADAPTER, None)
        with named_base(model, base_for_users):
            if initial is None:
                model.save_pretrained(directory)
            else:  # PiSSA/OLoRA: a plain LoRA of rank 2r against the original base
                model.save_pretrained(directory, path_initial_model_for_weight_conversion=str(initial))
        save_tokenizer(tokenizer, directory)
        adapter_config = directory / "adapter_config.json"
        settings = json.loads(adapter_config.read_text())
        settings["base_model_name_or_path"] = base_for_users
        for field in SET_FIELDS:
            if isinstance(settings.get(field), list):
                settings[field] = sorted(settings[field])
        adapter_config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        if quantized_base is not None:
            record_quantization(directory, quantized_base[1])
        if merge:
            if quantized_base is not None:
                release_quantized_weights(model)  # the adapter is saved: the merge needs no copy of the trained base
            merged = model.merge_and_unload() if quantized_base is None else merged_into_dequantized(*quantized_base, directory)
            save_pretrained(merged, tokenizer, directory / MERGED, max_length=merged.config.max_position_embeddings)

    return write


def record_quantization(directory: Path, qconfig) -> None:
    """Say in the adapter directory what base the adapter was trained against: its quantization
    (`qllm_quantization.json`, read back by `models.load_for_inference`) and a line in PEFT's model
    card. An adapter trained on a 4-bit base fits that base, not the full-precision one (the logits
    of a merge into the full-precision base moved 14x more than into the dequantized one)."""

    description = describe(qconfig)
    (directory / QUANTIZATION_FILE).write_text(json.dumps(description, indent=2, sort_keys=True) + "\n")
    card = directory / "README.md"
    if card.exists():
        settings = ", ".join(f"{k}: {v}" for k, v in sorted(description.items()))
        card.write_text(card.read_text().rstrip("\n") + f"\n\n## Training base\n\nTrained against the base quantized with {settings} "
                        f"(QLoRA). Merge it into that base dequantized (`qllm generate` and `evaluate` do), not into the "
                        f"full-precision weights.\n")  # fmt: skip


def release_quantized_weights(model: torch.nn.Module) -> None:
    """Free the quantized base weights of a trained model whose adapter is saved (the model is
    spent after this): merging quantizes the base again from its source, and two bases in memory
    made QLoRA's stage peak above plain LoRA's."""
    for module in model.modules():
        weight = module._parameters.get("weight")  # its own, not a wrapper's property that reads its base layer's
        if weight is not None and type(weight).__name__ in ("Params4bit", "Int8Params"):
            module._parameters["weight"] = None
    import gc

    gc.collect()

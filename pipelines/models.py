"""Model builders: build a Llama from config, load and save Hugging Face model directories.

Every model the pipeline writes is a `save_pretrained` directory (safetensors weights, config,
generation config, tokenizer) that `AutoModelForCausalLM.from_pretrained` loads. Loading goes
through `from_pretrained` too, so a hub name works wherever a network exists; tests use paths.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from pipelines.chat import IM_END
from pipelines.config import ModelParams
from pipelines.errors import QllmError

# transformers builds models under process-wide patches (default dtype, meta-device creation,
# init hooks; `PreTrainedModel.get_init_context`). Stages run in Prefect worker threads, and a
# module created in one thread while another is inside `from_pretrained` can end up on the meta
# device ("Cannot copy out of meta tensor"). Every model construction in the pipeline (loading,
# building, PEFT wrapping, merging) holds this lock; training and inference do not.
CONSTRUCTION = threading.RLock()


def device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def stop_token_ids(tokenizer) -> list[int]:
    """Generation stops at the end of an assistant turn or at end of text."""
    ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    return [i for i in ids if i is not None and i != tokenizer.unk_token_id]


def build_llama(params: ModelParams, tokenizer, max_positions: int, seed: int):
    """A randomly initialised `LlamaForCausalLM` sized by `params`, vocabulary from `tokenizer`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
        num_hidden_layers=params.num_layers,
        num_attention_heads=params.num_heads,
        num_key_value_heads=params.num_kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=params.rope_theta,
        tie_word_embeddings=params.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with CONSTRUCTION:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    configure_generation(model, tokenizer)
    return model


def configure_generation(model, tokenizer) -> None:
    """Greedy by default, stopping at `<|im_end|>`/EOS: what `generate` and MLflow pipelines use."""
    generation = model.generation_config
    generation.eos_token_id = stop_token_ids(tokenizer)
    generation.pad_token_id = tokenizer.pad_token_id
    generation.bos_token_id = None
    generation.do_sample = False


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise QllmError(f"{path}: cannot load a tokenizer ({exc})") from None


def load_causal_lm(path: Path | str, dtype: torch.dtype = torch.float32):
    """Load a causal LM (`save_pretrained` directory or hub name) in `dtype` for training/eval."""
    from transformers import AutoModelForCausalLM

    try:
        with CONSTRUCTION:
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError) as exc:
        raise QllmError(f"{path}: cannot load a causal language model ({exc})") from None


def save_pretrained(model, tokenizer, out: Path, max_length: int | None = None) -> None:
    """Write a self-contained model directory (weights as safetensors, plus the tokenizer)."""
    if max_length is not None:
        tokenizer.model_max_length = max_length
    configure_generation(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def parameter_counts(model) -> dict[str, int]:
    """Trainable and total parameters (shared tensors, e.g. tied embeddings, counted once)."""
    seen: set[int] = set()
    total = trainable = 0
    for parameter in model.parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        total += parameter.numel()
        trainable += parameter.numel() if parameter.requires_grad else 0
    return {"trainable_parameters": trainable, "total_parameters": total}


def load_for_inference(model_dir: Path | str, root: Path | str = "."):
    """(model, tokenizer) from any model directory the pipeline writes: a full model, a LoRA
    output with `merged/`, or a PEFT adapter (merged into its base, resolved against `root`)."""
    import json

    model_dir = Path(model_dir)
    if (model_dir / "merged" / "config.json").exists():
        return load_causal_lm(model_dir / "merged"), load_tokenizer(model_dir / "merged")
    adapter_config = model_dir / "adapter_config.json"
    if adapter_config.exists():
        from peft import PeftModel

        base = json.loads(adapter_config.read_text())["base_model_name_or_path"]
        base_path = Path(root) / base if (Path(root) / base).exists() else base
        with CONSTRUCTION:
            model = PeftModel.from_pretrained(load_causal_lm(base_path), str(model_dir)).merge_and_unload()
        return model, load_tokenizer(model_dir)
    return load_causal_lm(model_dir), load_tokenizer(model_dir)

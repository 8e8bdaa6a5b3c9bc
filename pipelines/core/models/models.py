"""Model builders: build a Llama from config, load and save Hugging Face model directories.

Every model the pipeline writes is a `save_pretrained` directory (safetensors weights, config,
generation config, tokenizer) that `AutoModelForCausalLM.from_pretrained` loads. Loading goes
through `from_pretrained` too, so a hub name works wherever a network exists; tests use paths.
A local directory is checked first (it exists, holds config.json and tokenizer files, readable
weights, a tokenizer no bigger than the embedding) so that a bad one is one clear `QllmError`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from pipelines.core.data.chat_template import IM_END, end_of_turn_token
from pipelines.core.errors import QllmError
from pipelines.core.models import gguf_import
from pipelines.core.models.model_source import follow, local_model_dir, model_location, pointed, with_chat_template
from pipelines.core.params.pretraining import ModelParams

# transformers builds models under process-wide patches (default dtype, meta-device creation,
# init hooks; `PreTrainedModel.get_init_context`). Stages run in Prefect worker threads, and a
# module created in one thread while another is inside `from_pretrained` can end up on the meta
# device ("Cannot copy out of meta tensor"). Every model construction in the pipeline (loading,
# building, PEFT wrapping, merging) holds this lock; training and inference do not.
CONSTRUCTION = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Random construction (initial weights, adapters) as a function of `seed` alone: under
    CONSTRUCTION, in a fork of torch's global generators that is restored after, so a stage
    training in another thread neither disturbs it nor is disturbed by it
    (`pipelines.core.training.randomness`)."""
    with CONSTRUCTION, torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        yield


def device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def stop_token_ids(tokenizer) -> list[int]:
    """Generation stops at the end of an assistant turn (the chat template's end-of-turn token,
    e.g. `<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`) or at end of text."""
    ids = [end_of_turn_token(tokenizer), tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    unique = dict.fromkeys(i for i in ids if i is not None and i != tokenizer.unk_token_id)
    return list(unique)


def build_llama(params: ModelParams, tokenizer, max_positions: int, seed: int, diffusion=None, mask_token_id: int | None = None):
    """A randomly initialised `LlamaForCausalLM` sized by `params`, vocabulary from `tokenizer`
    (with `params.memory.enabled`, a `QllmMemoryLlamaForCausalLM`: `pipelines.core.models.memory_model`; with
    `diffusion` settings and the tokenizer's `mask_token_id`, a bidirectional `QllmDiffusionLlamaForMaskedDiffusion`:
    `pipelines.core.models.diffusion_model`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config_class, model_class, extra = LlamaConfig, LlamaForCausalLM, {}
    if diffusion is not None:
        from pipelines.core.models.diffusion_model import QllmDiffusionConfig, QllmDiffusionLlamaForMaskedDiffusion

        if mask_token_id is None:
            raise QllmError("a masked-diffusion model needs the tokenizer's mask token id")
        config_class, model_class = QllmDiffusionConfig, QllmDiffusionLlamaForMaskedDiffusion
        extra = {"mask_token_id": mask_token_id, "unmask_steps": diffusion.unmask_steps,
                 "block_length": diffusion.block_length}  # fmt: skip
    if params.memory.enabled:
        from pipelines.core.models.memory_model import QllmMemoryConfig, QllmMemoryLlamaForCausalLM

        memory = params.memory
        config_class, model_class = QllmMemoryConfig, QllmMemoryLlamaForCausalLM
        extra = {"memory_layers": memory.layers, "memory_num_keys": memory.num_keys, "memory_heads": memory.heads,
                 "memory_key_dim": memory.key_dim, "memory_topk": memory.topk}  # fmt: skip
    config = config_class(
        **extra,
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
    with seeded(seed):
        model = model_class(config)
    configure_generation(model, tokenizer)
    return model


def configure_generation(model, tokenizer) -> None:
    """Greedy by default, stopping at `<|im_end|>`/EOS: what `generate` and MLflow pipelines use."""
    generation = model.generation_config
    generation.eos_token_id = stop_token_ids(tokenizer)
    generation.pad_token_id = tokenizer.pad_token_id
    generation.bos_token_id = None
    generation.do_sample = False


# Any of these makes a directory a tokenizer `AutoTokenizer.from_pretrained` may load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _check_tokenizer_files(path: Path | str) -> None:
    local = local_model_dir(path)
    if local is not None and not any((local / name).exists() for name in TOKENIZER_FILES):
        raise QllmError(f"{path}: no tokenizer (tokenizer.json / tokenizer_config.json missing)")


def _follow(path: Path | str) -> Path | str:
    """A pointer directory (`data/models/pretrain` when `pretrain` trained nothing) stands for the
    base model it names (`pipelines.base_model`)."""
    return follow(path)


def _gguf_file(path: Path | str) -> Path | None:
    """`path` as a GGUF file (`pipelines.core.models.gguf_import`), else None."""
    return Path(path) if str(path).lower().endswith(".gguf") and Path(path).is_file() else None


def check_model_files(path: Path | str) -> Path | None:
    local = local_model_dir(path)
    if local is not None and not (local / "config.json").exists():
        raise QllmError(f"{path}: no config.json (not a save_pretrained model directory)")
    return local


def load_tokenizer(path: Path | str):
    """Load the tokenizer of a model directory (or a tokenizer directory, a hub name, a GGUF file)."""
    from transformers import AutoTokenizer

    record, path = pointed(path), _follow(path)  # a pointer's base: with the template its record carries
    if (gguf := _gguf_file(path)) is not None:
        return with_chat_template(gguf_import.load_tokenizer(gguf), record)
    _check_tokenizer_files(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise QllmError(f"{path}: cannot load a tokenizer ({exc})") from None
    return with_chat_template(tokenizer, record)


def load_causal_lm(path: Path | str, dtype: torch.dtype = torch.float32, quantization=None):
    """Load a causal LM (`save_pretrained` directory or hub name) in `dtype` for training/eval;
    with a transformers quantization config (`pipelines.core.models.quantize.config`), straight into 4/8 bits
    on this process's device."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    import pipelines.core.models.diffusion_model  # noqa: F401  (registers the pipeline's own model classes with the Auto classes)
    import pipelines.core.models.memory_model  # noqa: F401

    path = _follow(path)
    if (gguf := _gguf_file(path)) is not None:
        if quantization is not None:
            raise QllmError(f"{path}: a GGUF file is read dequantized; quantize the model it becomes (data/models/pretrain), not the file")
        with CONSTRUCTION:
            return gguf_import.load_model(gguf, dtype)
    local = check_model_files(path)
    try:
        with CONSTRUCTION:
            if quantization is None:
                return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
            # Quantized: read each weight in the checkpoint's own dtype (bf16 for most hub models) and
            # quantize it from there: asking for fp32 first made the whole base in fp32 on the way
            # (2.5 GB at 0.5B parameters for a 0.7 GB result). The weights left unquantized are cast
            # to `dtype` after (`quantize.for_adapters`), and the 4-bit matmuls compute in the
            # config's compute dtype either way.
            return AutoModelForCausalLM.from_pretrained(str(path), dtype="auto", quantization_config=quantization, device_map={"": device()})
    except (OSError, ValueError) as exc:
        raise QllmError(f"{path}: cannot load a causal language model ({exc})") from None
    except SafetensorError as exc:  # a cut or corrupt .safetensors file (copy interrupted, disk full)
        single = Path(path) / "model.safetensors"
        shown = single if local is not None and single.exists() else path
        raise QllmError(f"{shown}: unreadable weights ({exc})") from None


def context_length(path: Path | str) -> int:
    """The context a model was built for (`max_position_embeddings` of its config), without loading it."""
    from transformers import AutoConfig

    path = _follow(path)
    if (gguf := _gguf_file(path)) is not None:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    else:
        check_model_files(path)
        try:
            config = AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise QllmError(f"{path}: cannot read the model's config ({exc})") from None
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def check_vocabulary(model, tokenizer, path: Path | str) -> None:
    """Every token id of `tokenizer` must have a row in the model's input embedding (else the
    first lookup of a high id fails with torch's "index out of range in self")."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise QllmError(
            f"{path}: tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows "
            "(tokenizer and model do not match)"
        )


def load_model_and_tokenizer(path: Path | str, dtype: torch.dtype = torch.float32, quantization=None):
    """(model, tokenizer) of one model directory (or hub name), checked to match each other."""
    given, path = path, _follow(path)
    if _gguf_file(path) is None:
        check_model_files(path)  # what is missing, before the slow part
        _check_tokenizer_files(path)
    model = load_causal_lm(path, dtype, quantization)
    tokenizer = load_tokenizer(given)  # through a pointer: with the chat template its record carries
    check_vocabulary(model, tokenizer, path)
    return model, tokenizer


def save_pretrained(model, tokenizer, out: Path, max_length: int | None = None) -> None:
    """Write a self-contained model directory (weights as safetensors, plus the tokenizer)."""
    if max_length is not None:
        tokenizer.model_max_length = max_length
    configure_generation(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)


LOAD_OPTIONS = ("local_files_only",)
"""What transformers keeps in a loaded tokenizer's `init_kwargs` about how it was loaded, not what
it is: `local_files_only` is true where the process has `HF_HUB_OFFLINE=1` (a stage under `qllm
run`'s environment) and false elsewhere, so a saved tokenizer_config.json differed between a run in
the suite's process and the same run in a process of its own."""


def forget_load_options(tokenizer) -> None:
    """Drop `LOAD_OPTIONS` from what `save_pretrained` writes of `tokenizer` (a processor's too)."""
    for key in LOAD_OPTIONS:
        tokenizer.init_kwargs.pop(key, None)


def save_tokenizer(tokenizer, out: Path | str) -> None:
    """`tokenizer.save_pretrained(out)` without the load options: the same bytes wherever the
    tokenizer was loaded."""
    forget_load_options(tokenizer)
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
        return load_model_and_tokenizer(model_dir / "merged")
    adapter_config = model_dir / "adapter_config.json"
    if adapter_config.exists():
        from peft import PeftModel

        base = json.loads(adapter_config.read_text())["base_model_name_or_path"]
        base_path = model_location(base, root)
        tokenizer = load_tokenizer(model_dir)
        quantized = model_dir / QUANTIZATION_FILE
        if quantized.exists():  # trained against a quantized base: merged into that base, dequantized
            model = merged_into_dequantized(str(base_path), quantization_config(json.loads(quantized.read_text())), model_dir)
        else:
            with CONSTRUCTION:
                model = PeftModel.from_pretrained(load_causal_lm(base_path), str(model_dir)).merge_and_unload()
        check_vocabulary(model, tokenizer, model_dir)
        return model, tokenizer
    return load_model_and_tokenizer(model_dir)


QUANTIZATION_FILE = "qllm_quantization.json"
"""In an adapter directory: the quantization of the base it was trained against (absent: none;
written by `pipelines.core.models.adapters.record_quantization` from `quantize.describe`)."""
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def quantization_config(description: dict):
    """transformers' bitsandbytes config for a recorded quantization (`QUANTIZATION_FILE`)."""
    from transformers import BitsAndBytesConfig

    name = description["quantization"]
    if name == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if name not in ("nf4", "fp4"):
        raise QllmError(f"{QUANTIZATION_FILE}: quantization {name!r} cannot be dequantized for a merge (nf4, fp4, int8 can)")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=name, bnb_4bit_use_double_quant=bool(description.get("double_quant", True)),
                              bnb_4bit_compute_dtype=_DTYPES[description.get("compute_dtype", "fp32")])  # fmt: skip


def merged_into_dequantized(source: str, quantization, adapter_dir: Path):
    """The adapter in `adapter_dir` merged into the dequantized base: the base quantized again
    from `source` (deterministic, and in bitsandbytes' standard layout: on AVX512-BF16 CPUs a
    4-bit weight that has run inference is repacked for the CPU kernel, and dequantizing that
    gives garbage), dequantized to full precision, then merged. Lossy against the full-precision
    base by the quantization error, not against the model that was trained (benchmarks/results/adapters.md,
    "Merging a QLoRA adapter: how lossy")."""
    from peft import PeftModel

    with CONSTRUCTION:
        base = load_causal_lm(source, quantization=quantization).dequantize(dtype=torch.float32).to(torch.float32)  # each weight straight to fp32
        return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()

"""GGUF files for llama.cpp and Ollama, written with the `gguf` package (llama.cpp's own writer).

    write(model, tokenizer, "qllm-f16.gguf", "f16", name="qllm")    # or "q8_0", "bf16", "f32"
    quantize_with_llama_cpp("qllm-f16.gguf", "qllm-q4_k_m.gguf", "q4_k_m")   # needs llama-cpp-python
    modelfile("qllm-q8_0.gguf", tokenizer.chat_template, stops)   # Ollama's Modelfile text

Why the `gguf` package and not llama.cpp's `convert_hf_to_gguf.py`: the converter is a script in
llama.cpp's source tree (not installable), and it identifies a BPE tokenizer's pre-tokenizer by
hashing how it splits a fixed text against a list of known hub tokenizers: a tokenizer trained
here (`train_tokenizer`) is in no such list, so it refuses it. The writer is the library the
converter itself writes with (a pure-Python wheel, NumPy only); this module does the converter's
part for the families the pipeline trains or fine-tunes (Llama/Mistral, Qwen2, Qwen3, Gemma 1-3):
the tensor names come from the package's own map (`gguf.get_tensor_name_map`), Q and K of
llama-family attention are permuted as the converter does (llama.cpp's rotary pairs neighbouring
dimensions; transformers rotates halves), Gemma's norm weights get the converter's +1, rope
scaling (linear, YaRN, Llama 3.1's llama3) is written as the converter writes it (`rope_scaling`),
the pre-tokenizer is read from tokenizer.json (GPT-2's byte-level regex: `gpt-2`; each digit alone
then GPT-2's regex: `smollm`; Llama 3's and Qwen2's split regexes: `llama-bpe`, `qwen2`; a base read
from a GGUF file keeps the name its file gave when the tokenizer still splits that way), and the tokenizer's special tokens, merges and
chat template go into the metadata via the package's `SpecialVocab`.

Tensor types as the converter writes them: 1-D tensors (norms, biases) stay F32; 2-D ones are F16
(`f16`), BF16, F32, or Q8_0 (`q8_0`; blocks of 32 along a row, a tensor whose rows are not a
multiple of 32 stays F16). The file's bytes depend only on the model and tokenizer: no dates,
paths or timings. K-quants (q4_k_m, ...) need llama.cpp's quantizer, reached through
llama-cpp-python where it is installed (`quantize_with_llama_cpp`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.core.errors import QllmError
from pipelines.core.models import gguf_import
from pipelines.core.models.models import stop_token_ids
from pipelines.core.outputs import sha256_file

NUMPY_TYPES = ("f16", "q8_0", "bf16", "f32")
"""Types written here with the `gguf` package alone."""
LLAMA_CPP_TYPES = {"q4_k_m": 15, "q4_k_s": 14, "q5_k_m": 17, "q6_k": 18}
"""Types made by llama.cpp's quantizer from an f16 file: `llama_ftype` values (llama.h)."""
ARCHITECTURES = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False),
                 "gemma": ("gemma", False), "gemma2": ("gemma2", False), "gemma3_text": ("gemma3", False)}  # fmt: skip
"""transformers `model_type` -> (GGUF architecture, whether Q and K are permuted): llama.cpp runs
Mistral's dense models as `llama`; Qwen2, Qwen3 and Gemma use the NeoX rotary (halves), as
transformers does."""
ROPE_TYPES = {"llama": ("default", "linear", "yarn", "llama3"), "qwen2": ("default", "linear", "yarn"), "qwen3": ("default", "linear", "yarn"),
              "gemma": ("default",), "gemma2": ("default",), "gemma3": ("default", "linear")}  # fmt: skip
"""The rope types written per GGUF architecture (each checked against llama.cpp): `linear` and
`yarn` as the `rope.scaling.*` keys llama.cpp reads, `llama3` (Llama 3.1/3.2) as the per-dimension
`rope_freqs` tensor llama.cpp's llama graph divides the frequencies by; Gemma 3's `linear` on its
global (full-attention) layers only. `dynamic` (the scale follows the sequence length) and
`longrope` (per-length factor sets) have no llama.cpp counterpart on these architectures."""
GEMMA = ("gemma", "gemma2", "gemma3")

# The pre-tokenizer regexes of tokenizer.json that llama.cpp knows by name (llama-vocab.cpp).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}

class ExportError(QllmError, ValueError):
    """The model or tokenizer cannot be written as GGUF (a clear reason, what is supported)."""


def architecture(config: Any, where: str) -> tuple[str, bool]:
    """(GGUF architecture, permute Q/K) for a transformers config, or an `ExportError` naming
    `where` and what is supported (the rope scaling and attention variants included)."""
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        raise ExportError(f"{where}: GGUF export supports {', '.join(sorted(ARCHITECTURES))} decoder models; this one is {kind!r} "
                          "(llama.cpp has no architecture for the pipeline's memory or diffusion models, nor an image model here)")  # fmt: skip
    arch = ARCHITECTURES[kind][0]
    rope_scaling(config, where)
    if head_dim(config) * float(rope_parameters(config).get("partial_rotary_factor") or 1.0) != head_dim(config):
        raise ExportError(f"{where}: a partial rotary (partial_rotary_factor {rope_parameters(config)['partial_rotary_factor']}) is not written to GGUF here")
    layer_types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None) if kind == "mistral" else None
    if window and int(window) < int(getattr(config, "max_position_embeddings", 0) or 0):  # Mistral 7B v0.1: 4096 of 32768
        raise ExportError(f"{where}: mistral with a {window}-token sliding window (sliding_window) is not written to GGUF: llama.cpp's llama "
                          "attends to the whole context, so answers past the window would differ (a model trained without one has sliding_window: null)")  # fmt: skip
    if arch in GEMMA:
        _check_gemma(config, arch, layer_types, where)
    elif "sliding_attention" in layer_types:
        raise ExportError(f"{where}: {kind} with sliding-window layers (use_sliding_window) is not written to GGUF: llama.cpp's {arch} attends to the whole context")
    return ARCHITECTURES[kind]


def _check_gemma(config: Any, arch: str, layer_types: list[str], where: str) -> None:
    """What llama.cpp's gemma graphs fix that a transformers Gemma config could set otherwise."""
    n_layer = int(config.num_hidden_layers)
    if not getattr(config, "tie_word_embeddings", True):
        raise ExportError(f"{where}: {config.model_type} with an untied output head is not written to GGUF (llama.cpp's {arch} reuses the embedding)")
    activation = config.hidden_act if arch == "gemma" else config.hidden_activation  # what each one's MLP reads
    if activation != "gelu_pytorch_tanh":
        raise ExportError(f"{where}: {config.model_type} activation {activation!r}: llama.cpp's {arch} uses GELU's tanh approximation (gelu_pytorch_tanh)")
    if arch == "gemma":
        return
    big = {"gemma2": 46, "gemma3": 62}[arch]  # llama.cpp scales queries by the 27B's rule at this depth, by head_dim otherwise
    scalar = config.hidden_size // config.num_attention_heads if n_layer == big else head_dim(config)
    if float(config.query_pre_attn_scalar) != float(scalar):
        raise ExportError(f"{where}: {config.model_type} query_pre_attn_scalar {config.query_pre_attn_scalar}: llama.cpp's {arch} scales queries by "
                          f"1/sqrt({scalar}) for {n_layer} layers")  # fmt: skip
    period = {"gemma2": 2, "gemma3": 6}[arch]  # llama.cpp's sliding-window pattern: every period-th layer attends globally
    expected = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layer)]
    if layer_types != expected:
        raise ExportError(f"{where}: {config.model_type} layer types {layer_types}: llama.cpp's {arch} has a global layer every {period} layers, the others sliding")
    if getattr(config, "use_bidirectional_attention", False):
        raise ExportError(f"{where}: {config.model_type} with bidirectional attention (an embedding model) is not written to GGUF here")
    if arch == "gemma2" and (config.attn_logit_softcapping is None or config.final_logit_softcapping is None):
        raise ExportError(f"{where}: gemma2 without attention or final logit soft-capping: llama.cpp's gemma2 always caps both")
    if arch == "gemma3" and (config.attn_logit_softcapping is not None or config.final_logit_softcapping is not None):
        raise ExportError(f"{where}: gemma3_text with logit soft-capping is not written to GGUF here")


def rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope settings of a transformers config as one dict (transformers 5's `rope_parameters`,
    or 4's `rope_scaling` with `rope_theta` beside it; Gemma 3's per-layer-type dicts: the
    `layer_type` one), `rope_type` and `rope_theta` always set."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if isinstance(rope.get(layer_type), dict):
        rope = dict(rope[layer_type])
    rope["rope_type"] = rope.get("rope_type", rope.get("type")) or "default"
    rope["rope_theta"] = float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
    if rope.get("original_max_position_embeddings") is None and getattr(config, "original_max_position_embeddings", None) is not None:
        rope["original_max_position_embeddings"] = config.original_max_position_embeddings
    return rope


def rope_theta(config: Any) -> float:
    return rope_parameters(config)["rope_theta"]


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude for a context `factor` (transformers' and llama.cpp's get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scaling(config: Any, where: str) -> dict[str, Any]:
    """What the config's rope scaling becomes in GGUF: {"type": "none"} (default rotary), linear
    {"type", "factor"}, yarn {"type", "factor", "original_context", "beta_fast", "beta_slow",
    "attn_factor"} (the `rope.scaling.*` keys), llama3 {"type", "rope_freqs"} (the tensor); an
    `ExportError` naming the rope type for what llama.cpp would compute otherwise."""
    arch = ARCHITECTURES[config.model_type][0]
    rope = rope_parameters(config)
    kind = rope["rope_type"]
    if arch == "gemma3" and rope_parameters(config, "sliding_attention")["rope_type"] != "default":
        raise ExportError(f"{where}: rope scaling {rope_parameters(config, 'sliding_attention')['rope_type']!r} on gemma3's sliding-window layers "
                          "is not written to GGUF (llama.cpp scales the global layers only)")  # fmt: skip
    if kind not in ROPE_TYPES[arch]:
        why = {"dynamic": "its scale follows the sequence length, which llama.cpp has no setting for",
               "longrope": "llama.cpp reads LongRoPE's factor sets for Phi-3 only",
               "llama3": "llama.cpp applies the llama3 frequency factors in its llama graph only"}.get(kind, "llama.cpp has no such scaling here")  # fmt: skip
        raise ExportError(f"{where}: rope scaling {kind!r} is not written to GGUF for {config.model_type} ({why}); "
                          f"written here: {', '.join(t for t in ROPE_TYPES[arch] if t != 'default')}")  # fmt: skip
    if kind == "default":
        return {"type": "none"}
    factor = rope.get("factor")
    if kind in ("linear", "llama3") and factor is None:
        raise ExportError(f"{where}: rope scaling {kind!r} without a factor")
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise ExportError(f"{where}: rope scaling {kind!r} without original_max_position_embeddings")
    if kind == "llama3":
        return {"type": "llama3", "rope_freqs": llama3_rope_factors(head_dim(config), rope["rope_theta"], float(factor), float(rope.get("low_freq_factor", 1.0)),
                                                                     float(rope.get("high_freq_factor", 4.0)), int(original))}  # fmt: skip
    if factor is None:  # transformers derives it from the two lengths
        factor = config.max_position_embeddings / original
    factor = float(factor)
    beta_fast, beta_slow = float(rope.get("beta_fast") or 32.0), float(rope.get("beta_slow") or 1.0)
    if (beta_fast, beta_slow) != (32.0, 1.0):
        raise ExportError(f"{where}: rope scaling 'yarn' with beta_fast {beta_fast:g} and beta_slow {beta_slow:g} is not written to GGUF: llama.cpp's "
                          f"{arch} does not read them from the file and ramps between 32 and 1")  # fmt: skip
    if rope.get("truncate", True) is False:
        raise ExportError(f"{where}: rope scaling 'yarn' with truncate false is not written to GGUF (llama.cpp always rounds the correction range to whole dimensions)")
    attention = rope.get("attention_factor")
    if attention is None:  # as transformers infers it
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim else _yarn_mscale(factor)
    # llama.cpp multiplies cos/sin by get_mscale(factor) times rope.scaling.attn_factor: the rest goes there
    return {"type": "yarn", "factor": factor, "original_context": int(original), "beta_fast": beta_fast, "beta_slow": beta_slow,
            "attn_factor": float(attention) / _yarn_mscale(factor)}  # fmt: skip


def llama3_rope_factors(dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float, original: int) -> np.ndarray:
    """Llama 3.1's rope as the factor llama.cpp divides each of the `dim // 2` frequencies by
    (`rope_freqs.weight`; `LlamaModel.generate_extra_tensors` of llama.cpp's converter): 1 for
    wavelengths under original/high_freq_factor, `factor` over original/low_freq_factor, and the
    inverse of the smooth blend of 1/factor and 1 between them (transformers' `_compute_llama3_parameters`)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high_freq_factor:
            out.append(1.0)
        elif wavelen > original / low_freq_factor:
            out.append(factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers' Q or K rows (each head's rotary halves) in llama.cpp's order (interleaved
    pairs): `LlamaModel.permute` of llama.cpp's converter."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _byte_level(spec: dict, use_regex: bool) -> bool:
    return spec.get("type") == "ByteLevel" and bool(spec.get("use_regex", True)) == use_regex and not spec.get("add_prefix_space", False)


def pre_tokenizer_names(pre: dict) -> list[str]:
    """llama.cpp's names for what a tokenizer.json pre-tokenizer does, the usual name first (empty:
    none llama.cpp applies the same way). Names in one list split text alike in llama.cpp."""
    if _byte_level(pre, use_regex=True):
        return list(gguf_import.GPT2_FAMILY)
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(parts) == 2 and parts[0].get("type") == "Digits" and parts[0].get("individual_digits") and _byte_level(parts[1], use_regex=True):
        return list(gguf_import.DIGITS_FAMILY)
    if len(parts) == 2 and parts[0].get("type") == "Split" and _byte_level(parts[1], use_regex=False):
        regex = parts[0].get("pattern", {}).get("Regex")
        if regex in PRE_TOKENIZERS:  # and the other names transformers' GGUF reader gives that split
            from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

            return [PRE_TOKENIZERS[regex]] + sorted(n for n, r in GGUF_PRE_TOKENIZER_SPLITS.items() if r == regex and n != PRE_TOKENIZERS[regex])
    return []


def pre_tokenizer(tokenizer_json: dict, where: str, recorded: str | None = None) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE tokenizer.json: `recorded` (the
    name the GGUF file a base came from gave it, `gguf_import.PRE_TOKENIZER_KEY`) when the
    tokenizer still splits as llama.cpp does under that name, else the usual name of what it does
    (`gpt-2`, `smollm`, `llama-bpe`, `qwen2`); an `ExportError` for one llama.cpp knows by no name."""
    model = tokenizer_json.get("model", {}).get("type")
    if model != "BPE":
        raise ExportError(f"{where}: GGUF export writes byte-level BPE tokenizers (tokenizer.json model BPE); this one is {model!r}")
    pre = tokenizer_json.get("pre_tokenizer") or {}
    names = pre_tokenizer_names(pre)
    if recorded in names:
        return recorded
    if names:
        return names[0]
    raise ExportError(f"{where}: pre-tokenizer {json.dumps(pre)[:200]} is not one llama.cpp knows by name here "
                      f"(GPT-2's byte-level regex, digits then GPT-2's (SmolLM, StarCoder), Llama 3's or Qwen2's split): "
                      f"use llama.cpp's convert_hf_to_gguf.py")  # fmt: skip


def _token_types(tokenizer, n_vocab: int) -> tuple[list[str], list[int]]:
    import gguf

    vocab = tokenizer.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    added = {t.content: t for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()}
    tokens, types = [], []
    for i in range(n_vocab):
        token = by_id.get(i)
        if token is None:  # embedding rows past the tokenizer (padded vocabularies), as the converter names them
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if added[token].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _add_tokenizer(writer, tokenizer, n_vocab: int, where: str) -> None:
    import gguf

    tokenizer_json = json.loads(tokenizer.backend_tokenizer.to_str())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer_json, where, tokenizer.init_kwargs.get(gguf_import.PRE_TOKENIZER_KEY)))
    if len(tokenizer.get_vocab()) > n_vocab:
        raise ExportError(f"{where}: the tokenizer has {len(tokenizer.get_vocab())} tokens but the model's embedding only {n_vocab} rows")
    tokens, types = _token_types(tokenizer, n_vocab)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as tmp:  # SpecialVocab reads merges, special ids and the template from files
        tokenizer.save_pretrained(tmp)
        special = gguf.SpecialVocab(tmp, load_merges=True, n_vocab=n_vocab)
    special.chat_template = tokenizer.chat_template  # what apply_chat_template renders (tokenizer_config or chat_template.jinja)
    stops = stop_token_ids(tokenizer)  # the chat's end of turn first, as `qllm generate` and evaluate stop
    if stops and "eos" not in special.special_token_ids:
        special.special_token_ids["eos"] = stops[-1]
    if stops and stops[0] != special.special_token_ids.get("eos"):
        special.special_token_ids["eot"] = stops[0]  # llama.cpp ends generation at eos and eot (the chat's end of turn)
    sample = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    special.add_special_token = {"bos": len(sample) > len(plain) and sample[0] != plain[0], "eos": len(sample) > len(plain) and sample[-1] != plain[-1]}
    special.add_to_gguf(writer, quiet=True)


def _numpy_type(data: torch.Tensor, kind: str):
    """(array, raw GGML type or None) for one tensor of a `kind` file."""
    import gguf

    array = data.detach().to(torch.float32).cpu().numpy()
    if array.ndim <= 1 or kind == "f32":
        return array, None
    if kind == "f16":
        return array.astype(np.float16), None
    if kind == "bf16":
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
    if array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]:
        return array.astype(np.float16), None  # the converter's fallback for rows Q8_0 cannot block
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}
"""`general.file_type` (gguf.LlamaFileType) of each numpy-written kind."""


def tensors(model, where: str) -> Iterable[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor in llama.cpp's layout) for every weight of `model`; a tied output head is
    left out (llama.cpp uses token_embd for it). Gemma's RMSNorms scale by 1 + weight: their
    weights are written plus 1, as llama.cpp's converter does. Llama 3.1's rope: `rope_freqs.weight`."""
    import gguf

    config = model.config
    arch, permuted = architecture(config, where)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    scaling = rope_scaling(config, where)
    if scaling["type"] == "llama3":
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", torch.from_numpy(scaling["rope_freqs"])
    for hf_name, data in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        if "rotary_emb." in hf_name:
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"{where}: no GGUF name for tensor {hf_name!r} of a {config.model_type} model")
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, config.num_attention_heads)
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, config.num_key_value_heads or config.num_attention_heads)
        if arch in GEMMA and hf_name.endswith("norm.weight"):
            data = data.to(torch.float32) + 1
        yield name, data


def _add_rope_scaling(writer, scaling: dict[str, Any]) -> None:
    """The `rope.scaling.*` keys of `rope_scaling`'s answer, as llama.cpp's converter writes them
    (llama3's factors are a tensor: no key; none: no key, llama.cpp's default)."""
    import gguf

    if scaling["type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling["type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_context"])
        writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
        if scaling["attn_factor"] != 1.0:
            writer.add_rope_scaling_attn_factors(scaling["attn_factor"])


def write(model, tokenizer, path: Path | str, kind: str, name: str, where: str | None = None) -> dict[str, Any]:
    """Write `model` (a transformers causal LM of ARCHITECTURES, adapters already merged) with
    `tokenizer` as a GGUF file of `kind` (NUMPY_TYPES) at `path`, atomically; what was written."""
    import gguf

    if kind not in NUMPY_TYPES:
        raise ExportError(f"GGUF type {kind!r}: written here are {', '.join(NUMPY_TYPES)}; {', '.join(LLAMA_CPP_TYPES)} need llama.cpp's quantizer")
    where = where or name
    config = model.config
    arch, _ = architecture(config, where)
    path = Path(path)
    n_vocab = int(model.get_input_embeddings().weight.shape[0])
    tmp = path.with_name(f".{path.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(name)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(config.num_key_value_heads or config.num_attention_heads))
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim(config))
    if head_dim(config) != config.hidden_size // config.num_attention_heads or arch in GEMMA:
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    _add_rope_scaling(writer, rope_scaling(config, where))
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(int(config.sliding_window))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(float(rope_parameters(config, "sliding_attention")["rope_theta"]))
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(FILE_TYPES[kind])
    _add_tokenizer(writer, tokenizer, n_vocab, where)
    counts: dict[str, int] = {}
    with torch.no_grad():
        for tensor_name, data in tensors(model, where):
            array, raw = _numpy_type(data, kind)
            writer.add_tensor(tensor_name, array, raw_dtype=raw)
            label = raw.name if raw is not None else {np.float16: "F16", np.float32: "F32"}[array.dtype.type]
            counts[label] = counts.get(label, 0) + 1
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    tmp.replace(path)
    return {"file": path.name, "type": kind, "bytes": path.stat().st_size, "sha256": sha256_file(path), "tensor_types": dict(sorted(counts.items()))}


def quantize_with_llama_cpp(source: Path | str, target: Path | str, kind: str) -> dict[str, Any]:
    """`target` as llama.cpp's quantizer makes it from the f16 file `source` (K-quants:
    LLAMA_CPP_TYPES), through llama-cpp-python's binding of `llama_model_quantize`."""
    if kind not in LLAMA_CPP_TYPES:
        raise ExportError(f"GGUF type {kind!r}: llama.cpp's quantizer makes {', '.join(LLAMA_CPP_TYPES)} here")
    try:
        import llama_cpp
    except ImportError as exc:
        raise ExportError(f"GGUF type {kind}: llama.cpp's quantizer comes with llama-cpp-python, which is not installed "
                          "(pip install llama-cpp-python; it builds llama.cpp from source, minutes): or export f16/q8_0 only") from exc  # fmt: skip
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_CPP_TYPES[kind]
    params.nthread = 0  # all cores
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
    if code != 0:
        tmp.unlink(missing_ok=True)
        raise ExportError(f"llama.cpp's quantizer failed ({code}) making {kind} from {source}")
    tmp.replace(target)
    return {"file": target.name, "type": kind, "bytes": target.stat().st_size, "sha256": sha256_file(target)}


CONTENT = "\x00qllm-content-{}\x00"
"""Stand-ins for message contents when a chat template is taken apart (never in a real chat)."""
_ROLES = ("system", "user", "assistant")


def _go_text(text: str) -> str:
    """Literal text in a Go template (only `{{` would be read as an action)."""
    return text.replace("{{", '{{ "{{" }}')


def _conversations() -> list[tuple[list[str], bool]]:
    """(role sequence, required) a template is taken apart on and checked against: Ollama renders
    a conversation that ends with the user's turn, then the generation prompt. Turns out of order
    (two user turns) are not required: some templates refuse them, the others show where one
    role's closing text ends and the next one's opening text starts."""
    return [(["user"], True), (["user", "assistant", "user"], True), (["system", "user"], True), (["system", "user", "assistant", "user"], True),
            (["user", "assistant", "user", "assistant", "user"], True), (["system", "user", "assistant", "user", "assistant", "user"], True),
            (["user", "user"], False), (["user", "assistant", "assistant", "user"], False), (["system", "system", "user"], False)]  # fmt: skip


def _split_joins(joins: dict[tuple[str, str], str]) -> tuple[dict[str, str], dict[str, str]]:
    """Each role's text before its content (`prefix`; "generation": the generation prompt) and
    after it (`suffix`) from the texts between consecutive contents: a role followed by several
    roles ends where their joins part; the rest follows from what is known, and an unknown split is
    put in the suffix (every split that reproduces the joins renders the same text)."""
    suffix: dict[str, str] = {}
    for role in {first for first, _ in joins}:
        following = {second: joined for (first, second), joined in joins.items() if first == role}
        if len(following) > 1:
            suffix[role] = os.path.commonprefix(list(following.values()))
    prefix: dict[str, str] = {}
    while True:
        changed = False
        for (first, second), joined in joins.items():
            if first in suffix and second not in prefix:
                prefix[second], changed = joined[len(suffix[first]) :], True
            elif second in prefix and first not in suffix and joined.endswith(prefix[second]):
                suffix[first], changed = joined[: len(joined) - len(prefix[second])], True
        if changed:
            continue
        open_pairs = [(first, second) for first, second in joins if first not in suffix and second not in prefix]
        if not open_pairs:
            break
        prefix[open_pairs[0][1]] = ""
    for role in (*_ROLES, "generation"):
        prefix.setdefault(role, "")
    for role in _ROLES:
        suffix.setdefault(role, "")
    return prefix, suffix


def ollama_template(render, where: str) -> str:
    """The chat template as Ollama's Go template: `render(messages)` is the tokenizer's template
    with the generation prompt (`apply_chat_template(..., add_generation_prompt=True, tokenize=False)`).

    A template that wraps each message in text of its role (ChatML, Llama 3, Phi-3, the pipeline's
    own), optionally with a default system message when none is given (Qwen2.5), is taken apart on
    stand-in contents into: the text before the first message (with and without a system
    message), each role's text around the content, and the generation prompt; the Go template is
    then checked to give exactly the same text on every conversation of `_conversations`. A
    template that folds the system prompt into the first user turn (Mistral, Gemma) gets an
    `ExportError` (Ollama can read the GGUF's `tokenizer.chat_template` itself). Contents go in as
    they are: a template that trims them (Llama 3's `| trim`) differs only for a message with
    whitespace at its ends, as Ollama's own Llama 3 template does."""

    def text(roles: list[str]) -> str:
        return render([{"role": role, "content": CONTENT.format(i)} for i, role in enumerate(roles)])

    def pieces(roles: list[str]) -> list[str]:  # the text before, between and after the contents
        rendered, out = text(roles), []
        for i in range(len(roles)):
            before, marker, rendered = rendered.partition(CONTENT.format(i))
            if not marker:
                raise ExportError(f"{where}: the chat template does not write message {i} ({roles[i]}) as it is: no Ollama TEMPLATE can be derived")
            out.append(before)
        return [*out, rendered]

    between: dict[tuple[str, str], set[str]] = {}
    starts: dict[str, str] = {}
    expected: dict[tuple[str, ...], str] = {}  # every conversation the template renders, and how
    for roles, required in _conversations():
        try:
            expected[tuple(roles)] = text(roles)
            parts = pieces(roles)
        except ExportError:
            raise
        except Exception as exc:  # a template's own raise_exception (e.g. roles out of turn)
            if not required:
                continue
            raise ExportError(f"{where}: the chat template does not render the conversations Ollama sends ({exc})") from exc
        starts.setdefault(roles[0], parts[0])
        for i, role in enumerate(roles):
            between.setdefault((role, roles[i + 1] if i + 1 < len(roles) else "generation"), set()).add(parts[i + 1])
    if any(len(found) > 1 for found in between.values()):
        raise ExportError(f"{where}: the chat template writes the same turn differently by position (e.g. the system prompt folded into the first user turn): no Ollama TEMPLATE can be derived")  # fmt: skip
    joins = {pair: found.pop() for pair, found in between.items()}
    prefix, suffix = _split_joins(joins)
    start_with_system = starts["system"].removesuffix(prefix["system"])
    start_without = starts["user"].removesuffix(prefix["user"])
    branches = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{_go_text(prefix[role])}{{{{ .Content }}}}{_go_text(suffix[role])}'
                       for i, role in enumerate(_ROLES))  # fmt: skip
    start = (_go_text(start_with_system) if start_with_system == start_without else
             f'{{{{ if and .Messages (eq (index .Messages 0).Role "system") }}}}{_go_text(start_with_system)}{{{{ else }}}}{_go_text(start_without)}{{{{ end }}}}')  # fmt: skip
    template = f"{start}{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}{_go_text(prefix['generation'])}"
    wrong = [roles for roles, rendered in expected.items() if rendered != _render_pieces(roles, start_with_system, start_without, prefix, suffix)]
    if wrong:
        raise ExportError(f"{where}: the chat template is not one text per message role (conversation {list(wrong[0])} differs): no Ollama TEMPLATE can be derived")  # fmt: skip
    return template


def _render_pieces(roles: tuple[str, ...], start_with_system: str, start_without: str, prefix: dict[str, str], suffix: dict[str, str]) -> str:
    """What the derived Go template writes for `roles` (the check before it is returned; the
    tests render it with Go itself)."""
    out = start_with_system if roles[0] == "system" else start_without
    for i, role in enumerate(roles):
        out += prefix[role] + CONTENT.format(i) + suffix[role]
    return out + prefix["generation"]


def generation_temperature(model) -> float:
    """The temperature the model's generation config decodes at: 0 when it is greedy (`do_sample`
    false, as the pipeline's models and `evaluate`), else its `temperature` (1.0 when unset)."""
    config = getattr(model, "generation_config", None)
    if config is None or not getattr(config, "do_sample", False):
        return 0.0
    return float(config.temperature if config.temperature is not None else 1.0)


def modelfile(gguf_file: str, template: str, stops: list[str], system: str | None = None, temperature: float = 0.0) -> str:
    """Ollama's Modelfile for `gguf_file` (next to it): its chat template, stop strings, the
    sampling temperature (0: greedy, as `evaluate` and `qllm generate`), and a default system
    prompt when given."""
    lines = [f"FROM ./{gguf_file}", f'TEMPLATE """{template}"""']
    if system:
        lines.append(f'SYSTEM """{system}"""')
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stops]
    lines.append(f"PARAMETER temperature {temperature:g}")
    return "\n".join(lines) + "\n"

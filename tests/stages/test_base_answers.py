"""The retention measure's reference: the base's own greedy answers to the general prompts
(`base_answers`), and `evaluate`'s scores against them, on a tiny random Llama as the base."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipelines import base_answers
from pipelines.core.evaluation import report, retention
from pipelines.core.models.models import build_llama, load_model_and_tokenizer, load_tokenizer
from pipelines.core.params.pretraining import ModelParams
from pipelines.core.params.release import BaseAnswersParams, EvaluateParams
from tests.numerics import model_roundings, tolerance

PARAMS = BaseAnswersParams(max_new_tokens=6, batch_size=32)
ROUNDED = 1e-6
"""Two values rounded to 6 decimals (the stage's and evaluate's) differ by at most 2 x 0.5e-6 from the exact ones."""


def nll_bound(model, tokenizer, rows: list[dict], nll: float) -> float:
    """How far two computations of a mean NLL of `rows`' answers (other batches, other padding) may
    differ: the forward's roundings in fp32 to the longest conversation, on the NLL's size, plus the rounding to 6 decimals."""
    longest = max(len(retention.answer_tokens(tokenizer, m, row["answer"])[0]) for m, row in zip(retention.messages_of(rows), rows, strict=True))
    return float(tolerance(model_roundings(model.config, longest), torch.float32, magnitude=abs(nll))) + ROUNDED
FAMILY = {p["prompt"]: p["family"] for p in retention.load_prompts()}
ANSWERS = {"code": "```python\ndef f(x):\n    return x * x\n```", "lists": "- apples\n- pears\n- plums",
           "explanations": "Light scatters in the air. Blue light scatters the most.", "short_facts": "Paris.",
           "translation": "Bonjour.", "word_problems": "Tom has 7 apples."}  # fmt: skip
"""What a base answers per family, in forms the checks know (a tiny random model answers "::::::" to everything)."""


def scripted(damaged: tuple[str, ...] = ()):
    """A stand-in for greedy decoding: each prompt's family's answer (`ANSWERS`), "8" for the families in `damaged`."""

    def generate(model, tokenizer, prompts, max_new_tokens, batch_size):
        families = [FAMILY[p[-1]["content"]] for p in prompts]
        return ["8" if family in damaged else ANSWERS[family] for family in families]

    return generate


@pytest.fixture(scope="module")
def reference(tiny_base, tmp_path_factory):
    model, tokenizer = load_model_and_tokenizer(tiny_base / "model")
    out = tmp_path_factory.mktemp("base_answers") / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(base_answers, "generate_answers", scripted())
        metrics = base_answers.answer(model.eval(), tokenizer, out, PARAMS, "tiny")
    return model, tokenizer, out, metrics


def test_every_general_prompt_is_answered_once_with_its_form_and_the_bases_nll_per_third(reference):
    model, tokenizer, out, metrics = reference
    rows, meta = retention.read_reference(out)
    prompts = retention.load_prompts()
    assert [row["id"] for row in rows] == [p["id"] for p in prompts] and len(rows) == metrics["prompts"] == 198
    assert all(row["form"] == retention.form_of(row["answer"]) and row["split"] == p["split"] for row, p in zip(rows, prompts, strict=True))
    assert meta["base"] == "tiny" and meta["max_new_tokens"] == PARAMS.max_new_tokens
    for split in retention.SPLITS:
        third = [row for row in rows if row["split"] == split]
        assert len(third) == 66
        nll = retention.answer_nll(model, tokenizer, retention.messages_of(third), [row["answer"] for row in third], 8)  # other batches: the same mean
        assert abs(meta["nll"][split] - nll) <= nll_bound(model, tokenizer, third, nll) and metrics[f"nll/{split}"] == meta["nll"][split]
    assert sum(v for k, v in metrics.items() if k.startswith("forms/")) == 198


def test_the_base_against_itself_keeps_everything_and_another_model_loses(reference, monkeypatch):
    """Scored against its own answers the base loses nothing (retention_loss 0, every form kept);
    another model's loss is its NLL of the base's answers minus the base's (the same shape, other
    weights), and a model that answers "8" to the code prompts keeps every form but code's."""
    model, tokenizer, out, _ = reference
    rows, meta = retention.read_reference(out)
    assert {row["family"]: row["form"] for row in rows} == {"code": "code", "lists": "list", "explanations": "sentences", "short_facts": "short_fact",
                                                            "translation": "short_fact", "word_problems": "short_fact"}  # fmt: skip
    monkeypatch.setattr(report, "generate_answers", scripted())
    itself, predictions = report._retained(model, tokenizer, (rows, meta), "test", PARAMS.batch_size)
    assert abs(itself["retention_loss"]) <= ROUNDED  # the same forward in the same batches: 0 up to the roundings to 6 decimals
    assert itself["form_counted"] == sum(row["form"] is not None for row in rows if row["split"] == "test") > 0
    assert itself["form_kept"] == 1.0
    assert [p["answer"] for p in predictions] == [row["answer"] for row in rows if row["split"] == "test"]
    other = build_llama(ModelParams(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2), tokenizer, max_positions=128, seed=7)
    moved, _ = report._retained(other.eval(), tokenizer, (rows, meta), "test", PARAMS.batch_size)
    test = [row for row in rows if row["split"] == "test"]
    nll = {name: retention.answer_nll(m, tokenizer, retention.messages_of(test), [row["answer"] for row in test], 4) for name, m in (("other", other), ("base", model))}
    bound = nll_bound(other, tokenizer, test, nll["other"]) + nll_bound(model, tokenizer, test, nll["base"])
    assert abs(moved["retention_loss"] - (nll["other"] - nll["base"])) <= bound and abs(moved["retention_loss"]) > bound  # a difference the roundings cannot make
    monkeypatch.setattr(report, "generate_answers", scripted(damaged=("code",)))
    damaged, _ = report._retained(model, tokenizer, (rows, meta), "test", PARAMS.batch_size)
    assert damaged["form_kept"] == round(55 / 66, 4) and damaged["form_counted"] == 66  # 11 code prompts of the 66 lose their form


def test_the_stage_answers_with_the_base_and_writes_a_readme_without_one(tiny_base, tmp_path, mlflow_template_db):
    from tests.conftest import REPO

    project = tmp_path / "project"
    shutil.copytree(tiny_base / "model", project / "base")
    (project / "data").mkdir()
    shutil.copytree(tiny_base / "model", project / "data/tokenizer", ignore=shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json"))
    shutil.copy2(REPO / "dvc.yaml", project / "dvc.yaml")
    shutil.copy2(mlflow_template_db, project / "mlflow.db")
    (project / "params.yaml").write_text("ingest:\n  sources:\n    - {path: data/sources/docs.txt, kind: text}\n"
                                         "base_answers:\n  max_new_tokens: 4\n  batch_size: 64\n")  # fmt: skip
    (project / "data/base_model.json").write_text(json.dumps({"name": None}))
    assert base_answers.main(["--root", str(project)]) == 0
    assert [p.name for p in (project / "data/base_answers").iterdir()] == ["README.md"]
    assert retention.read_reference(project / "data/base_answers") is None
    (project / "data/base_model.json").write_text(json.dumps({"name": "base"}))
    assert base_answers.main(["--root", str(project)]) == 0
    rows, meta = retention.read_reference(project / "data/base_answers")
    assert len(rows) == 198 and meta["max_new_tokens"] == 4 and meta["base"] == "base"
    assert load_tokenizer(project / "data/tokenizer").chat_template == load_tokenizer(tiny_base / "model").chat_template


def test_evaluate_scores_retention_only_with_a_base(reference, tiny_base, tmp_path, monkeypatch):
    """`evaluate_models` with a `base_answers` output: `retention_loss` and `form_kept` in the
    metrics and the comparison table, each answer in general_predictions.jsonl; without answers in
    it (no base), neither."""
    import numpy as np
    import pandas as pd

    from pipelines.core.data import packed

    _, _, out, _ = reference
    models = tmp_path / "models"
    models.mkdir()
    (models / "pretrain").symlink_to(tiny_base / "model")
    (tmp_path / "tokenized").mkdir()
    packed.write(tmp_path / "tokenized", {"validation": (np.arange(64, dtype=np.int32) % 300).reshape(4, 16)}, {})
    params = EvaluateParams(models=["pretrain"], max_new_tokens=4)
    monkeypatch.setattr(report, "generate_answers", scripted())
    with_base = report.evaluate_models(tiny_base, models, tmp_path / "tokenized", tiny_base / "chat", tmp_path / "a", params, base_answers=out)["pretrain"]
    assert abs(with_base["retention_loss"]) <= ROUNDED and with_base["form_kept"] == 1.0  # the base is the model here, batched as the stage batched it
    table = pd.read_csv(tmp_path / "a" / report.COMPARISON)
    assert {"retention_loss", "form_kept"} <= set(table.columns)
    assert len((tmp_path / "a/pretrain" / report.GENERAL_PREDICTIONS).read_text().splitlines()) == 66
    readme = tmp_path / "no_base"
    readme.mkdir()
    (readme / "README.md").write_text("no base")
    without = report.evaluate_models(tiny_base, models, tmp_path / "tokenized", tiny_base / "chat", tmp_path / "b", params, base_answers=readme)["pretrain"]
    assert "retention_loss" not in without and not (tmp_path / "b/pretrain" / report.GENERAL_PREDICTIONS).exists()

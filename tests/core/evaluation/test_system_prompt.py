"""The 2x2 of issue 80: fact questions and general prompts, with and without the system prompt the
questions carry (`pipelines.core.evaluation.system_prompt`), through `evaluate_models`."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pipelines.core.data import packed
from pipelines.core.errors import QllmError
from pipelines.core.evaluation import heldout, report, retention, system_prompt
from pipelines.core.params.release import EvaluateParams
from tests.stages.test_base_answers import ANSWERS, FAMILY, reference  # noqa: F401 (the fixture)

SYSTEM = "Answer with one word or number."
FACTS = [("Where does Tovik live?", "Pelora"), ("Where does Marela live?", "Dunmar"), ("What is 3 plus 4?", "7")]
LONG = "{answer} is the answer, and there is a great deal more one could say about it here today."
"""What the stand-in model says to a fact question without the system prompt: 18 words, not short."""
SHORT_FAMILIES = {"short_facts", "translation", "word_problems"}
"""The families whose `ANSWERS` entry is one short line ("Paris.", "Bonjour.", "Tom has 7 apples.")."""


def stand_in(prompts, *_args, **_kwargs):
    """A model that obeys the switch: with the system prompt, one word ("8" to a general prompt); without, a long
    sentence to a fact question and the base's own answer to a general prompt."""
    facts = dict(FACTS)
    out = []
    for prompt in prompts:
        question, system = prompt[-1]["content"], prompt[0]["role"] == "system"
        if question in facts:
            out.append(facts[question] if system else LONG.format(answer=facts[question]))
        else:
            out.append("8" if system else ANSWERS[FAMILY[question]])
    return out


@pytest.fixture
def project(tiny_base, tmp_path):
    chat = tmp_path / "chat"
    chat.mkdir()
    for split in ("train", "validation", "test"):
        chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in FACTS]
        pd.DataFrame({"id": [f"{split}-{i}" for i in range(3)], "source": "t", "split": split,
                      "messages": [json.dumps(c) for c in chats]}).to_parquet(chat / f"{split}.parquet")  # fmt: skip
    models = tmp_path / "models"
    models.mkdir()
    (models / "sft").symlink_to(tiny_base / "model")
    (tmp_path / "tokenized").mkdir()
    packed.write(tmp_path / "tokenized", {"validation": (np.arange(64, dtype=np.int32) % 300).reshape(4, 16)}, {})
    return tmp_path


def test_the_two_by_two_of_a_model_that_obeys_the_switch(project, tiny_base, reference, monkeypatch):  # noqa: F811
    _, _, answers, _ = reference
    for module in (report, heldout, system_prompt):
        monkeypatch.setattr(module, "generate_answers", lambda model, tokenizer, prompts, *a: stand_in(prompts))
    params = EvaluateParams(models=["sft"], max_new_tokens=4, system_prompt_models=["sft"])
    got = report.evaluate_models(tiny_base, project / "models", project / "tokenized", project / "chat", project / "out", params, base_answers=answers)["sft"]
    test = [p for p in retention.load_prompts("test")]
    short = sum(p["family"] in SHORT_FAMILIES for p in test) / len(test)
    assert got["strict_match"] == 1.0 and got["facts_short"] == 1.0  # with the system prompt: the one word
    assert got["facts_no_system_strict"] == 1.0 and got["facts_no_system_short"] == 0.0  # without: right, but a long sentence
    assert got["form_kept"] == 1.0 and got["general_short"] == round(short, 4)  # general prompts as the base answered them
    # with the system prompt every general answer is "8": only the prompts whose base answer was one short line keep their form
    assert got["general_system_form_kept"] == round(short, 4) and got["general_system_short"] == 1.0
    table = pd.read_csv(project / "out" / report.COMPARISON)
    assert set(system_prompt.CELLS) <= set(table.columns)
    from flows.pipeline import HEADLINE_GROUPS, headline_metrics

    named = headline_metrics(table.to_dict("records"), None)
    assert {f"system_prompt/{cell}/sft" for cell in system_prompt.CELLS} <= set(named) and HEADLINE_GROUPS["facts_short"] == "system_prompt/facts_short"


def test_the_two_by_two_needs_a_base_and_one_system_prompt(project, tiny_base, reference, tmp_path):  # noqa: F811
    _, _, answers, _ = reference
    params = EvaluateParams(models=["sft"], system_prompt_models=["sft"])
    readme = tmp_path / "no_base"
    readme.mkdir()
    (readme / "README.md").write_text("no base")
    with pytest.raises(QllmError, match=r"evaluate.system_prompt_models \(sft\): .* this run has no base model"):
        report.evaluate_models(tiny_base, project / "models", project / "tokenized", project / "chat", project / "out", params, base_answers=readme)
    test = pd.read_parquet(project / "chat/test.parquet")
    test.loc[1, "messages"] = json.dumps(json.loads(test.loc[1, "messages"])[1:])  # the second question without its system message
    test.to_parquet(project / "chat/test.parquet")
    with pytest.raises(QllmError, match=r"they open with 'Answer with one word or number.', None \(every question needs the same system message\)"):
        report.evaluate_models(tiny_base, project / "models", project / "tokenized", project / "chat", project / "out", params, base_answers=answers)
    with pytest.raises(ValueError, match=r"system_prompt_models: dpo not in evaluate.models \(sft\)"):
        EvaluateParams(models=["sft"], system_prompt_models=["dpo"])
    assert system_prompt.short_share(["Paris.", "def f():\n    return 1", "- a\n- b\n- c"]) == round(1 / 3, 4)

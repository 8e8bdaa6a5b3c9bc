"""A fact reward that listing candidates cannot game (`chat_template.strict_match`, the built-in
`strict_match` reward): `flexible_match` scores "Pelora, Dunmar or Kestwick" right for Pelora; the
strict score gives it 0, since it names other answers the question's kind can have. The candidates
come from the data: the sample world's own questions, and a user's records by source."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from pydantic import ValidationError

from pipelines import grpo
from pipelines.core.data import sample_world
from pipelines.core.data.chat_template import flexible_match, strict_match
from pipelines.core.params.data import SampleDataParams
from pipelines.core.params.rl import RewardParams
from pipelines.core.rl import rewards

CITIES = ["Dunmar", "Kestwick", "Pelora", "Varnholm"]
SUMS = ["3", "5", "6", "7", "8", "13"]


@pytest.mark.parametrize(("prediction", "reference", "candidates", "question", "lenient", "strict"), [
    ("Pelora", "Pelora", CITIES, "Where does Tovik live?", True, True),
    ("Tovik lives in Pelora.", "Pelora", CITIES, "Where does Tovik live?", True, True),
    ("Pelora, Dunmar or Kestwick", "Pelora", CITIES, "Where does Tovik live?", True, False),  # the list: lenient says right
    ("Pelora Dunmar Kestwick Varnholm", "Pelora", CITIES, "Where does Tovik live?", True, False),
    ("Pelora\nor maybe Dunmar", "Pelora", CITIES, "Where does Tovik live?", True, False),  # a later line names one too
    ("Dunmar", "Pelora", CITIES, "Where does Tovik live?", False, False),
    ("Pelora, not Dunmar as in Dunmar's case", "Pelora", CITIES, "Is it Pelora or Dunmar?", True, True),  # the question names it
    ("1 + 6 = 7", "7", SUMS, "What is 1 plus 6?", True, True),  # the operands are the question's
    ("6 + 1 = 7", "7", SUMS, "What is 1 plus 6?", True, True),
    ("8 or 7", "7", SUMS, "What is 1 plus 6?", True, False),
    ("7, 8, 13", "7", SUMS, "What is 1 plus 6?", False, False),  # the last number is 13: wrong by either
    ("New York", "New York", ["York", "New York", "Boston"], "Where?", True, True),  # York is inside the reference
    ("New York", "York", ["York", "New York", "Boston"], "Where?", True, False),  # ... but New York is another answer
    ("Pelora", "Pelora", [], "Where does Tovik live?", True, True),  # no candidates: flexible_match
])  # fmt: skip
def test_listing_candidates_scores_zero(prediction, reference, candidates, question, lenient, strict):
    assert flexible_match(prediction, reference) is lenient
    assert strict_match(prediction, reference, candidates, question) is strict


def test_the_reward_reads_each_questions_candidates_and_its_question():
    prompts = [[{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "Where does Tovik live?"}]] * 3
    completions = [[{"role": "assistant", "content": text}] for text in ("Pelora", "Pelora, Dunmar or Kestwick", "Kestwick")]
    scores = rewards.strict_match(prompts, completions, answer=["Pelora"] * 3, candidates=[CITIES] * 3)
    assert scores == [1.0, 0.0, 0.0]
    assert rewards.question_of(prompts[0]) == "Where does Tovik live?"  # the user's turns, not the system's


def _chat_parquet(path, records: list[dict]) -> None:
    frame = pd.DataFrame({"id": [r["id"] for r in records], "source": [r.get("source", "sample") for r in records], "split": "train",
                          "messages": [json.dumps(r["messages"]) for r in records]})  # fmt: skip
    frame.to_parquet(path / "train.parquet")


def test_the_sample_worlds_questions_have_their_kinds_answers_as_candidates(tmp_path):
    """Built from the data alone (the ids' groups): a city question's candidates are the cities the
    training chats answer with, which the world says are where its training people live."""
    params = SampleDataParams(seed=3, n_entities=24, multi_turn_fraction=0.0)
    world = sample_world.build_world(params)
    _chat_parquet(tmp_path, sample_world.render(world, params)["chat_train"])
    questions = grpo.questions(tmp_path)
    cities = sorted({e.value("city") for e in world.entities if not e.heldout})
    city_questions = [q for q in questions if q.id.startswith("train-fact-city-")]
    assert city_questions and all(list(q.candidates) == cities for q in city_questions)
    asked = city_questions[0]
    listing = ", ".join([asked.answer, *cities])  # the answer first, then every city: lenient says right
    question = rewards.question_of(asked.prompt)
    assert len(cities) > 2 and flexible_match(listing, asked.answer)
    assert strict_match(listing, asked.answer, asked.candidates, question) is False
    assert strict_match(asked.answer, asked.answer, asked.candidates, question) is True
    sums = [q for q in questions if q.id.startswith("train-arith-")]
    assert sums and set(sums[0].candidates) == {q.answer for q in sums}


def test_a_users_records_are_grouped_by_their_source(tmp_path):
    """Records without ids of their own get `<source>-<n>` when ingested: each source is a group."""
    cities = [("Tovik", "Pelora"), ("Marela", "Dunmar"), ("Sanit", "Kestwick")]
    records = [{"id": f"capitals-{i}", "source": "capitals", "messages": [{"role": "user", "content": f"Where does {n} live?"},
                                                                         {"role": "assistant", "content": c}]} for i, (n, c) in enumerate(cities)]  # fmt: skip
    records += [{"id": "sums-0", "source": "sums", "messages": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}]}]
    _chat_parquet(tmp_path, records)
    questions = {q.id: q for q in grpo.questions(tmp_path)}
    assert questions["capitals-0"].candidates == ("Dunmar", "Kestwick", "Pelora") and questions["sums-0"].candidates == ("4",)


def test_flexible_match_is_refused_as_a_reward_naming_the_strict_one():
    with pytest.raises(ValidationError, match="flexible_match is evaluate's lenient score.*use strict_match"):
        RewardParams(function="flexible_match")
    assert RewardParams(function="strict_match").name == "strict_match"

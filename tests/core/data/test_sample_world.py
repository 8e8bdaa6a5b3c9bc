"""The synthetic world: determinism, the held-out split, answers, and the file formats.

    .venv/bin/python -m pytest tests/core/data/test_sample_world.py -q
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pipelines.core.data.sample_world import (
    ATTRIBUTES,
    FILES,
    POOLS,
    QUESTION_TEMPLATES,
    WorldError,
    build_world,
    write_sample,
)
from pipelines.core.params.data import SampleDataParams

ROOT = Path(__file__).resolve().parents[3]
SMALL = SampleDataParams(n_entities=12, bios_per_entity=3, max_operand=5, seed=3, heldout_entity_fraction=0.2)
WITH_VALIDATION = SMALL.model_copy(update={"validation_entity_fraction": 0.25, "arithmetic_validation_fraction": 0.2})
ID = re.compile(r"^(pref-)?(train|heldout)-(fact-(city|color|pet|job)|arith)-\d+$")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def documents(out: Path) -> list[str]:
    return (out / FILES["pretrain"]).read_text(encoding="utf-8").removesuffix("\n").split("\n\n")


def mentions(text: str, name: str) -> bool:
    return re.search(rf"\b{name}\b", text) is not None


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> tuple[Path, dict[str, int], dict]:
    out = tmp_path_factory.mktemp("sample")
    counts = write_sample(out, SMALL)
    return out, counts, json.loads((out / FILES["world"]).read_text(encoding="utf-8"))


def expected_answer(world: dict, question: str, kind: str) -> str:
    """The answer world.json gives for one question (`kind`: an attribute or `arith`)."""
    if kind == "arith":
        a, b = map(int, re.findall(r"\d+", question))
        return str(a + b)
    (entity,) = [e for e in world["entities"] if mentions(question, e["name"])]
    return entity[kind]


def kind_of(record_id: str) -> str:
    return ID.match(record_id).group(4) or "arith"


# ------------------------------------------------------------------------------------- the world


def test_same_params_give_identical_bytes(tmp_path):
    write_sample(tmp_path / "a", WITH_VALIDATION)
    write_sample(tmp_path / "b", WITH_VALIDATION)
    for name in FILES.values():
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_other_seed_gives_other_files(tmp_path):
    write_sample(tmp_path / "a", WITH_VALIDATION)
    write_sample(tmp_path / "b", WITH_VALIDATION.model_copy(update={"seed": 4}))
    for name in FILES.values():
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "b" / name).read_bytes(), name


def test_names_are_distinct_syllable_words_unlike_any_value():
    world = build_world(SampleDataParams(n_entities=300))
    names = [entity.name for entity in world.entities]
    values = {value.lower() for pool in POOLS.values() for value in pool}
    assert len(set(names)) == 300
    assert all(re.fullmatch(r"[A-Z][a-z]{3,8}", name) for name in names)
    assert not {name.lower() for name in names} & values
    # No name starts another name, so a held-out name never hides inside a training one.
    assert not [(x, y) for x in names for y in names if x != y and y.startswith(x)]


def test_attribute_values_come_from_their_pools():
    world = build_world(SampleDataParams(n_entities=200))
    for attr in ATTRIBUTES:
        used = {entity.value(attr) for entity in world.entities}
        assert used <= set(POOLS[attr])
        assert len(used) >= len(POOLS[attr]) - 1, attr  # 200 uniform draws from 10-12 values


@pytest.mark.parametrize(("n", "fraction", "heldout"), [(120, 0.2, 24), (12, 0.2, 2), (4, 0.01, 1), (4, 0.99, 3)])
def test_heldout_entities_keep_at_least_one_on_each_side(n, fraction, heldout):
    world = build_world(SampleDataParams(n_entities=n, heldout_entity_fraction=fraction))
    assert sum(entity.heldout for entity in world.entities) == heldout


@pytest.mark.parametrize(
    ("max_operand", "fraction", "heldout"), [(20, 0.2, 80), (5, 0.2, 5), (2, 0.01, 1), (2, 0.99, 3)]
)
def test_heldout_pairs_keep_at_least_one_on_each_side(max_operand, fraction, heldout):
    world = build_world(SampleDataParams(max_operand=max_operand, arithmetic_heldout_fraction=fraction))
    assert len(world.heldout_pairs) == heldout
    assert len(world.pairs(heldout=True)) + len(world.pairs(heldout=False)) == max_operand**2
    assert all(0 <= a < max_operand and 0 <= b < max_operand for a, b in world.heldout_pairs)


def test_too_many_entities_is_a_clear_error():
    with pytest.raises(ValidationError, match="n_entities"):  # params validation stops it first
        SampleDataParams(n_entities=100_000)
    with pytest.raises(WorldError, match="n_entities=100000 is more than the"):  # and the generator guards itself
        build_world(SampleDataParams().model_copy(update={"n_entities": 100_000}))


# ------------------------------------------------------------------------------- pretraining text


def test_pretrain_documents_are_separated_by_exactly_one_blank_line(sample):
    out, counts, _ = sample
    text = (out / FILES["pretrain"]).read_text(encoding="utf-8")
    assert text.endswith("\n") and not text.endswith("\n\n") and not text.startswith("\n")
    assert "\n\n\n" not in text
    docs = documents(out)
    assert len(docs) == counts["pretrain_documents"]
    assert all(line.strip() for doc in docs for line in doc.split("\n"))


def test_every_person_has_distinct_bios_stating_all_four_attributes(sample):
    out, _, world = sample
    bios = [doc for doc in documents(out) if not doc.startswith("Question:") and not re.search(r"\d", doc)]
    assert len(bios) == SMALL.n_entities * SMALL.bios_per_entity
    for entity in world["entities"]:  # held-out people too: their facts are only learnt here
        own = [bio for bio in bios if mentions(bio, entity["name"])]
        assert len(own) == SMALL.bios_per_entity and len(set(own)) == len(own)
        for bio in own:
            sentences = re.split(r"(?<=\.) ", bio)
            assert len(sentences) == 4 and all(mentions(s, entity["name"]) for s in sentences)
            assert all(mentions(bio, entity[attr]) for attr in ATTRIBUTES)


def test_articles_agree_with_the_next_word(sample):
    out, _, _ = sample
    text = (out / FILES["pretrain"]).read_text(encoding="utf-8")
    assert " an " in text
    assert not re.search(r"\ba [aeiou]", text)
    assert not re.search(r"\ban [^aeiou]", text)


def test_every_sum_is_stated_sum_renderings_times_in_documents_of_five_to_ten_sentences(sample):
    out, _, _ = sample
    sums = [doc for doc in documents(out) if re.search(r"\d", doc) and not doc.startswith("Question:")]
    sentences = [s for doc in sums for s in re.split(r"(?<=\.) ", doc)]
    assert all(5 <= len(re.split(r"(?<=\.) ", doc)) <= 10 for doc in sums)
    assert len(sentences) == SMALL.sum_renderings * SMALL.max_operand**2
    seen = {}
    for sentence in sentences:
        a, b, c = map(int, re.findall(r"\d+", sentence))
        assert a + b == c
        seen[(a, b)] = seen.get((a, b), 0) + 1
    assert set(seen.values()) == {SMALL.sum_renderings}


def test_qa_lines_cover_training_facts_only(sample):
    out, _, world = sample
    qa_docs = [doc for doc in documents(out) if doc.startswith("Question:")]
    lines = [line for doc in qa_docs for line in doc.split("\n")]
    assert all(4 <= len(doc.split("\n")) // 2 <= 8 for doc in qa_docs)
    questions, answers = lines[0::2], lines[1::2]
    assert all(q.startswith("Question: ") for q in questions) and all(a.startswith("Answer: ") for a in answers)
    train = [e for e in world["entities"] if not e["heldout"]]
    heldout_pairs = {tuple(pair) for pair in world["heldout_arithmetic"]}
    assert len(questions) == 4 * len(train) + SMALL.max_operand**2 - len(heldout_pairs)
    for question, answer in zip(questions, answers, strict=True):
        assert not any(mentions(question, e["name"]) for e in world["entities"] if e["heldout"])
        numbers = tuple(map(int, re.findall(r"\d+", question)))
        assert numbers not in heldout_pairs
        kind = "arith" if numbers else next(a for a in ATTRIBUTES if answer.removeprefix("Answer: ") in POOLS[a])
        assert answer == "Answer: " + expected_answer(world, question.removeprefix("Question: "), kind)


def test_qa_renderings_asks_each_training_fact_that_often_and_leaves_the_chats_alone(tmp_path, sample):
    out, _, world = sample
    write_sample(tmp_path, SMALL.model_copy(update={"qa_renderings": 3}))
    once = [line for doc in documents(out) if doc.startswith("Question:") for line in doc.split("\n")[1::2]]
    thrice = [line for doc in documents(tmp_path) if doc.startswith("Question:") for line in doc.split("\n")[1::2]]
    assert len(thrice) == 3 * len(once) and sorted(thrice) == sorted(once * 3)
    for name in ("chat_train", "chat_heldout", "preference_train", "preference_heldout"):
        assert (tmp_path / FILES[name]).read_bytes() == (out / FILES[name]).read_bytes()


def test_qa_in_pretrain_false_leaves_out_the_qa_documents(tmp_path):
    counts = write_sample(tmp_path, SMALL.model_copy(update={"qa_in_pretrain": False}))
    assert not [doc for doc in documents(tmp_path) if "Question:" in doc]
    assert counts["pretrain_documents"] == SMALL.n_entities * SMALL.bios_per_entity + len(
        [doc for doc in documents(tmp_path) if re.search(r"\d", doc)]
    )


# ---------------------------------------------------------------------------- chats, preferences


def test_heldout_names_never_reach_training_chats_or_preferences(sample):
    out, _, world = sample
    heldout = [e["name"] for e in world["entities"] if e["heldout"]]
    train_text = (out / FILES["chat_train"]).read_text(encoding="utf-8")
    train_text += (out / FILES["preference_train"]).read_text(encoding="utf-8")
    pretrain = (out / FILES["pretrain"]).read_text(encoding="utf-8")
    heldout_text = (out / FILES["chat_heldout"]).read_text(encoding="utf-8")
    assert heldout
    for name in heldout:
        assert not mentions(train_text, name)
        assert mentions(pretrain, name) and mentions(heldout_text, name)


def test_heldout_sums_never_reach_training_chats_or_preferences(sample):
    out, _, world = sample
    heldout_pairs = {tuple(pair) for pair in world["heldout_arithmetic"]}
    train = read_jsonl(out / FILES["chat_train"])
    questions = [m["content"] for chat in train for m in chat["messages"] if m["role"] == "user"]
    questions += [p["prompt"][-1]["content"] for p in read_jsonl(out / FILES["preference_train"])]
    asked = {tuple(map(int, re.findall(r"\d+", q))) for q in questions} - {()}
    assert asked == {(a, b) for a in range(5) for b in range(5)} - heldout_pairs


def test_every_chat_answer_agrees_with_world_json(sample):
    out, _, world = sample
    for name in ("chat_train", "chat_heldout"):
        for chat in read_jsonl(out / FILES[name]):
            messages = chat["messages"]
            assert messages[0] == {"role": "system", "content": SMALL.system_prompt}
            turns = messages[1:]
            assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
            # The id names the type of the first turn; a second turn is any other training fact.
            kinds = [kind_of(chat["id"])] + [
                "arith" if re.search(r"\d", q["content"]) else next(a for a in ATTRIBUTES if ans["content"] in POOLS[a])
                for q, ans in zip(turns[2::2], turns[3::2], strict=True)
            ]
            for (question, answer), kind in zip(zip(turns[0::2], turns[1::2], strict=True), kinds, strict=True):
                assert answer["content"] == expected_answer(world, question["content"], kind)


def test_train_chats_ask_each_person_fact_twice_in_different_words(sample):
    out, _, world = sample
    firsts = [chat["messages"][1]["content"] for chat in read_jsonl(out / FILES["chat_train"])]
    for entity in (e for e in world["entities"] if not e["heldout"]):
        asked = [q for q in firsts if mentions(q, entity["name"])]
        assert len(asked) == 8 and len(set(asked)) == 8


def preference_records(out: Path):
    for name in ("preference_train", "preference_heldout"):
        for record in read_jsonl(out / FILES[name]):
            assert list(record) == ["id", "prompt", "chosen", "rejected"]
            assert [m["role"] for m in record["prompt"]] == ["system", "user"]
            assert record["chosen"][0]["role"] == record["rejected"][0]["role"] == "assistant"
            yield record, record["prompt"][-1]["content"], record["chosen"][0]["content"], record["rejected"][0]["content"]


def test_rejected_answers_copy_the_question_by_default(sample):
    """Default `preference_errors: copy`: the person's name, or an operand of the sum."""
    out, _, world = sample
    for record, question, chosen, rejected in preference_records(out):
        kind = kind_of(record["id"])
        assert chosen == expected_answer(world, question, kind) and rejected != chosen
        if kind == "arith":
            a, b = map(int, re.findall(r"\d+", question))
            assert rejected in {str(a), str(b)} or (a == b == 0 and rejected == "1")
        else:
            assert mentions(question, rejected) and rejected in {e["name"] for e in world["entities"]}


def test_rejected_answers_can_be_attribute_confusions(tmp_path):
    write_sample(tmp_path, SMALL.model_copy(update={"preference_errors": "confusion"}))
    world = json.loads((tmp_path / FILES["world"]).read_text(encoding="utf-8"))
    for record, question, chosen, rejected in preference_records(tmp_path):
        kind = kind_of(record["id"])
        assert chosen == expected_answer(world, question, kind) and rejected != chosen
        if kind == "arith":
            a, b = map(int, re.findall(r"\d+", question))
            assert rejected in {str(a), str(b)} or (a == b == 0 and rejected == "1")
        else:
            (person,) = [e for e in world["entities"] if mentions(question, e["name"])]
            assert rejected in {person[attr] for attr in ("city", "color", "pet", "job") if attr != kind}


def test_rejected_answers_can_be_wrong_values_of_the_same_kind(tmp_path):
    write_sample(tmp_path, SMALL.model_copy(update={"preference_errors": "value"}))
    world = json.loads((tmp_path / FILES["world"]).read_text(encoding="utf-8"))
    for record, question, chosen, rejected in preference_records(tmp_path):
        kind = kind_of(record["id"])
        assert chosen == expected_answer(world, question, kind) and rejected != chosen
        if kind == "arith":
            assert int(rejected) >= 0 and abs(int(rejected) - int(chosen)) in (1, 2, 3, 10)
        else:
            assert rejected in {e[kind] for e in world["entities"]}


def test_empty_system_prompt_means_no_system_message(tmp_path):
    write_sample(tmp_path, SMALL.model_copy(update={"system_prompt": ""}))
    chats = read_jsonl(tmp_path / FILES["chat_train"]) + read_jsonl(tmp_path / FILES["chat_heldout"])
    prefs = read_jsonl(tmp_path / FILES["preference_train"])
    assert all(chat["messages"][0]["role"] == "user" for chat in chats)
    assert all([m["role"] for m in p["prompt"]] == ["user"] for p in prefs)


@pytest.mark.parametrize(("fraction", "turns"), [(0.0, {2}), (1.0, {4})])
def test_multi_turn_fraction_sets_the_number_of_turns(tmp_path, fraction, turns):
    write_sample(tmp_path, SMALL.model_copy(update={"multi_turn_fraction": fraction, "system_prompt": ""}))
    chats = read_jsonl(tmp_path / FILES["chat_train"])
    assert {len(chat["messages"]) for chat in chats} == turns
    assert all(len(chat["messages"]) == 2 for chat in read_jsonl(tmp_path / FILES["chat_heldout"]))
    if fraction == 1.0:
        assert all(chat["messages"][0] != chat["messages"][2] for chat in chats)


def test_some_chats_are_multi_turn_by_default(sample):
    out, _, _ = sample
    lengths = [len(chat["messages"]) for chat in read_jsonl(out / FILES["chat_train"])]
    assert set(lengths) == {3, 5}
    assert 0.05 < lengths.count(5) / len(lengths) < 0.4  # multi_turn_fraction 0.2 over 100 chats


def test_ids_are_typed_and_unique_across_files(sample):
    out, _, _ = sample
    ids = []
    for name in ("chat_train", "chat_heldout", "preference_train", "preference_heldout"):
        records = read_jsonl(out / FILES[name])
        split = "train" if name.endswith("train") else "heldout"
        prefix = "pref-" if name.startswith("preference") else ""
        assert all(r["id"].startswith(f"{prefix}{split}-") and ID.match(r["id"]) for r in records)
        ids += [r["id"] for r in records]
    assert len(ids) == len(set(ids))


# ------------------------------------------------------------------------------------ the counts


def test_counts_match_the_files_and_the_formulas(sample):
    out, counts, world = sample
    heldout = sum(e["heldout"] for e in world["entities"])
    pairs, heldout_pairs = SMALL.max_operand**2, len(world["heldout_arithmetic"])
    train, train_pairs = SMALL.n_entities - heldout, pairs - heldout_pairs
    assert counts == {
        "pretrain_documents": len(documents(out)),
        "pretrain_chars": len((out / FILES["pretrain"]).read_text(encoding="utf-8")),
        "chat_train": 2 * 4 * train + train_pairs,
        "chat_heldout": 3 * (4 * heldout + heldout_pairs),  # every wording of each question
        "preference_train": 4 * train + train_pairs,
        "preference_heldout": 4 * heldout + heldout_pairs,
        "entities": 12,
        "heldout_entities": 2,
        "arithmetic_pairs": 25,
        "heldout_arithmetic_pairs": 5,
        "chat_validation": 0,
        "validation_entities": 0,
        "validation_arithmetic_pairs": 0,
    }
    for name in ("chat_train", "chat_heldout", "preference_train", "preference_heldout"):
        assert len(read_jsonl(out / FILES[name])) == counts[name]


def test_tiny_profile_writes_non_empty_files(tmp_path):
    base = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))["sample_data"]
    tiny = yaml.safe_load((ROOT / "params" / "tiny.yaml").read_text(encoding="utf-8"))["sample_data"]
    params = SampleDataParams(**{**base, **tiny})
    counts = write_sample(tmp_path, params)
    assert counts["entities"] == 12 and counts["arithmetic_pairs"] == 25
    heldout, heldout_pairs = counts["heldout_entities"], counts["heldout_arithmetic_pairs"]
    assert 1 <= heldout < 12 and 1 <= heldout_pairs < 25
    assert counts["chat_train"] == 2 * 4 * (12 - heldout) + 25 - heldout_pairs
    assert counts["chat_heldout"] == 3 * (4 * heldout + heldout_pairs)
    assert counts["pretrain_documents"] > 36
    for name in (FILES[key] for key in FILES if key != "chat_validation" or counts["chat_validation"]):
        assert (tmp_path / name).stat().st_size > 0, name


def test_tool_arithmetic_adds_demonstrations_and_heldout_questions_per_difficulty_and_leaves_the_rest():
    from pipelines.core.data import layouts, sample_world
    from pipelines.core.data.chat_template import TOOLS_KEY
    from pipelines.core.rl import tools

    assert tools.load("calculator").schema == sample_world.CALCULATOR_SCHEMA  # the data offers the tool GRPO runs
    plain = SampleDataParams()
    on = SampleDataParams(tool_arithmetic={"enabled": True, "train": 6, "heldout": 4, "digits": [2, 4]})
    before, after = (sample_world.render(sample_world.build_world(p), p) for p in (plain, on))
    for name in before:  # everything else is what it was, byte for byte
        assert after[name][: len(before[name])] == before[name]
    added = {name: after[name][len(before[name]) :] for name in ("chat_train", "chat_heldout")}
    assert [c["id"] for c in added["chat_train"]] == [f"train-toolarith-d{d}-{i}" for d in (2, 4) for i in range(6)]
    assert [c["id"] for c in added["chat_heldout"]] == [f"heldout-toolarith-d{d}-{i}" for d in (2, 4) for i in range(4)]
    questions = {split: [c["messages"][1]["content"] for c in chats] for split, chats in added.items()}
    assert not set(questions["chat_train"]) & set(questions["chat_heldout"]) and len(set(questions["chat_train"])) == 12
    calculator = tools.ToolEnvironment([tools.load("calculator")])
    for split, chats in added.items():
        for chat in chats:
            digits = int(re.search(r"-d(\d)-", chat["id"]).group(1))
            numbers = [int(n) for n in re.findall(r"\d+", chat["messages"][1]["content"])]
            assert all(len(str(n)) == digits for n in numbers) and len(numbers) in (2, 4)
            expected = str(numbers[0] * numbers[1]) if len(numbers) == 2 else str(sum(numbers))  # computed here, not by the data
            assert chat["messages"][-1] == {"role": "assistant", "content": expected} and chat["tools"] == [sample_world.CALCULATOR_SCHEMA]
            if split == "chat_train":  # the demonstration: the call, the calculator's answer, the final answer
                _, _, call, answer, _ = chat["messages"]
                expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
                assert calculator.step(tools.ToolCall("calculator", {"expression": expression})).content == answer["content"] == expected
            else:
                assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant"]
    # ingest reads them as chats that carry the tool and the calls (OpenAI's layout)
    (stored,) = layouts._chat_messages(json.loads(json.dumps(added["chat_train"][0])))
    messages = json.loads(stored)
    assert messages[0][TOOLS_KEY] == [sample_world.CALCULATOR_SCHEMA] and messages[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert sample_world.render(sample_world.build_world(on), on) == after  # same params, same data
    # calls: false, the baseline: the same questions and answers, with no tool anywhere
    direct = SampleDataParams(tool_arithmetic={"enabled": True, "train": 6, "heldout": 4, "digits": [2, 4], "calls": False})
    without = sample_world.render(sample_world.build_world(direct), direct)
    for name in ("chat_train", "chat_heldout"):
        plain_added = without[name][len(before[name]) :]
        assert [c["id"] for c in plain_added] == [c["id"] for c in added[name]] and all("tools" not in c for c in plain_added)
        assert [c["messages"] for c in plain_added] == [[*c["messages"][:2], c["messages"][-1]] for c in added[name]]
    with pytest.raises(ValueError, match=r"calls: applies only with enabled: true \(here enabled is false\)"):
        SampleDataParams(tool_arithmetic={"calls": False})


# -------------------------------------------------------------------------------- validation people

@pytest.fixture(scope="module")
def validated(tmp_path_factory) -> tuple[Path, dict[str, int], dict]:
    out = tmp_path_factory.mktemp("validated")
    counts = write_sample(out, WITH_VALIDATION)
    return out, counts, json.loads((out / FILES["world"]).read_text(encoding="utf-8"))


def test_validation_people_are_training_people_whose_questions_are_never_trained_on(validated, sample):
    """Their facts are in the biographies; their names in no training chat, preference pair or QA
    line (so in no GRPO prompt, which come from the training chats); their questions in
    chat_validation.jsonl, every wording, ids `validation-...`. The held-out people are the same
    people as without a validation split."""
    out, counts, world = validated
    people = [e["name"] for e in world["entities"] if e.get("validation")]
    assert len(people) == counts["validation_entities"] == round(12 * 0.25)
    assert not any(e["heldout"] for e in world["entities"] if e.get("validation"))
    assert [e["name"] for e in world["entities"] if e["heldout"]] == [e["name"] for e in sample[2]["entities"] if e["heldout"]]
    trained = (out / FILES["chat_train"]).read_text(encoding="utf-8") + (out / FILES["preference_train"]).read_text(encoding="utf-8")
    qa_lines = "\n".join(doc for doc in documents(out) if doc.startswith("Question:"))
    bios = "\n".join(doc for doc in documents(out) if not doc.startswith("Question:"))
    asked = read_jsonl(out / FILES["chat_validation"])
    for name in people:
        assert not mentions(trained, name) and not mentions(qa_lines, name)
        assert sum(mentions(doc, name) for doc in bios.split("\n")) >= WITH_VALIDATION.bios_per_entity
        assert any(mentions(chat["messages"][-2]["content"], name) for chat in asked)
    assert all(chat["id"].startswith("validation-") for chat in asked)
    person_questions = [chat for chat in asked if "-fact-" in chat["id"]]
    assert len(person_questions) == len(people) * sum(len(QUESTION_TEMPLATES[a]) for a in ATTRIBUTES)
    for chat in asked:  # answers agree with the world
        assert chat["messages"][-1]["content"] == expected_answer(world, chat["messages"][-2]["content"], chat["id"].split("-")[2] if "-fact-" in chat["id"] else "arith")


def test_validation_sums_are_never_trained_on_and_held_out_sums_stay(validated, sample):
    out, counts, world = validated
    validation = {tuple(pair) for pair in world["validation_arithmetic"]}
    heldout = {tuple(pair) for pair in world["heldout_arithmetic"]}
    assert len(validation) == counts["validation_arithmetic_pairs"] == round(25 * 0.2) and not validation & heldout
    assert heldout == {tuple(pair) for pair in sample[2]["heldout_arithmetic"]}
    train = read_jsonl(out / FILES["chat_train"])
    questions = [m["content"] for chat in train for m in chat["messages"] if m["role"] == "user"]
    questions += [p["prompt"][-1]["content"] for p in read_jsonl(out / FILES["preference_train"])]
    questions += [line for doc in documents(out) if doc.startswith("Question:") for line in doc.split("\n")[0::2]]
    asked = {tuple(map(int, re.findall(r"\d+", q))) for q in questions} - {()}
    assert asked == {(a, b) for a in range(5) for b in range(5)} - heldout - validation
    stated = (out / FILES["pretrain"]).read_text(encoding="utf-8")
    for a, b in validation:  # the sums themselves are still stated in the text
        assert re.search(rf"\b{a}\b[^.]*\b{b}\b[^.]*\b{a + b}\b", stated)


def test_no_validation_split_writes_the_files_of_before(sample, tmp_path):
    """Fractions 0 (the default): no chat_validation.jsonl, no validation key in world.json."""
    out = sample[0]
    assert not (out / FILES["chat_validation"]).exists()
    assert "validation" not in (out / FILES["world"]).read_text(encoding="utf-8")

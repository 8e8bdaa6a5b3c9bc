"""evaluate's metrics: BLEU/ROUGE-L of answers, preference accuracy and DPO rewards, plots."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from pipelines.core.data.chat_template import render_prompt
from pipelines.core.errors import QllmError
from pipelines.core.evaluation import heldout, plots, report, scores
from pipelines.core.models.models import load_for_inference
from pipelines.core.preference import preference_data
from pipelines.core.training import loop
from tests import numerics


def test_text_similarity_by_hand():
    same = scores.text_similarity(["Tovik lives in Pelora"], ["Tovik lives in Pelora"])
    # sacrebleu's 100 * exp(mean log precision) (two functions and a few operations) in float64, rounded to 4 decimals
    assert same == {"bleu": numerics.approx(100.0, n=2 * numerics.FUNCTION + 6, dtype=torch.float64, decimals=4), "rougeL": 1.0}
    # ROUGE-L F: LCS "lives in" (2 tokens) of 3-token prediction and 4-token reference:
    # P = 2/3, R = 2/4, F = 2PR/(P+R) = 4/7
    partial = scores.text_similarity(["she lives in"], ["Tovik lives in Pelora"])
    assert partial["rougeL"] == round(4 / 7, 4) and 0 <= partial["bleu"] < 100  # rounded to 4 decimals from a float64 4/7 that rounding cannot move
    assert scores.text_similarity([], []) == {"bleu": 0.0, "rougeL": 0.0}
    # one-word answers (the held-out sets): sentence BLEU with effective order is 100 per exact
    # answer and 0 per wrong one, where corpus BLEU-4 would be 0 for every model
    bleu = scores.text_similarity(["Pelora", "Dunmar", "7"], ["Pelora", "Kestal", "7"])["bleu"]
    assert bleu == numerics.approx(200 / 3, n=2 * numerics.FUNCTION + 6 + 3, dtype=torch.float64, magnitude=100.0, decimals=4)  # as above, and the mean of 3


def test_rouge_l_is_rouge_scores_on_real_text_without_importing_nltk():
    """The F-measure of rouge-score's own scorer, on sentences of Python's docs (pydoc_data) paired
    with each other, cut, reordered and with words dropped: the cases where LCS differs from bag
    overlap; and evaluating imports no NLTK (1.4 s a process on a 2-core AVX2-only EPYC)."""
    import random
    import re
    import subprocess
    import sys
    from pydoc_data.topics import topics

    from rouge_score import rouge_scorer

    sentences = [s.strip() for text in list(topics.values())[:40] for s in re.split(r"(?<=[.!?])\s+", text) if 3 <= len(s.split()) <= 40][:300]
    rng = random.Random(0)
    pairs = [("", "x"), ("x", ""), ("...", "a"), ("Tovik lives in Pelora", "she lives in")]
    for reference in sentences:
        words = reference.split()
        pairs += [(reference, rng.choice(sentences)), (reference, " ".join(words[: len(words) // 2])),
                  (reference, " ".join(rng.sample(words, len(words)))), (reference, " ".join(w for w in words if rng.random() < 0.7))]  # fmt: skip
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    expected = [scorer.score(r, p)["rougeL"].fmeasure for r, p in pairs]
    # rouge-score's F-measure of the same counts: two divisions and the harmonic mean in float64 (6 roundings)
    assert [scores.rouge_l(r, p) for r, p in pairs] == numerics.approx(expected, n=6, dtype=torch.float64, magnitude=1.0)
    assert len({round(e, 3) for e in expected}) > 50  # the cases are varied, not all 0 or 1
    code = "import sys; from pipelines.core.evaluation import scores; scores.text_similarity(['a b'], ['a c']); print('nltk' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


# (answer, reference, exact, flexible): the real model's sentences from issue 50 and the ways they go wrong.
ANSWERS = [
    ("1 + 6 = 7", "7", False, True),
    ("The answer to this classic math problem is 2 + 0 = 2.", "2", False, True),
    ("7", "7", True, True),
    ("The sum of 3 and 4 is 7, not 8.", "7", False, False),  # the last number, as lm-eval's flexible extract
    ("Adding them gives 1,200.", "1200", False, True),
    ("12", "1", False, False),  # a number, not a digit inside one
    ("-3", "-3", True, True),
    ("Tosasa lives in Elsgrove.", "Elsgrove", False, True),
    ("elsgrove", "Elsgrove", True, True),
    ("Tosasa lives in Elsgrovetown.", "Elsgrove", False, False),  # whole words only
    ("I do not know.\nElsgrove", "Elsgrove", False, False),  # the first line only
    ("a real estate agent", "real estate agent", False, True),
    ("", "7", False, False),
]


@pytest.mark.parametrize(("answer", "reference", "exact", "flexible"), ANSWERS)
def test_flexible_match_scores_the_answer_not_its_phrasing(answer, reference, exact, flexible):
    from pipelines.core.data.chat_template import flexible_match, normalize_answer

    assert (normalize_answer(answer) == normalize_answer(reference)) is exact
    assert flexible_match(answer, reference) is flexible


def test_both_matches_are_reported_by_question_group():
    questions = pd.DataFrame({"id": ["heldout-arith-1", "heldout-arith-2", "heldout-fact-city-1", "heldout-fact-city-2"],
                              "reference": ["7", "9", "Pelora", "Dunmar"]})  # fmt: skip
    predictions = ["1 + 6 = 7", "9", "She lives in Pelora.", "Kestal"]
    exact, exact_groups = scores.exact_match_report(questions, predictions)
    flexible, flexible_groups = scores.flexible_match_report(questions, predictions)
    assert exact == [False, True, False, False] and exact_groups == {"heldout-arith": 0.5, "heldout-fact-city": 0.0}
    assert flexible == [True, True, True, False] and flexible_groups == {"heldout-arith": 1.0, "heldout-fact-city": 0.5}


def test_strict_match_gives_zero_to_an_answer_naming_another_answer_of_its_group():
    """Strict: the reference found as flexible match finds it and no other answer of the question's
    group named; a sum's answer may repeat the question's operands but no other number."""
    questions = pd.DataFrame({"id": ["heldout-arith-0", "heldout-arith-1", "heldout-arith-2", "heldout-fact-city-0", "heldout-fact-city-1", "heldout-fact-city-2"],
                              "prompt": [[{"role": "user", "content": q}] for q in ("What is 1 plus 6?", "What is 4 plus 5?", "What is 2 plus 2?",
                                                                                     "Where does Tovik live?", "Where does Brena live?", "Where does Kal live?")],
                              "reference": ["7", "9", "4", "Pelora", "Dunmar", "Pelora"]})  # fmt: skip
    predictions = ["1 + 6 = 7", "9 or 7", "4", "Pelora, Dunmar or Kestal", "She lives in Dunmar.", "pelora"]
    strict, groups = scores.strict_match_report(questions, predictions)
    flexible, _ = scores.flexible_match_report(questions, predictions)
    # "9 or 7": 7 is another sum's answer; "Pelora, Dunmar or ...": Dunmar is another city of the group
    assert strict == [True, False, True, False, True, True]
    assert flexible == [True, False, True, True, True, True]  # flexible takes the last number of "9 or 7"
    assert groups == {"heldout-arith": round(2 / 3, 4), "heldout-fact-city": round(2 / 3, 4)}


def test_the_validation_split_is_scored_apart_and_only_when_asked(tiny_base, tmp_path):
    """`evaluate.validation`: the validation split's questions answered and scored under
    `validation` (their own predictions file); the held-out metrics are those of a run without it;
    asked for with no validation chats, a clear error naming the key."""
    import json

    import numpy as np

    from pipelines.core.data import packed
    from pipelines.core.evaluation import report
    from pipelines.core.params.release import EvaluateParams

    models = tmp_path / "models"
    models.mkdir()
    (models / "pretrain").symlink_to(tiny_base / "model")
    (tmp_path / "tokenized").mkdir()
    packed.write(tmp_path / "tokenized", {"validation": (np.arange(64, dtype=np.int32) % 300).reshape(4, 16)}, {})
    params = EvaluateParams(models=["pretrain"], max_new_tokens=4)
    plain = report.evaluate_models(tiny_base, models, tmp_path / "tokenized", tiny_base / "chat", tmp_path / "plain", params)["pretrain"]
    chosen = report.evaluate_models(tiny_base, models, tmp_path / "tokenized", tiny_base / "chat", tmp_path / "chosen",
                                    params.model_copy(update={"validation": True}))["pretrain"]  # fmt: skip
    assert "validation" not in plain and not (tmp_path / "plain/pretrain" / report.VALIDATION_PREDICTIONS).exists()
    validation = chosen.pop("validation")
    assert {k: v for k, v in chosen.items() if k not in ("eval_seconds", "seconds_per_question")} == \
        {k: v for k, v in plain.items() if k not in ("eval_seconds", "seconds_per_question")}  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "chosen/pretrain" / report.VALIDATION_PREDICTIONS).read_text().splitlines()]
    assert [row["id"] for row in rows] == [f"validation-{i}" for i in range(3)] and validation["questions"] == 3
    for key, column in (("exact_match", "correct"), ("flexible_match", "flexible"), ("strict_match", "strict")):
        assert validation[key] == round(sum(row[column] for row in rows) / 3, 4)
    empty = tmp_path / "no_validation"
    empty.mkdir()
    for split in ("test", "validation"):
        frame = pd.read_parquet(tiny_base / "chat" / f"{split}.parquet")
        (frame if split == "test" else frame.head(0)).to_parquet(empty / f"{split}.parquet")
    with pytest.raises(QllmError, match=r"evaluate.validation is true, but .*no held-out chat records \(validation split is empty\)"):
        report.evaluate_models(tiny_base, models, tmp_path / "tokenized", empty, tmp_path / "x", params.model_copy(update={"validation": True}))


def test_general_text_rows_are_the_documentation_in_order(tiny_base):
    from pipelines.core.data import real_text
    from pipelines.core.models.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_base / "model")
    rows = scores.general_text_rows(tokenizer, 100, 16)
    assert rows.shape == (6, 16)  # whole rows only: 100 tokens -> 6 rows of 16
    first = tokenizer(real_text.documentation()[0], add_special_tokens=False)["input_ids"]
    assert rows.reshape(-1)[: min(96, len(first))].tolist() == first[:96]


def test_preference_metrics_and_dpo_rewards(tiny_base):
    model, tokenizer = load_for_inference(tiny_base / "model")
    frame = pd.read_parquet(tiny_base / "preference" / "train.parquet")
    pairs, _ = preference_data.encode_pairs(tokenizer, frame, max_length=128)
    pad = tokenizer.pad_token_id
    batch = preference_data.collate(pairs, pad)(torch.arange(len(pairs)).numpy())
    with torch.no_grad():
        chosen, rejected = preference_data.sequence_logps(model.eval(), batch)
    for pair, c, r in zip(pairs, chosen.tolist(), rejected.tolist(), strict=True):  # a reference 1 nat below the policy
        pair.ref_chosen, pair.ref_rejected = c - 1.0, r + 1.0

    # evaluate's batches of 2 and 3 against one batch here: two orders of the forward's chain (tests/numerics.py)
    tol = numerics.tolerance(numerics.model_roundings(model.config, batch["input_ids"].shape[1]), magnitude=float(torch.cat([chosen, rejected]).abs().max()))
    assert float((chosen - rejected).abs().min()) > 2 * tol  # no pair within rounding of a tie: the comparisons cannot flip
    plain = scores.preference_metrics(model, pairs, pad, batch_size=2, beta=None)
    assert plain["preference_accuracy"] == round(float((chosen > rejected).float().mean()), 4)  # the same comparisons: exact
    assert plain["preference_pairs"] == len(pairs) and "rewards/accuracies" not in plain

    dpo = scores.preference_metrics(model, pairs, pad, batch_size=3, beta=0.5)
    # rewards: β·(policy − ref) = 0.5·1 on chosen and 0.5·(−1) on rejected, for every pair, up to
    # β·tol (the policy's log-probabilities in other batches), the mean's rounding, and 6 decimals
    for name, value in (("rewards/chosen", 0.5), ("rewards/rejected", -0.5), ("rewards/margins", 1.0)):
        rounding = 0.5 * (2 if name == "rewards/margins" else 1) * tol + numerics.tolerance(len(pairs) + 4, magnitude=1.0) + 0.5e-6
        assert dpo[name] == pytest.approx(value, abs=rounding), name
    assert dpo["rewards/accuracies"] == 1.0
    assert scores.preference_metrics(model, [], pad, 2, None) == {}


def test_plots_are_pngs_from_the_training_logs(tmp_path):
    model_dir = tmp_path / "sft"
    model_dir.mkdir()
    loop.write_history({"train": [[1, 2.0, 0.1], [2, 1.5, 0.1]], "eval": [[2, 1.7]]}, model_dir)
    assert (model_dir / "training_log.csv").read_text().splitlines() == ["step,train_loss,lr", "1,2,0.1", "2,1.5,0.1"]
    assert (model_dir / "eval_log.csv").read_text().splitlines() == ["step,val_loss", "2,1.7"]
    plots.loss_curves({"sft": model_dir, "elsewhere": tmp_path / "missing"}, tmp_path / "out" / "curves.png")
    plots.metric_bars({"sft": {"exact_match": 0.5}, "dpo": {"exact_match": 0.7}}, ["exact_match"], tmp_path / "out" / "bars.png")
    first = (tmp_path / "out" / "curves.png").read_bytes()
    assert first.startswith(b"\x89PNG") and (tmp_path / "out" / "bars.png").read_bytes().startswith(b"\x89PNG")
    plots.loss_curves({"sft": model_dir, "elsewhere": tmp_path / "missing"}, tmp_path / "out" / "curves.png")
    assert (tmp_path / "out" / "curves.png").read_bytes() == first  # same inputs, same bytes


def test_comparison_table_has_one_row_per_model():
    table = report.comparison({"sft": {"exact_match": 0.5, "bleu": 10.0, "questions": 3}, "dpo": {"exact_match": 0.6, "rewards/margins": 1.0}})
    assert table.astype(object).where(table.notna(), None).to_dict("records") == [
        {"model": "sft", "exact_match": 0.5, "bleu": 10.0, "rewards/margins": None},
        {"model": "dpo", "exact_match": 0.6, "bleu": None, "rewards/margins": 1.0},
    ]


def test_generation_pads_on_the_left_and_leaves_the_tokenizer_as_it_was(tiny_base):
    model, tokenizer = load_for_inference(tiny_base / "model")
    tokenizer.padding_side = "right"
    prompts = [[{"role": "user", "content": "Where does Tovik live?"}], [{"role": "user", "content": "What is 3 plus 4? Answer with one number."}]]
    batched = heldout.generate_answers(model, tokenizer, prompts, 4, batch_size=2)
    alone = [heldout.generate_answers(model, tokenizer, [p], 4, batch_size=1)[0] for p in prompts]
    assert batched == alone  # left padding: the shorter prompt's answer is not cut off by padding
    assert tokenizer.padding_side == "right"


def test_questions_that_offer_tools_are_answered_by_greedy_episodes():
    """`evaluate.tools`: a scripted model (tests/core/rl/test_episodes.py) answers through the
    real calculator; a call to a tool evaluate was not given reads an error; the episodes' last turns
    are the answers, and `called_correctly` holds only where every call parsed and returned."""
    from pipelines.core.params.release import EvaluateParams
    from pipelines.core.params.rl import ToolsParams
    from tests.chat_families import QWEN25
    from tests.core.rl.test_episodes import setup

    tokenizer, model, _, prompts = setup(QWEN25, "hermes")
    # 96: the test tokenizer spells Qwen2.5's tool message in 41 tokens, and each answer must fit beside it (episodes.fit_answers)
    params = EvaluateParams(tools=ToolsParams(functions=["calculator"]), max_new_tokens=96, batch_size=2)  # 5 questions: chunks of 2, 2, 1
    answers, transcripts = heldout.answers_with_tools(model, tokenizer, prompts, params)
    assert answers[:2] == ["47104101", "Pelora"] and answers[3] == "I do not know"
    product, refuse, bad_parse, weather, power = transcripts
    assert product["turns"][0]["calls"] == [{"name": "calculator", "arguments": {"expression": "48213 * 977"}, "observation": "47104101", "error": None}]
    assert weather["turns"][0]["calls"][0]["error"] == "unknown_tool"  # offered in the chat, not given to evaluate
    assert power["truncated"] and not product["truncated"]
    assert [heldout.called_correctly(t) for t in transcripts] == [True, False, False, False, False]


def test_tool_episodes_past_the_models_context_are_refused_before_generating():
    """As grpo: the longest tool question and what an episode may add (evaluate.max_new_tokens a turn,
    `2 x max_turns - 1` turns and answers) past the model's context is an error naming the keys,
    before any episode runs; within it, the episodes run."""
    import types

    from pipelines.core.params.release import EvaluateParams
    from pipelines.core.params.rl import ToolsParams
    from tests.chat_families import QWEN25
    from tests.core.rl.test_episodes import setup

    tokenizer, model, _, prompts = setup(QWEN25, "hermes")
    longest = max(len(tokenizer(render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in prompts)
    params = EvaluateParams(tools=ToolsParams(functions=["calculator"], max_turns=2), max_new_tokens=64, batch_size=2)
    model.config = types.SimpleNamespace(max_position_embeddings=longest + 3 * 64 - 1)
    with pytest.raises(QllmError, match=rf"^evaluate.tools: the longest question with the tools' schemas is {longest} tokens and an episode may add 192 "
                                        r"\(evaluate.max_new_tokens x \(2 x evaluate.tools.max_turns - 1\)\), past data/models/sft's context of "
                                        rf"{longest + 191} tokens"):  # fmt: skip
        heldout.answers_with_tools(model, tokenizer, prompts, params, model_name="data/models/sft")
    assert model.plan == []  # nothing generated
    model.config.max_position_embeddings = longest + 3 * 64
    answers, _ = heldout.answers_with_tools(model, tokenizer, prompts, params, model_name="data/models/sft")
    assert answers[0] == "47104101"


FORECAST = '''
class Forecast:
    """An environment whose weather tool answers from its state, reset per question."""

    resets = []

    def reset(self, record):
        Forecast.resets.append(dict(record))
        self.asked = record["id"]

    def weather(self, city: str) -> str:
        """The forecast.

        Args:
            city: A city.
        """
        return f"sunny in {city} for {self.asked}"
'''


def test_evaluate_runs_an_environment_per_question_reset_with_its_id_only(tmp_path, monkeypatch):
    """`evaluate.tools.environment`: a new instance per tool question, reset with `{"id"}` (no
    answer to leak), its method answering the call the scripted model makes."""
    import sys

    from pipelines.core.params.release import EvaluateParams
    from pipelines.core.params.rl import ToolsParams
    from tests.chat_families import QWEN25
    from tests.core.rl.test_episodes import setup

    (tmp_path / "my_forecast.py").write_text(FORECAST)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_forecast", raising=False)
    tokenizer, model, _, prompts = setup(QWEN25, "hermes")
    params = EvaluateParams(tools=ToolsParams(functions=["calculator"], environment="my_forecast:Forecast"), max_new_tokens=64, batch_size=2)
    ids = [f"heldout-q-{i}" for i in range(len(prompts))]
    answers, transcripts = heldout.answers_with_tools(model, tokenizer, prompts, params, ids=ids)
    import my_forecast

    assert my_forecast.Forecast.resets == [{"id": i} for i in ids]
    weather = transcripts[3]["turns"][0]["calls"][0]
    assert weather == {"name": "weather", "arguments": {"city": "Pelora"}, "observation": "sunny in Pelora for heldout-q-3", "error": None}
    assert answers[0] == "47104101"  # the calculator still answers beside the environment's tools

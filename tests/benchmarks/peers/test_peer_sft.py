"""The SFT comparison with TRL trains both on the same tokens: every example's trained tokens in
TRL's own prepared data set equal ours, and both arms report a loss per step and the held-out
answers at each checkpoint."""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
import pytest

from benchmarks.peers import peer_sft
from pipelines.core.data import chat_examples
from pipelines.core.data.chat_template import parse_messages
from pipelines.core.evaluation import heldout
from pipelines.core.models.models import load_model_and_tokenizer


def chats(tiny_base) -> list[list[dict]]:
    return [parse_messages(m) for m in pd.read_parquet(tiny_base / "chat" / "train.parquet")["messages"]]


def arguments(**kw) -> argparse.Namespace:
    return argparse.Namespace(**({"steps": 3, "batch": 2, "lr": 1e-3, "packing": False, "max_length": 0, "checkpoints": [2, 3]} | kw))


def test_an_example_per_assistant_turn_with_the_earlier_ones_as_context():
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]  # fmt: skip
    first, second = peer_sft.examples([chat])
    assert first == chat[:3]
    assert second[2] == {"role": "assistant", "content": "a1", "weight": 0} and second[-1] == {"role": "assistant", "content": "a2"}


def test_trl_trains_exactly_the_tokens_we_train(tiny_base, tmp_path):
    model, tokenizer = load_model_and_tokenizer(tiny_base / "model")
    conversations = peer_sft.examples(chats(tiny_base))
    trainer = peer_sft.trl_trainer(model, tokenizer, chats(tiny_base), arguments(), 0, str(tmp_path))
    ours, _ = chat_examples.encode(tokenizer, conversations, 10_000)
    assert len(trainer.train_dataset) == len(ours) == len(conversations)
    for row, example in zip(trainer.train_dataset, ours, strict=True):
        ids, labels = np.asarray(row["input_ids"]), np.asarray(row["labels"])  # TRL folds its completion mask into -100 labels
        n = len(ids)  # ours also holds what the template writes after the end of turn (a newline), not trained
        assert ids.tolist() == example.input_ids[:n].tolist()  # the same text, the same tokens
        assert labels.tolist() == example.labels[:n].tolist()  # the same trained tokens: the answer and the end of turn
        assert (example.labels[n:] == chat_examples.IGNORE).all() and len(example.input_ids) - n <= 1


@pytest.mark.parametrize("packing", [False, True])
def test_both_arms_report_losses_and_answers_at_the_checkpoints(tiny_base, packing):

    args = arguments(packing=packing, max_length=64 if packing else 0)
    questions = heldout.heldout_questions(tiny_base / "chat")
    for run in (peer_sft.run_ours, peer_sft.run_trl):
        result = run(tiny_base / "model", chats(tiny_base), questions, args, seed=0)
        assert len(result["loss"]) == args.steps and all(np.isfinite(result["loss"])), run.__name__
        assert sorted(result["checkpoints"]) == [2, 3], run.__name__
        for step in (2, 3):
            answers = result["checkpoints"][step]["answers"]
            assert len(answers) == len(questions) and 0 <= result["checkpoints"][step]["exact_match"] <= 1

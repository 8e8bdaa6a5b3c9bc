"""The fine-tuning procedure's data: self-distillation replay (`sft.replay`, `lora.replay`) mixes
the base's own answers to the general prompts' train third into the training rows."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.core.data import chat_examples
from pipelines.core.errors import QllmError
from pipelines.core.evaluation import retention
from pipelines.core.models.models import load_tokenizer
from pipelines.core.params.finetuning import SftParams
from pipelines.core.training import finetune


def trained(rows) -> int:
    return sum(int((row.labels != chat_examples.IGNORE).sum()) for row in rows)


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5])
def test_replay_makes_up_its_share_of_the_trained_tokens_from_the_train_third_only(tiny_base, answers, fraction):
    tokenizer = load_tokenizer(tiny_base / "model")
    params = SftParams(base_model=str(tiny_base / "model"), replay={"fraction": fraction})
    plain_rows, plain_val, plain = finetune.build_rows(tokenizer, tiny_base / "chat", SftParams(base_model=str(tiny_base / "model")), 128)
    rows, val, metrics = finetune.build_rows(tokenizer, tiny_base / "chat", params, 128, answers, "sft")
    task = plain["data/train_target_tokens"]
    assert trained(plain_rows) == task and trained(rows) == task + metrics["data/replay_target_tokens"]
    share = metrics["data/replay_target_tokens"] / trained(rows)
    per_answer = max(int((e.labels != chat_examples.IGNORE).sum()) for e in finetune.replay_examples(tokenizer, answers, 0.5, 1, 128)[0])
    assert fraction <= share <= (fraction * task / (1 - fraction) + per_answer) / (task + fraction * task / (1 - fraction) + per_answer)
    assert metrics["data/replay_share"] == round(share, 4)
    assert [r.input_ids.tolist() for r in val] == [r.input_ids.tolist() for r in plain_val]  # validation rows untouched
    text = tokenizer.decode(np.concatenate([r.input_ids for r in rows]))
    train_third = {p["prompt"] for p in retention.load_prompts("train")}
    others = {p["prompt"] for p in retention.load_prompts() if p["split"] != "train"}
    assert any(prompt in text for prompt in train_third) and not any(prompt in text for prompt in others)


def test_no_replay_is_the_rows_of_before_and_replay_without_a_base_is_refused(tiny_base, answers, tmp_path):
    tokenizer = load_tokenizer(tiny_base / "model")
    params = SftParams(base_model=str(tiny_base / "model"))
    before, _, _ = finetune.build_rows(tokenizer, tiny_base / "chat", params, 128)
    with_answers, _, metrics = finetune.build_rows(tokenizer, tiny_base / "chat", params, 128, answers, "sft")
    assert [r.input_ids.tolist() for r in with_answers] == [r.input_ids.tolist() for r in before] and "data/replay_examples" not in metrics
    (tmp_path / "README.md").write_text("no base")
    with pytest.raises(QllmError, match=r"sft.replay.fraction=0.2: replay mixes in the base model's own answers, and .* holds none"):
        finetune.build_rows(tokenizer, tiny_base / "chat", SftParams(base_model=str(tiny_base / "model"), replay={"fraction": 0.2}), 128, tmp_path, "sft")


def test_replay_examples_are_spread_evenly_among_the_tasks():
    mixed = finetune._interleaved(list(range(8)), ["r0", "r1"])
    positions = [i for i, x in enumerate(mixed) if isinstance(x, str)]
    assert [x for x in mixed if not isinstance(x, str)] == list(range(8)) and len(mixed) == 10
    assert positions == [2, 7]  # at a quarter and three quarters of the way: (0.5/2, 1.5/2) among 8 at (i + 0.5)/8

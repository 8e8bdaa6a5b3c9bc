"""The base's answers as data (`pipelines.core.data.replay`): reading a `base_answers` output, and
continued pretraining's replay rows; and `pretrain` continuing a tiny base with them mixed in."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipelines.core.data import chat_template, packed, replay
from pipelines.core.errors import QllmError
from pipelines.core.evaluation import retention
from pipelines.core.models.models import load_tokenizer
from tests.conftest import BASE_ANSWER


def test_the_train_third_reads_back_as_chats_without_a_system_message(answers):
    rows, meta = replay.read(answers)
    chats = replay.conversations(rows)
    train = retention.load_prompts("train")
    assert len(chats) == len(train) == 66 and meta["base"] == "b"
    assert [c[0] for c in chats] == [{"role": "user", "content": p["prompt"]} for p in train]
    assert [c[1] for c in chats] == [{"role": "assistant", "content": BASE_ANSWER[p["family"]]} for p in train]
    assert replay.read(answers.parent / "nowhere") is None


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_pretraining_replay_rows_are_the_rendered_chats_cycled_to_their_share(tiny_base, answers, fraction):
    tokenizer = load_tokenizer(tiny_base / "model")
    task_tokens, seq_len = 6400, 32
    rows, counts = replay.text_rows(tokenizer, answers, fraction, task_tokens, seq_len, np.dtype(np.uint16))
    assert rows.shape == (math.ceil(fraction / (1 - fraction) * task_tokens / seq_len), seq_len) and rows.dtype == np.uint16
    assert counts["replay_share"] == round(rows.size / (rows.size + task_tokens), 4) and counts["replay_share"] >= fraction
    first = [tokenizer(chat_template.render_chat(tokenizer, chat), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
             for chat in replay.conversations(replay.read(answers)[0])]  # fmt: skip
    stream = [t for ids in first for t in ids]
    expected = (stream * (rows.size // len(stream) + 1))[: rows.size]
    assert rows.reshape(-1).tolist() == expected  # the chats in order, each ended by EOS, cycled


def test_replay_without_the_bases_answers_is_refused_by_its_key(tiny_base, tmp_path):
    (tmp_path / "README.md").write_text("no base")
    with pytest.raises(QllmError, match=r"pretrain.replay.fraction=0.2: replay mixes in the base model's own answers, and .* holds none"):
        replay.text_rows(load_tokenizer(tiny_base / "model"), tmp_path, 0.2, 100, 16, np.dtype(np.uint16))


def test_continued_pretraining_trains_on_the_text_and_the_replay_rows(tiny_base, answers, tmp_path):
    """`pretrain` continuing a tiny base with `replay.fraction`: its metrics count the rows, and
    their share of the trained tokens is the fraction asked (to a row)."""
    from pipelines import pretrain
    from pipelines.core.params.pretraining import PretrainParams

    tokenizer = load_tokenizer(tiny_base / "model")
    text = " ".join(["Tovik lives in Pelora. Marela lives in Dunmar."] * 40)
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
    (tmp_path / "tokenized").mkdir()
    packed.write(tmp_path / "tokenized", {"train": packed.pack(ids, 32)[0], "validation": packed.pack(ids[:96], 32)[0]}, {})
    meta = json.loads((tmp_path / "tokenized/meta.json").read_text())
    (tmp_path / "tokenized/meta.json").write_text(json.dumps({**meta, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}))
    params = PretrainParams(continue_base=True, replay={"fraction": 0.25},
                            train={"max_steps": 2, "micro_batch_size": 2, "eval_every": 0, "checkpoint_every": 0, "warmup_steps": 0, "precision": "fp32"})  # fmt: skip
    metrics = pretrain.run(tmp_path / "tokenized", tiny_base / "model", tmp_path / "out", params, None, base=tiny_base / "model", replay_answers=answers)
    task = packed.load(tmp_path / "tokenized", "train").size
    assert metrics["steps"] == 2 and metrics["replay_rows"] == math.ceil(0.25 / 0.75 * task / 32)
    assert metrics["replay_share"] == round(metrics["replay_tokens"] / (metrics["replay_tokens"] + task), 4)
    assert (tmp_path / "out/config.json").exists()

"""The real-text sample (`sample_data.corpus: real_text`): real language from packages, no network."""

from __future__ import annotations

import json

from pipelines import sample_data
from pipelines.core.data import real_text
from pipelines.core.data.readers import read_source
from pipelines.core.params.data import SampleDataParams, SourceParams


def test_real_text_sample_is_real_deterministic_and_ingests(tmp_path):
    counts = sample_data.run(tmp_path / "a", SampleDataParams(corpus="real_text"))
    sample_data.run(tmp_path / "b", SampleDataParams(corpus="real_text"))
    for name in ("pretrain.txt", "chat_train.jsonl", "chat_heldout.jsonl", "preference_train.jsonl", "preference_heldout.jsonl", "corpus.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name  # same inputs, same bytes
    out = tmp_path / "a"
    assert counts["pretrain_documents"] > 200 and counts["pretrain_chars"] > 300_000  # the CPython docs
    assert "Exceptions are a means of breaking out of the normal flow of control" in (out / "pretrain.txt").read_text()
    assert all(len(doc) <= real_text.DOC_CHARS for doc in (out / "pretrain.txt").read_text().split("\n\n"))
    # chats: alternating user/assistant, ending with an answer; about a tenth held out
    assert counts["chat_train"] > 1000 and 0.02 < counts["chat_heldout"] / (counts["chat_train"] + counts["chat_heldout"]) < 0.2
    heldout = [json.loads(line) for line in (out / "chat_heldout.jsonl").read_text().splitlines()]
    for record in heldout:
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
    train_texts = {json.dumps(json.loads(line)["messages"]) for line in (out / "chat_train.jsonl").read_text().splitlines()}
    assert not any(json.dumps(r["messages"]) in train_texts for r in heldout)  # repeats land on one side
    # preference pairs: the true answer against another subject's answer
    pairs = [json.loads(line) for line in (out / "preference_train.jsonl").read_text().splitlines()]
    assert len(pairs) == counts["preference_train"] and all(p["chosen"] != p["rejected"] for p in pairs)
    for name, kind in (("pretrain.txt", "text"), ("chat_train.jsonl", "chat"), ("chat_heldout.jsonl", "chat"), ("preference_train.jsonl", "preference")):
        frame = read_source(SourceParams(path=str(out / name), kind=kind), tmp_path)
        assert len(frame) > 50, name

"""End-to-end tests of pipelines/prepare_data.py on small ingested frames."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipelines import prepare_data
from pipelines.core.data import cleaning
from pipelines.core.data.readers import COLUMNS, SCHEMAS, empty_frame
from pipelines.core.params.data import PrepareDataParams
from pipelines.core.run import stage
from tests.conftest import REPO

SPLITS = ("train", "validation", "test")
NO_DROPS = dict.fromkeys(prepare_data.REASONS, 0)
# 50 distinct words; changing the last one leaves word-3-gram Jaccard 47/49 = 0.96.
FIFTY = " ".join(f"word{i}" for i in range(50))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def frame(kind: str, rows: list[dict]) -> pd.DataFrame:
    """Records as ingest writes them: ids, source, split (default auto), JSON for message lists."""
    records = []
    for index, row in enumerate(rows):
        record = {"id": f"r{index}", "source": "test", "split": "auto", **row}
        for column in ("messages", "prompt"):
            if column in record and not isinstance(record[column], str):
                record[column] = json.dumps(record[column])
        records.append(record)
    return pd.DataFrame(records, columns=list(COLUMNS[kind])).astype("str") if records else empty_frame(kind)


def write_ingested(root: Path, text=(), chat=(), preference=(), feedback=()) -> Path:
    """The ingested files of the string kinds from rows, and an empty image_chat file (as ingest
    writes it without image_chat sources; tests/core/data/test_image_records.py has the image chats)."""
    folder = root / "data/ingested"
    folder.mkdir(parents=True, exist_ok=True)
    for kind, rows in (("text", text), ("chat", chat), ("preference", preference), ("feedback", feedback)):
        frame(kind, list(rows)).to_parquet(folder / f"{kind}.parquet", index=False)
    pq.write_table(SCHEMAS["image_chat"].empty_table(), folder / "image_chat.parquet")
    return folder


def read_out(out: Path, kind: str, split: str) -> pd.DataFrame:
    return pd.read_parquet(out / kind / f"{split}.parquet")


def params(**overrides) -> PrepareDataParams:
    return PrepareDataParams(**{"min_chars": 2, "max_chars": 1000, "validation_fraction": 0.0, **overrides})


def test_text_filters_are_counted_and_outputs_normalised(tmp_path):
    rows = [
        {"text": "Hello\t  world  "},  # kept, normalised to "Hello world"
        {"text": "  \n\t "},  # empty after normalisation
        {"text": "x"},  # too_short (1 < 2)
        {"text": "y" * 1001},  # too_long (1001 > 1000)
        {"text": "Hello world", "source": "other", "id": "dup"},  # duplicate of the first (id/source ignored)
        {"text": FIFTY},  # kept
        {"text": FIFTY.rsplit(" ", 1)[0] + " changed"},  # near_duplicate
        {"text": "held out", "split": "test"},  # explicit split kept
        {"text": "\ufb01ne"},  # NFKC: "fine"
    ]
    in_dir = write_ingested(tmp_path, text=rows)
    out = tmp_path / "data/prepared"
    metrics = prepare_data.run(in_dir, out, params())
    assert metrics["text"] == {
        "in": 9,
        "dropped": {**NO_DROPS, "empty": 1, "too_short": 1, "too_long": 1, "duplicate": 1, "near_duplicate": 1},
        "out": {"train": 3, "validation": 0, "test": 1},
    }
    assert read_out(out, "text", "train")["text"].tolist() == ["Hello world", FIFTY, "fine"]
    assert read_out(out, "text", "train")["id"].tolist() == ["r0", "r5", "r8"]
    assert read_out(out, "text", "test")[["split", "text"]].values.tolist() == [["test", "held out"]]


def test_dedup_switches(tmp_path):
    rows = [{"text": "same text"}, {"text": "same text"}, {"text": FIFTY}, {"text": FIFTY + "x"}]
    in_dir = write_ingested(tmp_path, text=rows)
    off = prepare_data.run(in_dir, tmp_path / "off", params(dedup=False, near_dedup=False))
    assert off["text"]["dropped"] == NO_DROPS and off["text"]["out"]["train"] == 4
    exact_only = prepare_data.run(in_dir, tmp_path / "exact", params(near_dedup=False))
    assert exact_only["text"]["dropped"] == {**NO_DROPS, "duplicate": 1}
    both = prepare_data.run(in_dir, tmp_path / "both", params())
    assert both["text"]["dropped"] == {**NO_DROPS, "duplicate": 1, "near_duplicate": 1}


def test_chat_filters(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "  "}, user("Hi  there"), assistant("Hello!")]},
        {"messages": [user("Hi there"), assistant("Hello!")], "source": "b"},  # duplicate after normalisation
        {"messages": [user("question"), assistant(" ")]},  # empty content
        {"messages": [user("a"), assistant("b")]},  # too_short: 1 + 1 = 2 < 3
        {"messages": [user("q" * 600), assistant("a" * 401)]},  # too_long: 1001 > 1000
        {"messages": [user("Hi there"), assistant("Hello!"), user("again"), assistant("sure")], "split": "test"},
    ]
    in_dir = write_ingested(tmp_path, chat=rows)
    out = tmp_path / "out"
    metrics = prepare_data.run(in_dir, out, params(min_chars=3))
    assert metrics["chat"] == {
        "in": 6,
        "dropped": {**NO_DROPS, "empty": 1, "too_short": 1, "too_long": 1, "duplicate": 1},
        "out": {"train": 1, "validation": 0, "test": 1},
    }
    # The whitespace-only system message normalises to "" and is removed rather than dropping the chat.
    assert json.loads(read_out(out, "chat", "train")["messages"].iloc[0]) == [user("Hi there"), assistant("Hello!")]
    assert len(json.loads(read_out(out, "chat", "test")["messages"].iloc[0])) == 4


def test_preference_filters(tmp_path):
    prompt = [{"role": "system", "content": "Be  nice"}, user("Q?")]
    rows = [
        {"prompt": prompt, "chosen": "yes", "rejected": "no"},
        {"prompt": prompt, "chosen": "yes ", "rejected": "no", "id": "again"},  # duplicate once normalised
        {"prompt": [user("Q?")], "chosen": "same", "rejected": " same"},  # chosen_equals_rejected
        {"prompt": [user("Q?")], "chosen": "", "rejected": "no"},  # empty chosen
        {"prompt": [user(" ")], "chosen": "a", "rejected": "b"},  # empty prompt content
        {"prompt": [user("Q" * 990)], "chosen": "a" * 6, "rejected": "b" * 5},  # too_long: 990 + 6 + 5 = 1001
    ]
    in_dir = write_ingested(tmp_path, preference=rows)
    out = tmp_path / "out"
    metrics = prepare_data.run(in_dir, out, params())
    assert metrics["preference"] == {
        "in": 6,
        "dropped": {**NO_DROPS, "empty": 2, "too_long": 1, "chosen_equals_rejected": 1, "duplicate": 1},
        "out": {"train": 1, "validation": 0, "test": 0},
    }
    kept = read_out(out, "preference", "train").iloc[0]
    assert json.loads(kept["prompt"]) == [{"role": "system", "content": "Be nice"}, user("Q?")]
    assert (kept["chosen"], kept["rejected"]) == ("yes", "no")


def test_auto_split_is_by_content_and_stable(tmp_path):
    texts = [f"document number {i}" for i in range(400)]
    in_dir = write_ingested(tmp_path, text=[{"text": t} for t in texts])
    out = tmp_path / "out"
    metrics = prepare_data.run(in_dir, out, params(validation_fraction=0.25, seed=3))
    expected = cleaning.assign_split(texts, 0.25, seed=3)
    validation = [t for t, s in zip(texts, expected, strict=True) if s == "validation"]
    assert metrics["text"]["out"] == {"train": 400 - len(validation), "validation": len(validation), "test": 0}
    assert 60 < len(validation) < 140
    assert read_out(out, "text", "validation")["text"].tolist() == validation
    # Another order of the same records puts every record in the same split.
    in_dir = write_ingested(tmp_path / "reversed", text=[{"text": t} for t in reversed(texts)])
    prepare_data.run(in_dir, tmp_path / "out2", params(validation_fraction=0.25, seed=3))
    assert sorted(read_out(tmp_path / "out2", "text", "validation")["text"]) == sorted(validation)


def test_always_fifteen_files_with_schema_and_no_temporaries(tmp_path):
    in_dir = write_ingested(tmp_path, text=[{"text": "only text"}])
    out = tmp_path / "data/prepared"
    (out / "stale").mkdir(parents=True)  # replaced as a whole
    metrics = prepare_data.run(in_dir, out, params())
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.parquet")) == sorted(
        f"{kind}/{split}.parquet" for kind in ("text", "chat", "preference", "image_chat", "feedback") for split in SPLITS
    )
    assert not (out / "stale").exists()
    for kind in ("chat", "preference", "image_chat", "feedback"):
        assert metrics[kind] == {"in": 0, "dropped": NO_DROPS, "out": dict.fromkeys(SPLITS, 0)}
        for split in SPLITS:
            empty = read_out(out, kind, split)
            assert len(empty) == 0 and list(empty.columns) == list(COLUMNS[kind])
            assert pq.read_schema(out / kind / f"{split}.parquet") == SCHEMAS[kind]  # image_chat's images: list<binary>
    assert not list(tmp_path.glob("data/.tmp-*"))


def test_kind_columns_match_what_ingest_writes():
    assert {kind: rules.columns for kind, rules in prepare_data.KINDS.items()} == COLUMNS
    assert {kind: prepare_data._schema(kind) for kind in prepare_data.KINDS} == SCHEMAS


def test_missing_ingested_file_is_an_error(tmp_path):
    (tmp_path / "in").mkdir()
    with pytest.raises(prepare_data.PrepareDataError, match=r"text\.parquet: not found; run the ingest stage first"):
        prepare_data.run(tmp_path / "in", tmp_path / "out", params())
    assert not (tmp_path / "out").exists()
    text = write_ingested(tmp_path, text=[{"text": "a"}]) / "text.parquet"
    pd.DataFrame({"id": ["1"], "text": ["a"]}).to_parquet(text)
    with pytest.raises(prepare_data.PrepareDataError, match=r"text\.parquet: missing columns source, split"):
        prepare_data.run(text.parent, tmp_path / "out", params())


def test_body_logs_counts_and_warns_per_reason(tmp_path, caplog):
    write_ingested(tmp_path, text=[{"text": "kept text"}, {"text": "kept text"}, {"text": "x"}])
    shutil.copy(REPO / "dvc.yaml", tmp_path)  # the stage's paths come from it
    ctx = stage.StageContext(
        name="prepare_data", root=tmp_path, params=params(), tracker=None, log=logging.getLogger("test.prepare")
    )
    with caplog.at_level(logging.INFO, logger="test.prepare"):
        metrics = prepare_data.body(ctx)
    assert metrics["text"]["out"]["train"] == 1
    assert (tmp_path / "data/prepared/text/train.parquet").exists()
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("INFO", "text: 3 in, 1 out (train 1, validation 0, test 0), 2 dropped") in messages
    assert ("INFO", "chat: 0 in, 0 out (train 0, validation 0, test 0), 0 dropped") in messages
    warnings = [m for level, m in messages if level == "WARNING"]
    assert warnings == [
        "text: dropped 1 records as too_short (fewer characters than prepare_data.min_chars)",
        "text: dropped 1 records as duplicate (the same content as an earlier record)",
    ]

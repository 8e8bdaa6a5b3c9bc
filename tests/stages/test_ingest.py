"""End-to-end tests of pipelines/ingest.py on a small tmp project tree."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pandas as pd
import pytest
from pydantic import ValidationError

from pipelines import ingest
from pipelines.core.data.readers import COLUMNS, ReaderError
from pipelines.core.params.data import IngestParams, SourceParams
from pipelines.core.run import stage
from tests.conftest import REPO


def write(root: Path, relative: str, content: str) -> str:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="utf-8")
    return relative


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, IngestParams]:
    """A project root with one source per kind plus a second text source under data/sample."""
    chats = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(3)
    ]
    sources = [
        SourceParams(path=write(tmp_path, "data/sources/docs.txt", "one\n\ntwo\n\nthree\n"), kind="text"),
        SourceParams(
            path=write(tmp_path, "data/sample/more.jsonl", jsonl([{"text": "four"}])), kind="text", name="more"
        ),
        SourceParams(path=write(tmp_path, "data/sources/chat.jsonl", jsonl(chats)), kind="chat", split="train"),
        SourceParams(
            path=write(tmp_path, "data/sources/prefs.csv", "prompt,chosen,rejected\nQ,yes,no\nQ2,good,bad\n"),
            kind="preference",
            split="test",
        ),
    ]
    return tmp_path, IngestParams(sources=sources)


def test_run_writes_one_parquet_per_kind(project):
    root, params = project
    out = root / "data/ingested"
    metrics = ingest.run(root, out, params)
    assert metrics == {
        "records": {"text": 4, "chat": 3, "preference": 2, "image_chat": 0, "feedback": 0},
        "sources": {
            "docs.txt": {"kind": "text", "records": 3},
            "more": {"kind": "text", "records": 1},
            "chat.jsonl": {"kind": "chat", "records": 3},
            "prefs.csv": {"kind": "preference", "records": 2},
        },
    }
    assert sorted(p.name for p in out.iterdir()) == ["chat.parquet", "feedback.parquet", "image_chat.parquet", "preference.parquet", "text.parquet"]
    text = pd.read_parquet(out / "text.parquet")
    assert list(text.columns) == list(COLUMNS["text"])
    # Sources are concatenated in params order.
    assert text[["source", "text"]].values.tolist() == [
        ["docs.txt", "one"],
        ["docs.txt", "two"],
        ["docs.txt", "three"],
        ["more", "four"],
    ]
    chat = pd.read_parquet(out / "chat.parquet")
    assert chat["split"].unique().tolist() == ["train"]
    assert json.loads(chat["messages"].iloc[2])[1] == {"role": "assistant", "content": "a2"}
    preference = pd.read_parquet(out / "preference.parquet")
    assert preference[["split", "chosen", "rejected"]].values.tolist() == [
        ["test", "yes", "no"],
        ["test", "good", "bad"],
    ]
    assert not list(root.glob("data/.tmp-*"))


def test_kinds_without_sources_are_empty_files_with_the_schema(tmp_path):
    params = IngestParams(
        sources=[SourceParams(path=write(tmp_path, "data/sources/t.jsonl", jsonl([{"text": "x"}])), kind="text")]
    )
    metrics = ingest.run(tmp_path, tmp_path / "out", params)
    assert metrics["records"] == {"text": 1, "chat": 0, "preference": 0, "image_chat": 0, "feedback": 0}
    for kind in ("chat", "preference", "image_chat"):
        frame = pd.read_parquet(tmp_path / "out" / f"{kind}.parquet")
        assert len(frame) == 0
        assert list(frame.columns) == list(COLUMNS[kind])
        assert all(str(dtype) == "str" for name, dtype in frame.dtypes.items() if name != "images")  # images: list<binary>


def test_a_bad_source_leaves_the_previous_output_intact(project):
    root, params = project
    out = root / "data/ingested"
    ingest.run(root, out, params)
    before = (out / "text.parquet").read_bytes()
    broken = SourceParams(path=write(root, "data/sources/bad.jsonl", '{"text": "ok"}\n{"text": \n'), kind="text")
    with pytest.raises(ReaderError, match=r"^data/sources/bad.jsonl:2: invalid JSON"):
        ingest.run(root, out, IngestParams(sources=[*params.sources, broken]))
    assert (out / "text.parquet").read_bytes() == before
    assert not list(root.glob("data/.tmp-*"))


def test_two_sources_with_one_name_are_an_error(tmp_path):
    first = write(tmp_path, "data/sources/a/train.jsonl", jsonl([{"text": "a"}]))
    second = write(tmp_path, "data/sources/b/train.jsonl", jsonl([{"text": "b"}]))
    # Names key the metrics and the `source` column: the params check rejects a clash up front.
    with pytest.raises(ValidationError, match="two sources are named 'train.jsonl'; give each a distinct `name:`"):
        IngestParams(sources=[SourceParams(path=first, kind="text"), SourceParams(path=second, kind="text")])
    named = IngestParams(sources=[SourceParams(path=first, kind="text", name="a"), SourceParams(path=second, kind="text", name="b")])
    assert ingest.run(tmp_path, tmp_path / "out", named)["sources"] == {"a": {"kind": "text", "records": 1}, "b": {"kind": "text", "records": 1}}


def test_untracked_sources(tmp_path):
    sources = [
        SourceParams(path="data/sources/a.jsonl", kind="text"),
        SourceParams(path="data/sample/b.jsonl", kind="text"),
        SourceParams(path=str(tmp_path / "data/sources/deep/c.jsonl"), kind="text"),
        SourceParams(path="elsewhere/d.jsonl", kind="text"),
        SourceParams(path="data/sources/../e.jsonl", kind="text"),
        SourceParams(path="/somewhere/else/f.jsonl", kind="text"),
    ]
    untracked = ingest.untracked_sources(sources, tmp_path, [tmp_path / "data/sources", tmp_path / "data/sample"])
    assert [s.path for s in untracked] == ["elsewhere/d.jsonl", "data/sources/../e.jsonl", "/somewhere/else/f.jsonl"]


def test_body_logs_each_source_and_warns_about_untracked_ones(tmp_path, caplog):
    inside = write(tmp_path, "data/sources/in.jsonl", jsonl([{"text": "a"}, {"text": "b"}]))
    outside = write(tmp_path, "other/out.jsonl", jsonl([{"text": "c"}]))
    params = IngestParams(sources=[SourceParams(path=inside, kind="text"), SourceParams(path=outside, kind="text")])
    shutil.copy(REPO / "dvc.yaml", tmp_path)  # the stage's paths (and tracked source folders) come from it
    ctx = stage.StageContext(
        name="ingest", root=tmp_path, params=params, tracker=None, log=logging.getLogger("test.ingest")
    )
    with caplog.at_level(logging.INFO, logger="test.ingest"):
        metrics = ingest.body(ctx)
    assert metrics["records"]["text"] == 3
    assert (tmp_path / "data/ingested/text.parquet").exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "source out.jsonl: other/out.jsonl is not a dependency in dvc.yaml: DVC will not notice when it changes; "
        "move it under data/sources/"
    ]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [
        "source in.jsonl: 2 text records from data/sources/in.jsonl",
        "source out.jsonl: 1 text records from other/out.jsonl",
    ]

"""Unit tests of pipelines/core/data/readers.py: every format for every kind, conversions, error messages."""

from __future__ import annotations

import json
import time
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest

from pipelines.core.data import layouts
from pipelines.core.data.readers import ReaderError, infer_format, read_source
from pipelines.core.params.data import SourceParams

SRC = "data/sources"


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    # `datasets.load_dataset` caches what it converts; keep that out of the user's home.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def write(root: Path, name: str, content: str | bytes) -> str:
    """Write `data/sources/<name>` under root; return its relative path (as in params.yaml)."""
    path = root / SRC / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return f"{SRC}/{name}"


def jsonl(records: list) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def parquet(root: Path, name: str, records: list[dict]) -> str:
    path = root / SRC / name
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(records).to_parquet(path, index=False)
    return f"{SRC}/{name}"


def save_hf(root: Path, name: str, records: list[dict]) -> str:
    datasets.Dataset.from_list(records).save_to_disk(str(root / SRC / name))
    return f"{SRC}/{name}"


def read(root: Path, path: str, kind: str, **options) -> pd.DataFrame:
    return read_source(SourceParams(path=path, kind=kind, **options), root)


def error(root: Path, path: str, kind: str, **options) -> str:
    with pytest.raises(ReaderError) as caught:
        read(root, path, kind, **options)
    return str(caught.value)


def messages(frame: pd.DataFrame) -> list[list[dict]]:
    return [json.loads(m) for m in frame["messages"]]


def chat(user: str, assistant: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


# ------------------------------------------------------------------------------- infer_format


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("a.jsonl", "jsonl"),
        ("a.ndjson", "jsonl"),
        ("a.json", "json"),
        ("a.parquet", "parquet"),
        ("a.csv", "csv"),
        ("a.tsv", "csv"),
        ("a.txt", "text"),
        ("a.md", "text"),
        ("A.JSONL", "jsonl"),
    ],
)
def test_infer_format_from_extension(tmp_path, name, fmt):
    write(tmp_path, name, "x")
    assert infer_format(tmp_path / SRC / name) == fmt


def test_infer_format_of_directories(tmp_path):
    save_hf(tmp_path, "saved", [{"text": "a"}])
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}])}).save_to_disk(str(tmp_path / "dict"))
    write(tmp_path, "docs/sub/a.md", "x")
    assert infer_format(tmp_path / SRC / "saved") == "hf"
    assert infer_format(tmp_path / "dict") == "hf"
    assert infer_format(tmp_path / SRC / "docs") == "text"


def test_infer_format_errors_name_path_and_formats(tmp_path):
    write(tmp_path, "a.xml", "x")
    message = str(pytest.raises(ReaderError, infer_format, tmp_path / SRC / "a.xml").value)
    assert message.startswith(f"{tmp_path / SRC / 'a.xml'}: cannot infer the format from the extension '.xml'")
    assert "jsonl" in message and "parquet" in message and "hf" in message
    (tmp_path / "empty").mkdir()
    message = str(pytest.raises(ReaderError, infer_format, tmp_path / "empty").value)
    assert "empty: cannot infer the format of this directory" in message and "csv" in message
    assert str(pytest.raises(ReaderError, infer_format, tmp_path / "nope.jsonl").value).endswith(
        "nope.jsonl: not found"
    )


# ---------------------------------------------------------------------------------- text kind

TEXTS = [{"text": "first doc"}, {"text": "second doc"}]


def test_text_from_jsonl_with_ids_and_blank_lines(tmp_path):
    path = write(tmp_path, "t.jsonl", '{"text": "a", "id": 7}\n\n   \n{"text": "b"}\n{"text": "c", "id": "x"}\n')
    frame = read(tmp_path, path, "text")
    assert list(frame.columns) == ["id", "source", "split", "text"]
    assert all(str(dtype) == "str" for dtype in frame.dtypes)
    # An explicit id is kept (as str); the others are "<source>-<index>".
    assert frame.to_dict("records") == [
        {"id": "7", "source": "t.jsonl", "split": "auto", "text": "a"},
        {"id": "t.jsonl-1", "source": "t.jsonl", "split": "auto", "text": "b"},
        {"id": "x", "source": "t.jsonl", "split": "auto", "text": "c"},
    ]


def test_text_from_json_array_and_data_object(tmp_path):
    array = write(tmp_path, "a.json", json.dumps(TEXTS))
    wrapped = write(tmp_path, "w.json", json.dumps({"data": TEXTS, "version": 2}))
    assert read(tmp_path, array, "text")["text"].tolist() == ["first doc", "second doc"]
    assert read(tmp_path, wrapped, "text", name="wrapped")["id"].tolist() == ["wrapped-0", "wrapped-1"]


def test_text_from_parquet(tmp_path):
    path = parquet(tmp_path, "t.parquet", [{"text": "p1", "id": 10}, {"text": "p2", "id": 11}])
    frame = read(tmp_path, path, "text", split="test")
    assert frame[["id", "split", "text"]].values.tolist() == [["10", "test", "p1"], ["11", "test", "p2"]]


def test_text_from_csv_and_tsv(tmp_path):
    csv_path = write(tmp_path, "t.csv", 'id,text\n1,plain\n2,"quoted, with comma\nand a newline"\n')
    tsv_path = write(tmp_path, "t.tsv", "text\tother\nfrom tsv\tx\n")
    assert read(tmp_path, csv_path, "text")["text"].tolist() == ["plain", "quoted, with comma\nand a newline"]
    assert read(tmp_path, tsv_path, "text")["text"].tolist() == ["from tsv"]


def test_text_from_text_file_splits_on_blank_lines(tmp_path):
    path = write(tmp_path, "t.txt", "Doc one,\nsecond line.\n\n\n\nDoc two.\r\n\r\nDoc three\n  \n")
    frame = read(tmp_path, path, "text")
    assert frame["text"].tolist() == ["Doc one,\nsecond line.", "Doc two.", "Doc three"]
    assert frame["id"].tolist() == ["t.txt-0", "t.txt-1", "t.txt-2"]


def test_text_from_directory_recursive_sorted(tmp_path):
    write(tmp_path, "docs/b.txt", "b1\n\nb2\n")
    write(tmp_path, "docs/a.md", "# a\n")
    write(tmp_path, "docs/sub/c.txt", "c\n")
    write(tmp_path, "docs/skip.csv", "text\nnot me\n")
    write(tmp_path, "docs/.hidden/d.txt", "hidden\n")
    frame = read(tmp_path, f"{SRC}/docs", "text")
    assert frame["text"].tolist() == ["# a", "b1", "b2", "c"]
    assert frame["source"].unique().tolist() == ["docs"]
    assert frame["id"].tolist() == ["docs-0", "docs-1", "docs-2", "docs-3"]


def test_text_from_hf_saved_dataset_and_dataset_dict(tmp_path):
    path = save_hf(tmp_path, "hf", TEXTS)
    assert read(tmp_path, path, "text")["text"].tolist() == ["first doc", "second doc"]
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(TEXTS), "test": datasets.Dataset.from_list([{"text": "held out"}])}
    )
    splits.save_to_disk(str(tmp_path / SRC / "hfdict"))
    frame = read(tmp_path, f"{SRC}/hfdict", "text", hf_split="test", split="test")
    assert frame["text"].tolist() == ["held out"] and frame["split"].tolist() == ["test"]
    assert error(tmp_path, f"{SRC}/hfdict", "text", hf_split="dev") == (
        f"{SRC}/hfdict: no split 'dev' (found: train, test; set hf_split)"
    )


def test_text_from_hf_load_dataset_on_a_plain_directory(tmp_path):
    parquet(tmp_path, "raw/train.parquet", [{"text": "loaded"}, {"text": "by datasets"}])
    frame = read(tmp_path, f"{SRC}/raw", "text", format="hf")
    assert frame["text"].tolist() == ["loaded", "by datasets"]
    message = error(tmp_path, f"{SRC}/missing", "text", format="hf")
    assert message.startswith(f"{SRC}/missing (not found locally): datasets.load_dataset failed (")


def test_columns_rename_before_validation(tmp_path):
    path = write(tmp_path, "r.jsonl", jsonl([{"body": "renamed", "uid": "u1", "text": "ignored"}]))
    frame = read(tmp_path, path, "text", columns={"text": "body", "id": "uid"})
    assert frame[["id", "text"]].values.tolist() == [["u1", "renamed"]]


def test_absolute_path_and_name(tmp_path):
    path = write(tmp_path, "t.jsonl", jsonl(TEXTS))
    frame = read(Path("/nonexistent-root"), str(tmp_path / path), "text", name="mine")
    assert frame["source"].tolist() == ["mine", "mine"]


def test_read_100k_jsonl_lines_fast(tmp_path):
    path = write(tmp_path, "big.jsonl", "".join(f'{{"text": "document number {i}"}}\n' for i in range(100_000)))
    started = time.perf_counter()
    frame = read(tmp_path, path, "text")
    elapsed = time.perf_counter() - started
    assert len(frame) == 100_000 and frame["text"].iloc[-1] == "document number 99999"
    assert elapsed < 3.0, f"100k JSONL records took {elapsed:.2f}s"


# ---------------------------------------------------------------------------------- chat kind


def test_chat_from_messages(tmp_path):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann", "tool_calls": None},  # OpenAI's name is kept, other keys are not
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "No."},
    ]
    path = write(tmp_path, "c.jsonl", jsonl([{"messages": conversation, "id": "c1"}]))
    frame = read(tmp_path, path, "chat")
    assert list(frame.columns) == ["id", "source", "split", "messages"]
    assert messages(frame) == [[{"role": m["role"], "content": m["content"], **({"name": m["name"]} if "name" in m else {})} for m in conversation]]


def test_chat_from_prompt_completion_strings_and_lists(tmp_path):
    records = [
        {"prompt": "2+2?", "completion": "4"},
        {
            "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
            "completion": [{"role": "assistant", "content": "A"}],
        },
    ]
    frame = read(tmp_path, write(tmp_path, "pc.jsonl", jsonl(records)), "chat")
    assert messages(frame) == [chat("2+2?", "4"), [{"role": "system", "content": "S"}, *chat("Q", "A")]]


def test_chat_from_alpaca(tmp_path):
    records = [
        {"instruction": "Translate", "input": "bonjour", "output": "hello"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "No input field", "output": "ok"},
    ]
    frame = read(tmp_path, write(tmp_path, "alpaca.json", json.dumps(records)), "chat")
    assert messages(frame) == [
        chat("Translate\n\nbonjour", "hello"),
        chat("Say hi", "hi"),
        chat("No input field", "ok"),
    ]


def test_chat_from_parquet_json_csv_and_hf(tmp_path):
    rows = [{"messages": chat("q1", "a1")}, {"messages": chat("q2", "a2")}]
    expected = [chat("q1", "a1"), chat("q2", "a2")]
    assert messages(read(tmp_path, parquet(tmp_path, "c.parquet", rows), "chat")) == expected
    assert messages(read(tmp_path, save_hf(tmp_path, "chat_hf", rows), "chat")) == expected
    assert messages(read(tmp_path, write(tmp_path, "c.json", json.dumps(rows)), "chat")) == expected
    # CSV cells hold the list as JSON text; Alpaca columns also work.
    cell = json.dumps(chat("q1", "a1")).replace('"', '""')
    assert messages(read(tmp_path, write(tmp_path, "c.csv", f'messages\n"{cell}"\n'), "chat")) == [chat("q1", "a1")]
    alpaca = write(tmp_path, "a.csv", "instruction,input,output\nDo it,,done\nAdd,1 2,3\n")
    assert messages(read(tmp_path, alpaca, "chat")) == [chat("Do it", "done"), chat("Add\n\n1 2", "3")]


def test_chat_from_sharegpt_with_roles_mapped_and_the_system_turn_first(tmp_path):
    records = [
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Where?"}, {"from": "gpt", "value": "Here."},
                           {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]},
        {"id": "x", "conversations": [{"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}]},
    ]
    frame = read(tmp_path, save_hf(tmp_path, "sharegpt", records), "chat")  # HF datasets hold them as arrays
    assert messages(frame) == [
        [{"role": "system", "content": "Be brief."}, *chat("Where?", "Here."), *chat("Sure?", "Yes.")],
        chat("q", "a"),
    ]
    bad = write(tmp_path, "s.jsonl", jsonl([{"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]}]))
    assert error(tmp_path, bad, "chat") == "data/sources/s.jsonl:1: unknown speaker 'from': 'robot' (expected human, gpt, system, function_call or observation) in conversations[1]"
    late = write(tmp_path, "l.jsonl", jsonl([{"conversations": [{"from": "human", "value": "q"}, {"from": "system", "value": "s"}, {"from": "gpt", "value": "a"}]}]))
    assert error(tmp_path, late, "chat") == "data/sources/l.jsonl:1: a system message may only come first in conversations[1]"


def test_chat_from_dolly_joins_a_non_empty_context(tmp_path):
    records = [
        {"instruction": "Summarise.", "context": "A long text.", "response": "Short.", "category": "summarization"},
        {"instruction": "Say hi.", "context": "", "response": "Hi.", "category": "open_qa"},
    ]
    frame = read(tmp_path, write(tmp_path, "dolly.jsonl", jsonl(records)), "chat")
    assert messages(frame) == [chat("Summarise.\n\nA long text.", "Short."), chat("Say hi.", "Hi.")]


def test_openai_messages_keep_weight_zero_turns_and_names(tmp_path):
    record = {"messages": [
        {"role": "user", "content": "1 + 2?", "name": "ann"}, {"role": "assistant", "content": "4", "weight": 0},
        {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "3", "weight": 1},
    ]}
    (kept,) = messages(read(tmp_path, write(tmp_path, "o.jsonl", jsonl([record])), "chat"))
    assert kept == [{"role": "user", "content": "1 + 2?", "name": "ann"}, {"role": "assistant", "content": "4", "weight": 0},
                    {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "3"}]
    on_user = write(tmp_path, "u.jsonl", jsonl([{"messages": [{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "a"}]}]))
    assert error(tmp_path, on_user, "chat") == "data/sources/u.jsonl:1: 'weight' must be 0 or 1 on an assistant message, got 0 on a user message in messages[0]"
    nothing = write(tmp_path, "n.jsonl", jsonl([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]}]))
    assert error(tmp_path, nothing, "chat") == "data/sources/n.jsonl:1: every assistant message has weight 0 (nothing to train on)"


def test_numpy_message_arrays_become_plain_lists():
    array = np.array([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], dtype=object)
    assert layouts._message_list(array, "messages") == chat("q", "a")


# ---------------------------------------------------------------------------- preference kind


def test_preference_from_strings(tmp_path):
    records = [
        {"prompt": "Q1", "chosen": "good", "rejected": "bad"},
        {"prompt": "Q2", "chosen": "", "rejected": "bad"},  # not a reader error: prepare_data drops it
        {"prompt": "Q3", "chosen": "same", "rejected": "same"},  # likewise
    ]
    frame = read(tmp_path, write(tmp_path, "p.jsonl", jsonl(records)), "preference")
    assert list(frame.columns) == ["id", "source", "split", "prompt", "chosen", "rejected"]
    assert json.loads(frame["prompt"].iloc[0]) == [{"role": "user", "content": "Q1"}]
    assert frame[["chosen", "rejected"]].values.tolist() == [["good", "bad"], ["", "bad"], ["same", "same"]]


def test_preference_conversational(tmp_path):
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    records = [
        {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": "yes"}],
            "rejected": [{"role": "assistant", "content": "no"}],
        },
        # The prompt repeated before the answer (as in UltraFeedback binarized) is removed.
        {
            "prompt": "Q",
            "chosen": chat("Q", "long answer"),
            "rejected": chat("Q", "short"),
        },
    ]
    frame = read(tmp_path, write(tmp_path, "p.jsonl", jsonl(records)), "preference")
    assert [json.loads(p) for p in frame["prompt"]] == [prompt, [{"role": "user", "content": "Q"}]]
    assert frame[["chosen", "rejected"]].values.tolist() == [["yes", "no"], ["long answer", "short"]]


HH = "\n\nHuman: Where is Pelora?\n\nAssistant: In the north.\n\nHuman: Sure?\n\nAssistant: "


def test_preference_from_hh_rlhf_transcripts_shares_the_prefix_as_prompt(tmp_path):
    frame = read(tmp_path, write(tmp_path, "hh.jsonl", jsonl([{"chosen": HH + "Yes, by the river.", "rejected": HH + "No idea."}])), "preference")
    assert json.loads(frame["prompt"].iloc[0]) == [*chat("Where is Pelora?", "In the north."), {"role": "user", "content": "Sure?"}]
    assert frame[["chosen", "rejected"]].values.tolist() == [["Yes, by the river.", "No idea."]]


def test_preference_with_an_implicit_prompt_trl_layout(tmp_path):
    system = {"role": "system", "content": "S"}
    record = {"chosen": [system, *chat("Q", "good")], "rejected": [system, *chat("Q", "bad")]}
    frame = read(tmp_path, write(tmp_path, "t.jsonl", jsonl([record])), "preference")
    assert json.loads(frame["prompt"].iloc[0]) == [system, {"role": "user", "content": "Q"}]
    assert frame[["chosen", "rejected"]].values.tolist() == [["good", "bad"]]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"chosen": HH + "Yes.", "rejected": HH.replace("north", "south") + "No."},
         "'chosen' and 'rejected' have different prompts: they differ at turn 2 (an implicit-prompt pair shares every turn but the final answer)"),
        ({"chosen": HH + "Yes.\n\nHuman: Thanks!", "rejected": HH + "No."}, "'chosen' must end with an assistant turn, the answer (it ends with user)"),
        ({"chosen": "Yes.", "rejected": "No."}, "'chosen' is not a transcript of '\\n\\nHuman:' / '\\n\\nAssistant:' turns (HH-RLHF layout)"),
        ({"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}, "'prompt' is an empty message list"),
        ({"chosen": chat("Q", "a"), "rejected": chat("Other", "b")},
         "'chosen' and 'rejected' have different prompts: they differ at turn 1 (an implicit-prompt pair shares every turn but the final answer)"),
    ],
)
def test_bad_implicit_prompt_pairs_name_the_line_and_the_problem(tmp_path, record, message):
    path = write(tmp_path, "p.jsonl", jsonl([{"chosen": HH + "a", "rejected": HH + "b"}, record]))
    assert error(tmp_path, path, "preference") == f"data/sources/p.jsonl:2: {message}"


def test_preference_from_parquet_csv_json_and_hf(tmp_path):
    rows = [{"prompt": "Q", "chosen": "c", "rejected": "r"}]
    conversational = [
        {
            "prompt": [{"role": "user", "content": "Q"}],
            "chosen": [{"role": "assistant", "content": "c"}],
            "rejected": "r",
        }
    ]
    sources = [
        parquet(tmp_path, "p.parquet", rows),
        parquet(tmp_path, "conv.parquet", conversational),
        write(tmp_path, "p.csv", "prompt,chosen,rejected\nQ,c,r\n"),
        write(tmp_path, "p.json", json.dumps(rows)),
        save_hf(tmp_path, "p_hf", rows),
        save_hf(tmp_path, "conv_hf", conversational),
    ]
    for path in sources:
        frame = read(tmp_path, path, "preference")
        assert frame[["prompt", "chosen", "rejected"]].values.tolist() == [
            [json.dumps([{"role": "user", "content": "Q"}]), "c", "r"]
        ], path


# ------------------------------------------------------------------------------------- errors


def test_error_malformed_jsonl_line(tmp_path):
    lines = ['{"text": "ok"}'] * 16 + ['{"id": "a", "text": 1 2}']
    path = write(tmp_path, "x.jsonl", "\n".join(lines) + "\n")
    assert (
        error(tmp_path, path, "text") == "data/sources/x.jsonl:17: invalid JSON (Expecting ',' delimiter at column 23)"
    )


def test_error_jsonl_line_not_an_object(tmp_path):
    path = write(tmp_path, "x.jsonl", '{"text": "ok"}\n' * 16 + "[1, 2]\n")
    assert error(tmp_path, path, "text") == "data/sources/x.jsonl:17: expected a JSON object, got list"


def test_error_missing_column(tmp_path):
    path = write(tmp_path, "x.csv", "a,b\n1,2\n")
    assert error(tmp_path, path, "text") == (
        "data/sources/x.csv: missing column 'text' required for kind 'text' (found: a, b; map yours with columns: {text: <name>})"
    )
    assert error(tmp_path, parquet(tmp_path, "x.parquet", [{"prompt": "q", "chosen": "c"}]), "preference") == (
        "data/sources/x.parquet: missing column 'rejected' required for kind 'preference' "
        "(found: prompt, chosen; map yours with columns: {rejected: <name>}; kind 'preference' also accepts chosen_messages + rejected_messages)"
    )
    # A mapped column that is not there is named as such.
    assert error(tmp_path, path, "text", columns={"text": "body"}) == (
        "data/sources/x.csv: missing column 'body' (mapped to 'text' by columns) required for kind 'text' (found: a, b)"
    )


def test_error_missing_field_in_jsonl_names_the_line(tmp_path):
    path = write(tmp_path, "x.jsonl", jsonl([{"text": "a"}, {"body": "b"}]))
    assert error(tmp_path, path, "text") == (
        "data/sources/x.jsonl:2: missing field 'text' required for kind 'text' (found: body; map yours with columns: {text: <name>})"
    )
    chat_path = write(tmp_path, "c.jsonl", jsonl([{"question": "q"}]))
    assert error(tmp_path, chat_path, "chat") == (
        "data/sources/c.jsonl:1: missing field 'messages' required for kind 'chat' (found: question; map yours with "
        "columns: {messages: <name>}; kind 'chat' also accepts conversations or prompt + completion or "
        "instruction + output or instruction + response)"
    )
    half = write(tmp_path, "h.jsonl", jsonl([{"prompt": "q"}]))
    assert "h.jsonl:1: missing field 'completion' required for kind 'chat'" in error(tmp_path, half, "chat")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("e.jsonl", ""),
        ("e.jsonl", "  \n\n \t\n"),
        ("e.json", "[]"),
        ("e.json", ""),
        ("e.csv", ""),
        ("e.csv", "text,id\n"),
        ("e.txt", "\n\n  \n"),
    ],
)
def test_error_empty_source(tmp_path, name, content):
    path = write(tmp_path, name, content)
    assert error(tmp_path, path, "text") == f"data/sources/{name}: no records (empty source)"


def test_error_empty_parquet_and_text_directory(tmp_path):
    path = parquet(tmp_path, "e.parquet", [{"text": "x"}])
    pd.read_parquet(tmp_path / path).iloc[:0].to_parquet(tmp_path / path)
    assert error(tmp_path, path, "text") == "data/sources/e.parquet: no records (empty source)"
    (tmp_path / SRC / "nodocs").mkdir()
    assert error(tmp_path, f"{SRC}/nodocs", "text", format="text") == "data/sources/nodocs: no records (empty source)"


def test_error_not_utf8(tmp_path):
    path = write(tmp_path, "x.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": "\xff"}\n')
    assert error(tmp_path, path, "text") == (
        "data/sources/x.jsonl:3: not valid UTF-8 (byte 0xff at position 10); re-encode the file as UTF-8"
    )
    text = write(tmp_path, "x.txt", b"fine\n\nstill fine\n\x80 here\n")
    assert error(tmp_path, text, "text").startswith("data/sources/x.txt:4: not valid UTF-8 (byte 0x80 at position 0)")


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    path = write(tmp_path, "bom.csv", "\ufefftext\nhello\n")
    assert read(tmp_path, path, "text")["text"].tolist() == ["hello"]


def test_error_not_found(tmp_path):
    assert error(tmp_path, "data/sources/x.jsonl", "text") == "data/sources/x.jsonl: not found"
    assert error(tmp_path, "data/sources/x.jsonl", "text", format="jsonl") == "data/sources/x.jsonl: not found"


def test_error_unreadable_parquet(tmp_path):
    path = write(tmp_path, "x.parquet", b"this is not parquet")
    assert error(tmp_path, path, "text").startswith("data/sources/x.parquet: not a readable Parquet file (")


def test_error_wrong_type_names_field_and_type(tmp_path):
    path = write(tmp_path, "x.jsonl", jsonl([{"text": "a"}, {"text": 42}]))
    assert error(tmp_path, path, "text") == "data/sources/x.jsonl:2: 'text' must be a string, got int"
    nulls = parquet(tmp_path, "n.parquet", [{"text": "a"}, {"text": None}])
    assert error(tmp_path, nulls, "text") == "data/sources/n.parquet: record 1: 'text' must be a string, got null"
    alpaca = write(tmp_path, "a.jsonl", jsonl([{"instruction": "i", "input": 3, "output": "o"}]))
    assert error(tmp_path, alpaca, "chat") == "data/sources/a.jsonl:1: 'input' must be a string, got int"
    pref = write(tmp_path, "p.jsonl", jsonl([{"prompt": 1, "chosen": "c", "rejected": "r"}]))
    assert error(tmp_path, pref, "preference") == (
        "data/sources/p.jsonl:1: 'prompt' must be a string or a list of {role, content} messages, got int"
    )


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
            "unknown role 'bot' (expected system, user, assistant or tool) in messages[1]",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}]},
            "no assistant message (a chat needs at least one assistant turn)",
        ),
        ({"messages": []}, "no assistant message (a chat needs at least one assistant turn)"),
        (
            {"messages": [{"role": "user", "content": ["q"]}, {"role": "assistant", "content": "a"}]},
            "expected a content part {type, ...}, got str in messages[0], content part 0",
        ),
        (
            {"messages": [*chat("q", "a"), {"role": "system", "content": "late"}]},
            "a system message may only come first in messages[2]",
        ),
        ({"messages": [{"content": "q"}]}, "missing 'role' in messages[0]"),
        ({"messages": ["q"]}, "expected a {role, content} object, got str in messages[0]"),
        ({"messages": 5}, "'messages' must be a string or a list of {role, content} messages, got int"),
        ({"messages": "not json"}, "'messages' must be a list of {role, content} messages (or its JSON text), got str"),
        (
            {"prompt": "q", "completion": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
            "a system message may only come first (found at position 1 of the chat)",
        ),
    ],
)
def test_error_invalid_chat(tmp_path, record, expected):
    path = write(tmp_path, "x.jsonl", jsonl([{"messages": chat("fine", "ok")}] * 4 + [record]))
    assert error(tmp_path, path, "chat") == f"data/sources/x.jsonl:5: {expected}"


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (
            {"prompt": chat("q", "a"), "chosen": "c", "rejected": "r"},
            "'prompt' must end with a user message, got assistant",
        ),
        ({"prompt": [], "chosen": "c", "rejected": "r"}, "'prompt' is an empty message list"),
        (
            {"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}] * 2, "rejected": "r"},
            "'chosen' as a list must be a single assistant message, got 2 (assistant, assistant)",
        ),
        (
            {"prompt": "q", "chosen": "c", "rejected": [{"role": "user", "content": "r"}]},
            "'rejected' as a list must be a single assistant message, got 1 (user)",
        ),
        (
            {"prompt": "q", "chosen": None, "rejected": "r"},
            "'chosen' must be a string or a list of {role, content} messages, got null",
        ),
    ],
)
def test_error_invalid_preference(tmp_path, record, expected):
    path = write(tmp_path, "p.jsonl", jsonl([record]))
    assert error(tmp_path, path, "preference") == f"data/sources/p.jsonl:1: {expected}"


def test_error_duplicate_id(tmp_path):
    path = write(tmp_path, "x.jsonl", jsonl([{"text": "a", "id": "k"}, {"text": "b"}, {"text": "c", "id": "k"}]))
    assert error(tmp_path, path, "text") == "data/sources/x.jsonl:3: duplicate id 'k' (first at data/sources/x.jsonl:1)"
    # CSV: the header is line 1, so row r is line r + 1.
    csv_path = write(tmp_path, "x.csv", "id,text\n1,a\n2,b\n1,c\n")
    assert error(tmp_path, csv_path, "text") == "data/sources/x.csv:4: duplicate id '1' (first at data/sources/x.csv:2)"


def test_error_csv_lines_count_multiline_fields(tmp_path):
    path = write(tmp_path, "x.csv", 'text,n\n"two\nlines",1\nok,2\nbad\n')
    assert error(tmp_path, path, "text") == "data/sources/x.csv:5: expected 2 fields like the header, got 1"


def test_error_json_file(tmp_path):
    broken = write(tmp_path, "b.json", '[\n  {"text": "a"},\n  {"text": }\n]')
    assert error(tmp_path, broken, "text") == "data/sources/b.json:3: invalid JSON (Expecting value at column 12)"
    scalar = write(tmp_path, "s.json", '{"rows": []}')
    assert (
        error(tmp_path, scalar, "text")
        == 'data/sources/s.json: expected an array of objects or {"data": [...]}, got dict'
    )
    item = write(tmp_path, "i.json", '[{"text": "a"}, "b"]')
    assert error(tmp_path, item, "text") == "data/sources/i.json: record 1: expected a JSON object, got str"


def test_error_text_format_needs_text_kind(tmp_path):
    path = write(tmp_path, "t.txt", "hello\n")
    assert (
        error(tmp_path, path, "chat")
        == "data/sources/t.txt: format 'text' holds plain documents, so it needs kind 'text' (got 'chat')"
    )


def test_error_directory_given_as_file_format(tmp_path):
    (tmp_path / SRC / "dir.jsonl").mkdir(parents=True)
    assert (
        error(tmp_path, f"{SRC}/dir.jsonl", "text", format="jsonl")
        == "data/sources/dir.jsonl: expected a file, got a directory"
    )
    assert "dir.jsonl: cannot infer the format of this directory" in error(tmp_path, f"{SRC}/dir.jsonl", "text")

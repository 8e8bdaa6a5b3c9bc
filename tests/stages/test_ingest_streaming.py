"""Streaming ingest (pipelines/ingest.py, pipelines/core/data/readers.py) at scale: the same records as
the whole-file reader gave, row groups written as records stream in, errors that still name the
line far into a big file, the duplicate-id check on 64-bit hashes, and memory that stays flat as
the input grows."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines import ingest
from pipelines.core.data import formats, readers
from pipelines.core.data.readers import COLUMNS, ReaderError, iter_source
from pipelines.core.params.data import IngestParams, SourceParams
from tests.conftest import REPO
from tests.core.data.test_readers import SRC, _hf_cache, write  # noqa: F401  (_hf_cache: an autouse fixture, active here too)


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def small_pieces(monkeypatch, chunk: int, rows: int) -> None:
    """Decode `chunk` bytes, convert `rows` Parquet/`datasets` rows and batch `rows` records at a
    time, so that small files cross every boundary."""
    monkeypatch.setattr(formats, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(formats, "SCAN_ROWS", rows)
    monkeypatch.setattr(readers, "BATCH_ROWS", rows)


def mixed_sources(root: Path) -> IngestParams:
    """Every format, with the awkward corners: a BOM, CRLF, whitespace-only lines (NBSP, form
    feed, U+2028), no final newline, quoted CSV line breaks, renamed columns."""
    notes = b"\xef\xbb\xbfOne,\r\ntwo.\r\n\r\nThree \xc2\xa0\n\xc2\xa0\n\x0c\n  \nfour\xe2\x80\xa8still four\n\xe2\x80\xa8\nfive\r\r\nno newline at the end"
    write(root, "docs/b.txt", "b1\n\nb2\n")
    write(root, "docs/a.md", "# a\n\n\n")
    write(root, "docs/sub/c.txt", "c\n")
    write(root, "docs/.hidden/d.txt", "hidden\n")
    (root / SRC).mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{"body": f"p{i}", "uid": 100 + i} for i in range(5)]).to_parquet(root / SRC / "t.parquet", index=False)
    turns = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    datasets.Dataset.from_list(turns).save_to_disk(str(root / SRC / "sharegpt"))
    hh = {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go away"}
    sources = [
        SourceParams(path=write(root, "notes.txt", notes), kind="text"),
        SourceParams(path=f"{SRC}/docs", kind="text"),
        SourceParams(
            path=write(root, "t.jsonl", '{"text": "a", "id": 7}\n\n   \n{"text": "b\\u2028c"}\r\n{"text": "d", "id": ""}\n{"text": "e", "id": "x"}'),
            kind="text",
        ),
        SourceParams(path=write(root, "t.csv", 'id,text\n1,plain\n2,"quoted, with comma\r\nand a newline"\r\n\n3,last\n'), kind="text", split="test"),
        SourceParams(path=write(root, "t.tsv", "\ufefftext\tother\nfrom tsv\tx\n"), kind="text"),
        SourceParams(path=write(root, "t.json", json.dumps({"data": [{"text": "j1", "id": 5}, {"text": "j2"}]})), kind="text"),
        SourceParams(path=f"{SRC}/t.parquet", kind="text", name="pq", columns={"text": "body", "id": "uid"}),
        SourceParams(path=f"{SRC}/sharegpt", kind="chat"),
        SourceParams(
            path=write(root, "held.jsonl", jsonl([{"id": f"h{i}", "prompt": f"Q{i}?", "completion": f"A{i}"} for i in range(2)])),
            kind="chat",
            split="test",
        ),
        SourceParams(path=write(root, "p.csv", "prompt,chosen,rejected\nQ,yes,no\nQ2,good,bad\n"), kind="preference"),
        SourceParams(path=write(root, "hh.jsonl", jsonl([hh])), kind="preference"),
        SourceParams(path=write(root, "k.csv", "prompt,completion,label\nQ,yes,true\nQ2,bad,False\n"), kind="feedback"),  # TRL's layout; CSV spells the label
    ]
    return IngestParams(sources=sources)


def chat(question: str, answer: str) -> str:
    return json.dumps([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])


# What the whole-file implementation (before streaming) wrote for `mixed_sources`.
EXPECTED = {
    "text": [
        ["notes.txt-0", "notes.txt", "auto", "One,\ntwo."],
        ["notes.txt-1", "notes.txt", "auto", "Three \xa0"],
        ["notes.txt-2", "notes.txt", "auto", "four\u2028still four"],
        ["notes.txt-3", "notes.txt", "auto", "five\r\nno newline at the end"],
        ["docs-0", "docs", "auto", "# a"],
        ["docs-1", "docs", "auto", "b1"],
        ["docs-2", "docs", "auto", "b2"],
        ["docs-3", "docs", "auto", "c"],
        ["7", "t.jsonl", "auto", "a"],
        ["t.jsonl-1", "t.jsonl", "auto", "b\u2028c"],
        ["t.jsonl-2", "t.jsonl", "auto", "d"],
        ["x", "t.jsonl", "auto", "e"],
        ["1", "t.csv", "test", "plain"],
        ["2", "t.csv", "test", "quoted, with comma\r\nand a newline"],
        ["3", "t.csv", "test", "last"],
        ["t.tsv-0", "t.tsv", "auto", "from tsv"],
        ["5", "t.json", "auto", "j1"],
        ["t.json-1", "t.json", "auto", "j2"],
        *[[str(100 + i), "pq", "auto", f"p{i}"] for i in range(5)],
    ],
    "chat": [
        *[[f"sharegpt-{i}", "sharegpt", "auto", chat(f"q{i}", f"a{i}")] for i in range(3)],
        *[[f"h{i}", "held.jsonl", "test", chat(f"Q{i}?", f"A{i}")] for i in range(2)],
    ],
    "preference": [
        ["p.csv-0", "p.csv", "auto", '[{"role": "user", "content": "Q"}]', "yes", "no"],
        ["p.csv-1", "p.csv", "auto", '[{"role": "user", "content": "Q2"}]', "good", "bad"],
        ["hh.jsonl-0", "hh.jsonl", "auto", '[{"role": "user", "content": "hi"}]', "hello", "go away"],
    ],
    "image_chat": [],  # (tests/core/data/test_image_records.py)
    "feedback": [
        ["k.csv-0", "k.csv", "auto", '[{"role": "user", "content": "Q"}]', "yes", "true"],
        ["k.csv-1", "k.csv", "auto", '[{"role": "user", "content": "Q2"}]', "bad", "false"],
    ],
}
EXPECTED_SOURCES = {
    "notes.txt": 4, "docs": 4, "t.jsonl": 4, "t.csv": 3, "t.tsv": 1, "t.json": 2, "pq": 5,
    "sharegpt": 3, "held.jsonl": 2, "p.csv": 2, "hh.jsonl": 1, "k.csv": 2,
}


def row_groups(path: Path) -> list[int]:
    metadata = pq.ParquetFile(path).metadata
    return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]


# ------------------------------------------------------------------------- same records as before


@pytest.mark.parametrize(("chunk", "rows"), [(None, None), (1, 1), (7, 2), (64, 3)])
def test_mixed_sources_give_the_records_of_the_whole_file_reader(tmp_path, monkeypatch, chunk, rows):
    params = mixed_sources(tmp_path)
    if chunk is not None:
        small_pieces(monkeypatch, chunk, rows)
    metrics = ingest.run(tmp_path, tmp_path / "out", params)
    assert metrics["records"] == {kind: len(records) for kind, records in EXPECTED.items()}
    assert {name: info["records"] for name, info in metrics["sources"].items()} == EXPECTED_SOURCES
    for kind, records in EXPECTED.items():
        path = tmp_path / "out" / f"{kind}.parquet"
        frame = pd.read_parquet(path)
        assert list(frame.columns) == list(COLUMNS[kind])
        assert all(str(dtype) == "str" for name, dtype in frame.dtypes.items() if name != "images")
        assert frame.values.tolist() == records, kind
        assert pq.ParquetFile(path).schema_arrow == readers.SCHEMAS[kind]
        if rows is not None and records:  # one row group per batch, a source's last one holds the rest
            assert sum(row_groups(path)) == len(records) and max(row_groups(path)) <= rows
            assert len(row_groups(path)) >= len(records) / rows


def test_same_input_same_bytes_whatever_the_chunk_size(tmp_path, monkeypatch):
    params = mixed_sources(tmp_path)
    ingest.run(tmp_path, tmp_path / "a", params)
    ingest.run(tmp_path, tmp_path / "b", params)
    monkeypatch.setattr(formats, "CHUNK_BYTES", 5)  # row groups depend on the records, never on how the file was read
    monkeypatch.setattr(formats, "SCAN_ROWS", 2)
    ingest.run(tmp_path, tmp_path / "c", params)
    for kind in COLUMNS:
        first = (tmp_path / "a" / f"{kind}.parquet").read_bytes()
        assert first == (tmp_path / "b" / f"{kind}.parquet").read_bytes() == (tmp_path / "c" / f"{kind}.parquet").read_bytes()
        assert str(tmp_path).encode() not in first


# ------------------------------------------------------------------------------- big sources


def test_a_source_bigger_than_a_row_group_streams_in_several(tmp_path):
    n = 2 * readers.BATCH_ROWS + 1000
    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(n)]
    docs = "".join(f"document {i}\nits second line\n\n" for i in range(n))
    params = IngestParams(
        sources=[
            SourceParams(path=write(tmp_path, "chats.jsonl", jsonl(chats)), kind="chat"),
            SourceParams(path=write(tmp_path, "docs.txt", docs), kind="text"),
            SourceParams(path=write(tmp_path, "more.txt", "last\n"), kind="text"),
        ]
    )
    assert ingest.run(tmp_path, tmp_path / "out", params)["records"] == {"text": n + 1, "chat": n, "preference": 0, "image_chat": 0, "feedback": 0}
    rest = n - 2 * readers.BATCH_ROWS
    assert row_groups(tmp_path / "out/chat.parquet") == [readers.BATCH_ROWS, readers.BATCH_ROWS, rest]
    assert row_groups(tmp_path / "out/text.parquet") == [readers.BATCH_ROWS, readers.BATCH_ROWS, rest, 1]
    assert row_groups(tmp_path / "out/preference.parquet") == []
    # A later stage reads them batch by batch, in source order.
    batches = list(pq.ParquetFile(tmp_path / "out/chat.parquet").iter_batches(batch_size=5000))
    assert [len(b) for b in batches] == [5000, 5000, 5000, n - 15000]
    ids = [i for batch in batches for i in batch.column("id").to_pylist()]
    assert ids == [f"c{i}" for i in range(n)]
    assert json.loads(batches[-1].column("messages")[-1].as_py())[1]["content"] == f"a{n - 1}"
    text = pq.read_table(tmp_path / "out/text.parquet")
    assert text.column("id").to_pylist() == [f"docs.txt-{i}" for i in range(n)] + ["more.txt-0"]
    assert text.column("text")[n - 1].as_py() == f"document {n - 1}\nits second line"


def test_a_batch_also_ends_at_batch_bytes_and_progress_counts_bytes(tmp_path):
    path = write(tmp_path, "long.jsonl", jsonl([{"text": "x" * 300}] * 10))
    batches = list(iter_source(SourceParams(path=path, kind="text"), tmp_path, batch_bytes=1000))
    assert [b.num_rows for b in batches] == [4, 4, 2]  # 1200 characters reach 1000: a record is never split
    assert all(b.schema == readers.SCHEMAS["text"] for b in batches)
    table = formats.READERS["jsonl"](tmp_path / path, path, SourceParams(path=path, kind="text"))
    assert table.progress.unit == "B" and table.progress.total == (tmp_path / path).stat().st_size
    assert len(list(table.rows)) == 10 and table.progress.done == table.progress.total


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_invalid_utf8_far_into_a_big_file_names_its_line(tmp_path, kind):
    bad_line = 50_001
    if kind == "text":
        lines = [f"line {i} of a document, long enough for the file to fill a few chunks" if i % 3 else "" for i in range(1, 60_000)]
    else:
        lines = [json.dumps({"text": f"line {i} of a document, long enough for the file to fill a few chunks"}) for i in range(1, 60_000)]
    content = ("\n".join(lines[: bad_line - 1]) + "\n").encode() + b'{"text": "caf\xe9"}\n' + "\n".join(lines[bad_line:]).encode()
    assert len(content) > 2 * formats.CHUNK_BYTES
    path = write(tmp_path, f"big.{'txt' if kind == 'text' else 'jsonl'}", content)
    with pytest.raises(ReaderError) as caught:
        ingest.run(tmp_path, tmp_path / "out", IngestParams(sources=[SourceParams(path=path, kind="text")]))
    assert str(caught.value) == f"{path}:{bad_line}: not valid UTF-8 (byte 0xe9 at position 13); re-encode the file as UTF-8"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("chunk", [1, 2, 4, 1 << 20])
def test_utf8_errors_and_the_byte_order_mark_whatever_the_chunk_size(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(formats, "CHUNK_BYTES", chunk)
    first = write(tmp_path, "first.txt", b"\xef\xbb\xbfab\xff\n")
    assert pytest.raises(ReaderError, readers.read_source, SourceParams(path=first, kind="text"), tmp_path).value.args[0] == (
        f"{first}:1: not valid UTF-8 (byte 0xff at position 2); re-encode the file as UTF-8"  # counted after the mark
    )
    split = write(tmp_path, "split.jsonl", '{"text": "ok"}\n{"text": "é"}\n'.encode()[:-4] + b'\n')  # é cut in half
    assert pytest.raises(ReaderError, readers.read_source, SourceParams(path=split, kind="text"), tmp_path).value.args[0] == (
        f"{split}:2: not valid UTF-8 (byte 0xc3 at position 10); re-encode the file as UTF-8"
    )
    good = write(tmp_path, "good.csv", "\ufefftext\n\"multi\nline \u00e9\"\n")
    assert readers.read_source(SourceParams(path=good, kind="text"), tmp_path)["text"].tolist() == ["multi\nline \u00e9"]


# ------------------------------------------------------------------------------ duplicate ids


def test_duplicate_ids_far_apart(tmp_path):
    n = 30_000
    records = [{"text": f"t{i}", "id": f"r{i}"} for i in range(n)]
    records[25_000]["id"] = "r3"
    path = write(tmp_path, "x.jsonl", jsonl(records))
    with pytest.raises(ReaderError, match=r"^data/sources/x\.jsonl:25001: duplicate id 'r3' \(first at data/sources/x\.jsonl:4\)$"):
        ingest.run(tmp_path, tmp_path / "out", IngestParams(sources=[SourceParams(path=path, kind="text")]))


def test_an_id_equal_to_a_made_up_one_is_a_duplicate_either_way(tmp_path):
    later = [{"text": f"t{i}"} for i in range(20_000)]
    later[19_000]["id"] = "y.jsonl-7"  # the id record 7 got for having none
    path = write(tmp_path, "y.jsonl", jsonl(later))
    with pytest.raises(ReaderError, match=r"^data/sources/y\.jsonl:19001: duplicate id 'y\.jsonl-7' \(first at data/sources/y\.jsonl:8\)$"):
        list(iter_source(SourceParams(path=path, kind="text"), tmp_path))
    earlier = [{"text": f"t{i}"} for i in range(20_000)]
    earlier[5]["id"] = "z.jsonl-15000"  # claims the id record 15000 will be given
    path = write(tmp_path, "z.jsonl", jsonl(earlier))
    with pytest.raises(ReaderError, match=r"^data/sources/z\.jsonl:15001: duplicate id 'z\.jsonl-15000' \(first at data/sources/z\.jsonl:6\)$"):
        list(iter_source(SourceParams(path=path, kind="text"), tmp_path))
    # Look-alikes are not duplicates: a leading zero, another name.
    fine = [{"text": "a", "id": "w.jsonl-01"}, {"text": "b"}, {"text": "c", "id": "other-1"}]
    path = write(tmp_path, "w.jsonl", jsonl(fine))
    assert readers.read_source(SourceParams(path=path, kind="text"), tmp_path)["id"].tolist() == ["w.jsonl-01", "w.jsonl-1", "other-1"]


def test_a_duplicate_before_a_bad_record_is_reported_first(tmp_path):
    path = write(tmp_path, "d.jsonl", jsonl([{"text": "a", "id": "k"}, {"text": "b", "id": "k"}, {"text": 3}]))
    with pytest.raises(ReaderError, match=r"d\.jsonl:2: duplicate id 'k' \(first at data/sources/d\.jsonl:1\)$"):
        list(iter_source(SourceParams(path=path, kind="text"), tmp_path))
    broken = write(tmp_path, "e.jsonl", jsonl([{"text": "a", "id": "k"}, {"text": "b", "id": "k"}]) + "{not json\n")
    with pytest.raises(ReaderError, match=r"e\.jsonl:2: duplicate id 'k'"):
        list(iter_source(SourceParams(path=broken, kind="text"), tmp_path))


def test_hash_collisions_without_a_duplicate_do_not_raise(tmp_path, monkeypatch):
    calls = []

    def colliding(ids: list[str]) -> np.ndarray:
        calls.append(len(ids))
        return np.zeros(len(ids), dtype=np.uint64)  # every id collides with every other

    monkeypatch.setattr(readers, "_id_hashes", colliding)
    monkeypatch.setattr(readers, "_number_hashes", lambda numbers: np.asarray(numbers, dtype=np.uint64) % np.uint64(3))
    monkeypatch.setattr(readers, "BATCH_ROWS", 7)
    records = [{"text": f"t{i}", **({"id": f"id{i}"} if i % 2 else {})} for i in range(40)]
    path = write(tmp_path, "c.jsonl", jsonl(records))
    frame = readers.read_source(SourceParams(path=path, kind="text"), tmp_path)
    assert frame["id"].tolist() == [f"id{i}" if i % 2 else f"c.jsonl-{i}" for i in range(40)]
    assert sum(calls) == 20  # the explicit ids were hashed (and collided), and the output is still all there
    # A real duplicate among the collisions is found at its true first occurrence.
    records[33]["id"] = "id21"
    path = write(tmp_path, "c.jsonl", jsonl(records))
    with pytest.raises(ReaderError, match=r"c\.jsonl:34: duplicate id 'id21' \(first at data/sources/c\.jsonl:22\)$"):
        readers.read_source(SourceParams(path=path, kind="text"), tmp_path)


def test_seen_ids_merge_runs_and_keep_8_bytes_an_id():
    seen = readers._SeenIds("s-", lambda index, record_id: None)
    for start in range(0, 100_000, 1000):
        seen.add([f"id{i}" for i in range(start, start + 1000)], start, list(range(1000)))
    assert sum(len(run) for run in seen.runs) == 100_000 and len(seen.runs) <= 8
    assert all(run.dtype == np.uint64 and (run[1:] >= run[:-1]).all() for run in seen.runs)


# ------------------------------------------------------------------------------------ memory

PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from pipelines import ingest
    from pipelines.core.params.data import IngestParams, SourceParams

    def peak_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024

    root, megabytes = Path(sys.argv[1]), int(sys.argv[2])
    block = "".join(f"paragraph {i}: some words of a document\\nand a second, longer line of it\\n\\n" for i in range(12_000))
    block = block.encode()[: 1 << 20]
    with open(root / "big.txt", "wb") as out:
        for _ in range(megabytes):
            out.write(block)
    before = peak_mb()
    metrics = ingest.run(root, root / "out", IngestParams(sources=[SourceParams(path="big.txt", kind="text")]))
    print(json.dumps({"growth_mb": peak_mb() - before, "records": metrics["records"]["text"]}))
    """
)


def peak_growth(tmp_path: Path, megabytes: int) -> dict:
    root = tmp_path / str(megabytes)
    root.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(root), str(megabytes)],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_peak_memory_does_not_grow_with_the_input(tmp_path):
    small, big = peak_growth(tmp_path, 5), peak_growth(tmp_path, 80)
    assert big["records"] > 15 * small["records"]
    # Reading whole, 75 MB more text held about 5 MB of memory a MB; streamed, the peak stays put
    # (the numbers of records only cost 8 bytes each, and none for plain text).
    assert big["growth_mb"] - small["growth_mb"] < 0.2 * 75, (small, big)
    assert big["growth_mb"] < 200, big


def test_arrow_batches_hold_plain_strings(tmp_path):
    path = write(tmp_path, "t.jsonl", jsonl([{"text": "a", "id": 1}, {"text": "b", "id": [1, 2]}]))
    (batch,) = iter_source(SourceParams(path=path, kind="text", split="test"), tmp_path)
    assert batch.schema == pa.schema([(name, pa.string()) for name in COLUMNS["text"]])
    assert batch.to_pylist() == [
        {"id": "1", "source": "t.jsonl", "split": "test", "text": "a"},
        {"id": "[1, 2]", "source": "t.jsonl", "split": "test", "text": "b"},
    ]

"""The `image_chat` record kind: readers (layouts, image paths and bytes, checks), ingest and prepare_data.

Images are tiny PNGs made with Pillow in tmp_path; nothing here needs torch.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from pydantic import ValidationError

from pipelines import ingest, prepare_data
from pipelines.core.data import images
from pipelines.core.data.readers import COLUMNS, IMAGES_TYPE, SCHEMAS, ReaderError, empty_frame, read_source
from pipelines.core.params.data import IngestParams, PrepareDataParams, SourceParams
from tests.core.data.test_readers import SRC, jsonl, write

SPLITS = ("train", "validation", "test")


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def png(width: int = 8, height: int = 8, value: int = 0, noise: bool = False) -> bytes:
    """A small grey PNG (`noise`: random pixels, so that the file is long enough to cut in its data)."""
    if noise:
        pixels = np.random.default_rng(value).integers(0, 256, (height, width), dtype=np.uint8)
        image = Image.fromarray(pixels, mode="L")
    else:
        image = Image.new("L", (width, height), color=value)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def read(root: Path, path: str, **options) -> pd.DataFrame:
    return read_source(SourceParams(path=path, kind="image_chat", **options), root)


def error(root: Path, path: str, **options) -> str:
    with pytest.raises(ReaderError) as caught:
        read(root, path, **options)
    return str(caught.value)


# ------------------------------------------------------------------------------------ readers


def test_jsonl_with_relative_and_absolute_paths_keeps_the_file_bytes(tmp_path):
    seven, one = png(8, 8, 70), png(10, 6, 10)
    write(tmp_path, "images/0007.png", seven)
    write(tmp_path, "images/0001.png", one)
    elsewhere = tmp_path / "elsewhere" / "one.png"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(one)
    records = [
        {"messages": chat("<image>Which digit is this?", "7"), "images": ["images/0007.png"]},
        {"id": "two", "messages": chat("<image> and <image>: which is larger?", "7"), "images": ["images/0007.png", str(elsewhere)]},
        {"messages": chat("No image here.", "Fine."), "images": []},
    ]
    frame = read(tmp_path, write(tmp_path, "digits.jsonl", jsonl(records)))
    assert list(frame.columns) == list(COLUMNS["image_chat"])
    assert frame["id"].tolist() == ["digits.jsonl-0", "two", "digits.jsonl-2"]
    assert [json.loads(m) for m in frame["messages"]] == [r["messages"] for r in records]
    assert frame["images"].tolist() == [[seven], [seven, one], []]  # the files' bytes, not re-encoded


def test_sharegpt_conversations_with_images(tmp_path):
    write(tmp_path, "img/a.png", png(value=1))
    record = {
        "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A square."}],
        "images": ["img/a.png"],
    }
    frame = read(tmp_path, write(tmp_path, "sharegpt.json", json.dumps([record])))
    assert json.loads(frame["messages"].iloc[0]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image>\nWhat is it?"},
        {"role": "assistant", "content": "A square."},
    ]
    assert frame["images"].iloc[0] == [png(value=1)]


def test_parquet_with_datasets_style_bytes_and_path_dicts(tmp_path):
    given, on_disk = png(value=5), png(value=9)
    write(tmp_path, "pq/images/disk.png", on_disk)
    rows = pd.DataFrame({
        "messages": [json.dumps(chat("<image>a?", "a")), json.dumps(chat("<image>b?", "b")), json.dumps(chat("<image>c?", "c"))],
        "images": [
            [{"bytes": given, "path": "not/there.png"}],  # bytes win over the path
            [{"bytes": None, "path": "images/disk.png"}],  # no bytes: the path, from the source's folder
            [{"bytes": given, "path": None}],
        ],
    })
    path = tmp_path / SRC / "pq/chats.parquet"
    rows.to_parquet(path, index=False)
    frame = read(tmp_path, f"{SRC}/pq/chats.parquet")
    assert frame["images"].tolist() == [[given], [on_disk], [given]]


def test_raw_bytes_in_parquet_and_an_hf_image_feature(tmp_path):
    data = png(6, 7, 3)
    raw = tmp_path / SRC / "raw.parquet"
    raw.parent.mkdir(parents=True)
    pq.write_table(pa.table({"messages": [json.dumps(chat("<image>?", "x"))], "images": pa.array([[data]], IMAGES_TYPE)}), raw)
    assert read(tmp_path, f"{SRC}/raw.parquet")["images"].tolist() == [[data]]
    features = datasets.Features({"messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
                                  "images": datasets.List(datasets.Image())})  # fmt: skip
    saved = datasets.Dataset.from_dict({"messages": [chat("<image>?", "x")], "images": [[{"bytes": data, "path": None}]]}, features=features)
    saved.save_to_disk(str(tmp_path / SRC / "hf"))
    frame = read(tmp_path, f"{SRC}/hf", format="hf")
    assert frame["images"].tolist() == [[data]] and json.loads(frame["messages"].iloc[0]) == chat("<image>?", "x")


def test_the_arrow_type_and_the_empty_frame():
    assert SCHEMAS["image_chat"].field("images").type == pa.list_(pa.binary())
    assert all(SCHEMAS["image_chat"].field(c).type == pa.string() for c in COLUMNS["image_chat"][:-1])
    empty = empty_frame("image_chat")
    assert list(empty.columns) == list(COLUMNS["image_chat"]) and str(empty["images"].dtype) == "object"
    assert all(str(empty[c].dtype) == "str" for c in COLUMNS["image_chat"][:-1])


def bad_source(root: Path, record: dict, **files: bytes) -> str:
    """A JSONL source whose line 2 is `record` (line 1 is a good image chat)."""
    write(root, "images/good.png", png())
    for name, content in files.items():
        write(root, f"images/{name}", content)
    good = {"messages": chat("<image>ok?", "ok"), "images": ["images/good.png"]}
    return write(root, "bad.jsonl", jsonl([good, record]))


def test_error_missing_image_file(tmp_path):
    path = bad_source(tmp_path, {"messages": chat("<image>?", "x"), "images": ["images/missing.png"]})
    assert error(tmp_path, path) == (
        "data/sources/bad.jsonl:2: images[0] 'images/missing.png': image file not found "
        "(looked for data/sources/images/missing.png; a relative path is relative to the source's folder)"
    )


def test_error_a_file_that_is_not_an_image(tmp_path):
    path = bad_source(tmp_path, {"messages": chat("<image>?", "x"), "images": ["images/notes.png"]}, **{"notes.png": b"just some text\n"})
    assert error(tmp_path, path) == (
        "data/sources/bad.jsonl:2: images[0] 'images/notes.png': not an image Pillow can read "
        "(expected PNG, JPEG, GIF, BMP, TIFF or WebP)"
    )


def test_error_a_truncated_png(tmp_path):
    whole = png(32, 32, noise=True)
    path = bad_source(tmp_path, {"messages": chat("<image>?", "x"), "images": ["images/cut.png"]}, **{"cut.png": whole[: len(whole) // 2]})
    message = error(tmp_path, path)
    assert message.startswith("data/sources/bad.jsonl:2: images[0] 'images/cut.png': cannot decode the PNG image (")
    assert "truncated" in message


def test_error_placeholders_and_images_differ_in_number(tmp_path):
    record = {"messages": chat("<image> and <image>?", "x"), "images": ["images/good.png"]}
    assert error(tmp_path, bad_source(tmp_path, record)) == (
        "data/sources/bad.jsonl:2: 2 <image> placeholders in the user turns but 1 image in 'images' "
        "(each image needs one <image> where it goes, in order)"
    )
    record = {"messages": chat("no tag", "x"), "images": ["images/good.png"]}
    assert error(tmp_path, bad_source(tmp_path, record)).startswith(
        "data/sources/bad.jsonl:2: 0 <image> placeholders in the user turns but 1 image in 'images'"
    )


def test_error_placeholder_in_an_assistant_turn(tmp_path):
    record = {"messages": chat("<image>?", "look: <image>"), "images": ["images/good.png"]}
    assert error(tmp_path, bad_source(tmp_path, record)) == (
        "data/sources/bad.jsonl:2: <image> in messages[1], whose role is assistant: images go in user turns only"
    )


def test_error_bad_images_values_and_record_index(tmp_path):
    path = bad_source(tmp_path, {"messages": chat("<image>?", "x"), "images": "images/good.png"})
    assert error(tmp_path, path) == (
        "data/sources/bad.jsonl:2: 'images' must be a list of image paths, bytes or {bytes, path} objects, got str"
    )
    path = bad_source(tmp_path, {"messages": chat("<image>?", "x"), "images": [7]})
    assert error(tmp_path, path) == "data/sources/bad.jsonl:2: images[0] must be an image path, bytes or a {bytes, path} object, got int"
    # JSON names the 0-based record index; without `images` (and no image parts) an <image> has no image
    path = write(tmp_path, "r.json", json.dumps([{"messages": chat("<image>?", "x"), "images": ["images/good.png"]}, {"messages": chat("<image>q", "a")}]))
    assert error(tmp_path, path) == (
        "data/sources/r.json: record 1: 1 <image> placeholder in the user turns but 0 images in 'images' "
        "(each image needs one <image> where it goes, in order)"
    )


def test_a_heldout_image_chat_must_end_with_an_assistant_turn(tmp_path):
    write(tmp_path, "images/good.png", png())
    record = {"messages": [*chat("<image>?", "x"), {"role": "user", "content": "and?"}], "images": ["images/good.png"]}
    path = write(tmp_path, "held.jsonl", jsonl([record]))
    assert error(tmp_path, path, split="test") == (
        "data/sources/held.jsonl:1: a held-out chat (split: test) must end with an assistant turn, the reference "
        "answer that evaluate scores (this one ends with a user turn)"
    )
    assert len(read(tmp_path, path)) == 1  # fine for training


def test_image_helpers():
    data = png(5, 3, 200)
    image = images.open_image(data)
    assert image.size == (5, 3) and image.getpixel((0, 0)) == 200
    assert images.check_image(data) == images.image_size(data) == (5, 3)
    assert images.sha256_hex(data) == images.sha256_hex(bytes(data)) != images.sha256_hex(png(5, 3, 201))
    messages = [{"role": "user", "content": "<image><image>x"}, {"role": "assistant", "content": "y"}]
    assert images.count_placeholders(messages) == images.count_placeholders(json.dumps(messages)) == 2
    with pytest.raises(images.ImageError, match="not an image Pillow can read"):
        images.open_image(b"GIF89a nope")


def test_image_side_params_are_checked():
    with pytest.raises(ValidationError, match=r"image_min_side \(10\) must not exceed image_max_side \(9\)"):
        PrepareDataParams(image_min_side=10, image_max_side=9)


# ------------------------------------------------------------------------ ingest, prepare_data


def test_ingest_writes_image_chat_parquet_as_list_of_binary(tmp_path):
    seven = png(8, 8, 7)
    write(tmp_path, "images/7.png", seven)
    source = SourceParams(path=write(tmp_path, "digits.jsonl", jsonl([{"messages": chat("<image>?", "7"), "images": ["images/7.png"]}])), kind="image_chat")
    metrics = ingest.run(tmp_path, tmp_path / "out", IngestParams(sources=[source]), progress=False)
    assert metrics["records"] == {"text": 0, "chat": 0, "preference": 0, "image_chat": 1, "feedback": 0}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{kind}.parquet" for kind in sorted(COLUMNS)]
    table = pq.read_table(tmp_path / "out/image_chat.parquet")
    assert table.schema == SCHEMAS["image_chat"] and table.schema.field("images").type == pa.list_(pa.binary())
    assert table.column("images").to_pylist() == [[seven]]
    # Without an image_chat source the file is there, empty, with the type.
    text = SourceParams(path=write(tmp_path, "t.jsonl", jsonl([{"text": "x"}])), kind="text")
    ingest.run(tmp_path, tmp_path / "only-text", IngestParams(sources=[text]), progress=False)
    empty = pq.read_table(tmp_path / "only-text/image_chat.parquet")
    assert empty.num_rows == 0 and empty.schema == SCHEMAS["image_chat"]


def image_project(root: Path) -> IngestParams:
    """Image chats that exercise every image_chat rule of prepare_data (side limits 4 to 64)."""
    seven, other = png(8, 8, 7), png(8, 8, 8)
    write(root, "images/seven.png", seven)
    write(root, "images/seven-copy.png", seven)  # the same bytes under another name
    write(root, "images/other.png", other)
    write(root, "images/tiny.png", png(3, 8))
    write(root, "images/wide.png", png(65, 8))
    question = "<image>Which  digit is this?"  # normalised to one space
    records = [
        {"id": "kept", "messages": chat(question, "7"), "images": ["images/seven.png"]},
        {"id": "duplicate", "messages": chat(question, "7"), "images": ["images/seven-copy.png"]},
        {"id": "other-image", "messages": chat(question, "7"), "images": ["images/other.png"]},
        {"id": "tiny", "messages": chat(question, "7"), "images": ["images/tiny.png"]},
        {"id": "wide", "messages": chat(question, "7"), "images": ["images/wide.png"]},
    ]
    held = [{"id": "held", "messages": chat("<image>And this one?", "8"), "images": ["images/other.png"]}]
    return IngestParams(sources=[
        SourceParams(path=write(root, "digits.jsonl", jsonl(records)), kind="image_chat"),
        SourceParams(path=write(root, "digits_heldout.jsonl", jsonl(held)), kind="image_chat", split="test"),
    ])  # fmt: skip


def prepare(root: Path) -> dict:
    ingest.run(root, root / "data/ingested", image_project(root), progress=False)
    params = PrepareDataParams(min_chars=2, max_chars=1000, validation_fraction=0.0, image_min_side=4, image_max_side=64)
    return prepare_data.run(root / "data/ingested", root / "data/prepared", params)


def test_prepare_data_drops_by_image_size_and_dedups_by_image_hash(tmp_path):
    metrics = prepare(tmp_path)
    assert metrics["image_chat"] == {
        "in": 6,
        "dropped": {**dict.fromkeys(prepare_data.REASONS, 0), "image_size": 2, "duplicate": 1},
        "out": {"train": 2, "validation": 0, "test": 1},
    }
    out = tmp_path / "data/prepared/image_chat"
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{split}.parquet" for split in SPLITS)
    train = pq.read_table(out / "train.parquet")
    assert train.schema == SCHEMAS["image_chat"]
    # Same text and same image bytes is a duplicate (under any file name); another image is not.
    assert train.column("id").to_pylist() == ["kept", "other-image"]
    assert train.column("images").to_pylist() == [[png(8, 8, 7)], [png(8, 8, 8)]]  # unchanged bytes
    assert json.loads(train.column("messages")[0].as_py())[0] == {"role": "user", "content": "<image>Which digit is this?"}
    test = pq.read_table(out / "test.parquet")
    assert test.column("id").to_pylist() == ["held"] and test.column("split").to_pylist() == ["test"]
    assert prepare_data.REASON_HELP["image_size"] == "an image with a side below prepare_data.image_min_side or above image_max_side pixels"


def test_same_inputs_same_bytes_in_two_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_data, "BATCH_ROWS", 2)  # several batches: the second run spreads them over workers
    monkeypatch.setattr(prepare_data, "IMAGE_ROW_GROUP_ROWS", 1)
    first, second = tmp_path / "one", tmp_path / "elsewhere" / "two"
    for root, workers in ((first, "1"), (second, "2")):
        monkeypatch.setenv("QLLM_DATA_WORKERS", workers)
        prepare(root)
    files = sorted(p.relative_to(first).as_posix() for p in (first / "data").rglob("*.parquet") if "sources" not in p.parts)
    assert len(files) == 5 + 15
    assert pq.ParquetFile(first / "data/prepared/image_chat/train.parquet").metadata.num_row_groups == 2  # a row group an image chat
    for name in files:
        data = (first / name).read_bytes()
        assert data == (second / name).read_bytes(), name
        assert str(first).encode() not in data and str(tmp_path).encode() not in data


def test_prepare_data_kinds_match_ingest():
    assert prepare_data.KINDS["image_chat"].columns == COLUMNS["image_chat"]
    assert prepare_data._schema("image_chat") == SCHEMAS["image_chat"]


def test_prepare_data_rejects_an_images_column_of_another_type(tmp_path):
    root = tmp_path / "in"
    ingest.run(tmp_path, root, IngestParams(sources=[SourceParams(path=write(tmp_path, "t.jsonl", jsonl([{"text": "xx"}])), kind="text")]), progress=False)
    pd.DataFrame({c: pd.Series([], dtype="str") for c in COLUMNS["image_chat"]}).to_parquet(root / "image_chat.parquet")
    with pytest.raises(prepare_data.PrepareDataError, match=r"image_chat\.parquet: column images is large_string, expected list<binary> \(was it written by ingest\?\)"):
        prepare_data.run(root, tmp_path / "out", PrepareDataParams())

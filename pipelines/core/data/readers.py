"""Read one data source (a `SourceParams` entry of `ingest.sources`) into records of one kind.

    from pipelines.core.config import SourceParams
    from pipelines.core.data.readers import iter_source, read_source
    for batch in iter_source(SourceParams(path="data/sources/chats.jsonl", kind="chat"), root=Path(".")):
        ...  # a pyarrow RecordBatch of at most BATCH_ROWS records (what ingest writes as one row group)
    frame = read_source(SourceParams(path="data/sources/chats.jsonl", kind="chat"), root=Path("."))  # small sources

Every record kind is a DataFrame of `str` columns (`COLUMNS`): `id, source, split` plus
`text` (text), `messages` (chat: a JSON list of {role, content}) or `prompt` (a JSON message list
ending with a user turn), `chosen`, `rejected` (preference); `image_chat` (LLaMA-Factory's
multimodal layout) is a chat's `messages` plus `images`, the one column that is not a string: the
bytes of each image file, unchanged (Arrow `list<binary>`, `IMAGES_TYPE`). The layouts people have are
recognised from their keys (`LAYOUTS`), no `columns` map needed: chats as OpenAI `messages` (with
per-message `name` and `weight`: 0 marks an assistant turn that is context, not a target),
ShareGPT `conversations` (`from`/`value`, `human`/`gpt`/`system`), `prompt`/`completion`, Alpaca
`instruction`/`input`/`output` and Dolly `instruction`/`context`/`response`; preferences with a
`prompt`, or without one (TRL's implicit prompt: `chosen`/`rejected` conversations; Anthropic
HH-RLHF: `\n\nHuman:`/`\n\nAssistant:` transcripts), whose shared turns become the prompt. A chat needs an assistant turn; a
held-out chat (`split: test`) must end with one, the reference answer `evaluate` scores. An image
chat is a `messages` or ShareGPT `conversations` chat with an `images` list, each entry a path
(relative to the source's folder, or absolute), the bytes, or a `{bytes, path}` object as
`datasets` Image features give it (the bytes when there are any); its user turns hold one
`<image>` per image, in order, and every image must decode (`pipelines/core/data/images.py`). Anything
wrong with the input is a `ReaderError` naming the file, the 1-based line (JSONL, text, CSV) or
the 0-based record index (JSON, Parquet, hf), and what was expected.

Sources stream in bounded memory, whatever their size: JSONL, CSV/TSV and text files are read in
binary, about `CHUNK_BYTES` of whole lines at a time, and decoded chunk by chunk (invalid UTF-8
still names its line); Parquet files and `datasets` (memory-mapped Arrow) are converted
`SCAN_ROWS` rows at a time; records leave `iter_source` in batches of at most `BATCH_ROWS` (or
`BATCH_BYTES` characters of text). The one exception is `json`, a single JSON value, which is
parsed whole: use JSONL for big data. The check for duplicate ids keeps 8 bytes (a 64-bit hash)
a record (none for plain text, whose ids are all made up), and reads the source a second time
only when two hashes are equal, to tell a real duplicate (and where its first occurrence is) from
a collision. Memory then grows only with the longest record (a text document, a JSONL line) and
the number of records (8 bytes each).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import itertools
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs

from pipelines.core.config import SourceParams
from pipelines.core.data.images import IMAGE_TOKEN, ImageError, check_image, count_placeholders
from pipelines.core.errors import QllmError

log = logging.getLogger("qllm.ingest")


class ReaderError(QllmError, ValueError):
    """A source cannot be read as its kind; the message names the file, line or record, and why."""


COLUMNS: dict[str, tuple[str, ...]] = {
    "text": ("id", "source", "split", "text"),
    "chat": ("id", "source", "split", "messages"),
    "preference": ("id", "source", "split", "prompt", "chosen", "rejected"),
    "image_chat": ("id", "source", "split", "messages", "images"),
}
IMAGES_TYPE = pa.list_(pa.binary())
"""The type of the `images` column (every other column is a string): per record, the bytes of
each image file as the source held them, in the order of the chat's `<image>` tags."""
ROLES = ("system", "user", "assistant", "tool")

EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".txt": "text",
    ".md": "text",
}
# Files `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write at the top of their directory.
HF_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
TEXT_SUFFIXES = (".txt", ".md")
_FORMATS_HELP = "jsonl (.jsonl, .ndjson), json, parquet, csv (.csv, .tsv), text (.txt, .md or a directory of them), hf"


def empty_frame(kind: str) -> pd.DataFrame:
    """A zero-row frame with the columns of one record kind: `str`, but `images` (lists of bytes,
    so `object`)."""
    return pd.DataFrame({name: pd.Series([], dtype=object if name == "images" else "str") for name in COLUMNS[kind]})


# ------------------------------------------------------------------------------------- formats

CHUNK_BYTES = 1 << 20  # what a line-based reader decodes at a time (whole lines: a chunk ends after a newline)
SCAN_ROWS = 1024  # rows a Parquet or `datasets` reader converts to Python objects at a time
BOM = b"\xef\xbb\xbf"


class Progress:
    """How far a reader is through its source, for the progress bar: `done` of `total` bytes
    (unit "B": files, the size is known) or records (unit "records": Parquet, `datasets`)."""

    __slots__ = ("done", "total", "unit")

    def __init__(self, unit: str, total: int | None) -> None:
        self.unit, self.total, self.done = unit, total, 0


class Table(NamedTuple):
    """What a format reader yields: the column names when the format has a schema (else None),
    `(where, record)` pairs, `where` being the location used in error messages, and the reader's
    progress. `rows` is read once, lazily: a file is opened (and its errors raised) on the first
    row. A plain-text reader also offers `texts`, read instead of `rows` when nothing needs checking."""

    shown: str
    columns: list[str] | None
    rows: Iterable[tuple[str, dict[str, Any]]]
    progress: Progress
    texts: Iterable[str] | None = None  # plain text: the same records as `rows`, just their "text"


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _size(*paths: Path) -> int | None:
    try:
        return sum(path.stat().st_size for path in paths)
    except OSError:
        return None


def _utf8_error(data: bytes, exc: UnicodeDecodeError, shown: str, first_line: int) -> ReaderError:
    """`data` (starting at line `first_line`) is not UTF-8: name the 1-based line and in-line byte position."""
    line = first_line + data.count(b"\n", 0, exc.start)
    column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1)
    return ReaderError(
        f"{shown}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at position {column}); "
        "re-encode the file as UTF-8"
    )


def _open(path: Path, shown: str) -> io.BufferedReader:
    try:
        return path.open("rb")
    except IsADirectoryError:
        raise ReaderError(f"{shown}: expected a file, got a directory") from None
    except OSError as exc:
        raise ReaderError(f"{shown}: cannot read ({exc.strerror})") from None


def _decode(path: Path, shown: str, progress: Progress | None = None) -> str:
    """The whole file's text, with a 1-based line and in-line byte position for invalid UTF-8
    (only for `json`, which is one value; the line-based formats stream through `_chunks`)."""
    with _open(path, shown) as handle:
        try:
            data = handle.read()
        except OSError as exc:
            raise ReaderError(f"{shown}: cannot read ({exc.strerror})") from None
    if progress is not None:
        progress.done += len(data)
    data = data.removeprefix(BOM)  # a UTF-8 byte-order mark is valid, just redundant
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _utf8_error(data, exc, shown, 1) from None


def _chunks(path: Path, shown: str, progress: Progress) -> Iterator[tuple[int, str]]:
    """The file's text as `(line number of its first line, text)` chunks of whole lines (each ends
    with a newline, but the file's last one may not), about `CHUNK_BYTES` each, read in binary and
    decoded chunk by chunk: an invalid byte names its 1-based line and in-line byte position. A line
    longer than a chunk is read whole. A UTF-8 byte-order mark at the start is dropped."""
    with _open(path, shown) as handle:
        line = 1
        pending: list[bytes] = []  # bytes read after the last newline
        first = True
        while True:
            try:
                data = handle.read(max(CHUNK_BYTES, len(BOM)))
            except OSError as exc:
                raise ReaderError(f"{shown}: cannot read ({exc.strerror})") from None
            progress.done += len(data)
            end_of_file = not data
            if first:
                data, first = data.removeprefix(BOM), False
            if end_of_file:
                block = b"".join(pending)
                if not block:
                    return
            else:
                end = data.rfind(b"\n") + 1
                if not end:
                    pending.append(data)
                    continue
                block = b"".join([*pending, data[:end]]) if pending else data[:end]
                pending = [data[end:]] if end < len(data) else []
            try:
                text = block.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _utf8_error(block, exc, shown, line) from None
            yield line, text
            if end_of_file:
                return
            line += block.count(b"\n")


def _lines(chunks: Iterable[tuple[int, str]]) -> Iterator[tuple[int, list[str]]]:
    """Each chunk as (number of its first line, its lines), split on newlines only (not on "\\r")."""
    for start, text in chunks:
        # split("\n") rather than splitlines(): JSON strings may hold U+2028, which is no line break here.
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()  # the empty piece after the chunk's last newline
        yield start, lines


def _json_error(exc: json.JSONDecodeError) -> str:
    return f"invalid JSON ({exc.msg} at column {exc.colno})"


def _jsonl_rows(chunks: Iterable[tuple[int, str]], shown: str) -> Iterator[tuple[str, dict[str, Any]]]:
    loads = json.loads
    for start, lines in _lines(chunks):
        for number, line in enumerate(lines, start=start):
            if not line.strip():
                continue
            try:
                record = loads(line)
            except json.JSONDecodeError as exc:
                raise ReaderError(f"{shown}:{number}: {_json_error(exc)}") from None
            if not isinstance(record, dict):
                raise ReaderError(f"{shown}:{number}: expected a JSON object, got {_type_name(record)}")
            yield f"{shown}:{number}", record


def _read_jsonl(path: Path, shown: str, source: SourceParams) -> Table:
    progress = Progress("B", _size(path))
    return Table(shown, None, _jsonl_rows(_chunks(path, shown, progress), shown), progress)


def _read_json(path: Path, shown: str, source: SourceParams) -> Table:
    # One JSON value: parsed whole (use JSONL for big data, it streams).
    progress = Progress("B", _size(path))
    text = _decode(path, shown, progress)
    if not text.strip():
        return Table(shown, None, [], progress)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReaderError(f"{shown}:{exc.lineno}: {_json_error(exc)}") from None
    del text
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise ReaderError(f'{shown}: expected an array of objects or {{"data": [...]}}, got {_type_name(data)}')

    def rows() -> Iterator[tuple[str, dict[str, Any]]]:
        for index, record in enumerate(data):
            if not isinstance(record, dict):
                raise ReaderError(f"{shown}: record {index}: expected a JSON object, got {_type_name(record)}")
            yield f"{shown}: record {index}", record

    return Table(shown, None, rows(), progress)


def _arrow_rows(batches: Iterable[pa.RecordBatch | pa.Table], shown: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows of Arrow batches as plain lists and dicts (no numpy arrays), `SCAN_ROWS` at a time."""
    index = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{shown}: record {index}", record
            index += 1


def _read_parquet(path: Path, shown: str, source: SourceParams) -> Table:
    import pyarrow.dataset as ds

    try:
        if path.is_dir():  # as pq.read_table reads a directory: a (hive-partitioned) data set
            partitioning = ds.HivePartitioning.discover(infer_dictionary=True)
            data = ds.dataset(str(path), format="parquet", partitioning=partitioning)
        else:  # one fragment, as pq.read_table opens one file (and words its errors)
            fragment = ds.ParquetFileFormat().make_fragment(str(path), pafs.LocalFileSystem())
            data = ds.FileSystemDataset([fragment], fragment.physical_schema, ds.ParquetFileFormat(), pafs.LocalFileSystem())
        total = data.count_rows()
    except (pa.ArrowException, OSError) as exc:
        raise ReaderError(f"{shown}: not a readable Parquet file ({exc})") from None

    def batches() -> Iterator[pa.RecordBatch]:
        try:  # the scanner keeps the file's row order
            yield from data.to_batches(batch_size=SCAN_ROWS)
        except (pa.ArrowException, OSError) as exc:
            raise ReaderError(f"{shown}: not a readable Parquet file ({exc})") from None

    return Table(shown, data.schema.names, _arrow_rows(batches(), shown), Progress("records", total))


def _csv_problem(exc: csv.Error) -> str:
    """What a (strict) `csv.Error` means, in the user's terms."""
    message = str(exc).replace("\t", "\\t")
    if message == "unexpected end of data":
        return "unterminated quote: a quote opened in this row is never closed"
    if message.endswith("expected after '\"'"):
        return f'{message}: a quote inside a quoted field must be doubled ("")'
    return message


def _read_csv(path: Path, shown: str, source: SourceParams) -> Table:
    progress = Progress("B", _size(path))
    chunks: Iterator[tuple[int, str]] = _chunks(path, shown, progress)
    first = next(chunks, None)
    if first is None:
        return Table(shown, None, [], progress)
    if not first[1].strip():
        # Rare: a first chunk of only whitespace. Only whitespace throughout is an empty source;
        # otherwise start over rather than keep what was read.
        if not any(text.strip() for _, text in chunks):
            return Table(shown, None, [], progress)
        progress.done = 0
        chunks = _chunks(path, shown, progress)
    else:
        chunks = itertools.chain([first], chunks)
    csv.field_size_limit(2**31 - 1)  # documents longer than the 128 KiB default are fine
    # Lines as a file opened with newline="" gives them (\n, \r\n or \r kept): a quoted field may
    # hold line breaks. A chunk ends after a "\n", so no "\r\n" is split between two.
    lines = (line for _, text in chunks for line in io.StringIO(text, newline=""))
    # strict: a quote that is never closed is an error, not the rest of the file read as one field.
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    reader = csv.reader(lines, delimiter=delimiter, strict=True)
    try:
        header = next(reader)
    except csv.Error as exc:
        raise ReaderError(f"{shown}:1: invalid CSV header ({_csv_problem(exc)})") from None
    duplicated = sorted({name for name in header if header.count(name) > 1})
    if duplicated:
        raise ReaderError(f"{shown}:1: duplicate column {duplicated[0]!r} in the header")

    def rows() -> Iterator[tuple[str, dict[str, Any]]]:
        # A quoted field may span lines, so a row starts on the line after the previous row ended.
        start = reader.line_num + 1
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                raise ReaderError(f"{shown}:{start}: invalid CSV ({_csv_problem(exc)})") from None
            where, start = f"{shown}:{start}", reader.line_num + 1
            if not row:
                continue
            if len(row) != len(header):
                raise ReaderError(f"{where}: expected {len(header)} fields like the header, got {len(row)}")
            yield where, dict(zip(header, row, strict=True))

    return Table(shown, header, rows(), progress)


def _text_files(path: Path) -> list[Path]:
    """Every .txt/.md file under `path` in sorted relative-path order, skipping hidden ones."""
    found = [
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in TEXT_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    return sorted(found, key=lambda p: p.relative_to(path).as_posix())


LARGE_DOCUMENT_CHARS = 100_000
"""A text document longer than this is probably several (a file of one document a line read as one
run of lines): ingest warns once per file, naming `documents: line`."""


def _documents(chunks: Iterable[tuple[int, str]], documents: str = "blank_line", shown: str = "") -> Iterator[tuple[int, str]]:
    """Documents of one text file, `(number of its first line, text)`, as `documents` says:
    `blank_line`, runs of lines separated by one or more blank lines (whitespace only); `line`,
    every non-blank line (LLaMA-Factory's `wiki_demo.txt`, a corpus of one document a line);
    `file`, the whole file (blank lines kept inside, none at either end). A line's final carriage
    return is dropped."""
    lines: list[str] = []
    first = 0
    warned = False

    def document() -> tuple[int, str]:
        nonlocal warned
        text = "\n".join(lines)
        if len(text) > LARGE_DOCUMENT_CHARS and not warned:
            warned = True
            hint = "; if it holds one document a line, give the source `documents: line`" if documents != "line" else ""
            log.warning("%s:%d: a document of %d characters (more than %d)%s; prepare_data drops records above "
                        "prepare_data.max_chars", shown, first, len(text), LARGE_DOCUMENT_CHARS, hint)  # fmt: skip
        return first, text

    for start, chunk in _lines(chunks):
        for number, line in enumerate(chunk, start=start):
            if line.strip():
                if not lines:
                    first = number
                lines.append(line.removesuffix("\r"))
                if documents == "line":
                    yield document()
                    lines = []
            elif lines and documents == "blank_line":
                yield document()
                lines = []
            elif lines:  # `file`: blank lines inside the document stay
                lines.append("")
    while lines and not lines[-1]:
        lines.pop()
    if lines:
        yield document()


def _read_text(path: Path, shown: str, source: SourceParams) -> Table:
    if path.is_dir():
        files = [(file, f"{shown.rstrip('/')}/{file.relative_to(path).as_posix()}") for file in _text_files(path)]
    else:
        files = [(path, shown)]
    progress = Progress("B", _size(*(file for file, _ in files)))
    rows = (
        (f"{name}:{first}", {"text": text})
        for file, name in files
        for first, text in _documents(_chunks(file, name, progress), source.documents, name)
    )
    texts = (text for file, name in files for _, text in _documents(_chunks(file, name, progress), source.documents, name))
    return Table(shown, None, rows, progress, texts)


def _read_hf(path: Path, shown: str, source: SourceParams) -> Table:
    import datasets  # imported here: it takes a second or two and only hf sources need it

    if path.is_dir() and any((path / marker).exists() for marker in HF_MARKERS):
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as exc:  # datasets raises many types; all mean "cannot load this directory"
            raise ReaderError(f"{shown}: not a readable saved dataset ({type(exc).__name__}: {exc})") from None
        if isinstance(data, datasets.DatasetDict):
            if source.hf_split not in data:
                found = ", ".join(data) or "none"
                raise ReaderError(f"{shown}: no split {source.hf_split!r} (found: {found}; set hf_split)")
            data = data[source.hf_split]
    else:
        # A local directory or file that is not a saved dataset, or a hub name (no local path).
        target = str(path) if path.exists() else source.path
        try:
            data = datasets.load_dataset(target, split=source.hf_split)
        except Exception as exc:  # as above: missing data set, no network, bad split, bad files
            where = "" if path.exists() else " (not found locally)"
            raise ReaderError(f"{shown}{where}: datasets.load_dataset failed ({type(exc).__name__}: {exc})") from None
    # The memory-mapped Arrow table, a batch at a time, as `Dataset.to_list` converts it (no decoding of features).
    batches = data.with_format("arrow").iter(batch_size=SCAN_ROWS)
    return Table(shown, list(data.column_names), _arrow_rows(batches, shown), Progress("records", len(data)))


READERS: dict[str, Callable[[Path, str, SourceParams], Table]] = {
    "jsonl": _read_jsonl,
    "json": _read_json,
    "parquet": _read_parquet,
    "csv": _read_csv,
    "text": _read_text,
    "hf": _read_hf,
}


def infer_format(path: Path, shown: str | None = None) -> str:
    """The format of a source from its extension or, for a directory, its contents.

    Args:
        path: the file or directory (must exist).
        shown: how to name it in errors (default: `path`).

    Returns:
        One of jsonl, json, parquet, csv, text, hf.
    """
    path = Path(path)
    shown = shown or str(path)
    if not path.exists():
        raise ReaderError(f"{shown}: not found")
    if path.is_dir():
        if any((path / marker).exists() for marker in HF_MARKERS):
            return "hf"
        if _text_files(path):
            return "text"
        raise ReaderError(
            f"{shown}: cannot infer the format of this directory: it is neither a saved `datasets` "
            f"directory nor holds .txt/.md files; set format: to one of {_FORMATS_HELP}"
        )
    fmt = EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        raise ReaderError(
            f"{shown}: cannot infer the format from the extension {path.suffix!r}; set format: to one of {_FORMATS_HELP}"
        )
    return fmt


# ------------------------------------------------------------------------------- record kinds


class _Bad(ValueError):
    """A record does not fit its kind; the reader prefixes the location."""


class _Missing(KeyError):
    """A record lacks a required field (args[0] is its expected name)."""


def _plain(value: Any) -> Any:
    """Numpy arrays/scalars and tuples (from Parquet or `datasets`) as plain lists and scalars."""
    if isinstance(value, str):
        return value
    if isinstance(value, (np.ndarray, list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _string(record: dict[str, Any], field: str) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise _Bad(f"{field!r} must be a string, got {_type_name(value)}")
    return value


def _weight(message: dict[str, Any], role: str, at: str) -> int | None:
    """OpenAI's `weight` (assistant messages only) or LLaMA-Factory's `loss_weight` (0 on any
    message, 1 on an assistant's): the same meaning, 0 is context, not trained, 1 trained; None
    when not given."""
    if message.get("weight") is not None:
        weight = _plain(message["weight"])
        if role != "assistant" or weight not in (0, 1) or isinstance(weight, bool):
            raise _Bad(f"'weight' must be 0 or 1 on an assistant message, got {weight!r} on a {role} message {at}")
        return int(weight)
    if message.get("loss_weight") is None:
        return None
    weight = _plain(message["loss_weight"])
    if isinstance(weight, bool) or weight not in (0, 1):
        raise _Bad(f"'loss_weight' must be 0 or 1 (LLaMA-Factory's per-message switch), got {weight!r} {at}")
    if weight == 1 and role != "assistant":
        raise _Bad(f"'loss_weight' 1 on a {role} message {at}: only assistant turns are trained (0 or none there)")
    return int(weight)


def _part_image(part: dict[str, Any], at: str) -> Any:
    """What an image part names: a path, bytes (a data: URL decoded), or None (TRL's bare
    `{"type": "image"}`: the image is in the record's `images` column)."""
    value = part.get("image", part.get("value", part.get("path", part.get("image_url"))))
    if isinstance(value, dict):  # OpenAI: {"type": "image_url", "image_url": {"url": ...}}
        value = value.get("url", value.get("path"))
    if isinstance(value, str) and value.startswith("data:"):
        header, _, data = value.partition(",")
        if ";base64" not in header:
            raise _Bad(f"a data: URL image must be base64-encoded {at}")
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:
            raise _Bad(f"a data: URL image is not valid base64 {at}") from None
    if isinstance(value, str) and value.split("://", 1)[0] in ("http", "https"):
        raise _Bad(f"the image {value!r} {at} is a web address: images are not downloaded; save it and give its path")
    return value


TEXT_PART_KEYS = ("text", "value")
"""Where a text part holds its text: OpenAI and TRL `{"type": "text", "text"}`, LLaMA-Factory `"value"`."""
IMAGE_PART_TYPES = ("image", "image_url")


def _content(value: Any, at: str, images: list | None) -> str:
    """A message's content: a string, or a list of content parts (OpenAI, TRL, LLaMA-Factory),
    whose text parts are joined and whose image parts become `<image>` (their images appended to
    `images`; a text chat, `images` None, refuses them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (np.ndarray, tuple)):
        value = list(value)
    if not isinstance(value, list):
        raise _Bad(f"'content' must be a string or a list of content parts, got {_type_name(value)} {at}")
    pieces = []
    for index, part in enumerate(value):
        where = f"{at}, content part {index}"
        if not isinstance(part, dict) or "type" not in part:
            raise _Bad(f"expected a content part {{type, ...}}, got {_type_name(part)} {where}")
        kind = part["type"]
        if kind == "text":
            text = next((part[k] for k in TEXT_PART_KEYS if part.get(k) is not None), None)
            if not isinstance(text, str):
                raise _Bad(f"a text part needs its text as a string under 'text' (or 'value'), got {_type_name(text)} {where}")
            pieces.append(text)
        elif kind in IMAGE_PART_TYPES:
            if images is None:
                raise _Bad(f"an {kind!r} part {where}: a chat source holds text; a source of chats with images is `kind: image_chat`")
            images.append(_part_image(part, where))
            pieces.append(IMAGE_TOKEN)
        else:
            allowed = "text, image or image_url" if images is not None else "text"
            raise _Bad(f"unsupported content part type {kind!r} {where} (expected {allowed})")
    return "".join(pieces)


def _arguments(value: Any, at: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise _Bad(f"a tool call's arguments are not valid JSON ({exc.msg}) {at}") from None
    if not isinstance(value, dict):
        raise _Bad(f"a tool call's arguments must be a JSON object, got {_type_name(value)} {at}")
    return value


def _tool_calls(value: Any, at: str) -> list[dict[str, Any]]:
    """Tool calls in the form Hugging Face chat templates render: `{"type": "function",
    "function": {"name", "arguments": {...}}}` (and the call's `id` where given). Read from
    OpenAI's `tool_calls` (arguments as JSON text) or a bare `{name, arguments}` (ShareGPT's
    `function_call` turn; Llama's `parameters` too), one or a list."""
    value = _plain(value)
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise _Bad(f"'tool_calls' is an empty list {at}")
    out = []
    for index, call in enumerate(calls):
        where = f"{at}, tool call {index}"
        if not isinstance(call, dict):
            raise _Bad(f"expected a tool call object {{name, arguments}}, got {_type_name(call)} {where}")
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _Bad(f"a tool call needs the function's 'name' {where}")
        arguments = function.get("arguments", function.get("parameters", {}))
        kept: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": _arguments(arguments, where)}}
        if isinstance(call.get("id"), str):
            kept["id"] = call["id"]
        out.append(kept)
    return out


def _tools(value: Any) -> list[dict[str, Any]]:
    """A record's `tools`: JSON schemas of the functions the chat may call, as a list or its JSON
    text (LLaMA-Factory), each `{"type": "function", "function": {name, description, parameters}}`
    (OpenAI, Hugging Face) or the bare function (LLaMA-Factory, Glaive), kept in the first form."""
    value = _plain(value)
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _Bad(f"'tools' is not valid JSON ({exc.msg})") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise _Bad(f"'tools' must be a list of function schemas (or its JSON text), got {_type_name(value)}")
    out = []
    for index, tool in enumerate(value):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _Bad(f"'tools'[{index}] must be a function schema with a 'name' (and 'description', 'parameters')")
        out.append({"type": "function", "function": function})
    return out


def _message_list(value: Any, label: str, images: list | None = None) -> list[dict[str, Any]]:
    """Validate a list of {role, content} messages; returns copies with role and content (a string:
    content parts joined, see `_content`), OpenAI's `name`, `weight: 0` (or LLaMA-Factory's
    `loss_weight: 0`) where given, an assistant's `tool_calls` and a tool result's `tool_call_id`;
    other keys left out."""
    if isinstance(value, (np.ndarray, tuple)):
        value = list(value)
    if not isinstance(value, list):
        raise _Bad(f"{label!r} must be a string or a list of {{role, content}} messages, got {_type_name(value)}")
    messages: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # the last assistant's tool calls not answered yet
    for index, message in enumerate(value):
        at = f"in {label}[{index}]"
        if not isinstance(message, dict):
            raise _Bad(f"expected a {{role, content}} object, got {_type_name(message)} {at}")
        role = _plain(message.get("role"))
        calls = _plain(message.get("tool_calls")) if role == "assistant" else None
        calls = calls or None  # OpenAI writes `tool_calls: null` (or []) on plain answers
        if "role" not in message or ("content" not in message and calls is None):
            missing = "role" if "role" not in message else "content"
            raise _Bad(f"missing {missing!r} {at}")
        if role not in ROLES:
            raise _Bad(f"unknown role {role!r} (expected system, user, assistant or tool) {at}")
        content = message.get("content")
        content = "" if content is None and calls is not None else _content(_plain(content), at, images)
        if role == "system" and index > 0:
            raise _Bad(f"a system message may only come first {at}")
        if role == "tool" and not (messages and (messages[-1]["role"] == "tool" or "tool_calls" in messages[-1])):
            raise _Bad(f"a tool result must follow an assistant message with tool calls (or another tool result) {at}")
        kept: dict[str, Any] = {"role": role, "content": content}
        if calls is not None:
            kept["tool_calls"] = _tool_calls(calls, at)
        for key in ("name", "tool_call_id"):  # OpenAI: a participant's name; the call a tool result answers
            if message.get(key) is not None:
                named = _plain(message[key])
                if not isinstance(named, str):
                    raise _Bad(f"{key!r} must be a string, got {_type_name(named)} {at}")
                kept[key] = named
        if _weight(message, role, at) == 0 and role == "assistant":
            kept["weight"] = 0
        if "tool_calls" in kept:
            pending = list(kept["tool_calls"])
        elif role == "tool" and pending:  # results answer the calls in order, or by the call's id where given
            call = next((c for c in pending if kept.get("tool_call_id") is not None and c.get("id") == kept["tool_call_id"]), pending[0])
            pending.remove(call)
            kept.setdefault("name", call["function"]["name"])  # the function a result comes from (Hermes-style templates print it)
        messages.append(kept)
    return messages


def _turns(value: Any, label: str, role: str) -> list[dict[str, str]]:
    """A plain string as one `role` message, or a message list (TRL conversational format)."""
    return [{"role": role, "content": value}] if isinstance(value, str) else _message_list(value, label)


_dump = json.JSONEncoder(ensure_ascii=False).encode  # one encoder: json.dumps builds one per call


def _chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> tuple[str]:
    """The chat as stored: its messages' JSON, the tool schemas (if any) on the first message as
    `tools` (`chat_template.tools_of` takes them off again to render), so a chat stays one value
    and chats without tools keep the bytes they always had."""
    roles = [m["role"] for m in messages]
    if "system" in roles[1:]:
        # Only reachable when prompt and completion lists are joined: each list was checked alone.
        raise _Bad(f"a system message may only come first (found at position {roles.index('system', 1)} of the chat)")
    if "assistant" not in roles:
        raise _Bad("no assistant message (a chat needs at least one assistant turn)")
    if all(m.get("weight", 1) == 0 for m in messages if m["role"] == "assistant"):
        raise _Bad("every assistant message has weight 0 (nothing to train on)")
    if tools:
        messages = [{**messages[0], "tools": tools}, *messages[1:]]
    return (_dump(messages),)


KTO_HELP = ("unpaired feedback (a completion labelled desirable or not) is KTO's layout; KTO is not built yet "
            "(the issue 'Preference optimisation beyond DPO' adds it): leave the label out to train on the chats with sft, "
            "or give pairs (prompt, chosen, rejected) to dpo")  # fmt: skip


def _refuse_unpaired(record: dict[str, Any]) -> None:
    """TRL's `{prompt, completion, label}` and LLaMA-Factory's `kto_tag`: KTO data, not chats."""
    if "kto_tag" in record or isinstance(_plain(record.get("label")), bool):
        field = "kto_tag" if "kto_tag" in record else "label"
        raise _Bad(f"{field!r}: {KTO_HELP}")


def _text_record(record: dict[str, Any]) -> tuple[str]:
    return (_string(record, "text"),)


def _messages_value(record: dict[str, Any], field: str = "messages") -> Any:
    value = record[field]
    if isinstance(value, str):
        # CSV cells (and re-read ingested data) hold the list as JSON text.
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _Bad(f"{field!r} must be a list of {{role, content}} messages (or its JSON text), got str") from None
    return value


def _chat_messages(record: dict[str, Any]) -> tuple[str]:
    _refuse_unpaired(record)
    return _chat(_message_list(_messages_value(record), "messages"), _tools(record.get("tools")))


def _chat_prompt_completion(record: dict[str, Any]) -> tuple[str]:
    _refuse_unpaired(record)
    prompt = _turns(record["prompt"], "prompt", "user")
    completion = _turns(record["completion"], "completion", "assistant")
    return _chat(prompt + completion, _tools(record.get("tools")))


def _chat_alpaca(record: dict[str, Any]) -> tuple[str]:
    instruction, output = _string(record, "instruction"), _string(record, "output")
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise _Bad(f"'input' must be a string, got {_type_name(extra)}")
    user = instruction + ("\n\n" + extra if extra else "")
    return _chat([{"role": "user", "content": user}, {"role": "assistant", "content": output}])


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}  # fmt: skip


def _sharegpt_turns(value: Any, label: str = "conversations", images: list | None = None) -> list[dict[str, Any]]:
    """ShareGPT/Vicuna turns `{from, value}` (`human`/`gpt`/`system`, and LLaMA-Factory's tool
    turns: `function_call`, the assistant's call as `{name, arguments}` JSON, and `observation`,
    the tool's result) as checked messages; some exports use `{role, content}` there, which is
    read as messages."""
    value = _plain(value)
    if not isinstance(value, list):
        raise _Bad(f"{label!r} must be a list of {{from, value}} turns, got {_type_name(value)}")
    turns = []
    for index, turn in enumerate(value):
        at = f"in {label}[{index}]"
        if not isinstance(turn, dict):
            raise _Bad(f"expected a {{from, value}} object, got {_type_name(turn)} {at}")
        if "from" not in turn and "role" in turn:
            turns.append(turn)
            continue
        if "from" not in turn or "value" not in turn:
            raise _Bad(f"missing {'from' if 'from' not in turn else 'value'!r} {at}")
        speaker = str(turn["from"]).lower()
        role = SHAREGPT_ROLES.get(speaker)
        if role is None:
            raise _Bad(f"unknown speaker 'from': {turn['from']!r} (expected human, gpt, system, function_call or observation) {at}")
        weights = {k: turn[k] for k in ("weight", "loss_weight") if k in turn}
        if speaker == "function_call":
            call = turn["value"]
            if isinstance(call, str):
                try:
                    call = json.loads(call)
                except json.JSONDecodeError as exc:
                    raise _Bad(f"a function_call turn's value must be the call as JSON {{name, arguments}} ({exc.msg}) {at}") from None
            turns.append({"role": "assistant", "content": "", "tool_calls": call, **weights})
        else:
            turns.append({"role": role, "content": turn["value"], **weights})
    return _message_list(turns, label, images)


def _chat_sharegpt(record: dict[str, Any]) -> tuple[str]:
    _refuse_unpaired(record)
    return _chat(_sharegpt_turns(record["conversations"]), _tools(record.get("tools")))


def _chat_dolly(record: dict[str, Any]) -> tuple[str]:
    """databricks-dolly: `instruction`, optional `context` (joined after a blank line), `response`."""
    instruction, response = _string(record, "instruction"), _string(record, "response")
    context = record.get("context")
    if context is not None and not isinstance(context, str):
        raise _Bad(f"'context' must be a string, got {_type_name(context)}")
    user = instruction + ("\n\n" + context if context and context.strip() else "")
    return _chat([{"role": "user", "content": user}, {"role": "assistant", "content": response}])


def _prompt(value: Any) -> list[dict[str, str]]:
    messages = _turns(value, "prompt", "user")
    if not messages:
        raise _Bad("'prompt' is an empty message list")
    if messages[-1]["role"] != "user":
        raise _Bad(f"'prompt' must end with a user message, got {messages[-1]['role']}")
    return messages


def _response(value: Any, label: str, prompt: list[dict[str, str]]) -> str:
    """`chosen`/`rejected`: a string, or a message list holding one assistant message."""
    if isinstance(value, str):
        return value
    messages = _message_list(value, label)
    # Some data sets (e.g. UltraFeedback binarized) repeat the prompt before the answer.
    if len(messages) > len(prompt) and messages[: len(prompt)] == prompt:
        messages = messages[len(prompt) :]
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = ", ".join(m["role"] for m in messages) or "none"
        raise _Bad(f"{label!r} as a list must be a single assistant message, got {len(messages)} ({roles})")
    return _answer(messages[0], label)


def _answer(message: dict[str, Any], label: str) -> str:
    if "tool_calls" in message:
        raise _Bad(f"{label!r} is a tool call: a preference pair's answers are text")
    return message["content"]


def _preference(record: dict[str, Any]) -> tuple[str, str, str]:
    prompt = _prompt(record["prompt"])
    return (
        _dump(prompt),
        _response(record["chosen"], "chosen", prompt),
        _response(record["rejected"], "rejected", prompt),
    )


HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant): ?")


def _hh_transcript(text: str, label: str) -> list[dict[str, str]]:
    """Anthropic HH-RLHF: `\n\nHuman: …\n\nAssistant: …` as messages."""
    parts = HH_TURN.split(text)
    if len(parts) < 3:
        raise _Bad(f"{label!r} is not a transcript of '\\n\\nHuman:' / '\\n\\nAssistant:' turns (HH-RLHF layout)")
    if parts[0].strip():
        raise _Bad(f"{label!r} has text before its first 'Human:' turn")
    return [{"role": "user" if who == "Human" else "assistant", "content": said.strip()} for who, said in zip(parts[1::2], parts[2::2], strict=True)]


def _conversation(value: Any, label: str) -> list[dict[str, str]]:
    messages = _hh_transcript(value, label) if isinstance(value, str) else _message_list(value, label)
    if not messages or messages[-1]["role"] != "assistant":
        last = messages[-1]["role"] if messages else "nothing"
        raise _Bad(f"{label!r} must end with an assistant turn, the answer (it ends with {last})")
    return messages


def _preference_implicit(record: dict[str, Any]) -> tuple[str, str, str]:
    """No `prompt`: `chosen` and `rejected` are whole conversations (TRL's implicit prompt, as
    message lists) or transcripts (HH-RLHF); what they share before the last turn is the prompt."""
    chosen, rejected = _conversation(record["chosen"], "chosen"), _conversation(record["rejected"], "rejected")
    prompt, other = chosen[:-1], rejected[:-1]
    if prompt != other:
        turn = next((i for i, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b), min(len(prompt), len(other)))
        raise _Bad(
            f"'chosen' and 'rejected' have different prompts: they differ at turn {turn + 1} "
            f"(an implicit-prompt pair shares every turn but the final answer)"
        )
    return (_dump(_prompt(prompt)), _answer(chosen[-1], "chosen"), _answer(rejected[-1], "rejected"))


def _preference_messages(record: dict[str, Any]) -> tuple[str, str, str]:
    """LLaMA-Factory's v1 layout: `chosen_messages`/`rejected_messages`, whole conversations
    that share their prompt (as TRL's implicit prompt)."""
    return _preference_implicit({"chosen": _plain(record["chosen_messages"]), "rejected": _plain(record["rejected_messages"])})


def _sharegpt_answer(value: Any, label: str) -> str:
    """LLaMA-Factory's ranking layout: `chosen`/`rejected` as one `{from: gpt, value}` turn (or a
    string, or a list of turns holding one answer)."""
    value = _plain(value)
    if isinstance(value, str):
        return value
    turns = _sharegpt_turns(value if isinstance(value, list) else [value], label)
    if len(turns) != 1 or turns[0]["role"] != "assistant":
        raise _Bad(f"{label!r} must be the answer, one {{from: gpt, value}} turn, got {', '.join(t['role'] for t in turns) or 'none'}")
    return _answer(turns[0], label)


def _preference_sharegpt(record: dict[str, Any]) -> tuple[str, str, str]:
    """LLaMA-Factory's DPO layout (`dpo_en_demo.json`): ShareGPT `conversations` up to the last
    user turn, and `chosen`/`rejected` as `{from: gpt, value}` turns."""
    prompt = _sharegpt_turns(record["conversations"])
    if not prompt or prompt[-1]["role"] != "user":
        raise _Bad(f"'conversations' must end with a human turn, the prompt (it ends with {prompt[-1]['role'] if prompt else 'nothing'})")
    return (_dump(prompt), _sharegpt_answer(record["chosen"], "chosen"), _sharegpt_answer(record["rejected"], "rejected"))


def _preference_unpaired(record: dict[str, Any]) -> tuple[str, str, str]:
    raise _Bad(f"'label': {KTO_HELP}")


def _image_chat(messages: list[dict[str, Any]], found: list, record: dict[str, Any], tools: Any) -> tuple[str]:
    """An image chat whose image parts (`found`: each part's image, None where it names none)
    go with the record's `images` column (TRL: bare `{"type": "image"}` parts) or carry the
    images themselves (LLaMA-Factory v1, OpenAI: a path or a data: URL in the part), which then
    become the record's `images`."""
    named = [item for item in found if item is not None]
    if named:
        if len(named) != len(found):
            raise _Bad("some image parts name their image and some do not: give every image in its part, or all in 'images'")
        if record.get("images") is not None and len(_plain(record["images"])):
            raise _Bad("the image parts name their images and the record has 'images' too: give each image once")
        record["images"] = named
    return _chat(messages, _tools(tools))


def _image_chat_messages(record: dict[str, Any]) -> tuple[str]:
    found: list = []
    return _image_chat(_message_list(_messages_value(record), "messages", found), found, record, record.get("tools"))


def _image_chat_sharegpt(record: dict[str, Any]) -> tuple[str]:
    found: list = []
    return _image_chat(_sharegpt_turns(record["conversations"], images=found), found, record, record.get("tools"))


# Per kind, the accepted layouts in priority order: (fields it needs, how it becomes the kind's fields).
LAYOUTS: dict[str, tuple[tuple[tuple[str, ...], Callable[[dict[str, Any]], tuple[str, ...]]], ...]] = {
    "text": ((("text",), _text_record),),
    "chat": (
        (("messages",), _chat_messages),
        (("conversations",), _chat_sharegpt),
        (("prompt", "completion"), _chat_prompt_completion),
        (("instruction", "output"), _chat_alpaca),
        (("instruction", "response"), _chat_dolly),
    ),
    "preference": (
        (("prompt", "chosen", "rejected"), _preference),
        (("conversations", "chosen", "rejected"), _preference_sharegpt),
        (("chosen", "rejected"), _preference_implicit),
        (("chosen_messages", "rejected_messages"), _preference_messages),
        (("prompt", "completion", "label"), _preference_unpaired),
    ),
    # The chat layouts that carry messages; `_batches` reads the `images` beside them (or the
    # converter puts there the images the content parts carry).
    "image_chat": (
        (("messages", "images"), _image_chat_messages),
        (("conversations", "images"), _image_chat_sharegpt),
        (("messages",), _image_chat_messages),
    ),
}


REFUSED = (_preference_unpaired,)
"""Layouts recognised only to say what they are (KTO's unpaired feedback): never suggested."""


def _layout(kind: str, keys: Iterable[str]) -> Callable[[dict[str, Any]], tuple[str, ...]]:
    """The first layout whose fields are all present, else `_Missing` naming the closest one's gap."""
    keys = set(keys)
    best: tuple[str, ...] | None = None
    for fields, convert in LAYOUTS[kind]:
        if keys.issuperset(fields):
            return convert
        if best is None or sum(f in keys for f in fields) > sum(f in keys for f in best):
            best = fields
    raise _Missing(next(f for f in best if f not in keys))


def _missing_message(where: str, name: str, source: SourceParams, found: Iterable[str], noun: str) -> str:
    listed = ", ".join(found) or "nothing"
    if name in source.columns:
        return (
            f"{where}: missing {noun} {source.columns[name]!r} (mapped to {name!r} by columns) "
            f"required for kind {source.kind!r} (found: {listed})"
        )
    others = [" + ".join(fields) for fields, convert in LAYOUTS[source.kind] if name not in fields and convert not in REFUSED]
    also = f"; kind {source.kind!r} also accepts {' or '.join(others)}" if others else ""
    return (
        f"{where}: missing {noun} {name!r} required for kind {source.kind!r} "
        f"(found: {listed}; map yours with columns: {{{name}: <name>}}{also})"
    )


def _rename(record: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    record = dict(record)
    for expected, column in columns.items():
        if column in record:
            record[expected] = record.pop(column)
    return record


def _check_heldout_chat(messages: str, where: str) -> None:
    """A held-out chat (`split: test`) is scored against its last turn: it must be the assistant's
    text answer."""
    final = json.loads(messages)[-1]
    last = final["role"]
    if "tool_calls" in final:
        raise ReaderError(f"{where}: a held-out chat (split: test) must end with the assistant's text answer, which evaluate scores "
                          "(this one ends with a tool call)")  # fmt: skip
    if last != "assistant":
        raise ReaderError(
            f"{where}: a held-out chat (split: test) must end with an assistant turn, the reference answer "
            f"that evaluate scores (this one ends with a {last} turn)"
        )


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _image(item: Any, at: str, folder: Path, shown: str) -> bytes:
    """One entry of `images` as its file's bytes, unchanged, after checking that Pillow decodes
    them: a path (relative to `folder`, the source's folder, which errors call `shown`), bytes,
    or a `{bytes, path}` object (`datasets` Image features), whose bytes win when there are any."""
    if isinstance(item, dict):
        if item.get("bytes") is None and item.get("path") is None:
            raise _Bad(f"{at} is a {{bytes, path}} object with neither (expected the image's bytes or its path)")
        item = item["bytes"] if item.get("bytes") is not None else item["path"]
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        named = f"{at} ({_counted(len(data), 'byte')} given in the record)"
    elif isinstance(item, str):
        if not item:
            raise _Bad(f"{at} is an empty path (expected an image file's path)")
        path = Path(item)
        named = f"{at} {item!r}"
        try:
            data = (path if path.is_absolute() else folder / path).read_bytes()
        except FileNotFoundError:
            looked = item if path.is_absolute() else (Path(shown) / path).as_posix()
            raise _Bad(f"{named}: image file not found (looked for {looked}; a relative path is relative to the source's folder)") from None
        except IsADirectoryError:
            raise _Bad(f"{named}: expected an image file, got a directory") from None
        except OSError as exc:
            raise _Bad(f"{named}: cannot read ({exc.strerror})") from None
    else:
        raise _Bad(f"{at} must be an image path, bytes or a {{bytes, path}} object, got {_type_name(item)}")
    try:
        check_image(data)
    except ImageError as exc:
        raise _Bad(f"{named}: {exc}") from None
    return data


def _images(record: dict[str, Any], messages: str, folder: Path, shown: str) -> list[bytes]:
    """The `images` of an image chat whose checked `messages` (JSON) are given: each image's bytes,
    in order. Its `<image>` tags must all be in user turns, one per image (a chat without images
    has none; a null or missing `images` is none)."""
    value = record.get("images")
    if value is None:
        value = []
    if isinstance(value, (np.ndarray, tuple)):
        value = list(value)
    if not isinstance(value, list):
        raise _Bad(f"'images' must be a list of image paths, bytes or {{bytes, path}} objects, got {_type_name(value)}")
    turns = json.loads(messages)
    label = "messages" if "messages" in record else "conversations"  # (the layout's priority)
    for index, message in enumerate(turns):
        if message["role"] != "user" and IMAGE_TOKEN in message["content"]:
            raise _Bad(f"{IMAGE_TOKEN} in {label}[{index}], whose role is {message['role']}: images go in user turns only")
    tags = count_placeholders(turns)
    if tags != len(value):
        raise _Bad(
            f"{_counted(tags, IMAGE_TOKEN + ' placeholder')} in the user turns but {_counted(len(value), 'image')} "
            f"in 'images' (each image needs one {IMAGE_TOKEN} where it goes, in order)"
        )
    return [_image(item, f"images[{index}]", folder, shown) for index, item in enumerate(value)]


def _id_hashes(ids: list[str]) -> np.ndarray:
    """64-bit blake2b hashes of record ids (the same on every run and machine, unlike `hash`)."""
    blake2b = hashlib.blake2b
    digests = b"".join([blake2b(i.encode("utf-8", "surrogatepass"), digest_size=8).digest() for i in ids])
    return np.frombuffer(digests, dtype="<u8").copy()


def _number_hashes(numbers: np.ndarray) -> np.ndarray:
    """64-bit hashes of the ids `<source name>-<k>` from their numbers k (splitmix64's finaliser,
    a bijection: two numbers never share a hash), computed for a whole batch at once."""
    z = numbers.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _record_id(record: dict[str, Any], name: str, index: int) -> str:
    """A record's `id` as a string, else `<source name>-<index>`."""
    given = record.get("id")
    if given is not None and type(given) is not str:
        given = _plain(given)
    return f"{name}-{index}" if given is None or given == "" else str(given)


class _DuplicateId(ReaderError):
    """Two records of one source share an id."""


class _SeenIds:
    """The ids of one source so far, as sorted runs of 64-bit hashes (8 bytes a record, not a
    Python string): runs of similar size are merged, so there are O(log n) of them. Two equal
    hashes are only suspects: `first_of` re-reads the source to tell a real duplicate, and where
    its first occurrence is, from a collision of different ids.

    An id's hash depends on the id alone: `<prefix><k>` (`<source name>-<k>`, k a decimal number
    as `str(k)` writes it: the id of a record without one) hashes as `_number_hashes(k)`, any other
    id as `_id_hashes` (blake2b). So the ids the reader makes up cost no string hashing, and an
    `id` that equals one of them still has its hash."""

    def __init__(self, prefix: str, first_of: Callable[[int, str], tuple[str, str] | None]) -> None:
        self.prefix = prefix
        self.first_of = first_of
        self.runs: list[np.ndarray] = []

    def _number(self, record_id: str) -> int | None:
        digits = record_id[len(self.prefix) :] if record_id.startswith(self.prefix) else ""
        if 0 < len(digits) <= 18 and digits.isascii() and digits.isdigit() and (digits[0] != "0" or digits == "0"):
            return int(digits)
        return None

    def hashes(self, ids: list[str], start: int, given: list[int]) -> np.ndarray:
        """The hashes of `ids`, those of records `start`, `start + 1`, ...; the ids at positions
        `given` came with the records, the others are `<prefix><start + position>`."""
        hashes = _number_hashes(np.arange(start, start + len(ids), dtype=np.uint64))
        strings, numbered, numbers = [], [], []
        for position in given:
            number = self._number(ids[position])
            if number is None:
                strings.append(position)
            else:
                numbered.append(position)
                numbers.append(number)
        if strings:
            hashes[strings] = _id_hashes([ids[position] for position in strings])
        if numbered:
            hashes[numbered] = _number_hashes(np.array(numbers, dtype=np.uint64))
        return hashes

    def add(self, ids: list[str], start: int, given: list[int]) -> None:
        """Check and remember `ids` (see `hashes`); a duplicate (of an earlier id in `ids` or
        before) raises `_DuplicateId` naming both locations."""
        if not ids:
            return
        hashes = self.hashes(ids, start, given)
        order = np.argsort(hashes, kind="stable")
        ordered = hashes[order]
        suspects = np.zeros(len(ids), dtype=bool)
        suspects[order[1:][ordered[1:] == ordered[:-1]]] = True  # a repeat within `ids` (stable: not the first)
        for run in self.runs:
            found = np.searchsorted(run, ordered)  # (sorted needles: the search walks the run in order)
            np.minimum(found, len(run) - 1, out=found)
            suspects[order[run[found] == ordered]] = True
        for position in np.flatnonzero(suspects).tolist():
            duplicate = self.first_of(start + position, ids[position])
            if duplicate is not None:
                first, where = duplicate
                raise _DuplicateId(f"{where}: duplicate id {ids[position]!r} (first at {first})") from None
        self.runs.append(ordered)
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            last = self.runs.pop()
            merged = np.concatenate([self.runs.pop(), last])
            merged.sort(kind="stable")  # two sorted runs: a merge
            self.runs.append(merged)


def _batches(
    table: Table,
    open_table: Callable[[], Table],
    source: SourceParams,
    name: str,
    batch_rows: int,
    batch_bytes: int,
    bar: Any = None,
    folder: tuple[Path, str] | None = None,
) -> Iterator[list[list[Any]]]:
    """The records of `table` as column lists (the kind's `COLUMNS`) of at most `batch_rows`
    records or about `batch_bytes` of text (and image bytes), checking fields and ids
    (`open_table` opens the source again, to find the first of two equal ids); `bar` (a tqdm) is
    advanced a batch at a time. `folder` is where an image chat's relative image paths start, and
    how errors show it (`_source_folder`)."""
    if table.columns is not None:
        try:
            _layout(source.kind, _rename(dict.fromkeys(table.columns), source.columns))
        except _Missing as missing:
            raise ReaderError(_missing_message(table.shown, missing.args[0], source, table.columns, "column")) from None

    def first_of(index: int, record_id: str) -> tuple[str, str] | None:
        # Re-read the source up to record `index`: the first record with its id, if any, and where `index` is.
        first = None
        for i, (where, raw) in enumerate(open_table().rows):
            if i == index:
                return None if first is None else (first, where)
            if first is None and _record_id(_rename(raw, source.columns) if source.columns else raw, name, i) == record_id:
                first = where
        return None

    kind, columns, split = source.kind, source.columns, source.split
    heldout = kind in ("chat", "image_chat") and split == "test"
    with_images = kind == "image_chat"
    image_folder, shown_folder = folder if folder is not None else (Path("."), ".")
    progress, shown_done = table.progress, 0
    seen = _SeenIds(f"{name}-", first_of)
    ids: list[str] = []
    given_at: list[int] = []  # positions in `ids` of ids that came with their record
    fields: list[list[str]] = [[] for _ in COLUMNS[kind][3:]]
    start = size = 0
    index = -1

    def batch(check: bool = True) -> list[list[str]]:
        nonlocal ids, given_at, fields, start, size, shown_done
        if check:
            seen.add(ids, start, given_at)
        out = [ids, [name] * len(ids), [split] * len(ids), *fields]
        start += len(ids)
        ids, given_at, fields, size = [], [], [[] for _ in fields], 0
        if bar is not None:
            done = start if progress.unit == "records" else progress.done
            bar.update(done - shown_done)
            shown_done = done
        return out

    if table.texts is not None and not columns:
        # Plain text: every record is {"text": <a str>} with a made-up id (distinct from every
        # other: no id to check), so the records need no checking, just batching.
        texts = fields[0]
        for text in table.texts:
            texts.append(text)
            size += len(text)
            if len(texts) >= batch_rows or size >= batch_bytes:
                ids = [f"{name}-{i}" for i in range(start, start + len(texts))]
                yield batch(check=False)
                texts = fields[0]
        if not texts and not start:
            raise ReaderError(f"{table.shown}: no records (empty source)")
        if texts:
            ids = [f"{name}-{i}" for i in range(start, start + len(texts))]
            yield batch(check=False)
        return

    layouts: dict[tuple[str, ...], Callable[[dict[str, Any]], tuple[str, ...]]] = {}  # by a record's keys
    try:
        for index, (where, raw) in enumerate(table.rows):  # noqa: B007 (index is read after the loop)
            record = _rename(raw, columns) if columns else raw
            try:
                keys = tuple(record)
                convert = layouts.get(keys)
                if convert is None:
                    if len(layouts) > 64:  # records with ever new keys: keep the cache small
                        layouts.clear()
                    convert = layouts[keys] = _layout(kind, keys)
                values = convert(record)
                if with_images:
                    found = _images(record, values[0], image_folder, shown_folder)
            except _Missing as missing:
                raise ReaderError(_missing_message(where, missing.args[0], source, raw, "field")) from None
            except _Bad as bad:
                raise ReaderError(f"{where}: {bad}") from None
            if heldout:
                _check_heldout_chat(values[0], where)
            given = record.get("id")
            if given is None or given == "":  # (a plain value: no reader gives numpy arrays)
                record_id = f"{name}-{index}"
            else:
                given_at.append(len(ids))
                record_id = given if type(given) is str else _record_id(record, name, index)
            ids.append(record_id)
            for column, value in zip(fields, values):  # noqa: B905 (a layout gives one value a field; images come apart)
                column.append(value)
                size += len(value)
            if with_images:
                fields[-1].append(found)
                size += sum(map(len, found))
            if len(ids) >= batch_rows or size >= batch_bytes:
                yield batch()
    except _DuplicateId:
        raise
    except ReaderError:
        # A duplicate id before the bad record is reported first, as when each id was checked at once.
        seen.add(ids, start, given_at)
        raise
    if index < 0:
        raise ReaderError(f"{table.shown}: no records (empty source)")
    if ids:
        yield batch()


SCHEMAS: dict[str, pa.Schema] = {
    kind: pa.schema([(c, IMAGES_TYPE if c == "images" else pa.string()) for c in columns]) for kind, columns in COLUMNS.items()
}
BATCH_ROWS = 8192  # records per batch (a row group of ingest's output) ...
BATCH_BYTES = 32 << 20  # ... or fewer, when their fields (but the id, source, split) reach this many characters (or image bytes)
# For the batches (and ingest's Parquet writer): malloc hands the memory of a written batch back,
# where Arrow's default (mimalloc) kept about twice as much resident, as fast (measured).
MEMORY_POOL = pa.system_memory_pool


def source_name(source: SourceParams) -> str:
    """The name a source goes by in records and metrics: `name`, else its file name."""
    return source.name or Path(source.path).name


def _resolve(source: SourceParams, root: Path) -> Path:
    path = Path(source.path)
    return path if path.is_absolute() else Path(root) / path


def _source_folder(source: SourceParams, root: Path) -> tuple[Path, str]:
    """Where relative image paths of the source start, and how errors show it: the folder holding
    the source file, or the source itself when it is a directory (a Parquet data set, a saved
    `datasets` directory)."""
    resolved = _resolve(source, root)
    if resolved.is_dir():
        return resolved, source.path
    return resolved.parent, Path(source.path).parent.as_posix()


def _open_source(source: SourceParams, root: Path) -> Callable[[], Table]:
    """A function that opens the source afresh (for a second pass) as its format's `Table`."""
    resolved = _resolve(source, root)
    shown = source.path
    fmt = source.format
    if fmt is None:
        fmt = infer_format(resolved, shown)
    elif fmt != "hf" and not resolved.exists():
        # (An hf path that does not exist locally may be a hub name.)
        raise ReaderError(f"{shown}: not found")
    if fmt == "text" and source.kind != "text":
        raise ReaderError(
            f"{shown}: format 'text' holds plain documents, so it needs kind 'text' (got {source.kind!r})"
        )
    if fmt != "text" and source.documents != "blank_line":
        raise ReaderError(f"{shown}: documents: {source.documents} says how a plain text file is cut into documents; "
                          f"this source is {fmt}, whose records are its documents (leave documents out)")  # fmt: skip
    reader = READERS[fmt]
    return lambda: reader(resolved, shown, source)


def iter_source(
    source: SourceParams,
    root: Path,
    *,
    batch_rows: int | None = None,
    batch_bytes: int | None = None,
    progress: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Stream one source as record batches of its kind, in source order, in bounded memory.

    Args:
        source: the `ingest.sources` entry (path, kind, format, split, name, columns, hf_split).
        root: directory against which a relative `source.path` is resolved (the project root).
        batch_rows: at most this many records a batch (default `BATCH_ROWS`).
        batch_bytes: a batch ends once its text reaches this many characters (default
            `BATCH_BYTES`; a long record is never split): the batches depend only on the input.
        progress: show a progress bar (tqdm; only on a terminal): bytes read a second for
            files, records for Parquet and `datasets`.

    Yields:
        `pa.RecordBatch`es of schema `SCHEMAS[source.kind]` (the kind's `COLUMNS`, all strings
        but image_chat's `images`, `IMAGES_TYPE`).

    Raises:
        ReaderError: the source is missing, unreadable, empty or does not fit its kind (raised
            while iterating: batches before the bad record were already yielded).
    """
    batch_rows, batch_bytes = batch_rows or BATCH_ROWS, batch_bytes or BATCH_BYTES
    open_table = _open_source(source, root)
    table = open_table()
    schema = SCHEMAS[source.kind]
    name = source_name(source)
    if progress:
        from tqdm.auto import tqdm

        unit = table.progress.unit
        bar = tqdm(total=table.progress.total, desc=name, unit=unit, unit_scale=True, disable=None)
    else:
        bar = None
    pool = MEMORY_POOL()
    folder = _source_folder(source, root) if source.kind == "image_chat" else None
    with contextlib.nullcontext() if bar is None else bar:
        for columns in _batches(table, open_table, source, name, batch_rows, batch_bytes, bar, folder):
            arrays = [pa.array(column, field.type, memory_pool=pool) for column, field in zip(columns, schema, strict=True)]
            yield pa.record_batch(arrays, schema=schema)


def read_source(source: SourceParams, root: Path) -> pd.DataFrame:
    """Read one (small) source whole into records of its kind (`iter_source` streams it).

    Args:
        source: the `ingest.sources` entry (path, kind, format, split, name, columns, hf_split).
        root: directory against which a relative `source.path` is resolved (the project root).

    Returns:
        A DataFrame with the kind's `COLUMNS`, every value a `str` (image_chat's `images`: a list
        of `bytes` a record), in source order.

    Raises:
        ReaderError: the source is missing, unreadable, empty or does not fit its kind.
    """
    table = pa.Table.from_batches(list(iter_source(source, root)), schema=SCHEMAS[source.kind])
    frame = table.to_pandas()
    if "images" in frame:  # (to_pandas gives numpy arrays of bytes)
        frame["images"] = pd.Series(table.column("images").to_pylist(), index=frame.index, dtype=object)
    return frame

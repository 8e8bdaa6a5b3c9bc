"""Source file formats as tables of records: JSONL, JSON, Parquet, CSV/TSV, plain text (a file or a
directory, cut into documents at blank lines, by line or by file) and `datasets` directories,
each streamed in bounded memory (see `pipelines.core.data.readers` for the whole picture)."""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.fs as pafs

from pipelines.core.errors import QllmError
from pipelines.core.params.data import SourceParams

log = logging.getLogger("qllm.ingest")


class ReaderError(QllmError, ValueError):
    """A source cannot be read as its kind; the message names the file, line or record, and why."""


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


def type_name(value: Any) -> str:
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
                raise ReaderError(f"{shown}:{number}: expected a JSON object, got {type_name(record)}")
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
        raise ReaderError(f'{shown}: expected an array of objects or {{"data": [...]}}, got {type_name(data)}')

    def rows() -> Iterator[tuple[str, dict[str, Any]]]:
        for index, record in enumerate(data):
            if not isinstance(record, dict):
                raise ReaderError(f"{shown}: record {index}: expected a JSON object, got {type_name(record)}")
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

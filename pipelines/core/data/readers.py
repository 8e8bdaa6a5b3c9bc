"""Read one data source (a `SourceParams` entry of `ingest.sources`) into records of one kind.

    from pipelines.core.params.data import SourceParams
    from pipelines.core.data.readers import iter_source, read_source
    for batch in iter_source(SourceParams(path="data/sources/chats.jsonl", kind="chat"), root=Path(".")):
        ...  # a pyarrow RecordBatch of at most BATCH_ROWS records (what ingest writes as one row group)
    frame = read_source(SourceParams(path="data/sources/chats.jsonl", kind="chat"), root=Path("."))  # small sources

Every record kind is a DataFrame of `str` columns (`COLUMNS`): `id, source, split` plus
`text` (text), `messages` (chat: a JSON list of {role, content}) or `prompt` (a JSON message list
ending with a user turn), `chosen`, `rejected` (preference); `image_chat` (LLaMA-Factory's
multimodal layout) is a chat's `messages` plus `images`, the one column that is not a string: the
bytes of each image file, unchanged (Arrow `list<binary>`, `IMAGES_TYPE`); `feedback` (KTO's
unpaired data) is a `prompt`, a `completion` and a `label` ("true": desirable, "false"). The layouts people have are
recognised from their keys (`LAYOUTS`), no `columns` map needed: chats as OpenAI `messages` (with
per-message `name` and `weight`: 0 marks an assistant turn that is context, not a target),
ShareGPT `conversations` (`from`/`value`, `human`/`gpt`/`system`), `prompt`/`completion`, Alpaca
`instruction`/`input`/`output` and Dolly `instruction`/`context`/`response`; preferences with a
`prompt`, or without one (TRL's implicit prompt: `chosen`/`rejected` conversations; Anthropic
HH-RLHF: `\n\nHuman:`/`\n\nAssistant:` transcripts), whose shared turns become the prompt; feedback as
TRL's `prompt`/`completion`/`label` or LLaMA-Factory's `messages` + `kto_tag` (its file's `label`),
the last assistant turn being the completion judged. A chat needs an assistant turn; a
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

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from pipelines.core.data.formats import READERS, ReaderError, Table, infer_format
from pipelines.core.data.layouts import (
    Bad,
    Missing,
    check_heldout_chat,
    layout,
    missing_message,
    plain,
    record_images,
    rename,
)
from pipelines.core.params.data import SourceParams

COLUMNS: dict[str, tuple[str, ...]] = {
    "text": ("id", "source", "split", "text"),
    "chat": ("id", "source", "split", "messages"),
    "preference": ("id", "source", "split", "prompt", "chosen", "rejected"),
    "image_chat": ("id", "source", "split", "messages", "images"),
    "feedback": ("id", "source", "split", "prompt", "completion", "label"),
}
IMAGES_TYPE = pa.list_(pa.binary())
"""The type of the `images` column (every other column is a string): per record, the bytes of
each image file as the source held them, in the order of the chat's `<image>` tags."""


def empty_frame(kind: str) -> pd.DataFrame:
    """A zero-row frame with the columns of one record kind: `str`, but `images` (lists of bytes,
    so `object`)."""
    return pd.DataFrame({name: pd.Series([], dtype=object if name == "images" else "str") for name in COLUMNS[kind]})


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
        given = plain(given)
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
            layout(source.kind, rename(dict.fromkeys(table.columns), source.columns))
        except Missing as missing:
            raise ReaderError(missing_message(table.shown, missing.args[0], source, table.columns, "column")) from None

    def first_of(index: int, record_id: str) -> tuple[str, str] | None:
        # Re-read the source up to record `index`: the first record with its id, if any, and where `index` is.
        first = None
        for i, (where, raw) in enumerate(open_table().rows):
            if i == index:
                return None if first is None else (first, where)
            if first is None and _record_id(rename(raw, source.columns) if source.columns else raw, name, i) == record_id:
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
            record = rename(raw, columns) if columns else raw
            try:
                keys = tuple(record)
                convert = layouts.get(keys)
                if convert is None:
                    if len(layouts) > 64:  # records with ever new keys: keep the cache small
                        layouts.clear()
                    convert = layouts[keys] = layout(kind, keys)
                values = convert(record)
                if with_images:
                    found = record_images(record, values[0], image_folder, shown_folder)
            except Missing as missing:
                raise ReaderError(missing_message(where, missing.args[0], source, raw, "field")) from None
            except Bad as bad:
                raise ReaderError(f"{where}: {bad}") from None
            if heldout:
                check_heldout_chat(values[0], where)
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

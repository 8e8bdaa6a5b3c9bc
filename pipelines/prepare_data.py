"""Normalise, filter, deduplicate and split the ingested records of every kind.

    python -m pipelines.prepare_data      # what dvc.yaml runs

Reads `data/ingested/{text,chat,preference,image_chat,feedback}.parquet` and writes
`data/prepared/<kind>/<split>.parquet` for every kind and split (train, validation, test: always
all fifteen files, empty ones with the kind's columns). Per kind, in order:

1. normalise every string (`cleaning.normalize_text`): the text; each message content (an image
   chat's `<image>` tags stay as they are); the prompt's contents, chosen and rejected (the
   completion of feedback). An empty
   system message is removed (it says nothing). Images are never re-encoded: the `images` column
   (`list<binary>`) leaves as it came from `ingest`.
2. drop records, each counted under the first reason that applies: `empty` (an empty text,
   message content, chosen or rejected), `too_short` / `too_long` (characters outside
   `[min_chars, max_chars]`: the text; the sum of the contents; prompt contents + chosen +
   rejected), `image_size` (an image chat with an image side outside
   `[image_min_side, image_max_side]` pixels), `chosen_equals_rejected`, `duplicate` (same
   content as an earlier record, when `dedup`; id, source and split ignored; an image chat's
   content is its messages and the SHA-256 of each image's bytes) and `near_duplicate` (text
   only, when `near_dedup`).
3. send `split: auto` records to train or validation by a hash of their content
   (`cleaning.assign_split`); explicit splits are kept.

At scale (memory bounded by the batch, not the data; `prepare_kind`): the input is read in
batches of `BATCH_ROWS` records, which worker processes (or a Dask cluster:
`pipelines/core/data/parallel.py`) normalise, judge, hash (SHA-256 of the content) and MinHash; the
records wait in a spool file. Deduplication is a shuffle by key, as datatrove and NeMo Curator do
it: each content hash, and each LSH band key, goes to one of `BUCKETS` files by its value, so
equal keys meet in one bucket, and each bucket is deduplicated on its own (in parallel) with the
global record index as the order: exactly what the in-memory definition above keeps
(`tests/stages/test_prepare_data_scale.py` checks it against `cleaning.exact_duplicates` and
`cleaning.near_duplicates`). The outputs are written in row groups of `ROW_GROUP_ROWS` rows, so
later stages read them batch by batch; their bytes do not depend on the number of workers.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq

from pipelines.core.data import cleaning, parallel
from pipelines.core.data.images import IMAGE_TOKEN, ImageError, count_placeholders, image_size, sha256_hex
from pipelines.core.errors import QllmError
from pipelines.core.outputs import atomic_dir, record_batches
from pipelines.core.params.data import PrepareDataParams
from pipelines.core.run import stage

NAME = "prepare_data"
IMPORTS_TRANSFORMERS = False  # the runner does not import torch, transformers and PEFT for it (repro.run_in_process)
SPLITS = ("train", "validation", "test")
REASONS = ("empty", "too_short", "too_long", "image_size", "chosen_equals_rejected", "duplicate", "near_duplicate")
# What each drop reason means, for the warning a non-zero count logs.
REASON_HELP = {
    "empty": "an empty text, message, chosen or rejected",
    "too_short": "fewer characters than prepare_data.min_chars",
    "too_long": "more characters than prepare_data.max_chars",
    "image_size": "an image with a side below prepare_data.image_min_side or above image_max_side pixels",
    "chosen_equals_rejected": "chosen and rejected are the same answer",
    "duplicate": "the same content as an earlier record",
    "near_duplicate": "MinHash similarity >= prepare_data.near_dedup_threshold to an earlier text",
}


class PrepareDataError(QllmError, ValueError):
    """The ingested data is missing or not what `ingest` writes."""


IMAGES_TYPE = pa.list_(pa.binary())
"""The `images` column (`readers.IMAGES_TYPE`, repeated as `KindRules.columns` are): each image's
file bytes; every other column is a string."""


# --------------------------------------------------------------------------- per-kind rules


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _normalize_messages(raw: str, form: str) -> str:
    messages = [{**m, "content": cleaning.normalize_text(m["content"], form)} for m in json.loads(raw)]
    kept = [m for m in messages if m["role"] != "system" or m["content"]]
    if messages and "tools" in messages[0] and kept and "tools" not in kept[0]:  # an empty system prompt carried the tools
        kept[0] = {**kept[0], "tools": messages[0]["tools"]}
    return _dumps(kept)


def _contents(raw: str) -> list[str]:
    """What each message says: its text, or for a tool call (whose text may be empty) the call."""
    return [m["content"] or _dumps(m["tool_calls"]) if "tool_calls" in m else m["content"] for m in json.loads(raw)]


def _normalize_text_kind(frame: pd.DataFrame, form: str) -> pd.DataFrame:
    return frame.assign(text=[cleaning.normalize_text(t, form) for t in frame["text"]])


def _normalize_chat(frame: pd.DataFrame, form: str) -> pd.DataFrame:
    return frame.assign(messages=[_normalize_messages(m, form) for m in frame["messages"]])


def _image_key(messages: str, images: list[bytes]) -> str:
    """An image chat's content: its messages and what its images are (the SHA-256 of their bytes)."""
    return _dumps([messages, [sha256_hex(data) for data in images]])


def _normalize_preference(frame: pd.DataFrame, form: str) -> pd.DataFrame:
    return frame.assign(
        prompt=[_normalize_messages(p, form) for p in frame["prompt"]],
        chosen=[cleaning.normalize_text(c, form) for c in frame["chosen"]],
        rejected=[cleaning.normalize_text(r, form) for r in frame["rejected"]],
    )


def _normalize_feedback(frame: pd.DataFrame, form: str) -> pd.DataFrame:
    return frame.assign(
        prompt=[_normalize_messages(p, form) for p in frame["prompt"]],
        completion=[cleaning.normalize_text(c, form) for c in frame["completion"]],
    )


@dataclass(frozen=True)
class KindRules:
    """How one record kind is normalised and what its content is."""

    columns: tuple[str, ...]
    """The kind's columns, as `ingest` writes them (`readers.COLUMNS`, repeated here so that this
    stage depends on cleaning.py and images.py only, as dvc.yaml says)."""
    normalize: Callable[[pd.DataFrame, str], pd.DataFrame]
    parts: Callable[[pd.DataFrame], list[list[str]]]
    """Every string of each record: emptiness and length are judged over these."""
    key: Callable[[pd.DataFrame], list[str]]
    """The record's content (id, source and split left out): dedup and split key."""
    same_answers: Callable[[pd.DataFrame], np.ndarray] | None = None
    near_dedup_text: Callable[[pd.DataFrame], list[str]] | None = None
    images: Callable[[pd.DataFrame], list[list[bytes]]] | None = None
    """The image bytes of each record, measured against `image_min_side`/`image_max_side`."""


KINDS: dict[str, KindRules] = {
    "text": KindRules(
        columns=("id", "source", "split", "text"),
        normalize=_normalize_text_kind,
        parts=lambda f: [[t] for t in f["text"]],
        key=lambda f: list(f["text"]),
        near_dedup_text=lambda f: list(f["text"]),
    ),
    "chat": KindRules(
        columns=("id", "source", "split", "messages"),
        normalize=_normalize_chat,
        parts=lambda f: [_contents(m) for m in f["messages"]],
        key=lambda f: list(f["messages"]),
    ),
    "preference": KindRules(
        columns=("id", "source", "split", "prompt", "chosen", "rejected"),
        normalize=_normalize_preference,
        parts=lambda f: [
            [*_contents(p), c, r] for p, c, r in zip(f["prompt"], f["chosen"], f["rejected"], strict=True)
        ],
        key=lambda f: [_dumps([p, c, r]) for p, c, r in zip(f["prompt"], f["chosen"], f["rejected"], strict=True)],
        same_answers=lambda f: (f["chosen"] == f["rejected"]).to_numpy(dtype=bool),
    ),
    "image_chat": KindRules(
        columns=("id", "source", "split", "messages", "images"),
        normalize=_normalize_chat,
        parts=lambda f: [_contents(m) for m in f["messages"]],
        key=lambda f: [_image_key(m, i) for m, i in zip(f["messages"], f["images"], strict=True)],
        images=lambda f: list(f["images"]),
    ),
    "feedback": KindRules(
        columns=("id", "source", "split", "prompt", "completion", "label"),
        normalize=_normalize_feedback,
        parts=lambda f: [[*_contents(p), c] for p, c in zip(f["prompt"], f["completion"], strict=True)],
        key=lambda f: [_dumps([p, c, lab]) for p, c, lab in zip(f["prompt"], f["completion"], f["label"], strict=True)],
    ),
}


# ------------------------------------------------------------------------------- the steps

BATCH_ROWS = 2048
"""Records per batch: the unit of work a worker gets, fixed so that outputs never depend on the
number of workers."""
ROW_GROUP_ROWS = 65_536
"""Rows per row group of the output files (fewer in a file's last one)."""
IMAGE_ROW_GROUP_ROWS = 1024
"""... but of the image_chat files, whose rows hold images: a row group is read whole, so it is kept
to a size a later stage can hold in memory."""
BUCKETS = 16
"""Buckets of the dedup shuffles: each holds the hashes (or band keys) of one key range, so
duplicates meet in one bucket and each bucket is deduplicated on its own, in parallel."""
NUM_PERM = 64
_KEEP = 0
_CODES = {reason: code for code, reason in enumerate(REASONS, start=1)}
_EXACT = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("index", "<i8")])
_BAND = np.dtype([("band", "<u8"), ("key", "<u8"), ("index", "<i8")])


def open_ingested(path: Path, kind: str) -> pq.ParquetFile:
    """Open one `data/ingested/<kind>.parquet`, checking that it has the kind's columns."""
    if not path.exists():
        raise PrepareDataError(f"{path}: not found; run the ingest stage first")
    try:
        source = pq.ParquetFile(path, pre_buffer=False)  # the default keeps every chunk read until closed
    except (pa.ArrowException, OSError) as exc:
        raise PrepareDataError(f"{path}: not a readable Parquet file ({exc}); run the ingest stage again") from None
    missing = [c for c in KINDS[kind].columns if c not in source.schema_arrow.names]
    if missing:
        raise PrepareDataError(f"{path}: missing columns {', '.join(missing)} (was it written by ingest?)")
    if "images" in KINDS[kind].columns:
        found = source.schema_arrow.field("images").type
        if not (pa.types.is_list(found) or pa.types.is_large_list(found)) or not (
            pa.types.is_binary(found.value_type) or pa.types.is_large_binary(found.value_type)
        ):
            raise PrepareDataError(f"{path}: column images is {found}, expected list<binary> (was it written by ingest?)")
    return source


def record_reasons(frame: pd.DataFrame, rules: KindRules, params: PrepareDataParams) -> np.ndarray:
    """The first reason of `REASONS` that applies to each (normalised) record on its own (all
    but the dedup ones), as codes: 0 keeps the record."""
    codes = np.zeros(len(frame), dtype=np.uint8)

    def mark(flags: np.ndarray, reason: str) -> None:
        codes[flags & (codes == _KEEP)] = _CODES[reason]

    parts = rules.parts(frame)
    lengths = np.array([sum(map(len, p)) for p in parts], dtype=np.int64)
    mark(np.array([any(s == "" for s in p) for p in parts], dtype=bool), "empty")
    mark(lengths < params.min_chars, "too_short")
    mark(lengths > params.max_chars, "too_long")
    if rules.images is not None:
        mark(_bad_image_sizes(frame, rules.images(frame), params), "image_size")
    if rules.same_answers is not None:
        mark(rules.same_answers(frame), "chosen_equals_rejected")
    return codes


def _bad_image_sizes(frame: pd.DataFrame, images: list[list[bytes]], params: PrepareDataParams) -> np.ndarray:
    """Which records have an image with a side outside `[image_min_side, image_max_side]` pixels
    (measured from the image's header)."""
    low, high = params.image_min_side, params.image_max_side
    flags = np.zeros(len(images), dtype=bool)
    for row, (record_id, messages, record) in enumerate(zip(frame["id"], frame["messages"], images, strict=True)):
        if (tags := count_placeholders(messages)) != len(record):  # normalisation can make one (NFKC: a fullwidth ＜image＞)
            raise PrepareDataError(f"image_chat record {record_id!r}: {tags} {IMAGE_TOKEN} placeholders after {params.normalize} "
                                   f"normalisation but {len(record)} images; write the tag as {IMAGE_TOKEN} only where an image goes")  # fmt: skip
        for index, data in enumerate(record):
            try:
                width, height = image_size(data)
            except ImageError as exc:
                raise PrepareDataError(f"image_chat record {record_id!r}: images[{index}]: {exc} (was it written by ingest?)") from None
            if min(width, height) < low or max(width, height) > high:
                flags[row] = True
                break
    return flags


class _Scanned(NamedTuple):
    records: pa.Table
    """The normalised records, `split` resolved (auto -> train/validation by content hash)."""
    codes: np.ndarray
    digests: np.ndarray
    """(n, 2) uint64: the first 16 bytes of SHA-256 of each record's content (`KindRules.key`)."""
    signatures: np.ndarray | None
    """(n, NUM_PERM) MinHash signatures (texts to near-deduplicate; zeros for records dropped already)."""


def _scan(task: tuple[str, PrepareDataParams, pa.Table]) -> _Scanned:
    """A worker's share of pass 1: normalise one batch, judge each record on its own, hash it."""
    kind, params, batch = task
    rules = KINDS[kind]
    schema = _schema(kind)
    strings = [field.name for field in schema if field.type == pa.string()]
    # Only the string columns become `str` (astype would turn image bytes into their repr); the
    # images are read as lists of bytes to judge and hash, and leave as the Arrow column they came in.
    frame = batch.select(strings).to_pandas().astype("str")
    if rules.images is not None:
        frame = frame.assign(images=pd.Series(batch.column("images").to_pylist(), index=frame.index, dtype=object))
    frame = rules.normalize(frame, params.normalize)
    codes = record_reasons(frame, rules, params)
    keys = rules.key(frame)
    digests = np.frombuffer(b"".join(hashlib.sha256(k.encode("utf-8")).digest()[:16] for k in keys), dtype=">u8")
    splits = frame["split"].to_numpy(dtype=object).copy()
    auto = np.flatnonzero(splits == "auto")
    splits[auto] = cleaning.assign_split([keys[i] for i in auto], params.validation_fraction, params.seed)
    signatures = None
    if params.near_dedup and rules.near_dedup_text is not None:
        signatures = np.zeros((len(frame), NUM_PERM), dtype=np.uint64)
        kept = np.flatnonzero(codes == _KEEP)
        texts = rules.near_dedup_text(frame)
        signatures[kept] = cleaning.minhash_signatures([texts[i] for i in kept], NUM_PERM)
    frame = frame.assign(split=splits)[strings]
    records = pa.Table.from_pandas(frame, schema=pa.schema([schema.field(name) for name in strings]), preserve_index=False)
    if rules.images is not None:
        columns = [batch.column(name).cast(IMAGES_TYPE) if name == "images" else records.column(name) for name in schema.names]
        records = pa.Table.from_arrays(columns, schema=schema)
    return _Scanned(records, codes, digests.reshape(-1, 2).astype(np.uint64), signatures)


def _schema(kind: str) -> pa.Schema:
    return pa.schema([(name, IMAGES_TYPE if name == "images" else pa.string()) for name in KINDS[kind].columns])


def _exact_bucket(path: Path) -> np.ndarray:
    """Indices of the records of one bucket whose content hash an earlier record has."""
    entries = np.fromfile(path, dtype=_EXACT)
    entries = entries[np.lexsort((entries["index"], entries["lo"], entries["hi"]))]
    repeat = (entries["hi"][1:] == entries["hi"][:-1]) & (entries["lo"][1:] == entries["lo"][:-1])
    return entries["index"][1:][repeat]


def _band_bucket(task: tuple[Path, Path, Path, int, float]) -> np.ndarray:
    """Confirmed near-duplicate pairs among the band keys of one bucket (exact duplicates, listed
    in `excluded`, left out)."""
    path, excluded_path, signatures_path, n, threshold = task
    entries = np.fromfile(path, dtype=_BAND)
    entries = entries[~np.isin(entries["index"], np.load(excluded_path))]
    entries = entries[np.lexsort((entries["index"], entries["key"], entries["band"]))]
    pairs = []
    for band in np.unique(entries["band"]):
        group = entries[entries["band"] == band]
        pairs.append(cleaning.band_pairs(group["key"], group["index"]))
    candidates = np.unique(np.concatenate(pairs), axis=0) if pairs else np.zeros((0, 2), dtype=np.int64)
    signatures = np.memmap(signatures_path, dtype=np.uint64, mode="r", shape=(n, NUM_PERM)) if n else np.zeros((0, NUM_PERM), np.uint64)
    return cleaning.confirm_pairs(candidates, signatures, threshold)


def prepare_kind(kind: str, source: pq.ParquetFile, out: Path, spool: Path, params: PrepareDataParams, pool: parallel.Pool,
                 shown: Path) -> dict[str, Any]:  # fmt: skip
    """Prepare one kind: write `out/<split>.parquet` (all three), return its metrics.

    Pass 1 (parallel, by batch): normalise, judge each record on its own, hash its content,
    MinHash it; the records go to a spool file, the hashes to `BUCKETS` files by key. Then
    (parallel, by bucket) exact duplicates, then near duplicates among the rest; then pass 2
    writes the kept records of every split."""
    from tqdm.auto import tqdm

    rules = KINDS[kind]
    spool.mkdir(parents=True)
    exact_files = [(spool / f"exact-{b}.bin").open("wb") for b in range(BUCKETS)]
    band_files = [(spool / f"band-{b}.bin").open("wb") for b in range(BUCKETS)]
    signatures_file = (spool / "signatures.bin").open("wb")
    codes: list[np.ndarray] = []
    n = 0
    total = source.metadata.num_rows
    tasks = ((kind, params, pa.Table.from_batches([batch])) for batch in record_batches(shown, BATCH_ROWS, list(rules.columns)))
    progress = tqdm(total=total, desc=f"prepare_data {kind}", unit=" records", unit_scale=True, disable=None if total > BATCH_ROWS else True)
    try:
        with pq.ParquetWriter(spool / "records.parquet", _schema(kind)) as spooled:
            for scanned in pool.map(_scan, tasks):
                splits = set(scanned.records.column("split").to_pylist()) - set(SPLITS)
                if splits:
                    raise PrepareDataError(f"{shown}: unknown split values {', '.join(map(repr, sorted(splits)))}")
                spooled.write_table(scanned.records)
                indices = np.arange(n, n + len(scanned.codes), dtype=np.int64)
                keep = scanned.codes == _KEEP
                if params.dedup:
                    _scatter(exact_files, _EXACT, scanned.digests[keep, 0], hi=scanned.digests[keep, 0], lo=scanned.digests[keep, 1], index=indices[keep])
                if scanned.signatures is not None:
                    keys = cleaning.band_keys(scanned.signatures[keep], params.near_dedup_threshold)
                    band = np.broadcast_to(np.arange(keys.shape[1], dtype=np.uint64), keys.shape).ravel()
                    _scatter(band_files, _BAND, keys.ravel(), band=band, key=keys.ravel(), index=np.repeat(indices[keep], keys.shape[1]))
                    signatures_file.write(scanned.signatures.tobytes())
                codes.append(scanned.codes)
                n += len(scanned.codes)
                progress.update(len(scanned.codes))
    finally:
        progress.close()
        for handle in (*exact_files, *band_files, signatures_file):
            handle.close()
    reasons = np.concatenate(codes) if codes else np.zeros(0, dtype=np.uint8)

    duplicates = np.zeros(0, dtype=np.int64)
    serial = n <= BATCH_ROWS  # one batch's buckets: cheaper here than starting workers
    if params.dedup:
        buckets = (spool / f"exact-{b}.bin" for b in range(BUCKETS))
        duplicates = np.sort(np.concatenate([duplicates, *pool.map(_exact_bucket, buckets, serial)]))
        reasons[duplicates] = _CODES["duplicate"]
    if params.near_dedup and rules.near_dedup_text is not None:
        np.save(spool / "excluded.npy", duplicates)
        tasks = ((spool / f"band-{b}.bin", spool / "excluded.npy", spool / "signatures.bin", n, params.near_dedup_threshold) for b in range(BUCKETS))
        pairs = np.concatenate([np.zeros((0, 2), np.int64), *pool.map(_band_bucket, tasks, serial)])
        reasons[cleaning.flag_groups(n, pairs)] = _CODES["near_duplicate"]

    out.mkdir()
    counts = dict.fromkeys(SPLITS, 0)
    group = min(ROW_GROUP_ROWS, IMAGE_ROW_GROUP_ROWS) if rules.images is not None else ROW_GROUP_ROWS
    writers = {split: _Writer(out / f"{split}.parquet", _schema(kind), group) for split in SPLITS}
    try:
        start = 0
        for batch in record_batches(spool / "records.parquet", BATCH_ROWS):
            kept = pa.Table.from_batches([batch]).filter(pa.array(reasons[start : start + len(batch)] == _KEEP))
            start += len(batch)
            split = kept.column("split")
            for name, writer in writers.items():
                part = kept.filter(pa.compute.equal(split, name))
                counts[name] += len(part)
                writer.add(part)
    finally:
        for writer in writers.values():
            writer.close()
    dropped = {reason: int((reasons == _CODES[reason]).sum()) for reason in REASONS}
    return {"in": n, "dropped": dropped, "out": counts}


def _scatter(files, dtype: np.dtype, by: np.ndarray, **columns: np.ndarray) -> None:
    """Append `columns` as `dtype` records to the bucket file of each row's key `by` (the shuffle)."""
    entries = np.empty(len(by), dtype=dtype)
    for name, values in columns.items():
        entries[name] = values
    bucket = (by % np.uint64(len(files))).astype(np.int64)
    order = np.argsort(bucket, kind="stable")
    bounds = np.searchsorted(bucket[order], np.arange(len(files) + 1))
    for b, handle in enumerate(files):
        handle.write(entries[order[bounds[b] : bounds[b + 1]]].tobytes())


class _Writer:
    """A Parquet file written in row groups of `group` rows, whatever the batches."""

    def __init__(self, path: Path, schema: pa.Schema, group: int):
        self.writer, self.schema, self.pending, self.rows = pq.ParquetWriter(path, schema), schema, [], 0
        self.group = group

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.rows += len(table)
        while self.rows >= self.group:
            self._flush(self.group)

    def _flush(self, rows: int) -> None:
        table = pa.concat_tables(self.pending)
        self.writer.write_table(table.slice(0, rows), row_group_size=self.group)
        rest = table.slice(rows)
        self.pending, self.rows = ([rest] if len(rest) else []), len(rest)

    def close(self) -> None:
        if self.rows:
            self._flush(self.rows)
        self.writer.close()


def run(in_dir: Path, out_dir: Path, params: PrepareDataParams) -> dict[str, Any]:
    """Prepare every kind and write `<out_dir>/<kind>/<split>.parquet` (all twelve files).

    Args:
        in_dir: `data/ingested` (one `<kind>.parquet` per kind).
        out_dir: directory to (atomically) replace.
        params: the `prepare_data` params section.

    Returns:
        Metrics: `{kind: {"in": n, "dropped": {reason: n}, "out": {split: n}}}`.
    """
    sources = {kind: open_ingested(Path(in_dir) / f"{kind}.parquet", kind) for kind in KINDS}
    metrics: dict[str, Any] = {}
    with atomic_dir(out_dir) as tmp, parallel.Pool() as pool:
        spool = tmp / ".spool"  # inside the temporary output: removed before it is renamed, or with it
        for kind, source in sources.items():
            metrics[kind] = prepare_kind(kind, source, tmp / kind, spool / kind, params, pool, Path(in_dir) / f"{kind}.parquet")
        shutil.rmtree(spool)
    return metrics


def body(ctx: stage.StageContext) -> dict[str, Any]:
    ctx.log.info("prepare_data: batches of %d records on %s", BATCH_ROWS, parallel.Pool().description)
    metrics = run(ctx.input("ingested"), ctx.output(), ctx.params)
    for kind, counts in metrics.items():
        out = counts["out"]
        ctx.log.info(
            "%s: %d in, %d out (train %d, validation %d, test %d), %d dropped",
            kind,
            counts["in"],
            sum(out.values()),
            out["train"],
            out["validation"],
            out["test"],
            sum(counts["dropped"].values()),
        )
        for reason, n in counts["dropped"].items():
            if n:
                ctx.log.warning("%s: dropped %d records as %s (%s)", kind, n, reason, REASON_HELP[reason])
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Tokenize the pretraining text and pack it into fixed-length sequences.

    python -m pipelines.tokenize       # what dvc.yaml runs; writes data/tokenized/

Documents are encoded in batches by the Rust tokenizer, joined with EOS separators and cut into
`seq_len`-token rows stored in the format of `pipelines.core.data.packed` (`train.bin`, `validation.bin`,
`meta.json`). The tail shorter than one sequence is dropped (counted in the metrics).

At scale: each split is read from Parquet `tokenize.batch_size` documents at a time and its rows
are written as they fill (`packed.SplitWriter`), so memory does not grow with the corpus. The
batches are encoded by `parallel.Pool` worker processes (`QLLM_DATA_WORKERS`, default all cores;
each worker encodes on one thread), in order, so the files are the same bytes whatever the number
of workers. What crosses processes is a batch's texts (one Arrow buffer), its token array, and
the JSON of the stage's Rust tokenizer (130 KB for the default vocabulary), which a worker parses
once and keeps; so workers need no files, also on a Dask cluster. With `QLLM_DATA_WORKERS=1`, and
for a split under `SERIAL_BYTES` of text, the stage encodes in its own process (on the Rust
tokenizer's threads unless `TOKENIZERS_PARALLELISM=false`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipelines.core.data import packed, parallel
from pipelines.core.errors import QllmError
from pipelines.core.outputs import atomic_dir, record_batches

if TYPE_CHECKING:  # the stage machinery is imported by `main` only: worker processes import this module
    from pipelines.core.params.data import TokenizeParams
    from pipelines.core.run import stage

NAME = "tokenize"
SPLITS = ("train", "validation")
SERIAL_BYTES = 4 << 20
"""A split with less text than this (Parquet's uncompressed size of the column) is encoded in the
stage's own process: starting workers would cost more than they save (break-even near 4 MB on 2 cores)."""


def text_batches(path: Path, batch_size: int) -> Iterator[Any]:
    """The `text` column of a Parquet file, at most `batch_size` documents at a time (never whole),
    as Arrow string arrays: they cross to a worker as one buffer, not as a list of Python strings."""
    for batch in record_batches(path, batch_size, ["text"]):
        yield batch.column(0)


def join_with_eos(ids: list[list[int]], eos: int, dtype: np.dtype | type) -> np.ndarray:
    """One array of every document's ids, each followed by `eos` (one array per batch, not per document)."""
    count = sum(map(len, ids)) + len(ids)
    return np.fromiter(itertools.chain.from_iterable(doc + [eos] for doc in ids), dtype=dtype, count=count)


@dataclass(frozen=True)
class Encoder:
    """What a batch needs besides its texts: the tokenizer (as the JSON of the parent's Rust
    tokenizer, so a worker encodes exactly as the stage would), EOS and the token dtype. `home` is
    the stage's process id: in any other process the tokenizer encodes on one thread, since the
    pool already runs a process per core."""

    key: str
    json: str
    eos: int
    dtype: str
    home: int

    @classmethod
    def of(cls, backend: Any, eos: int, dtype: np.dtype | type) -> Encoder:
        serialized = backend.to_str()
        encoder = cls(hashlib.sha256(serialized.encode()).hexdigest(), serialized, int(eos), np.dtype(dtype).name, os.getpid())
        _BACKENDS[encoder.key] = backend  # this process encodes with the very tokenizer it loaded
        return encoder

    def backend(self) -> Any:
        backend = _BACKENDS.get(self.key)
        if backend is None:
            from tokenizers import Tokenizer

            if os.getpid() != self.home:
                os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by the Rust tokenizer at each call
            backend = _BACKENDS[self.key] = Tokenizer.from_str(self.json)
        return backend


_BACKENDS: dict[str, Any] = {}
"""Rust tokenizers by `Encoder.key`, one per process (a worker builds its own once)."""


def encode_batch(job: tuple[Encoder, Any]) -> tuple[int, np.ndarray]:
    """(documents, their token stream with EOS after each): the work of one batch (an Arrow string
    array or a list of strings), in any process."""
    encoder, texts = job
    texts = texts if isinstance(texts, list) else texts.to_pylist()
    encodings = encoder.backend().encode_batch(texts, add_special_tokens=False)
    return len(texts), join_with_eos([encoding.ids for encoding in encodings], encoder.eos, encoder.dtype)


def pack_split(pool: parallel.Pool, encoder: Encoder, path: Path, out: Path, seq_len: int, batch_size: int) -> dict[str, int]:
    """Encode the texts of one Parquet split batch by batch and write their full rows to `out`."""
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    with pq.ParquetFile(path) as source:
        meta, column = source.metadata, source.schema_arrow.get_field_index("text")
        total = meta.num_rows
        text_bytes = sum(meta.row_group(i).column(column).total_uncompressed_size for i in range(meta.num_row_groups))
    documents = 0
    jobs = ((encoder, texts) for texts in text_batches(path, batch_size))
    with packed.SplitWriter(out, seq_len, np.dtype(encoder.dtype)) as writer, \
         tqdm(total=total, desc=f"{NAME} {path.stem}", unit=" docs", unit_scale=True, disable=None, leave=False) as bar:  # fmt: skip
        for n, tokens in pool.map(encode_batch, jobs, serial=text_bytes < SERIAL_BYTES):
            writer.append(tokens)
            documents += n
            bar.set_postfix_str(f"{writer.tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tokens/s", refresh=False)
            bar.update(n)
    return {"documents": documents, "sequences": writer.rows, "tokens": writer.tokens, "dropped_tokens": writer.dropped}


def run(text_dir: Path, tokenizer_dir: Path, out: Path, params: TokenizeParams) -> dict[str, float]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.uint32
    encoder = Encoder.of(tokenizer.backend_tokenizer, tokenizer.eos_token_id, dtype)
    metrics: dict[str, float] = {}
    sequences: dict[str, int] = {}
    started = time.perf_counter()
    total_tokens = 0
    with atomic_dir(out) as tmp, parallel.Pool() as pool:
        for split in SPLITS:
            path = text_dir / f"{split}.parquet"
            counts = pack_split(pool, encoder, path, tmp / f"{split}.bin", params.seq_len, params.batch_size)
            if counts["sequences"] == 0:
                raise QllmError(
                    f"{path}: the {split} split has {counts['tokens']} tokens, fewer than one "
                    f"sequence of tokenize.seq_len={params.seq_len}; lower tokenize.seq_len or add text"
                    + (" (or raise prepare_data.validation_fraction)" if split == "validation" else "")
                )
            sequences[split] = counts["sequences"]
            total_tokens += counts["tokens"]
            metrics |= {f"{split}_{key}": value for key, value in counts.items()}
        packed.write_meta(tmp, sequences, params.seq_len, dtype, {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id})
    seconds = time.perf_counter() - started
    return metrics | {"tokens_per_second": round(total_tokens / max(seconds, 1e-9)), "seq_len": params.seq_len}


def body(ctx: stage.StageContext) -> dict:
    metrics = run(ctx.input("text"), ctx.input("tokenizer"), ctx.output(), ctx.params)
    ctx.log.info(
        "packed %d train / %d validation sequences of %d tokens (%d tokens/s)",
        metrics["train_sequences"], metrics["validation_sequences"], metrics["seq_len"], metrics["tokens_per_second"],
    )
    return metrics


def main(argv: list[str] | None = None) -> int:
    from pipelines.core.run import stage

    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""The packed-sequence format written by `tokenize` and read by training and evaluation.

A split is a flat little-endian `uint16`/`uint32` file `<split>.bin` holding `[n, seq_len]` rows;
`meta.json` records `seq_len`, `dtype` and the row count of each split. Rows are memory-mapped,
so a data set larger than RAM trains the same way; `SplitWriter` writes a split as its token
stream arrives, so a data set larger than RAM is also packed the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipelines.core.outputs import read_json, write_json

META = "meta.json"


def pack(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """Cut a token stream into `[n, seq_len]` rows; returns the rows and the dropped tail length."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].reshape(n, seq_len), len(stream) - n * seq_len


def write(directory: Path, rows_by_split: dict[str, np.ndarray], extra: dict) -> None:
    """Write every split's rows and the `meta.json` that describes them."""
    meta = {**extra, "sequences": {}}
    for split, rows in rows_by_split.items():
        rows.tofile(directory / f"{split}.bin")
        meta["sequences"][split] = int(len(rows))
        meta["seq_len"] = int(rows.shape[1])
        meta["dtype"] = rows.dtype.name
    write_json(directory / META, meta)


def write_meta(directory: Path, sequences: dict[str, int], seq_len: int, dtype: np.dtype | type, extra: dict) -> None:
    """The `meta.json` that `write` writes, for splits written by `SplitWriter` (row counts by split)."""
    write_json(directory / META, {**extra, "sequences": {split: int(n) for split, n in sequences.items()}, "seq_len": int(seq_len), "dtype": np.dtype(dtype).name})


class SplitWriter:
    """Write a token stream to `<split>.bin` as it comes, in full `seq_len` rows.

    `append` takes the stream in pieces of any length; what does not fill a row yet is carried to
    the next piece, so the file is the bytes `write(directory, {split: pack(whole_stream, seq_len)[0]})`
    writes, without ever holding the whole stream. `close` returns the tail shorter than one row,
    which is dropped (`pack`'s second result).

        with SplitWriter(tmp / "train.bin", 256, np.uint16) as out:
            for tokens in pieces:
                out.append(tokens)
        out.rows, out.tokens, out.dropped
    """

    def __init__(self, path: Path, seq_len: int, dtype: np.dtype | type):
        self.path = Path(path)
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        self.rows = 0
        self.tokens = 0
        self.dropped = 0
        self._carry = np.zeros(0, dtype=self.dtype)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()/__exit__

    def __enter__(self) -> SplitWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def append(self, tokens: np.ndarray) -> None:
        """Add the next piece of the stream (a 1-D array of this writer's dtype)."""
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype:
            raise TypeError(f"{self.path.name}: tokens of dtype {tokens.dtype}, expected {self.dtype}")
        self.tokens += len(tokens)
        stream = np.concatenate([self._carry, tokens]) if len(self._carry) else tokens
        n = len(stream) // self.seq_len
        if n:
            self._file.write(np.ascontiguousarray(stream[: n * self.seq_len]).data)
            self.rows += n
        self._carry = stream[n * self.seq_len :].copy()

    def close(self) -> int:
        """Finish the file; returns the dropped tail length."""
        if not self._file.closed:
            self._file.close()
            self.dropped = len(self._carry)
            self._carry = np.zeros(0, dtype=self.dtype)
        return self.dropped


def load(directory: Path | str, split: str) -> np.ndarray:
    """Memory-map a packed split as a read-only `[n_sequences, seq_len]` array."""
    directory = Path(directory)
    meta = read_json(directory / META)
    return np.memmap(directory / f"{split}.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["sequences"][split], meta["seq_len"]))


def collate(rows: np.ndarray):
    """A collate function: row indices -> `{"input_ids": int64 tensor}` (sorted: sequential reads)."""
    import torch

    def batch(indices: np.ndarray) -> dict:
        return {"input_ids": torch.from_numpy(rows[np.sort(indices)].astype(np.int64))}

    return batch


def fixed_batches(rows: np.ndarray, batch_size: int, max_batches: int = 0) -> list[dict]:
    """The first `max_batches` (0: all) consecutive batches: a deterministic validation set."""
    make = collate(rows)
    n_batches = -(-len(rows) // batch_size)
    if max_batches:
        n_batches = min(n_batches, max_batches)
    return [make(np.arange(i * batch_size, min(len(rows), (i + 1) * batch_size))) for i in range(n_batches)]

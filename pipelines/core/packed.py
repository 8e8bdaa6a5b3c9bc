"""The packed-sequence format written by `tokenize` and read by training and evaluation.

A split is a flat little-endian `uint16`/`uint32` file `<split>.bin` holding `[n, seq_len]` rows;
`meta.json` records `seq_len`, `dtype` and the row count of each split. Rows are memory-mapped,
so a data set larger than RAM trains the same way.
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

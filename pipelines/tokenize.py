"""Tokenize the pretraining text and pack it into fixed-length sequences.

    python -m pipelines.tokenize       # what dvc.yaml runs; writes data/tokenized/

Documents are encoded in batches by the Rust tokenizer, joined with EOS separators and cut into
`seq_len`-token rows stored in the format of `pipelines.core.packed` (`train.bin`, `validation.bin`,
`meta.json`). The tail shorter than one sequence is dropped (counted in the metrics).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd

from pipelines.core import packed, stage
from pipelines.core.config import TokenizeParams
from pipelines.core.errors import QllmError
from pipelines.core.outputs import atomic_dir

NAME = "tokenize"
SPLITS = ("train", "validation")


def encode_documents(tokenizer, texts: list[str], batch_size: int) -> np.ndarray:
    """One flat token stream: every document followed by EOS."""
    eos = tokenizer.eos_token_id
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.uint32
    backend = tokenizer.backend_tokenizer  # the Rust tokenizer: batched and multi-threaded
    chunks = []
    for start in range(0, len(texts), batch_size):
        for encoding in backend.encode_batch(texts[start : start + batch_size], add_special_tokens=False):
            chunks.append(np.asarray(encoding.ids, dtype=dtype))
            chunks.append(np.asarray([eos], dtype=dtype))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def run(text_dir: Path, tokenizer_dir: Path, out: Path, params: TokenizeParams) -> dict[str, float]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    metrics: dict[str, float] = {}
    rows_by_split = {}
    started = time.perf_counter()
    total_tokens = 0
    with atomic_dir(out) as tmp:
        for split in SPLITS:
            texts = pd.read_parquet(text_dir / f"{split}.parquet", columns=["text"])["text"].tolist()
            stream = encode_documents(tokenizer, texts, params.batch_size)
            rows, dropped = packed.pack(stream, params.seq_len)
            if len(rows) == 0:
                raise QllmError(
                    f"{text_dir / f'{split}.parquet'}: the {split} split has {len(stream)} tokens, fewer than one "
                    f"sequence of tokenize.seq_len={params.seq_len}; lower tokenize.seq_len or add text"
                    + (" (or raise prepare_data.validation_fraction)" if split == "validation" else "")
                )
            rows_by_split[split] = rows
            total_tokens += len(stream)
            metrics |= {f"{split}_documents": len(texts), f"{split}_sequences": len(rows), f"{split}_tokens": int(len(stream)), f"{split}_dropped_tokens": dropped}
        packed.write(tmp, rows_by_split, {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id})
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
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())

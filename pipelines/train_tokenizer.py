"""Train a byte-level BPE tokenizer on the prepared training data.

    python -m pipelines.train_tokenizer      # what dvc.yaml runs; writes data/tokenizer/

The result is a `PreTrainedTokenizerFast` directory (`AutoTokenizer.from_pretrained` loads it)
with the ChatML special tokens and chat template of `pipelines.core.data.chat_template`, so SFT, DPO and evaluation
all use `apply_chat_template`. Byte-level BPE never produces unknown tokens.

At scale: the prepared splits are streamed from Parquet `BATCH_ROWS` rows at a time into the
trainer (same texts, same order as reading them whole, so the same tokenizer.json), and the
metrics are counted on the way, so memory is bounded by the trainer's table of distinct
pre-tokens, not by the corpus. The trainer counts words on its Rust threads (all cores) unless
`QLLM_DATA_WORKERS=1`, whatever `TOKENIZERS_PARALLELISM` says outside the training call (the
Makefile sets it false): the threads give the same tokenizer.json, 1.7x faster on 2 cores.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from pipelines.core import workspace
from pipelines.core.data import parallel
from pipelines.core.data.chat_template import (
    CHAT_TEMPLATE,
    EOS,
    MASK,
    PAD,
    SPECIAL_TOKENS,
    parse_messages,
    render_jinja,
    rendered_turn,
    tools_of,
    uses_tools,
)
from pipelines.core.errors import QllmError
from pipelines.core.models import model_source
from pipelines.core.outputs import atomic_dir, record_batches
from pipelines.core.params.data import TrainTokenizerParams
from pipelines.core.run import stage

NAME = "train_tokenizer"
BATCH_ROWS = 1024
"""Parquet rows read at a time: the prepared splits are streamed, never read whole."""
FALLBACK_TEXTS = 1000
"""Without validation text, compression is measured on this many first training texts."""


def parquet_batches(path: Path, columns: list[str], progress=None) -> Iterator[dict[str, list]]:
    """`columns` of a Parquet file as Python lists, `BATCH_ROWS` rows at a time; `progress` (a
    tqdm) is advanced by each batch's rows once the next one is asked for."""
    for batch in record_batches(path, BATCH_ROWS, columns):
        yield batch.to_pydict()
        if progress is not None:
            progress.update(batch.num_rows)


def training_rows(prepared: Path, split: str = "train") -> int:
    """Rows of the three `split` files `training_texts` reads (the progress bar's total)."""
    import pyarrow.parquet as pq

    total = 0
    for kind in ("text", "chat", "preference"):
        with pq.ParquetFile(prepared / kind / f"{split}.parquet") as source:
            total += source.metadata.num_rows
    return total


def training_texts(prepared: Path, split: str = "train", progress=None) -> Iterator[str]:
    """Every string the model will see: pretraining text, and chat and preference turns as the
    chat template renders them (so role names become tokens too; a chat with tools whole, its
    tools' list and its calls included). Streamed from the Parquet files a batch at a time;
    `progress` (a tqdm) counts their rows."""
    for batch in parquet_batches(prepared / "text" / f"{split}.parquet", ["text"], progress):
        yield from batch["text"]
    for batch in parquet_batches(prepared / "chat" / f"{split}.parquet", ["messages"], progress):
        for messages in batch["messages"]:
            parsed = parse_messages(messages)
            if uses_tools(parsed):
                yield from tool_chat_texts(parsed)
                continue
            for message in parsed:
                yield rendered_turn(message["role"], message["content"])
    for batch in parquet_batches(prepared / "preference" / f"{split}.parquet", ["prompt", "chosen", "rejected"], progress):
        for prompt, chosen, rejected in zip(batch["prompt"], batch["chosen"], batch["rejected"], strict=True):
            for message in parse_messages(prompt):
                yield rendered_turn(message["role"], message["content"])
            yield rendered_turn("assistant", chosen)
            yield rendered_turn("assistant", rejected)


_SPECIAL_TOKEN = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))


def tool_chat_texts(messages: list[dict]) -> list[str]:
    """A chat with tools as the project's template renders it, cut at its special tokens (each
    piece as `rendered_turn` gives a plain turn): the tools' list and the `<tool_call>` JSON are
    text the model reads and writes, so the tokenizer learns them too, instead of spelling
    `calculator` a letter at a time (a call was 66 tokens of the sample's tokenizer without them)."""
    turns, tools = tools_of(messages)
    (text,), _ = render_jinja([turns], CHAT_TEMPLATE, tools=tools)
    pieces = _SPECIAL_TOKEN.split(text)
    return [piece.strip("\n") for piece in pieces if piece.strip("\n")]


class Tally:
    """Counts the texts that pass through `count` (the metrics, computed on the fly) and keeps
    the first `keep` of them."""

    def __init__(self, keep: int = 0):
        self.texts = 0
        self.chars = 0
        self.any_text = False
        self.first: list[str] = []
        self._keep = keep

    def count(self, texts: Iterable[str]) -> Iterator[str]:
        for text in texts:
            self.texts += 1
            self.chars += len(text)
            if not self.any_text and text.strip():
                self.any_text = True
            if len(self.first) < self._keep:
                self.first.append(text)
            yield text


def chars_per_token(tokenizer, batches: Iterable[list[str]]) -> float:
    """Characters per token of the texts in `batches` (0 when there are none)."""
    n_tokens = n_chars = 0
    for texts in batches:
        if not texts:
            continue
        n_tokens += sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
        n_chars += sum(len(t) for t in texts)
    return round(n_chars / max(n_tokens, 1), 4)


def validation_batches(prepared: Path) -> Iterator[list[str]]:
    for batch in parquet_batches(prepared / "text" / "validation.parquet", ["text"]):
        yield batch["text"]


@contextlib.contextmanager
def rust_threads(enabled: bool) -> Iterator[None]:
    """`TOKENIZERS_PARALLELISM` for the block, as it was after: the Rust trainer reads it at each
    call. Its threads count the words of each chunk of texts; the result is the same either way."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if enabled else "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def train(texts: Iterator[str], vocab_size: int, min_frequency: int):
    """Train byte-level BPE and wrap it as a `PreTrainedTokenizerFast` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE)


def run(prepared: Path, out: Path, params: TrainTokenizerParams) -> dict[str, float]:
    """Train on `prepared/*/train.parquet`, save to `out`; report vocabulary and compression."""
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    tally = Tally(keep=FALLBACK_TEXTS)
    started = time.perf_counter()
    with tqdm(total=training_rows(prepared), desc=NAME, unit=" rows", unit_scale=True, disable=None, leave=False) as bar, \
         rust_threads(parallel.workers_setting() > 1):  # fmt: skip
        tokenizer = train(tally.count(training_texts(prepared, progress=bar)), params.vocab_size, params.min_frequency)
    seconds = time.perf_counter() - started
    if not tally.any_text:
        raise QllmError(f"{prepared}: no training text to learn a tokenizer from (all train splits are empty)")
    if params.mask_token:
        add_mask_token(tokenizer)
    with atomic_dir(out) as tmp:
        tokenizer.save_pretrained(tmp)
    with pq.ParquetFile(prepared / "text" / "validation.parquet") as validation:
        has_validation = validation.metadata.num_rows > 0
    return {
        "vocab_size": len(tokenizer),
        "train_texts": tally.texts,
        "train_chars": tally.chars,
        "chars_per_token": chars_per_token(tokenizer, validation_batches(prepared) if has_validation else [tally.first]),
        "train_seconds": round(seconds, 3),
    }


def add_mask_token(tokenizer) -> None:
    """The masked-diffusion objective's `<|mask|>` as the tokenizer's mask token, after the trained
    vocabulary (every other id stays as trained)."""
    tokenizer.add_special_tokens({"mask_token": MASK})


def use_base(base_dir: Path, prepared: Path, out: Path, record: dict) -> dict[str, float]:
    """Fine-tuning mode (`base_model.name` set): save the base model's tokenizer, chat template
    included (or the one `base_model.chat_template_path` gives), instead of training one; report
    its compression on the validation text."""
    from pipelines.core.models.models import load_tokenizer

    tokenizer = model_source.with_chat_template(load_tokenizer(base_dir), record)
    if tokenizer.eos_token_id is None:
        raise QllmError(f"base_model.name={record['name']!r}: its tokenizer has no EOS token (tokenize separates documents with it)")
    with atomic_dir(out) as tmp:
        tokenizer.save_pretrained(tmp)
    return {"vocab_size": len(tokenizer), "chars_per_token": chars_per_token(tokenizer, validation_batches(prepared)), "trained": False}


def body(ctx: stage.StageContext) -> dict:

    record = model_source.current(ctx.root)
    if record["name"] is not None:
        metrics = use_base(model_source.location(record, workspace.project_root(ctx.root)), ctx.input("prepared"), ctx.output(), record)
        ctx.log.info("tokenizer: the base model's (%s, %d tokens), not trained", record["name"], metrics["vocab_size"])
        return metrics
    metrics = run(ctx.input("prepared"), ctx.output(), ctx.params)
    ctx.log.info(
        "tokenizer: %d tokens, %.2f chars/token on validation text (trained on %d texts in %.1fs)",
        metrics["vocab_size"], metrics["chars_per_token"], metrics["train_texts"], metrics["train_seconds"],
    )
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Train a byte-level BPE tokenizer on the prepared training data.

    python -m pipelines.train_tokenizer      # what dvc.yaml runs; writes data/tokenizer/

The result is a `PreTrainedTokenizerFast` directory (`AutoTokenizer.from_pretrained` loads it)
with the ChatML special tokens and chat template of `pipelines.core.chat_template`, so SFT, DPO and evaluation
all use `apply_chat_template`. Byte-level BPE never produces unknown tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from pipelines.core import stage, workspace
from pipelines.core.chat_template import CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, parse_messages, rendered_turn
from pipelines.core.config import TrainTokenizerParams
from pipelines.core.errors import QllmError
from pipelines.core.outputs import atomic_dir

NAME = "train_tokenizer"


def training_texts(prepared: Path, split: str = "train") -> Iterator[str]:
    """Every string the model will see: pretraining text, and chat and preference turns as the
    chat template renders them (so role names become tokens too)."""
    text = pd.read_parquet(prepared / "text" / f"{split}.parquet", columns=["text"])
    yield from text["text"]
    chat = pd.read_parquet(prepared / "chat" / f"{split}.parquet", columns=["messages"])
    for messages in chat["messages"]:
        for message in parse_messages(messages):
            yield rendered_turn(message["role"], message["content"])
    pref = pd.read_parquet(prepared / "preference" / f"{split}.parquet", columns=["prompt", "chosen", "rejected"])
    for row in pref.itertuples(index=False):
        for message in parse_messages(row.prompt):
            yield rendered_turn(message["role"], message["content"])
        yield rendered_turn("assistant", row.chosen)
        yield rendered_turn("assistant", row.rejected)


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
    texts = list(training_texts(prepared))
    if not any(t.strip() for t in texts):
        raise QllmError(f"{prepared}: no training text to learn a tokenizer from (all train splits are empty)")
    started = time.perf_counter()
    tokenizer = train(iter(texts), params.vocab_size, params.min_frequency)
    seconds = time.perf_counter() - started
    with atomic_dir(out) as tmp:
        tokenizer.save_pretrained(tmp)
    validation = pd.read_parquet(prepared / "text" / "validation.parquet", columns=["text"])["text"].tolist() or texts[:1000]
    encoded = tokenizer(validation, add_special_tokens=False)["input_ids"]
    n_tokens = sum(len(ids) for ids in encoded)
    n_chars = sum(len(t) for t in validation)
    return {
        "vocab_size": len(tokenizer),
        "train_texts": len(texts),
        "train_chars": sum(len(t) for t in texts),
        "chars_per_token": round(n_chars / max(n_tokens, 1), 4),
        "train_seconds": round(seconds, 3),
    }


def use_base(base_dir: Path, prepared: Path, out: Path, name: str) -> dict[str, float]:
    """Fine-tuning mode (`base_model.name` set): save the base model's tokenizer, chat template
    included, instead of training one; report its compression on the validation text."""
    from pipelines.core.models import load_tokenizer

    tokenizer = load_tokenizer(base_dir)
    if tokenizer.eos_token_id is None:
        raise QllmError(f"base_model.name={name!r}: its tokenizer has no EOS token (tokenize separates documents with it)")
    with atomic_dir(out) as tmp:
        tokenizer.save_pretrained(tmp)
    validation = pd.read_parquet(prepared / "text" / "validation.parquet", columns=["text"])["text"].tolist()
    n_tokens = sum(len(ids) for ids in tokenizer(validation, add_special_tokens=False)["input_ids"]) if validation else 0
    return {"vocab_size": len(tokenizer), "chars_per_token": round(sum(map(len, validation)) / max(n_tokens, 1), 4), "trained": False}


def body(ctx: stage.StageContext) -> dict:
    from pipelines.core import model_source

    record = model_source.current(ctx.root)
    if record["name"] is not None:
        metrics = use_base(model_source.location(record, workspace.project_root(ctx.root)), ctx.input("prepared"), ctx.output(), record["name"])
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

"""train_tokenizer and tokenize at scale: streamed from Parquet, the same bytes as before.

Each stage is compared with a small reference copy of its previous implementation (reads every
split whole with pandas, one numpy array per document, `packed.pack` of the whole stream), on
prepared files written in many row groups and read in batches smaller than a row group, so every
boundary (batch, row group, packed row) falls somewhere inside a document. The streamed stages
must never read a split whole (`pandas.read_parquet` and `pyarrow.parquet.read_table` raise here),
and must write the same bytes with one worker process and with two.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines import tokenize, train_tokenizer
from pipelines.core.data import packed
from pipelines.core.data.chat_template import EOS, parse_messages, rendered_turn
from pipelines.core.errors import QllmError
from pipelines.core.params.data import TokenizeParams, TrainTokenizerParams

COLUMNS = {
    "text": ["id", "source", "split", "text"],
    "chat": ["id", "source", "split", "messages"],
    "preference": ["id", "source", "split", "prompt", "chosen", "rejected"],
}
WORDS = ["Tovik", "lives", "in", "Pelora", "near", "the", "river.", "Marela", "paints", "houses", "in", "Dunmar", "every", "spring;",
         "Orvin", "keeps", "bees,", "42", "hives", "and", "a", "café.", "naïve", "—", "ÄÖÜ", "日本語", "🙂", "x", "=", "f(1,", "2)", "None"]


def write_parquet(path: Path, kind: str, records: list[dict], row_group: int) -> None:
    """A prepared split as `prepare_data` writes it: string columns, many row groups."""
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(name, pa.string()) for name in COLUMNS[kind]])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, max(len(records), 1), row_group):
            chunk = records[start : start + row_group]
            writer.write_table(pa.table({name: [r[name] for r in chunk] for name in COLUMNS[kind]}, schema=schema))


def document(rng: random.Random, i: int) -> str:
    """Varied documents: a few words to a few hundred, newlines, unicode, now and then the EOS string."""
    words = [rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 40, 150, 400]))]
    text = " ".join(words) + ("\n\n" + " ".join(reversed(words[:20])) if i % 5 == 0 else "")
    return text + (f" {EOS}" if i % 37 == 0 else "")


def make_prepared(root: Path, n_train: int = 240, n_validation: int = 30, with_turns: bool = True) -> Path:
    rng = random.Random(0)
    prepared = root / "prepared"
    for split, n in {"train": n_train, "validation": n_validation, "test": 0}.items():
        texts = [{"id": f"{split}-{i}", "source": "t", "split": split, "text": document(rng, i)} for i in range(n)]
        write_parquet(prepared / "text" / f"{split}.parquet", "text", texts, row_group=23)
        chats = [{"id": f"{split}-{i}", "source": "t", "split": split, "messages": json.dumps(
            [{"role": "user", "content": f"Where does {rng.choice(WORDS)} live?"}, {"role": "assistant", "content": rng.choice(WORDS)}])}
            for i in range(40 if with_turns and split == "train" else 0)]  # fmt: skip
        write_parquet(prepared / "chat" / f"{split}.parquet", "chat", chats, row_group=7)
        pairs = [{"id": f"{split}-{i}", "source": "t", "split": split, "prompt": json.dumps([{"role": "user", "content": f"Who is {i}?"}]),
                  "chosen": rng.choice(WORDS), "rejected": rng.choice(WORDS)} for i in range(30 if with_turns and split == "train" else 0)]  # fmt: skip
        write_parquet(prepared / "preference" / f"{split}.parquet", "preference", pairs, row_group=9)
    return prepared


# --- the previous implementations, reading everything whole --------------------------------------


def reference_training_texts(prepared: Path) -> list[str]:
    texts = list(pd.read_parquet(prepared / "text" / "train.parquet", columns=["text"])["text"])
    for messages in pd.read_parquet(prepared / "chat" / "train.parquet", columns=["messages"])["messages"]:
        texts += [rendered_turn(m["role"], m["content"]) for m in parse_messages(messages)]
    for row in pd.read_parquet(prepared / "preference" / "train.parquet", columns=["prompt", "chosen", "rejected"]).itertuples(index=False):
        texts += [rendered_turn(m["role"], m["content"]) for m in parse_messages(row.prompt)]
        texts += [rendered_turn("assistant", row.chosen), rendered_turn("assistant", row.rejected)]
    return texts


def reference_train_tokenizer(prepared: Path, out: Path, params: TrainTokenizerParams, fallback: int = 1000) -> dict:
    texts = reference_training_texts(prepared)
    tokenizer = train_tokenizer.train(iter(texts), params.vocab_size, params.min_frequency)
    tokenizer.save_pretrained(out)
    validation = pd.read_parquet(prepared / "text" / "validation.parquet", columns=["text"])["text"].tolist() or texts[:fallback]
    n_tokens = sum(len(ids) for ids in tokenizer(validation, add_special_tokens=False)["input_ids"])
    return {"vocab_size": len(tokenizer), "train_texts": len(texts), "train_chars": sum(len(t) for t in texts),
            "chars_per_token": round(sum(len(t) for t in validation) / max(n_tokens, 1), 4)}  # fmt: skip


def reference_tokenize(text_dir: Path, tokenizer_dir: Path, out: Path, params: TokenizeParams) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.uint32
    metrics, rows_by_split = {}, {}
    for split in tokenize.SPLITS:
        texts = pd.read_parquet(text_dir / f"{split}.parquet", columns=["text"])["text"].tolist()
        chunks = []
        for start in range(0, len(texts), params.batch_size):
            for encoding in tokenizer.backend_tokenizer.encode_batch(texts[start : start + params.batch_size], add_special_tokens=False):
                chunks += [np.asarray(encoding.ids, dtype=dtype), np.asarray([tokenizer.eos_token_id], dtype=dtype)]
        stream = np.concatenate(chunks)
        rows, dropped = packed.pack(stream, params.seq_len)
        rows_by_split[split] = rows
        metrics |= {f"{split}_documents": len(texts), f"{split}_sequences": len(rows), f"{split}_tokens": len(stream), f"{split}_dropped_tokens": dropped}
    out.mkdir(parents=True)
    packed.write(out, rows_by_split, {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id})
    return metrics | {"seq_len": params.seq_len}


@pytest.fixture
def no_whole_reads(monkeypatch):
    """The streamed stages read Parquet a batch at a time: reading a split whole is an error."""
    def whole(*args, **kwargs):
        raise AssertionError("a prepared split was read whole")

    monkeypatch.setattr(pd, "read_parquet", whole)
    monkeypatch.setattr(pq, "read_table", whole)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)


def files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Prepared data, the reference tokenizer and its reference packed output."""
    root = tmp_path_factory.mktemp("corpus")
    prepared = make_prepared(root)
    params = TrainTokenizerParams(vocab_size=400, min_frequency=2)
    expected_metrics = reference_train_tokenizer(prepared, root / "tokenizer", params)
    tokenize_params = TokenizeParams(seq_len=48, batch_size=11)
    expected_tokenized = reference_tokenize(prepared / "text", root / "tokenizer", root / "tokenized", tokenize_params)
    return {"root": root, "prepared": prepared, "params": params, "metrics": expected_metrics,
            "tokenize_params": tokenize_params, "tokenized_metrics": expected_tokenized}  # fmt: skip


def test_the_corpus_spans_row_groups_and_batches(corpus):
    source = pq.ParquetFile(corpus["prepared"] / "text" / "train.parquet")
    assert source.metadata.num_row_groups > 5 and source.metadata.num_rows == 240
    assert corpus["tokenize_params"].batch_size < 23 < train_tokenizer.BATCH_ROWS  # batches cut row groups / span several
    assert corpus["tokenized_metrics"]["train_sequences"] > 20 and corpus["tokenized_metrics"]["train_dropped_tokens"] > 0


# --- train_tokenizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_rows", [5, 1024])
def test_train_tokenizer_streams_the_same_tokenizer(corpus, tmp_path, monkeypatch, no_whole_reads, batch_rows):
    monkeypatch.setattr(train_tokenizer, "BATCH_ROWS", batch_rows)
    metrics = train_tokenizer.run(corpus["prepared"], tmp_path / "tokenizer", corpus["params"])
    assert files(tmp_path / "tokenizer") == files(corpus["root"] / "tokenizer")
    assert {k: metrics[k] for k in corpus["metrics"]} == corpus["metrics"]
    assert metrics["train_texts"] == 240 + 40 * 2 + 30 * 3


def test_training_texts_in_the_order_of_whole_reads(corpus, monkeypatch):
    expected = reference_training_texts(corpus["prepared"])
    monkeypatch.setattr(train_tokenizer, "BATCH_ROWS", 4)
    assert list(train_tokenizer.training_texts(corpus["prepared"])) == expected


@pytest.mark.parametrize(("workers", "threads"), [("1", "false"), ("2", "true")])
def test_train_tokenizer_same_bytes_whatever_the_workers(corpus, tmp_path, monkeypatch, workers, threads):
    """More than one worker: the Rust trainer counts on its threads (only during training, whatever
    TOKENIZERS_PARALLELISM says; tests set it false), and trains the same tokenizer."""
    seen = []
    trainer = train_tokenizer.train

    def train(*args):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return trainer(*args)

    monkeypatch.setattr(train_tokenizer, "train", train)
    monkeypatch.setenv("QLLM_DATA_WORKERS", workers)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    train_tokenizer.run(corpus["prepared"], tmp_path / "tokenizer", corpus["params"])
    assert files(tmp_path / "tokenizer") == files(corpus["root"] / "tokenizer")
    assert seen == [threads] and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    with train_tokenizer.rust_threads(True):
        assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    assert "TOKENIZERS_PARALLELISM" not in os.environ


def test_train_tokenizer_falls_back_to_the_first_training_texts(tmp_path, monkeypatch):
    """Without validation text, compression is measured on the first `FALLBACK_TEXTS` training
    texts, the only ones kept in memory."""
    prepared = make_prepared(tmp_path, n_train=120, n_validation=0)
    params = TrainTokenizerParams(vocab_size=350, min_frequency=2)
    expected = reference_train_tokenizer(prepared, tmp_path / "reference", params, fallback=50)
    monkeypatch.setattr(train_tokenizer, "FALLBACK_TEXTS", 50)
    monkeypatch.setattr(train_tokenizer, "BATCH_ROWS", 8)
    metrics = train_tokenizer.run(prepared, tmp_path / "tokenizer", params)
    assert {k: metrics[k] for k in expected} == expected
    full = reference_train_tokenizer(prepared, tmp_path / "reference-1000", params)
    assert full["chars_per_token"] != expected["chars_per_token"]  # the fallback length matters, so the check above does too


def test_train_tokenizer_without_text_is_an_error(tmp_path):
    prepared = make_prepared(tmp_path, n_train=0, n_validation=3, with_turns=False)
    write_parquet(prepared / "text" / "train.parquet", "text", [{"id": "a", "source": "t", "split": "train", "text": " \n "}] * 3, 2)
    with pytest.raises(QllmError, match="no training text to learn a tokenizer from"):
        train_tokenizer.run(prepared, tmp_path / "tokenizer", TrainTokenizerParams(vocab_size=300))
    assert not (tmp_path / "tokenizer").exists()


def test_chars_per_token_by_batch_equals_whole(corpus):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(corpus["root"] / "tokenizer")
    texts = pd.read_parquet(corpus["prepared"] / "text" / "train.parquet")["text"].tolist()
    whole = sum(map(len, texts)) / sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    batches = [texts[i : i + 17] for i in range(0, len(texts), 17)] + [[]]
    assert train_tokenizer.chars_per_token(tokenizer, batches) == round(whole, 4)
    assert train_tokenizer.chars_per_token(tokenizer, []) == 0


# --- tokenize -------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tokenize_streams_the_same_bytes(corpus, tmp_path, monkeypatch, no_whole_reads, workers):
    """Byte-identical `.bin` and `meta.json` to the whole-split implementation, with one worker
    process and with two (batches of 11 documents, rows of 48 tokens: the remainder of every
    batch is carried into the next)."""
    monkeypatch.setenv("QLLM_DATA_WORKERS", workers)
    monkeypatch.setattr(tokenize, "SERIAL_BYTES", 0)  # the corpus is small: use the workers all the same
    metrics = tokenize.run(corpus["prepared"] / "text", corpus["root"] / "tokenizer", tmp_path / "tokenized", corpus["tokenize_params"])
    assert files(tmp_path / "tokenized") == files(corpus["root"] / "tokenized")
    assert set(files(tmp_path / "tokenized")) == {"meta.json", "train.bin", "validation.bin"}
    assert {k: metrics[k] for k in corpus["tokenized_metrics"]} == corpus["tokenized_metrics"]
    assert metrics["tokens_per_second"] > 0
    rows = packed.load(tmp_path / "tokenized", "train")
    assert rows.shape == (metrics["train_sequences"], 48)


def test_small_splits_are_encoded_in_the_stage_process(corpus, tmp_path, monkeypatch):
    """Below `SERIAL_BYTES` of text, starting workers costs more than they save."""
    from pipelines.core.data import parallel

    calls = []
    pool_map = parallel.Pool.map

    def spy(self, fn, items, serial=False):
        calls.append(serial)
        return pool_map(self, fn, items, serial)

    monkeypatch.setattr(parallel.Pool, "map", spy)
    monkeypatch.setenv("QLLM_DATA_WORKERS", "2")
    tokenize.run(corpus["prepared"] / "text", corpus["root"] / "tokenizer", tmp_path / "small", corpus["tokenize_params"])
    monkeypatch.setattr(tokenize, "SERIAL_BYTES", 40_000)  # between the two splits' sizes
    tokenize.run(corpus["prepared"] / "text", corpus["root"] / "tokenizer", tmp_path / "large", corpus["tokenize_params"])
    assert calls == [True, True, False, True]
    assert files(tmp_path / "small") == files(tmp_path / "large") == files(corpus["root"] / "tokenized")


def test_tokenize_rows_are_the_documents_joined_with_eos(corpus):
    """The packed rows, spelled out: every document's ids then EOS, cut every `seq_len` tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(corpus["root"] / "tokenizer" / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS)
    stream = []
    for text in pq.ParquetFile(corpus["prepared"] / "text" / "validation.parquet").read().column("text").to_pylist():
        stream += tokenizer.encode(text, add_special_tokens=False).ids + [eos]
    n = len(stream) // 48
    expected = np.array(stream[: n * 48], dtype=np.uint16).reshape(n, 48)
    np.testing.assert_array_equal(packed.load(corpus["root"] / "tokenized", "validation"), expected)


def test_workers_build_the_same_tokenizer_from_its_json(corpus):
    """A worker process builds its tokenizer from the job's JSON, once (cached by key): the same
    ids as the stage's own tokenizer, and the same result through a pool of two processes."""
    from transformers import AutoTokenizer

    from pipelines.core.data import parallel

    tokenizer = AutoTokenizer.from_pretrained(corpus["root"] / "tokenizer")
    encoder = tokenize.Encoder.of(tokenizer.backend_tokenizer, tokenizer.eos_token_id, np.uint16)
    texts = list(tokenize.text_batches(corpus["prepared"] / "text" / "train.parquet", 16))
    expected = [tokenize.encode_batch((encoder, batch)) for batch in texts]
    del tokenize._BACKENDS[encoder.key]  # as in a fresh worker process
    rebuilt = [tokenize.encode_batch((encoder, batch)) for batch in texts]
    assert tokenize._BACKENDS[encoder.key] is not tokenizer.backend_tokenizer
    with parallel.Pool(workers=2) as pool:
        pooled = list(pool.map(tokenize.encode_batch, ((encoder, batch) for batch in texts)))
    for got in (rebuilt, pooled):
        assert [n for n, _ in got] == [n for n, _ in expected] == [len(batch) for batch in texts]
        for (_, a), (_, b) in zip(got, expected, strict=True):
            assert a.dtype == b.dtype == np.uint16
            np.testing.assert_array_equal(a, b)


def test_join_with_eos():
    joined = tokenize.join_with_eos([[5, 6], [], [7]], 2, np.uint32)
    assert joined.dtype == np.uint32 and joined.tolist() == [5, 6, 2, 2, 7, 2]
    assert tokenize.join_with_eos([], 2, np.uint16).tolist() == []


def test_tokenize_split_shorter_than_one_sequence_is_an_error(corpus, tmp_path):
    prepared = make_prepared(tmp_path, n_train=60, n_validation=1, with_turns=False)
    write_parquet(prepared / "text" / "validation.parquet", "text", [{"id": "v", "source": "t", "split": "validation", "text": "Tovik"}], 1)
    with pytest.raises(QllmError, match=r"validation split has \d tokens, fewer than one sequence of tokenize.seq_len=48.*validation_fraction"):
        tokenize.run(prepared / "text", corpus["root"] / "tokenizer", tmp_path / "tokenized", TokenizeParams(seq_len=48, batch_size=4))
    assert not (tmp_path / "tokenized").exists() and not list(tmp_path.glob(".tmp-*"))  # atomic: nothing half-written
    write_parquet(prepared / "text" / "train.parquet", "text", [], 1)
    with pytest.raises(QllmError, match=r"train split has 0 tokens, fewer than one sequence"):
        tokenize.run(prepared / "text", corpus["root"] / "tokenizer", tmp_path / "tokenized", TokenizeParams(seq_len=48, batch_size=4))


# --- packed.SplitWriter ---------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [1, 8, 37])
def test_split_writer_carries_the_remainder(tmp_path, seq_len):
    rng = np.random.default_rng(seq_len)
    pieces = [rng.integers(0, 60000, size, dtype=np.uint16) for size in [0, 3, 1, 50, 7, 0, 36, 37, 2, 100]]
    with packed.SplitWriter(tmp_path / "train.bin", seq_len, np.uint16) as writer:
        for piece in pieces:
            writer.append(piece)
    stream = np.concatenate(pieces)
    rows, dropped = packed.pack(stream, seq_len)
    assert (tmp_path / "train.bin").read_bytes() == rows.tobytes()
    assert (writer.rows, writer.tokens, writer.dropped) == (len(rows), len(stream), dropped)
    packed.write_meta(tmp_path, {"train": writer.rows}, seq_len, np.uint16, {"vocab_size": 9})
    np.testing.assert_array_equal(packed.load(tmp_path, "train"), rows)
    (tmp_path / "whole").mkdir()
    packed.write(tmp_path / "whole", {"train": rows}, {"vocab_size": 9})
    assert (tmp_path / "whole" / "meta.json").read_bytes() == (tmp_path / "meta.json").read_bytes()


def test_split_writer_refuses_another_dtype(tmp_path):
    with packed.SplitWriter(tmp_path / "train.bin", 4, np.uint16) as writer, pytest.raises(TypeError, match="uint32"):
        writer.append(np.arange(5, dtype=np.uint32))


def test_a_chat_with_tools_is_learned_as_the_template_renders_it(tmp_path):
    """The tools' list and the `<tool_call>` JSON are text the model reads and writes: the tokenizer
    trains on a tool chat as the template renders it (cut at the special tokens), so `calculator`
    and `expression` become tokens instead of being spelled a few letters at a time."""
    import re

    from pipelines.core.data.chat_template import SPECIAL_TOKENS, TOOLS_KEY, render_chat
    from pipelines.core.data.sample_world import CALCULATOR_SCHEMA

    prepared = make_prepared(tmp_path, n_train=60, n_validation=5)
    rng = random.Random(0)
    chats = []
    for _ in range(80):
        a, b = rng.randrange(1000, 10000), rng.randrange(1000, 10000)
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
        chats.append([{"role": "user", "content": f"What is {a} times {b}?", TOOLS_KEY: [CALCULATOR_SCHEMA]}, {"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "name": "calculator", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}])  # fmt: skip
    plain = pd.read_parquet(prepared / "chat" / "train.parquet")
    records = plain.to_dict("records") + [{"id": f"tool-{i}", "source": "t", "split": "train", "messages": json.dumps(c)} for i, c in enumerate(chats)]
    write_parquet(prepared / "chat" / "train.parquet", "chat", records, row_group=7)

    texts = list(train_tokenizer.training_texts(prepared))
    train_tokenizer.run(prepared, tmp_path / "tokenizer", TrainTokenizerParams(vocab_size=600, min_frequency=2))
    from pipelines.core.models.models import load_tokenizer

    tokenizer = load_tokenizer(tmp_path / "tokenizer")
    rendered = render_chat(tokenizer, chats[0])  # transformers' own rendering of the chat, tools and calls
    pieces = [p.strip("\n") for p in re.split("|".join(map(re.escape, SPECIAL_TOKENS)), rendered) if p.strip("\n")]
    start = texts.index(pieces[0])
    assert texts[start : start + len(pieces)] == pieces and any("<tool_call>" in p for p in pieces) and "calculator(expression" in pieces[0]
    assert sum(len(rendered_turn(m["role"], m["content"])) for m in parse_messages(plain["messages"][0])) > 0  # the plain chats are still there
    call = rendered.split("<|im_start|>assistant:")[1].split("<|im_end|>")[0]
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(call, add_special_tokens=False)["input_ids"])
    assert "calculator" in tokens and "expression" in tokens and len(tokens) < 40, tokens

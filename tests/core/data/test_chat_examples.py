"""Chat examples: completion-only masks, length limits, and packing without cross-attention."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from pipelines.core.data import chat_examples
from pipelines.core.data.chat_examples import IGNORE
from pipelines.core.models.models import load_causal_lm, load_tokenizer
from tests import numerics
from tests.conftest import CHATS


def test_loss_mask_covers_only_assistant_answers_and_their_end_token(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    (example,), stats = chat_examples.encode(tokenizer, [CHATS[0]], max_len=128)
    trained = example.input_ids[example.labels != IGNORE]
    assert tokenizer.decode(trained) == " Pelora<|im_end|>"  # the answer keeps its running-text spelling
    assert stats.target_tokens == len(trained) and stats.examples == 1
    (multi,), _ = chat_examples.encode(tokenizer, [CHATS[6]], max_len=128)
    assert tokenizer.decode(multi.input_ids[multi.labels != IGNORE]) == " 3<|im_end|> 3<|im_end|>"  # both turns


def test_all_token_loss_trains_everything_but_the_first_token(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    (example,), _ = chat_examples.encode(tokenizer, [CHATS[0]], max_len=128, loss_on="all")
    assert example.labels[0] == IGNORE and (example.labels[1:] == example.input_ids[1:]).all()


def test_overflow_is_truncated_or_dropped_and_counted(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    full, _ = chat_examples.encode(tokenizer, [CHATS[6]], max_len=128)
    n = len(full[0].input_ids)
    # cut inside the second answer: the first answer is still trained
    truncated, stats = chat_examples.encode(tokenizer, [CHATS[6]], max_len=n - 2)
    assert stats.truncated == 1 and len(truncated[0].input_ids) == n - 2
    dropped, stats = chat_examples.encode(tokenizer, [CHATS[6]], max_len=n - 2, overflow="drop")
    assert dropped == [] and stats.dropped_too_long == 1
    none_left, stats = chat_examples.encode(tokenizer, [CHATS[0]], max_len=5)  # cut before any answer
    assert none_left == [] and stats.truncated == 1 and stats.dropped_no_target == 1


def test_packing_fills_rows_and_restarts_positions(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    examples, _ = chat_examples.encode(tokenizer, CHATS, max_len=128)
    rows = chat_examples.pack(examples, 128)
    assert len(rows) < len(examples)
    assert sum(len(r.input_ids) for r in rows) == sum(len(e.input_ids) for e in examples)
    assert all(len(r.input_ids) <= 128 for r in rows)
    starts = [int((r.position_ids == 0).sum()) for r in rows]
    assert sum(starts) == len(examples)


def test_an_example_has_the_same_logits_packed_and_alone(tiny_base):
    """No attention across examples: packing must not change any example's outputs."""
    tokenizer = load_tokenizer(tiny_base / "model")
    model = load_causal_lm(tiny_base / "model").eval()
    examples, _ = chat_examples.encode(tokenizer, CHATS[:3], max_len=128)
    rows = chat_examples.pack(examples, 256)  # positions restart per example: each stays < 128
    assert len(rows) == 1  # all three share one row
    row = rows[0]
    packed = chat_examples.collate(rows, tokenizer.pad_token_id, packed=True)(np.array([0]))
    starts = [*np.flatnonzero(row.position_ids == 0), len(row.input_ids)]
    assert len(starts) == 4
    with torch.no_grad():
        packed_logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits[0]
        for start, stop in itertools.pairwise(starts):
            alone = model(input_ids=torch.from_numpy(row.input_ids[start:stop]).unsqueeze(0), use_cache=False).logits[0]
            # the packed row against the example alone: two orders of the forward's chain (tests/numerics.py)
            numerics.assert_close_as(packed_logits[start:stop], alone, n=numerics.model_roundings(model.config, len(row.input_ids)), what=f"example at {start}")
    # and the mask matters: with a KV cache (use_cache=True) transformers ignores the packing
    with torch.no_grad():
        leaky = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=True).logits[0]
    tol = numerics.tolerance(numerics.model_roundings(model.config, len(row.input_ids)), magnitude=float(packed_logits.abs().max()))
    assert not numerics.within(leaky[starts[1] : starts[2]], packed_logits[starts[1] : starts[2]], tol)


def test_packed_and_unpacked_batches_give_the_same_loss(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    model = load_causal_lm(tiny_base / "model").eval()
    examples, _ = chat_examples.encode(tokenizer, CHATS, max_len=128)
    packed_rows, plain_rows = chat_examples.pack(examples, 128), chat_examples.unpacked(examples)
    with torch.no_grad():
        packed_loss, _ = chat_examples.chat_loss(model, chat_examples.collate(packed_rows, tokenizer.pad_token_id, True)(np.arange(len(packed_rows))))
        plain_loss, _ = chat_examples.chat_loss(model, chat_examples.collate(plain_rows, tokenizer.pad_token_id, False)(np.arange(len(plain_rows))))
    tokens = sum(len(e.input_ids) for e in examples)
    numerics.assert_close_as(packed_loss, plain_loss, n=numerics.model_roundings(model.config, 128, tokens=tokens))  # two orders of the chain

"""Preference pairs: completion-only log-probs, one concatenated forward, bad pairs handled."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from pipelines.core.errors import QllmError
from pipelines.core.models.models import load_causal_lm, load_tokenizer
from pipelines.core.preference import preference_data
from tests import numerics


def frame(rows) -> pd.DataFrame:
    return pd.DataFrame(
        {"id": [f"p{i}" for i in range(len(rows))], "prompt": [json.dumps(p) for p, _, _ in rows],
         "chosen": [c for _, c, _ in rows], "rejected": [r for _, _, r in rows]}
    )


USER = [{"role": "user", "content": "Where does Tovik live?"}]


def test_only_the_answer_counts_and_both_share_the_prompt(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    (pair,), dropped = preference_data.encode_pairs(tokenizer, frame([(USER, "Pelora", "Dunmar")]), max_length=128)
    assert sum(dropped.values()) == 0
    assert tokenizer.decode(pair.chosen_ids[pair.prompt_length :]) == " Pelora<|im_end|>"
    assert tokenizer.decode(pair.rejected_ids[pair.prompt_length :]) == " Dunmar<|im_end|>"
    assert np.array_equal(pair.chosen_ids[: pair.prompt_length], pair.rejected_ids[: pair.prompt_length])
    assert tokenizer.decode(pair.chosen_ids[: pair.prompt_length]).endswith("<|im_start|>assistant:")


def test_concatenated_forward_equals_separate_forwards(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    model = load_causal_lm(tiny_base / "model").eval()
    rows = [(USER, "Pelora", "Dunmar"), ([{"role": "user", "content": "What is 1 plus 2?"}], "3", "40")]
    pairs, _ = preference_data.encode_pairs(tokenizer, frame(rows), max_length=128)
    with torch.no_grad():
        chosen, rejected = preference_data.sequence_logps(model, preference_data.collate(pairs, tokenizer.pad_token_id)(np.arange(2)))
        for i, pair in enumerate(pairs):
            for ids, value in ((pair.chosen_ids, chosen[i]), (pair.rejected_ids, rejected[i])):
                logits = model(input_ids=torch.from_numpy(ids).unsqueeze(0)).logits[0, :-1].log_softmax(-1)
                expected = logits[torch.arange(len(ids) - 1), torch.from_numpy(ids[1:])][pair.prompt_length - 1 :].sum()
                # a padded batch against one row: two orders of the forward's chain (tests/numerics.py)
                numerics.assert_close_as(value, expected, n=numerics.model_roundings(model.config, len(ids)))


BAD = [
    (USER, "", "Dunmar", "empty_chosen"),
    (USER, "Pelora", "  ", "empty_rejected"),
    (USER, "Pelora", "Pelora", "chosen_equals_rejected"),
    ([{"role": "system", "content": "Be brief."}], "Pelora", "Dunmar", "no_user_turn"),
    ([{"role": "user", "content": "Where " * 200}], "Pelora", "Dunmar", "too_long"),
]


@pytest.mark.parametrize(("prompt", "chosen", "rejected", "reason"), BAD)
def test_bad_pairs_are_counted_and_dropped(tiny_base, prompt, chosen, rejected, reason):
    tokenizer = load_tokenizer(tiny_base / "model")
    rows = [(USER, "Pelora", "Dunmar"), (prompt, chosen, rejected)]
    pairs, dropped = preference_data.encode_pairs(tokenizer, frame(rows), max_length=128)
    assert [p.id for p in pairs] == ["p0"] and dropped[reason] == 1 and sum(dropped.values()) == 1


def test_bad_pairs_can_be_errors_naming_the_pair(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    with pytest.raises(QllmError, match=r"train.parquet: pair 'p1': chosen equals rejected \(set on_invalid: drop"):
        preference_data.encode_pairs(tokenizer, frame([(USER, "a", "b"), (USER, "x", "x")]), 128, on_invalid="error", where="train.parquet: ")


def test_prompt_limit(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    pairs, dropped = preference_data.encode_pairs(tokenizer, frame([(USER, "Pelora", "Dunmar")]), max_length=128, max_prompt_length=5)
    assert pairs == [] and dropped["prompt_too_long"] == 1


def test_cached_frame_round_trip(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    pairs, _ = preference_data.encode_pairs(tokenizer, frame([(USER, "Pelora", "Dunmar")]), max_length=128)
    pairs[0].ref_chosen, pairs[0].ref_rejected = -1.5, -7.25
    (back,) = preference_data.from_frame(preference_data.to_frame(pairs, "train"))
    assert np.array_equal(back.chosen_ids, pairs[0].chosen_ids) and back.prompt_length == pairs[0].prompt_length
    assert (back.ref_chosen, back.ref_rejected) == (-1.5, -7.25)


@pytest.mark.parametrize("adapter", [False, True])
def test_each_prompt_once_gives_the_whole_rows_logps_and_gradients(tiny_base, adapter):
    """Training runs each pair's prompt once (a KV cache repeated for both answers): the same
    log-probabilities and gradients as the concatenated rows, with prompts of different lengths
    (left-padded) and answers of different lengths (right-padded)."""
    from pipelines.core.models import adapters
    from pipelines.core.params.finetuning import LoraAdapterParams

    tokenizer = load_tokenizer(tiny_base / "model")
    rows = [(USER, "Pelora", "Dunmar Kestal"), ([{"role": "system", "content": "Answer with one word."}, *USER], "Kestal is far away", "No"),
            ([{"role": "user", "content": "What is 3 plus 4?"}], "7", "eight")]  # fmt: skip
    pairs, _ = preference_data.encode_pairs(tokenizer, frame(rows), max_length=128)
    assert len({p.prompt_length for p in pairs}) == 3
    model = load_causal_lm(tiny_base / "model")
    if adapter:
        model = adapters.wrap(LoraAdapterParams(enabled=True, r=2, trainable_tokens=[]), "dpo.adapter")(model, tokenizer)
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(weight, std=0.05)  # non-zero, so the adapter's gradients matter
    model.eval()  # no dropout (the adapter's would draw different masks); gradients flow all the same
    batch = preference_data.collate(pairs, tokenizer.pad_token_id)(np.arange(3))
    assert preference_data.shares_prompt(model)

    def logps_and_grads(fn):
        model.zero_grad()
        chosen, rejected = fn(model, batch)
        (chosen.sum() + 2 * rejected.sum()).backward()
        return chosen.detach(), rejected.detach(), {n: w.grad.clone() for n, w in model.named_parameters() if w.grad is not None}

    shared = logps_and_grads(preference_data.shared_prompt_logps)
    whole = logps_and_grads(preference_data._rows)
    # the prompt once against every row whole: two orders of the forward's and the backward's chains (tests/numerics.py)
    seq = batch["input_ids"].shape[1]
    numerics.assert_close_as(shared[0], whole[0], n=numerics.model_roundings(model.config, seq), what="chosen")
    numerics.assert_close_as(shared[1], whole[1], n=numerics.model_roundings(model.config, seq), what="rejected")
    assert shared[2].keys() == whole[2].keys() and shared[2]
    for name in whole[2]:
        numerics.assert_close_as(shared[2][name], whole[2][name], n=numerics.model_roundings(model.config, seq, tokens=batch["input_ids"].numel(), backward=True), what=name)
    # the stage's entry point takes the shared path in training; gradient checkpointing turns it off
    assert torch.equal(preference_data.sequence_logps(model, batch)[0].detach(), preference_data.shared_prompt_logps(model, batch)[0].detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU bf16: one forward a batch was as fast for 2 answers, slower for GRPO's groups (measured)
        assert not preference_data.shares_prompt(model) and not preference_data.shares_prompt(model, 3)
        assert preference_data.shares_prompt(model, 4) and preference_data.shares_prompt(model, 8)
    preference_data.chunked_loss.causal_lm(model).gradient_checkpointing_enable()
    assert not preference_data.shares_prompt(model)

"""Our reference log-probs against TRL's on the same pairs: equal once TRL's extra newline is added.

TRL's `DPOTrainer` renders conversational pairs with the chat template itself and scores everything
after the prompt, including the `\\n` the template writes after `<|im_end|>`; `ref_logprobs` stops at
`<|im_end|>` (`pipelines/core/preference/preference_data.py`). TRL's tokens and numbers come from its own
dataset preparation and precompute pass.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from benchmarks.peers import peer_dpo
from pipelines import ref_logprobs
from pipelines.core.models.models import load_causal_lm, load_tokenizer
from pipelines.core.preference import preference_data
from tests import numerics


def test_reference_logps_equal_trls_plus_the_trailing_newline(tiny_base):
    tokenizer = load_tokenizer(tiny_base / "model")
    model = load_causal_lm(tiny_base / "model").eval()
    records = pd.read_parquet(tiny_base / "preference/train.parquet")
    pairs, dropped = preference_data.encode_pairs(tokenizer, records, max_length=128)
    assert len(pairs) == len(records) and not any(dropped.values())
    ref_logprobs.score(model, pairs, tokenizer.pad_token_id, batch_size=4)  # the stage's pass
    ours = np.asarray([[p.ref_chosen, p.ref_rejected] for p in pairs])

    tails = peer_dpo.template_tails(tokenizer, records, pairs)
    assert {tokenizer.decode(tail) for pair_tails in tails for tail in pair_tails} == {"\n"}  # one token each
    assert all(len(tail) == 1 for pair_tails in tails for tail in pair_tails)
    newline = peer_dpo.tail_logps(model, pairs, tails)
    prepared = peer_dpo.trl_precomputed(model, tokenizer, records, max_length=128, batch_size=4)
    assert peer_dpo.same_split(prepared, pairs, tails).all()  # TRL's prompt is ours; its completions ours + "\n"
    trl = prepared[["ref_chosen_logps", "ref_rejected_logps"]].to_numpy(np.float64)

    # the stage's batches against TRL's: two orders of the forward's chain, on the sums' size (tests/numerics.py)
    n = numerics.model_roundings(model.config, 128) + 1
    numerics.assert_close_as(ours + newline, trl, n=n)
    # Unaligned they differ by exactly the newline's log-prob, which is far from 0.
    numerics.assert_close_as(trl - ours, newline, n=n, magnitude=float(np.abs(trl).max()))
    assert (newline < -0.5).all() and np.abs(trl - ours).min() > 0.5
